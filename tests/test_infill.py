"""/infill (issue 49): llama-server's FIM prompt per tokenizer (core/fim.py: the repo-level
pattern with FIM_REP/FIM_SEP, the snippet separator without them, SPM order, BOS, the batch's
share of prefix and suffix), the 400 of a model without FIM tokens, and the route through the
same worker as /completion; a real one on the tiny llama with StarCoder's FIM tokens (`--vocab starcoder`)."""

from __future__ import annotations

import pytest

from spark_cli.core.fim import SNIPPET, ExtraChunk, FimTokens, NoFim, infill_tokens

PRE, SUF, MID, REP, SEP, BOS = 900, 901, 902, 903, 904, 1
# Qwen2.5-Coder (all five FIM tokens, no BOS), CodeLlama (PRE/SUF/MID, BOS), an SPM-order model
QWEN = FimTokens(PRE, SUF, MID, REP, SEP, bos=-1, add_bos=False)
CODELLAMA = FimTokens(PRE, SUF, MID, bos=BOS, add_bos=True)
TEXT = {"myproject\n": [50], "a.h\n": [51], "filename\n": [52], "int f();": [53, 54], "int main() {": [60, 61, 62],
        "}": [70], "  return": [80], SNIPPET: [90, 91], "<|x|>": [99]}


def tok(text: str, special: bool) -> list[int]:
    if text == "<|x|>" and not special:
        return [98, 98]  # the code's text, not the special token
    return list(TEXT[text])


def build(fim: FimTokens, extra=(), prompt="", spm=False, n_batch=512, prefix="int main() {", suffix="}") -> list[int]:
    return infill_tokens(fim, tok, prefix, suffix, extra, prompt, n_batch=n_batch, n_predict=-1, n_ctx=4096, spm=spm)


def test_repo_level_pattern_with_rep_and_sep():
    got = build(QWEN, [ExtraChunk("int f();", "a.h")], "  return")
    assert got == [REP, 50, SEP, 51, 53, 54, SEP, 52, PRE, 60, 61, 62, 80, SUF, 70, MID]


def test_without_rep_and_sep_chunks_are_snippets_and_bos_leads_the_fim_part():
    got = build(CODELLAMA, [ExtraChunk("int f();", "a.h")])
    assert got == [90, 91, 53, 54, BOS, PRE, 60, 61, 62, SUF, 70, MID]


def test_spm_order_puts_the_suffix_first():
    assert build(CODELLAMA, spm=True) == [BOS, SUF, 70, PRE, 60, 61, 62, MID]


def test_the_prompt_parses_special_tokens_the_code_does_not():
    assert build(QWEN, prompt="<|x|>", prefix="<|x|>")[-6:] == [PRE, 98, 98, 99, SUF, 70, MID][-6:]


def test_prefix_and_suffix_share_one_batch():
    # a batch of 8: the prefix keeps its last 6 tokens (3/4), the suffix 8/4 - 2 = 0
    got = build(CODELLAMA, n_batch=8, prefix="int main() {", suffix="}")
    assert got == [BOS, PRE, 60, 61, 62, SUF, MID]


@pytest.mark.parametrize("fim,missing", [
    (FimTokens(), ["prefix", "suffix", "middle"]),
    (FimTokens(PRE, -1, MID), ["suffix"]),
])
def test_a_model_without_fim_tokens_is_named(fim, missing):
    with pytest.raises(NoFim) as e:
        build(fim)
    assert e.value.missing == missing
    assert str(e.value).startswith("Infill is not supported by this model: " + f"{missing[0]} token is missing.")
    assert "tokenizer.ggml.fim_" in str(e.value)


def _client(fim: FimTokens):
    pytest.importorskip("httpx")
    from _serve_client import fake_client
    from test_serve_hostile import _Engine

    class FimEngine(_Engine):
        def fim_tokens(self) -> FimTokens:
            return fim

        def detokenize(self, tokens) -> str:
            return " ".join(map(str, tokens))

        def server_text(self, tokens) -> str:
            return self.detokenize(tokens)

    return fake_client(lambda: FimEngine(n_ctx=256))


BODY = {"input_prefix": "int main() {", "input_suffix": "}", "prompt": "  return", "n_predict": 3}


def test_infill_runs_through_the_completion_path():
    fim = FimTokens(PRE, SUF, MID)
    with _client(fim) as tc:
        r = tc.post("/infill", json={**BODY, "input_extra": [{"filename": "a.h", "text": "int f();"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["content"] and body["stop"] is True and body["tokens_evaluated"] > 0


@pytest.mark.parametrize("extra,param", [
    ({}, "input_extra.0.text"), ({"filename": "ok"}, "input_extra.0.text"), ({"filename": 123, "text": "abc"},
                                                                              "input_extra.0.filename"),
    ({"filename": "x", "text": 456}, "input_extra.0.text"),
])
def test_bad_input_extra_is_a_400_and_the_server_goes_on(extra, param):
    with _client(FimTokens(PRE, SUF, MID)) as tc:
        r = tc.post("/infill", json={**BODY, "input_extra": [extra]})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert tc.post("/infill", json=BODY).status_code == 200


def test_a_model_without_fim_tokens_gets_a_400_naming_them():
    with _client(FimTokens()) as tc:
        r = tc.post("/infill", json=BODY)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "not_supported_error", r.text
    assert "prefix token is missing. suffix token is missing. middle token is missing." in err["message"]


# ---------------------------------------------------------------- a local model with FIM tokens


@pytest.fixture(scope="module")
def fim_model():
    """Spark's tiny llama with StarCoder's vocabulary (llama.cpp's vendored ggml-vocab-starcoder.gguf)."""
    from spark_cli.models.tiny_models import build_tiny_model

    return build_tiny_model("llama", vocab="starcoder")


def _engine(path, **kw):
    from spark_cli.native.engine import Engine, EngineOptions

    return Engine(EngineOptions(path, n_ctx=2048, n_batch=512, n_ubatch=512, device="none", repack=False, n_threads=1,
                                **kw))


def test_a_tiny_models_vocabulary_is_named_in_its_file():
    from spark_cli.models.tiny_models import TINY_VOCABS, build_tiny_model, tiny_model_name

    assert tiny_model_name("llama") == "tiny-llama-s0-v2.gguf"  # the SmolLM2-tokenizer files keep their names
    assert tiny_model_name("llama", vocab="starcoder") == "tiny-llama-starcoder-s0-v2.gguf"
    assert {"starcoder", "llama-spm", "bert-bge"} <= set(TINY_VOCABS)
    with pytest.raises(ValueError, match="vocab: must be one of"):
        build_tiny_model("llama", vocab="klingon")


@pytest.mark.parametrize("args,why", [(["--vocab", "starcoder"], "only with --tiny"),
                                      (["--tiny", "llama", "--vocab", "klingon"], "unknown vocabulary")])
def test_demo_model_vocab_refusals(monkeypatch, capsys, args, why):
    from conftest import cli_runner

    from spark_cli.commands import demo

    rc, out, err = cli_runner(monkeypatch, capsys, "demo-model", demo.register)(*args)
    assert rc == 2 and out == "" and why in err, err


@pytest.mark.model
def test_the_starcoder_tiny_model_has_llama_cpps_fim_tokens(fim_model):
    from spark_cli.core.gguf_info import load_geometry

    assert load_geometry(fim_model).arch == "llama"
    with _engine(fim_model) as eng:
        fim = eng.vocab.fim_tokens()
        assert fim.missing() == [], fim
        pieces = {eng.vocab.piece(t, special=True).decode() for t in (fim.pre, fim.suf, fim.mid)}
        assert pieces == {"<fim_prefix>", "<fim_suffix>", "<fim_middle>"}


@pytest.mark.model
def test_infill_on_a_real_model_with_fim_tokens_is_a_200(fim_model):
    pytest.importorskip("httpx")
    from _serve_client import fake_client

    with fake_client(lambda: _engine(fim_model)) as tc:
        r = tc.post("/infill", json={**BODY, "input_extra": [{"filename": "a.h", "text": "int f();"}]})
        assert r.status_code == 200, r.text
        assert r.json()["tokens_predicted"] == 3 and r.json()["tokens_evaluated"] > 5


@pytest.mark.model
def test_infill_on_the_smollm2_tokenizer_is_a_400_naming_the_tokens():
    pytest.importorskip("httpx")
    from _serve_client import fake_client

    from spark_cli.models.tiny_models import build_tiny_model

    with fake_client(lambda: _engine(build_tiny_model("llama"))) as tc:
        r = tc.post("/infill", json=BODY)
    assert r.status_code == 400 and "prefix token is missing" in r.json()["error"]["message"], r.text
