"""/embeddings and /v1/embeddings with --embedding (issue 49): the pooling a model gets, llama.cpp's
normalisations, the input shapes llama-server takes, both answers' shapes, and the errors (a
server without --embedding, pooling none on the OpenAI route, media parts); the model tier runs
the tiny llama for real."""

from __future__ import annotations

import base64
import math
import struct

import numpy as np
import pytest

from spark_cli.core.embedding import POOLINGS, choose_pooling, normalized
from spark_cli.errors import UsageError


@pytest.mark.parametrize("asked,rerank,model_pooling,cls,want", [
    (None, False, -1, False, "last"),  # a decoder without a pooling type
    (None, False, 2, False, "cls"),  # a BERT's own
    ("mean", False, 2, False, "mean"),
    (None, True, -1, True, "rank"),
])
def test_choose_pooling(asked, rerank, model_pooling, cls, want):
    assert choose_pooling(asked, rerank, model_pooling, cls) == want


def test_pooling_refusals():
    with pytest.raises(UsageError, match="--pooling max: expected one of"):
        choose_pooling("max", False, -1, False)
    with pytest.raises(UsageError, match="--reranking: m.gguf has no classifier head"):
        choose_pooling(None, True, -1, False, "m.gguf")


def test_normalisations_as_llama_cpp():
    v = np.array([3.0, -4.0], dtype=np.float32)
    assert normalized(v, 2) == pytest.approx([0.6, -0.8])
    assert normalized(v, -1) == pytest.approx([3.0, -4.0])
    assert normalized(v, 0) == pytest.approx([3 * 32760 / 4, -32760])
    assert normalized(v, 1) == pytest.approx([3 / 7, -4 / 7])
    assert normalized(np.zeros(2, np.float32), 2) == [0.0, 0.0]


class _Embedder:
    """A fake engine's embed: the vector [n_tokens, 1, 2, ...] (pooled) or one row per token."""

    pooled = True

    def detokenize(self, tokens) -> str:
        return " ".join(map(str, tokens))

    def embed(self, tokens, seq):
        if not self.pooled:
            return np.array([[float(t), 1.0] for t in tokens], dtype=np.float32)
        return np.array([float(len(tokens)), 1.0, 2.0], dtype=np.float32)


def _client(pooling: str | None = "last"):
    pytest.importorskip("httpx")
    from _serve_client import fake_client
    from test_serve_hostile import _Engine

    class Engine(_Embedder, _Engine):
        pooled = pooling != "none"

    return fake_client(lambda: Engine(n_ctx=256), pooling=pooling)


def test_oai_answer_counts_tokens_and_normalises():
    with _client() as tc:
        r = tc.post("/v1/embeddings", json={"input": ["a b c", [5, 6], {"prompt_string": "x y"},
                                                      {"content": [{"type": "text", "text": "p q"}]}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["object"] == "list"
        assert body["usage"] == {"prompt_tokens": 3 + 2 + 2 + 2, "total_tokens": 9}
        for d in body["data"]:
            assert math.isclose(sum(x * x for x in d["embedding"]), 1.0, rel_tol=1e-6)
        r = tc.post("/v1/embeddings", json={"input": "a b c", "encoding_format": "base64"})
        vec = struct.unpack("<3f", base64.b64decode(r.json()["data"][0]["embedding"]))
        assert vec == pytest.approx([3 / math.sqrt(14), 1 / math.sqrt(14), 2 / math.sqrt(14)])


def test_native_answer_and_embd_normalize():
    with _client() as tc:
        r = tc.post("/embeddings", json={"content": "a b", "embd_normalize": -1})
        assert r.json() == [{"index": 0, "embedding": [[2.0, 1.0, 2.0]]}], r.text


def test_pooling_none_gives_a_vector_per_token_on_the_native_route_only():
    with _client("none") as tc:
        r = tc.post("/embeddings", json={"input": [7, 8, 9]})
        assert r.json() == [{"index": 0, "embedding": [[7.0, 1.0], [8.0, 1.0], [9.0, 1.0]]}], r.text
        r = tc.post("/v1/embeddings", json={"input": "a"})
        assert r.status_code == 400 and "not OAI compatible" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,status", [
    ({"input": []}, 400), ({"input": {"content": "string"}}, 400), ({"input": {"content": [{"type": "unknown"}]}}, 400),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}}, 400),
    ({}, 400), ({"input": "a", "encoding_format": "hex"}, 400),
])
def test_bad_input_is_a_400_and_the_server_goes_on(body, status):
    with _client() as tc:
        r = tc.post("/v1/embeddings", json=body)
        assert r.status_code == status and "error" in r.json(), r.text
        assert tc.post("/v1/embeddings", json={"input": "a"}).status_code == 200


def test_without_embedding_the_routes_are_not_supported():
    with _client(None) as tc:
        r = tc.post("/v1/embeddings", json={"input": "a"})
        assert r.status_code == 501 and "Start it with `--embeddings`" in r.json()["error"]["message"]


def test_every_pooling_is_llama_cpps():
    from spark_cli.native.embed import POOLING

    assert tuple(POOLING) == POOLINGS and list(POOLING.values()) == list(range(5))


@pytest.mark.model
def test_tiny_llama_embeds_for_real():
    """The engine in embedding mode: pooled vectors of the model's width, the same prompt twice the
    same vector, a vector per token with pooling none, and generation still works between."""
    from spark_cli.models.tiny_models import build_tiny_model
    from spark_cli.native.embed import EmbedError
    from spark_cli.native.engine import Engine, EngineOptions

    path = build_tiny_model("llama")
    for pooling in ("last", "none"):
        with Engine(EngineOptions(path, n_ctx=256, n_batch=64, n_ubatch=64, device="none", repack=False,
                                  pooling=pooling, n_threads=1)) as eng:
            toks = eng.vocab.tokenize("I believe the meaning of life is")
            a, b = eng.embed(toks, 0), eng.embed(toks, 0)
            assert np.array_equal(a, b)
            want = (len(toks), eng.geometry.n_embd) if pooling == "none" else (eng.geometry.n_embd,)
            assert a.shape == want and np.isfinite(a).all() and eng.seq_pos(0) == 0
            assert eng.eval(toks).shape == (eng.n_vocab,)  # logits again after the embeddings
            with pytest.raises(EmbedError, match="too large to process"):
                eng.embed(toks * 20, 0)


# ---------------------------------------------------------------- /rerank (--reranking)


def test_rerank_prompt_without_a_template():
    from spark_cli.core.embedding import rerank_prompt, rerank_text

    assert rerank_prompt([5, 6], [7], bos=1, eos=2, sep=3) == [1, 5, 6, 2, 3, 7, 2]
    assert rerank_prompt([5], [7], eos=2) == [5, 2, 7, 2]  # no BOS, no SEP added by this vocabulary
    assert rerank_text("<q>{query}</q><d>{document}</d>", "a", "b") == "<q>a</q><d>b</d>"


def _rerank_client(pooling: str | None = "rank", no_generation: str | None = None):
    pytest.importorskip("httpx")
    from _serve_client import fake_client
    from test_serve_hostile import _Engine

    class Reranker(_Engine):
        """The score of a document: its length in words (the prompt's last token is the document's)."""

        def detokenize(self, tokens) -> str:
            return " ".join(map(str, tokens))

        def rerank_tokens(self, query, doc):
            return [len(doc.split())] * (1 + len(doc.split()))

        def embed(self, tokens, seq):
            return np.array([float(tokens[-1])], dtype=np.float32)

    return fake_client(lambda: Reranker(n_ctx=256), pooling=pooling, no_generation=no_generation)


DOCS = ["one", "one two three", "one two"]


def test_rerank_jina_and_tei_answers():
    with _rerank_client() as tc:
        body = tc.post("/v1/rerank", json={"query": "q", "documents": DOCS}).json()
        assert [(r["index"], r["relevance_score"]) for r in body["results"]] == [(1, 3.0), (2, 2.0), (0, 1.0)]
        assert body["usage"] == {"prompt_tokens": 2 + 4 + 3, "total_tokens": 9} and body["object"] == "list"
        assert len(tc.post("/rerank", json={"query": "q", "documents": DOCS, "top_n": 2}).json()["results"]) == 2
        tei = tc.post("/rerank", json={"query": "q", "texts": DOCS, "return_text": True, "top_n": 99}).json()
        assert tei == [{"index": 1, "score": 3.0, "text": "one two three"}, {"index": 2, "score": 2.0, "text": "one two"},
                       {"index": 0, "score": 1.0, "text": "one"}]


def test_a_body_with_texts_gets_teis_answer_from_the_documents():
    """As llama-server's: `texts` in the body means TEI's answer; `documents` is read first."""
    with _rerank_client() as tc:
        tei = tc.post("/rerank", json={"query": "q", "documents": DOCS, "texts": ["x"], "top_n": 1}).json()
        assert tei == [{"index": 1, "score": 3.0}]
        r = tc.post("/rerank", json={"query": "q", "documents": DOCS, "top_n": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_n"  # llama-server's resize(-1) fails


def test_a_reranker_that_cannot_generate_answers_501_and_reranks_on():
    with _rerank_client(no_generation="m.gguf is an encoder") as tc:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/completion", {"prompt": "hi"}), ("/v1/completions", {"prompt": "hi"}),
                           ("/v1/responses", {"input": "hi"}), ("/v1/messages", {"model": "m", "max_tokens": 4,
                                                                             "messages": [{"role": "user", "content": "hi"}]})):
            r = tc.post(path, json=body)
            err = r.json()["error"]
            assert r.status_code == 501 and "encoder" in err["message"], path  # each API's own error shape
        assert tc.post("/rerank", json={"query": "q", "documents": DOCS}).status_code == 200
        assert tc.post("/tokenize", json={"content": "a b"}).status_code == 200


@pytest.mark.parametrize("arch,causal,moe,why", [
    ("qwen3moe", True, True, None),
    ("bert", False, False, "is an encoder (bert, non-causal attention)"),
    ("nomic-bert-moe", False, True, "is an encoder"),
    ("qwen3", True, False, "is a dense qwen3 model, served for /rerank and /embeddings only"),
])
def test_which_served_models_generate(arch, causal, moe, why):
    from spark_cli.core.embedding import cannot_generate, ranks

    got = cannot_generate(arch, causal, moe, "m.gguf")
    assert got is None if why is None else why in got
    assert ranks(None, True) and ranks("rank", False) and not ranks("mean", False) and not ranks(None, False)


@pytest.mark.parametrize("body,param", [
    ({"query": "q", "documents": []}, "documents"), ({"query": "q"}, "documents"),
    ({"query": "q", "documents": 123}, "documents"), ({"query": "q", "documents": [1, 2]}, "documents"),
    ({"documents": DOCS}, "query"), ({"query": 5, "documents": DOCS}, "query"),
])
def test_bad_rerank_requests_are_400s(body, param):
    with _rerank_client() as tc:
        r = tc.post("/rerank", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_without_reranking_rerank_is_not_supported():
    with _rerank_client("last") as tc:
        r = tc.post("/rerank", json={"query": "q", "documents": DOCS})
        assert r.status_code == 501 and "Start it with `--reranking`" in r.json()["error"]["message"]


@pytest.mark.model
def test_reranking_a_model_without_a_classifier_is_one_line_at_start(monkeypatch, capsys):
    from conftest import cli_runner

    from spark_cli.commands import serve as serve_cmd
    from spark_cli.models.tiny_models import build_tiny_model

    spark = cli_runner(monkeypatch, capsys, "serve", serve_cmd.register)
    rc, out, err = spark(build_tiny_model("llama"), "--reranking", "--device", "none", "--port", "0", "--no-learn")
    lines = [line for line in err.splitlines() if line.strip().startswith("error:")]
    assert rc == 2 and out == "" and len(lines) == 1 and "has no classifier head" in lines[0], err


@pytest.mark.model
def test_the_tiny_reranker_scores_for_real():
    """Spark's tiny BERT reranker (the suite's reranker preset): llama.cpp's bert arch with pooling rank
    and a classifier head, one score per prompt, the same prompt the same score."""
    from spark_cli.core.gguf_info import load_geometry
    from spark_cli.models.tiny_models import TINY_RERANKER, build_tiny_model
    from spark_cli.native.engine import Engine, EngineOptions

    path = build_tiny_model(TINY_RERANKER)
    g = load_geometry(path, require_moe=False)
    assert (g.arch, POOLINGS[g.pooling_type], g.has_classifier, g.causal, g.moe_layers) == ("bert", "rank", True,
                                                                                            False, ())
    with Engine(EngineOptions(path, n_ctx=512, n_batch=512, n_ubatch=512, device="none", repack=False,
                              pooling="rank", n_threads=1)) as eng:
        toks = eng.vocab.rerank_tokens("Machine learning is", "A machine")
        assert toks[0] == 101 and toks.count(102) == 1  # bge's WordPiece: [CLS] query [SEP] document
        a, b = eng.embed(toks, 0), eng.embed(toks, 0)
        assert a.shape == (1,) and np.isfinite(a).all() and np.array_equal(a, b)
        assert eng.embed(eng.vocab.rerank_tokens("Machine learning is", "Paris"), 0) != a


@pytest.mark.model
def test_spark_serve_reranks_with_the_tiny_reranker(tmp_path):
    """`--reranking` serves the dense encoder reranker: /rerank answers, generating is a 501 (an
    encoder has no next-token output), and the server goes on."""
    import httpx
    from test_serve_hostile import _serve

    from spark_cli.models.tiny_models import TINY_RERANKER, build_tiny_model

    proc, port, log = _serve(build_tiny_model(TINY_RERANKER), tmp_path, "--reranking", "-c", "512")
    try:
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(f"{url}/rerank", json={"query": "Machine learning is", "documents": ["A machine", "Learning is"]},
                       timeout=60)
        body = r.json()
        assert r.status_code == 200 and sorted(x["index"] for x in body["results"]) == [0, 1], r.text
        assert body["usage"] == {"prompt_tokens": 14, "total_tokens": 14}  # 2 x [CLS] 3 words [SEP] 2 words
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 501 and "is an encoder (bert" in r.json()["error"]["message"], r.text
        assert httpx.post(f"{url}/rerank", json={"query": "q", "texts": ["a"]}, timeout=60).status_code == 200
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_an_embedding_counts_in_the_metrics():
    with _client() as tc:
        assert tc.post("/v1/embeddings", json={"input": ["a b", "c d e"]}).status_code == 200
        text = tc.get("/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("llamacpp:")}
    assert values["llamacpp:prompt_tokens_total"] == 5 and values["llamacpp:n_decode_total"] == 2
    assert values["llamacpp:tokens_predicted_total"] == 0
