"""`spark serve` where llama-server was (issue 24): every sampling field has its effect, logprobs
in llama-server's shape, the fields Spark does not implement refused by name, system_fingerprint,
the role chunk, timings, the context error's counts, llama.cpp's /tokenize, /detokenize and
/props, X-Api-Key, and the server's --alias, -n, --temp and --seed defaults. The app-level cases
run on a fake engine (fast tier); the rest on the real server process (model tier)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from test_chat import _FakeEngine
from test_serve import COUNTING, KEY, N_CTX, _start, _stop, model, rpc  # noqa: F401 - fixtures

from _serve_client import fake_client
from spark_cli.native.generate import TokenProbs
from spark_cli.serve.protocol import Timings

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ALIAS = "spark-demo"
DEFAULT_N = 5  # the server's -n: what a request without max_tokens gets
DEFAULT_SEED = 7
HELLO = [{"role": "user", "content": "What is the capital of Japan?"}]
STORY = "Once upon a time"  # a greedy story that each penalty changes within 12 tokens


# ---------------------------------------------------------------- without a model


def test_token_probs_are_the_softmax_of_the_logits():
    logits = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    p = TokenProbs.of(logits, token=2, n=2)
    soft = np.exp(logits - 3.0) / np.exp(logits - 3.0).sum()
    assert p.token == 2 and p.prob == pytest.approx(soft[2])
    assert [t for t, _ in p.top] == [1, 2] and [q for _, q in p.top] == pytest.approx([soft[1], soft[2]])
    assert TokenProbs.of(logits, token=0, n=0).top == ()


@pytest.mark.parametrize("parallel,names", [(True, ["f", "g"]), (False, ["f"])])
def test_parallel_tool_calls_false_keeps_the_first_call(parallel, names):
    from spark_cli.serve.chat import ChatConfig, prepare
    from spark_cli.serve.protocol import ChatRequest, parse

    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "fg"]
    req = parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                         "parallel_tool_calls": parallel}).encode())
    parser = prepare(req, ChatConfig()).parser("")
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    deltas = parser.feed(two) + parser.finish()
    assert [c.name for c in parser.result().tool_calls] == names
    assert {d.tool_call.index for d in deltas if d.tool_call is not None} == set(range(len(names)))


def test_timings_are_llama_servers():
    t = Timings(cache_n=3, prompt_n=10, prompt_seconds=0.5, predicted_n=4, predicted_seconds=2.0).to_dict()
    assert t == {"cache_n": 3, "prompt_n": 10, "prompt_ms": 500.0, "prompt_per_token_ms": 50.0,
                 "prompt_per_second": 20.0, "predicted_n": 4, "predicted_ms": 2000.0,
                 "predicted_per_token_ms": 500.0, "predicted_per_second": 2.0}


class _Engine(_FakeEngine):
    n_vocab = 100
    eog_tokens = [_FakeEngine.EOG]

    def bank_bytes(self) -> int:
        return 0

    def piece(self, t, special=False):
        return super().piece(t)

    def detokenize(self, tokens) -> str:
        return "".join(self.piece(t).decode() for t in tokens)


def _client(**state):
    return fake_client(lambda: _Engine(n_ctx=64), **state)


CHAT = {"messages": [{"role": "user", "content": "hi there"}], "temperature": 0}


@pytest.mark.parametrize("extra,where", [
    ({"mirostat": 2}, "mirostat"),
    ({"dry_multiplier": 0.8}, "dry_multiplier"),
    ({"xtc_probability": 0.5}, "xtc_probability"),
    ({"top_n_sigma": 1.0}, "top_n_sigma"),
    ({"samplers": ["top_k", "temperature", "top_p"]}, "samplers"),  # not Spark's order
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"n": 3}, "n"),  # more choices than the queue holds (2)
    ({"logit_bias": {"100": 5}}, "logit_bias"),  # past the vocabulary (checked by the engine thread)
])
def test_unimplemented_fields_are_refused_by_name(extra, where):
    with _client() as tc:
        r = tc.post("/v1/chat/completions", json={**CHAT, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == where and err["message"].startswith(where + ":")
        assert err["type"] == "invalid_request_error"
        # the values that ask for nothing are accepted, and fields outside the table are ignored as llama-server does
        ok = tc.post("/v1/chat/completions", json={**CHAT, "mirostat": 0, "ignore_eos": False, "user": "u",
                                                   "store": False, "metadata": {"a": "b"}})
        assert ok.status_code == 200, ok.text


def test_completions_refuse_echo_suffix_and_best_of():
    with _client() as tc:
        for extra in ({"echo": True}, {"suffix": "x"}, {"best_of": 2}):
            r = tc.post("/v1/completions", json={"prompt": "hi", **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text
        assert tc.post("/v1/completions", json={"prompt": "hi", "echo": False, "best_of": 1}).status_code == 200


def test_x_api_key_beside_bearer():
    with _client(api_key=KEY) as tc:
        assert tc.post("/v1/chat/completions", json=CHAT, headers={"X-Api-Key": KEY}).status_code == 200
        assert tc.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        r = tc.post("/v1/chat/completions", json=CHAT, headers={"X-Api-Key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert tc.post("/tokenize", json={"content": "hi"}).status_code == 401


def test_fake_answer_shapes():
    """system_fingerprint, the role chunk as llama-server sends it, timings on the last chunk."""
    with _client() as tc:
        r = tc.post("/v1/chat/completions", json=CHAT).json()
        assert r["system_fingerprint"].startswith("spark-") and r["timings"]["predicted_n"] == 3
        assert r["choices"][0]["logprobs"] is None
        with tc.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
        assert all(e["system_fingerprint"] == r["system_fingerprint"] for e in events)
        assert [("timings" in e) for e in events] == [False] * (len(events) - 1) + [True]
        assert events[-1]["choices"][0]["finish_reason"] == "stop" and events[-1]["timings"]["predicted_n"] == 3


def test_context_overflow_carries_the_counts():
    with _client() as tc:
        r = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w " * 80}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "exceed_context_size_error"
        assert err["n_ctx"] == 64 and err["n_prompt_tokens"] > 64
        assert "exceeds the available context size (64 tokens)" in err["message"]  # llama-server's words


def test_tokenize_and_detokenize_on_the_fake():
    with _client() as tc:
        ids = tc.post("/tokenize", json={"content": "hello there"}).json()["tokens"]
        pieces = tc.post("/tokenize", json={"content": "hello there", "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == ids and [p["piece"] for p in pieces] == ["hello ", "there "]
        assert tc.post("/detokenize", json={"tokens": ids}).json() == {"content": "hello there "}
        for path, bad in (("/tokenize", {"content": 5}), ("/detokenize", {"tokens": [-1]}),
                          ("/detokenize", {"tokens": [100]})):
            r = tc.post(path, json=bad)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)


def test_a_last_assistant_message_is_continued():
    """llama-server's prefill: the prompt ends inside the assistant's message, which the answer continues."""
    with _client() as tc:
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "well, so"}]
        prompt = tc.post("/apply-template", json={"messages": msgs}).json()["prompt"]
        assert prompt == "<user> hi <assistant> well, so"
        fresh = tc.post("/apply-template", json={"messages": msgs[:1]}).json()["prompt"]
        assert fresh == "<user> hi <assistant>"
        called = [{**msgs[1], "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]}]
        r = tc.post("/v1/chat/completions", json={"messages": msgs[:1] + called})
        assert r.status_code == 400 and "Cannot continue an assistant message that contains tool calls" in r.text
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        r = tc.post("/v1/chat/completions", json={"messages": msgs[:1], "tools": tools, "grammar": "root ::= \"a\""})
        assert r.status_code == 400 and r.json()["error"]["message"] == "Cannot use custom grammar constraints with tools."


def test_reasoning_effort_reaches_the_template():
    from spark_cli.serve.protocol import ChatRequest, parse

    def kwargs(**extra):
        return parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": "x"}], **extra}).encode()
                     ).template_kwargs()

    assert kwargs(reasoning_effort="high") == {"reasoning_effort": "high"}
    assert kwargs(reasoning_effort="none", chat_template_kwargs={"reasoning_effort": "low"}) == {
        "enable_thinking": False}
    assert kwargs(chat_template_kwargs={"enable_thinking": True}) == {"enable_thinking": True}


def test_native_completion_shapes():
    """llama.cpp's POST /completion: its final body, its stream (no [DONE]), token-id prompts."""
    with _client() as tc:
        r = tc.post("/completion", json={"prompt": "hello there", "temperature": 0})
        body = r.json()
        assert r.status_code == 200 and body["content"] == "yes of course " and body["stop"] is True
        assert (body["tokens_predicted"], body["tokens_evaluated"], body["stop_type"]) == (3, 2, "eos")
        # `prompt`: llama-server's, the prompt's tokens detokenized (this fake's pieces end in a space)
        assert body["prompt"] == "hello there " and body["timings"]["predicted_n"] == 3
        assert body["generation_settings"]["temperature"] == 0 and "completion_probabilities" not in body
        limited = tc.post("/completion", json={"prompt": "a b", "n_predict": 2, "logit_bias": [[5, False]]}).json()
        assert limited["stop_type"] == "limit" and limited["generation_settings"]["logit_bias"] == [
            {"token": 5, "bias": None}]
        ids = tc.post("/completion", json={"prompt": [1, 2, "again"]}).json()
        assert ids["tokens_evaluated"] == 3 and ids["prompt"].split() == ["hello", "there", "again"]
        with tc.stream("POST", "/completion", json={"prompt": "hello", "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        events = [json.loads(line[6:]) for line in lines]
        assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True] and len(events) > 2
        assert "".join(e["content"] for e in events) == "yes of course " and events[-1]["content"] == ""
        assert [e["tokens_predicted"] for e in events[:-1]] == list(range(1, len(events)))
        for bad, where in (({"prompt": ""}, "prompt"), ({"prompt": [100]}, "prompt: token 100"),
                           ({"prompt": "x", "n_probs": -1}, "n_probs")):
            r = tc.post("/completion", json=bad)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(where), r.text


class _SmallBatch(_Engine):
    """Two prompt tokens a step: a prompt of four words is evaluated in two chunks."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.n_batch = 2


PROGRESS_ROUTES = {"/v1/chat/completions": CHAT, "/v1/completions": {"prompt": "hello there you all"},
                   "/completion": {"prompt": "hello there you all"}}


def _sse(tc, path: str, body: dict) -> list[dict]:
    with tc.stream("POST", path, json=body) as s:
        assert s.status_code == 200, s.read()
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def _progress(events: list[dict]) -> list[tuple[int, int, int]]:
    return [(p["total"], p["cache"], p["processed"]) for e in events if (p := e.get("prompt_progress"))]


@pytest.mark.parametrize("path", PROGRESS_ROUTES)
def test_return_progress_reports_each_prompt_chunk(path):
    """llama-server's return_progress: one report before any prompt token is evaluated (processed ==
    cache), one after each n_batch chunk (the last: processed == total), all before the answer;
    the second time the cached prefix counts as cache. Each endpoint's chunk shape."""
    body = {**PROGRESS_ROUTES[path], "stream": True, "return_progress": True}
    with fake_client(lambda: _SmallBatch(n_ctx=64)) as tc:
        events = _sse(tc, path, body)
        assert _progress(events) == [(4, 0, 0), (4, 0, 2), (4, 0, 4)]
        again = _sse(tc, path, body)  # the slot holds the prompt: all but its last token are reused
        assert _progress(again) == [(4, 3, 3), (4, 3, 4)]
        plain = _sse(tc, path, {**body, "return_progress": False})
    assert _progress(plain) == [] and _progress(events[:-1]) == _progress(events)  # not on the last
    reports = [e for e in events if "prompt_progress" in e]
    first_text = next(i for i, e in enumerate(events) if _content(e))
    assert all(events.index(r) < first_text for r in reports)
    assert all(isinstance(r["prompt_progress"]["time_ms"], int) and "timings" not in r for r in reports)
    if path == "/v1/chat/completions":
        assert all(r["object"] == "chat.completion.chunk" and r["choices"][0]["delta"] == {
            "role": "assistant", "content": None} for r in reports)
    elif path == "/v1/completions":
        assert all(r["object"] == "text_completion" and r["choices"][0]["text"] == "" and
                   r["choices"][0]["finish_reason"] is None for r in reports)
    else:
        assert all(r["content"] == "" and r["stop"] is False and r["tokens"] == [] and
                   r["tokens_evaluated"] == 4 and r["tokens_predicted"] == 0 for r in reports)


def _content(event: dict) -> str:
    if "content" in event:
        return event["content"]
    choice = (event.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


@pytest.mark.parametrize("path", PROGRESS_ROUTES)
def test_return_progress_timings_start_at_zero_and_never_go_back(path):
    """With timings_per_token each report carries the prompt's timings so far: the first none
    evaluated (prompt_n 0, prompt_ms 0.0), prompt_ms never decreasing, to the answer's."""
    body = {**PROGRESS_ROUTES[path], "stream": True, "return_progress": True, "timings_per_token": True}
    with fake_client(lambda: _SmallBatch(n_ctx=64)) as tc:
        events = _sse(tc, path, body)
    timed = [e["timings"] for e in events if "prompt_progress" in e]
    assert [(t["cache_n"], t["prompt_n"], t["predicted_n"]) for t in timed] == [(0, 0, 0), (0, 2, 0), (0, 4, 0)]
    assert timed[0]["prompt_ms"] == 0.0 and timed[0]["predicted_ms"] == 0.0
    ms = [e["timings"]["prompt_ms"] for e in events if "timings" in e]
    assert ms == sorted(ms) and ms[-1] > 0


def test_return_progress_without_stream_is_ignored_as_llama_servers():
    with fake_client(lambda: _SmallBatch(n_ctx=64)) as tc:
        for path, body in PROGRESS_ROUTES.items():
            r = tc.post(path, json={**body, "return_progress": True})
            assert r.status_code == 200 and "prompt_progress" not in r.text, (path, r.text)


def test_return_progress_through_the_openai_client():
    """The official client reads a stream with progress chunks: the answer is whole, the reports
    reach it as the chunks' extra field."""
    with fake_client(lambda: _SmallBatch(n_ctx=64)) as tc:
        c = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none", http_client=tc, max_retries=0)
        chunks = list(c.chat.completions.create(model="x", messages=CHAT["messages"], stream=True,
                                                extra_body={"return_progress": True}))
    reports = [ch.model_extra["prompt_progress"] for ch in chunks if "prompt_progress" in (ch.model_extra or {})]
    assert [p["processed"] for p in reports] == [0, 2, 4]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "yes of course "


# ---------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def server(model, rpc):  # noqa: F811 - test_serve's fixtures
    srv = _start(model, rpc, model.parent, "--api-key", KEY, "--learn-every", "0", "--alias", ALIAS,
                 "-n", str(DEFAULT_N), "--temp", "0", "--seed", str(DEFAULT_SEED))
    yield srv
    _stop(srv)


def _complete(server, **body) -> dict:
    with server.http() as h:
        r = h.post("/v1/completions", json={"prompt": COUNTING, "temperature": 0, "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _text(server, **body) -> str:
    return _complete(server, **body)["choices"][0]["text"]


@pytest.mark.model
def test_chat_logprobs(server):
    c = server.client()
    r = c.chat.completions.create(model="x", messages=HELLO, temperature=0, max_tokens=6, logprobs=True,
                                  top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(x <= 0 for x in tops)
        assert sum(math.exp(x) for x in tops) <= 1 + 1e-6
        assert t.logprob == pytest.approx(tops[0]) and t.token == t.top_logprobs[0].token  # greedy: the likeliest
        assert bytes(t.bytes) == t.token.encode()
    # streamed: each chunk carries the tokens it completes, the same ones
    chunks = list(c.chat.completions.create(model="x", messages=HELLO, temperature=0, max_tokens=6, logprobs=True,
                                            top_logprobs=3, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]
    # without logprobs: null, as OpenAI's
    plain = c.chat.completions.create(model="x", messages=HELLO, temperature=0, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.model
def test_completion_logprobs(server):
    body = _complete(server, logprobs=2, max_tokens=4)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 4
    assert "".join(t["token"] for t in content) == body["choices"][0]["text"]
    assert all(len(t["top_logprobs"]) == 2 and {"id", "token", "bytes", "logprob"} <= set(t) for t in content)


@pytest.mark.model
def test_sampling_fields_have_their_effect(server):
    greedy = _complete(server, logprobs=1, max_tokens=8)
    base = greedy["choices"][0]["text"]
    first = greedy["choices"][0]["logprobs"]["content"][0]
    # logit_bias: banning the greedy first token changes it; a big bias forces a token every step
    banned = _complete(server, logit_bias={str(first["id"]): -100}, logprobs=0)["choices"][0]
    assert banned["logprobs"]["content"][0]["id"] != first["id"] and banned["text"] != base
    assert _text(server, logit_bias=[[first["id"], False]]) == banned["text"]  # false bans, as llama-server's
    forced = _complete(server, logit_bias={str(first["id"]): 100}, max_tokens=3, logprobs=0)
    assert [t["id"] for t in forced["choices"][0]["logprobs"]["content"]] == [first["id"]] * 3
    # the penalties (the prompt counts as history, as llama-server's): each changes the greedy story
    story = {"prompt": STORY, "max_tokens": 12}
    plain = _text(server, **story)
    for field in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repeat_penalty": 2.0}):
        assert _text(server, **story, **field) != plain, field
    assert _text(server, **story, repeat_penalty=2.0, repeat_last_n=0) == plain  # no window: no penalty
    # seed: the same seed draws the same text; different seeds do not all agree
    hot = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 12}
    assert _text(server, seed=11, **hot) == _text(server, seed=11, **hot)
    assert len({_text(server, seed=s, **hot) for s in (1, 2, 3)}) > 1
    # min_p 1 keeps only the likeliest token, typical_p near 0 only the most typical: seeds no longer matter
    assert _text(server, seed=1, **{**hot, "min_p": 1.0}) == _text(server, seed=2, **{**hot, "min_p": 1.0}) == \
        _text(server, max_tokens=12)
    assert _text(server, seed=1, **{**hot, "typical_p": 0.001}) == _text(server, seed=2, **{**hot, "typical_p": 0.001})
    # samplers: the ones left out are off (min_p 1 without min_p: the seeds matter again); llama-server's default
    # order, its letters or names, is Spark's
    no_min_p = {**hot, "min_p": 1.0, "samplers": ["penalties", "top_k", "typ_p", "top_p", "temperature"]}
    assert len({_text(server, seed=s, **no_min_p) for s in (1, 2, 3)}) > 1
    assert _text(server, seed=5, **hot, samplers="edskypmxt") == _text(server, seed=5, **hot)
    # ignore_eos: an answer that ends by itself runs to its limit instead
    with server.http() as h:
        ends = {"messages": HELLO, "max_tokens": 24, "temperature": 0}  # greedy: 7 tokens, then the end
        assert h.post("/v1/chat/completions", json=ends).json()["choices"][0]["finish_reason"] == "stop"
        on = h.post("/v1/chat/completions", json={**ends, "ignore_eos": True}).json()
    assert on["choices"][0]["finish_reason"] == "length" and on["usage"]["completion_tokens"] == 24
    # llama-server's n_predict (over max_tokens), grammar and json_schema
    assert _complete(server, n_predict=2)["usage"]["completion_tokens"] == 2
    assert _text(server, grammar='root ::= "yes" | "no"', max_tokens=8) in ("yes", "no")
    assert json.loads(_text(server, json_schema={"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"]}, max_tokens=40)).keys() == {"a"}


@pytest.mark.model
def test_cache_prompt_false_reuses_nothing(server):
    msgs = {"messages": HELLO, "max_tokens": 2}
    with server.http() as h:
        h.post("/v1/chat/completions", json=msgs)
        again = h.post("/v1/chat/completions", json=msgs).json()["usage"]
        fresh = h.post("/v1/chat/completions", json={**msgs, "cache_prompt": False}).json()
    assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["timings"]["cache_n"] == 0 and fresh["timings"]["prompt_n"] == fresh["usage"]["prompt_tokens"]


@pytest.mark.model
def test_shapes_fingerprint_role_chunk_timings(server):
    c = server.client()
    r = c.chat.completions.create(model="x", messages=HELLO, temperature=0, max_tokens=4)
    assert r.system_fingerprint and r.system_fingerprint.startswith("spark-")
    t = r.model_extra["timings"]
    assert t["predicted_n"] == r.usage.completion_tokens and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens
    with server.http() as h:
        with h.stream("POST", "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert {e["system_fingerprint"] for e in events} == {r.system_fingerprint}
    assert "timings" in events[-1] and events[-1]["choices"] == [] and not any("timings" in e for e in events[:-1])
    assert events[-1]["timings"]["predicted_n"] == events[-1]["usage"]["completion_tokens"]
    # a last assistant message is continued: the prompt ends with its text, no end of turn after it
    prefill = HELLO + [{"role": "assistant", "content": "The capital of Japan is"}]
    with server.http() as h:
        prompt = h.post("/apply-template", json={"messages": prefill}).json()["prompt"]
        fresh = h.post("/apply-template", json={"messages": HELLO}).json()["prompt"]
        more = h.post("/v1/chat/completions", json={"messages": prefill, "max_tokens": 3}).json()
    assert prompt.startswith(fresh) and prompt.endswith("The capital of Japan is")
    assert more["usage"]["prompt_tokens"] > len(fresh.split()) and more["choices"][0]["message"]["content"]
    with server.http() as h:
        over = h.post("/v1/completions", json={"prompt": "word " * 1500}).json()["error"]
    assert over["type"] == "exceed_context_size_error" and over["n_ctx"] == N_CTX and over["n_prompt_tokens"] > N_CTX


@pytest.mark.model
def test_server_defaults_and_alias(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [ALIAS]
    r = c.completions.create(model=ALIAS, prompt=COUNTING, max_tokens=None)  # no limit given: -n
    assert r.usage.completion_tokens == DEFAULT_N and r.model == ALIAS
    # --temp 0: a request without a temperature is greedy
    assert r.choices[0].text == _text(server, max_tokens=DEFAULT_N)
    # --seed: a request without a seed draws with the server's, the same each time
    hot = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 12}
    assert _text(server, **hot) == _text(server, **hot) == _text(server, seed=DEFAULT_SEED, **hot)


@pytest.mark.model
def test_native_completion(server):
    with server.http() as h:
        body = h.post("/completion", json={"prompt": COUNTING, "n_predict": 4, "temperature": 0, "n_probs": 2}).json()
        assert body["content"] == _text(server, max_tokens=4) and body["stop_type"] == "limit"
        probs = body["completion_probabilities"]
        assert len(probs) == body["tokens_predicted"] == 4 and all(len(p["top_logprobs"]) == 2 for p in probs)
        ids = h.post("/tokenize", json={"content": COUNTING}).json()["tokens"]
        by_ids = h.post("/completion", json={"prompt": ids, "n_predict": 4, "temperature": 0}).json()
        assert by_ids["content"] == body["content"] and by_ids["tokens_evaluated"] == len(ids)
        assert by_ids["tokens_cached"] == len(ids) + 4
        with h.stream("POST", "/completion", json={"prompt": COUNTING, "n_predict": 4, "temperature": 0,
                                                   "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        assert "".join(e["content"] for e in events) == body["content"] and events[-1]["stop"] is True
        assert events[-1]["timings"]["predicted_n"] == 4


@pytest.mark.model
def test_post_sampling_probs_leave_the_tokens(server):
    """post_sampling_probs samples through the same chain, step for step: the same seed draws the
    same tokens with them, with the raw logprobs or with neither; each token's top is the chain's
    candidates, probability above 0, at most n_probs, summing to 1 when fewer."""
    hot = {"prompt": STORY, "n_predict": 12, "temperature": 1.0, "seed": 5, "return_tokens": True,
           "repeat_penalty": 1.3}
    with server.http() as h:
        plain = h.post("/completion", json=hot).json()
        raw = h.post("/completion", json={**hot, "n_probs": 3}).json()
        post = h.post("/completion", json={**hot, "n_probs": 5, "post_sampling_probs": True}).json()
        greedy = h.post("/completion", json={**hot, "temperature": 0, "n_probs": 5, "post_sampling_probs": True}).json()
    assert post["tokens"] == raw["tokens"] == plain["tokens"] and len(set(plain["tokens"])) > 1
    probs = post["completion_probabilities"]
    assert [p["id"] for p in probs] == post["tokens"]
    for p in probs:
        tops = [t["prob"] for t in p["top_probs"]]
        assert 0 < p["prob"] <= 1 and 0 < len(tops) <= 5 and all(0 < q <= 1 for q in tops)
        assert tops == sorted(tops, reverse=True) and (len(tops) == 5 or sum(tops) == pytest.approx(1.0, abs=1e-5))
        assert p["prob"] in tops or p["prob"] <= tops[-1]
    assert all([(t["id"], t["prob"]) for t in p["top_probs"]] == [(p["id"], 1.0)] and p["prob"] == 1.0
               for p in greedy["completion_probabilities"])


@pytest.mark.model
def test_n_choices_are_their_seeds_answers(server):
    """n = 3 on one slot: choice j is the answer the seed + j gets alone (llama-server's child tasks)."""
    hot = {"prompt": STORY, "max_tokens": 6, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
           "ignore_eos": True}
    three = _complete(server, n=3, seed=21, **hot)
    alone = [_text(server, seed=21 + j, **hot) for j in range(3)]
    assert [c["text"] for c in three["choices"]] == alone and len(set(alone)) > 1
    assert [c["index"] for c in three["choices"]] == [0, 1, 2] and three["usage"]["completion_tokens"] == 18


@pytest.mark.model
def test_tokenize_detokenize_props(server):
    with server.http() as h:
        text = "Hello world, 1 2 3"
        ids = h.post("/tokenize", json={"content": text}).json()["tokens"]
        assert ids and all(isinstance(t, int) for t in ids)
        assert h.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
        pieces = h.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
        bad = h.post("/detokenize", json={"tokens": [10 ** 9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert h.post("/tokenize", json={"text": "x"}).status_code == 400  # content is required
        props = h.get("/props").json()
    assert props["model_alias"] == ALIAS and props["model_path"].endswith(server.model.name)
    assert props["default_generation_settings"]["n_ctx"] == N_CTX and props["total_slots"] == 1
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["seed"], params["n_predict"]) == (0.0, DEFAULT_SEED, DEFAULT_N)
    assert "{%" in props["chat_template"] and props["build_info"].startswith("spark-")
    assert props["spark"]["placement"]["cached_moe_layers"] > 0


# ---------------------------------------------------------------- metrics and per-token fields (fake engine)

# llama-server's series (tools/server/server-task.cpp, to_metrics), as its test_metrics.py checks them
LLAMACPP_COUNTERS = ("prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total",
                     "tokens_predicted_total", "tokens_predicted_seconds_total", "n_decode_total", "n_tokens_max",
                     "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                     "spec_decode_num_drafts_total")
LLAMACPP_GAUGES = ("prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing", "requests_deferred",
                   "n_busy_slots_per_decode")


def _prometheus(text: str) -> tuple[dict[str, str], dict[str, float]]:
    """{name: type} and {name: value} of the unlabelled series, read as llama.cpp's suite reads them."""
    types, values = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#") and "{" not in line:
            name, value = line.split(" ", 1)
            assert name in types, f"{name} has no # TYPE line"
            values[name] = float(value)
    return types, values


def test_metrics_are_llama_servers_series():
    from prometheus_client.parser import text_string_to_metric_families

    with _client() as tc:
        timings = [tc.post("/completion", json={"prompt": "hello there world", "n_predict": 4}).json()["timings"]
                   for _ in range(2)]
        r = tc.get("/metrics")
        assert r.status_code == 200 and int(r.headers["Process-Start-Time-Unix"]) > 0
        assert b"Process-Start-Time-Unix" in [k for k, _ in r.headers.raw]  # llama-server's spelling
        types, values = _prometheus(r.text)
        for names, kind in ((LLAMACPP_COUNTERS, "counter"), (LLAMACPP_GAUGES, "gauge")):
            for name in names:
                assert types[f"llamacpp:{name}"] == kind and f"# HELP llamacpp:{name} " in r.text, name
        v = {k.removeprefix("llamacpp:"): x for k, x in values.items()}
        # the reused prompt tokens are counted apart, as in the answers' timings
        assert timings[1]["cache_n"] > 0
        assert v["prompt_tokens_total"] == sum(t["prompt_n"] for t in timings)
        assert v["prompt_tokens_cached_total"] == sum(t["cache_n"] for t in timings)
        assert v["tokens_predicted_total"] == sum(t["predicted_n"] for t in timings)
        assert v["n_tokens_max"] == max(t["cache_n"] + t["prompt_n"] + t["predicted_n"] for t in timings)
        assert v["n_decode_total"] > 0 and v["requests_processing"] == 0 and v["n_busy_slots_per_decode"] == 1
        assert v["prompt_tokens_seconds"] > 0 and v["predicted_tokens_seconds"] > 0
        assert all(v[n] == 0 for n in LLAMACPP_COUNTERS if n.startswith("spec_"))
        # the throughput gauges are over the window since the last scrape (none since); counters go on
        again = {k.removeprefix("llamacpp:"): x for k, x in _prometheus(tc.get("/metrics").text)[1].items()}
        assert again["prompt_tokens_seconds"] == 0 and again["predicted_tokens_seconds"] == 0
        assert again["prompt_tokens_total"] == v["prompt_tokens_total"]
        # and prometheus_client reads the whole page, Spark's series after llama-server's
        families = {fam.name for fam in text_string_to_metric_families(r.text)}  # counters without _total
        assert {"llamacpp:n_tokens_max", "llamacpp:prompt_tokens", "spark:expert_cache_hits"} <= families


def test_metrics_and_slots_endpoints_can_be_off():
    """--no-metrics / --no-slots: llama-server's 501 for an endpoint its flag left off."""
    with _client(metrics=False, slots_endpoint=False) as tc:
        for path, flag in (("/metrics", "--metrics"), ("/slots", "--slots")):
            r = tc.get(path)
            err = r.json()["error"]
            assert r.status_code == 501 and err["type"] == "not_supported_error" and flag in err["message"], r.text
    with _client() as tc:
        assert tc.get("/metrics").status_code == 200 and tc.get("/slots").status_code == 200


def _events(tc, path: str, body: dict) -> list[dict]:
    with tc.stream("POST", path, json={**body, "stream": True}) as s:
        return [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]


def test_timings_per_token_and_return_tokens():
    with _client() as tc:
        body = tc.post("/completion", json={"prompt": "hello there", "temperature": 0, "return_tokens": True}).json()
        assert len(body["tokens"]) == body["tokens_predicted"] == 3 and all(type(t) is int for t in body["tokens"])
        assert tc.post("/completion", json={"prompt": "hello there"}).json()["tokens"] == []
        events = _events(tc, "/completion", {"prompt": "hello", "return_tokens": True, "timings_per_token": True})
        pieces, last = events[:-1], events[-1]
        assert pieces and all(e["tokens"] and e["timings"]["predicted_n"] == e["tokens_predicted"] for e in pieces)
        assert [t for e in pieces for t in e["tokens"]] == last["tokens"] and last["timings"]["predicted_n"] == 3
        plain = _events(tc, "/completion", {"prompt": "hi"})  # pieces carry their tokens anyway, as llama-server's
        assert all("timings" not in e and e["tokens"] for e in plain[:-1]) and plain[-1]["tokens"] == []
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})):
            events = _events(tc, path, {**body, "timings_per_token": True})
            first = 1 if path == "/v1/chat/completions" else 0  # the role chunk has none, as llama-server's
            assert "timings" not in events[0] or first == 0
            assert all("timings" in e for e in events[first:]), events
            # return_tokens is /completion's: the OpenAI endpoints refuse it by name
            r = tc.post(path, json={**body, "return_tokens": True})
            assert r.status_code == 400 and r.json()["error"]["param"] == "return_tokens"


def test_native_prompt_batches_and_json_prompts():
    """llama-server's prompt forms: a list without token ids is a batch (a list of bodies, each
    with its index); {"prompt_string": ...} is a prompt; media is refused (no multimodal model);
    /completions is /completion, as llama-server routes it."""
    with _client() as tc:
        one = tc.post("/completion", json={"prompt": "hello there", "temperature": 0}).json()
        r = tc.post("/completion", json={"prompt": ["hello there", [1, 2], {"prompt_string": "hello there"}],
                                         "temperature": 0})
        bodies = r.json()
        assert r.status_code == 200 and [b["index"] for b in bodies] == [0, 1, 2]
        assert bodies[0]["content"] == bodies[2]["content"] == one["content"] and bodies[1]["tokens_evaluated"] == 2
        assert tc.post("/completion", json={"prompt": {"prompt_string": "hello there"}, "temperature": 0}).json()[
            "content"] == one["content"]
        native = tc.post("/completions", json={"prompt": "hello there", "temperature": 0}).json()
        assert native["content"] == one["content"] and native["stop_type"] == one["stop_type"] and "choices" not in native
        for bad, why in (({"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}}, "Multimodal data"),
                         ({"prompt": [[1], {"other": 1}]}, "a JSON prompt"),
                         ({"prompt": ["a", "b"], "stream": True}, "stream: ")):
            r = tc.post("/completion", json=bad)
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_ignore_eos_lists_its_biases():
    """generation_settings.logit_bias shows the -inf (null) biases ignore_eos puts on the
    end-of-generation tokens, after the request's own, as llama-server's."""
    with _client() as tc:
        def bias(**extra):
            return tc.post("/completion", json={"prompt": "hi", "n_predict": 2, **extra}).json()[
                "generation_settings"]["logit_bias"]

        assert bias(ignore_eos=True) == [{"token": 0, "bias": None}]
        assert bias(ignore_eos=False) == [] == bias()
        assert bias(ignore_eos=True, logit_bias=[[5, 1.0]]) == [{"token": 5, "bias": 1.0}, {"token": 0, "bias": None}]


def test_native_body_truncated_when_the_context_filled():
    from spark_cli.serve.llama_api import final_body
    from spark_cli.serve.protocol import Usage

    def body(finish):
        return final_body("x", "m", "p", finish, None, Usage(3, 0, 1), None, {}, None)

    assert body("context")["truncated"] is True and body("context")["stop_type"] == "limit"
    assert not any(body(f)["truncated"] for f in ("eog", "stop", "length", "interrupted"))


def test_a_grammar_llama_cpp_refuses_is_that_requests_400():
    """A sampler llama.cpp cannot build (an invalid GBNF) answers that request with a 400; the
    engine thread goes on serving (it used to die, and every later request hung)."""
    from spark_cli.errors import SparkError

    class Picky(_Engine):
        def make_sampler(self, *args, **kw):
            if args[7]:  # the grammar
                raise SparkError("llama.cpp refused the grammar (failed to parse grammar)")
            return super().make_sampler(*args, **kw)

    with fake_client(lambda: Picky(n_ctx=64)) as tc:
        for _ in range(2):
            # NOTE: GBNF Spark's own check passes on (core/gbnf); the engine above refuses it, as llama.cpp may
            r = tc.post("/v1/chat/completions", json={**CHAT, "grammar": 'root ::= "a" [b-c]*'})
            assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
            assert "refused the grammar" in r.json()["error"]["message"]
            assert tc.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_a_bug_while_starting_a_request_is_its_500_and_the_server_goes_on():
    """An unexpected exception while a job starts (here: after it took a slot) answers that request
    with a 500 in the API's shape, frees the slot, and later requests are served."""

    class Buggy(_Engine):
        def make_sampler(self, *args, **kw):
            sampler = super().make_sampler(*args, **kw)
            if args[7]:  # the grammar
                sampler.prime = lambda toks: (_ for _ in ()).throw(RuntimeError("planted"))
            return sampler

    with fake_client(lambda: Buggy(n_ctx=64)) as tc:
        for _ in range(3):  # more than the slots: each failure gave its slot back
            r = tc.post("/v1/chat/completions", json={**CHAT, "grammar": 'root ::= "a"'})
            assert r.status_code == 500 and "planted" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["type"] == "server_error"
            assert tc.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_logit_bias_by_text():
    """llama-server's logit_bias keys may be text ({"text": bias} or [["text", bias]]): each of its
    tokens gets the bias."""
    from spark_cli.runs.chat_session import Sampling
    from spark_cli.serve.protocol import ChatRequest, parse
    from spark_cli.serve.worker import resolve_bias

    eng = _Engine(n_ctx=64)
    for bias in ({" of course ": -100, "7": 2}, [[" of course ", -100], [7, 2]]):
        req = parse(ChatRequest, json.dumps({**CHAT, "logit_bias": bias}).encode())
        assert req.bias == ((" of course ", -100.0), (7, 2.0))
        got = resolve_bias(Sampling(logit_bias=req.bias), eng).logit_bias
        assert got == ((eng._id("of"), -100.0), (eng._id("course"), -100.0), (7, 2.0))
    with _client() as tc:
        assert tc.post("/completion", json={"prompt": "hi", "logit_bias": [["yes", False]]}).status_code == 200


def test_chat_input_tokens():
    """llama-server's /v1/chat/completions/input_tokens: the prompt's tokens, nothing generated."""
    with _client() as tc:
        answer = tc.post("/v1/chat/completions", json=CHAT).json()
        for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
            r = tc.post(path, json=CHAT)
            assert r.status_code == 200 and r.json() == {"input_tokens": answer["usage"]["prompt_tokens"]}
        assert tc.post("/v1/chat/completions/input_tokens", json={"messages": []}).status_code == 400


# ---------------------------------------------------------------- post_sampling_probs, response_fields, verbose, n


def _chain(lc, temp: float, top_k: int = 0, seed: int = 3):
    from spark_cli.native.generate import NativeSampler

    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    if temp <= 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return NativeSampler(lc, chain, greedy=True)
    if top_k:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(top_k))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(temp))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(seed))
    return NativeSampler(lc, chain)


def test_post_sampling_probs_are_the_chains():
    """llama.cpp's own chain on given logits: the candidates it left, by the probability it gave
    them, none of probability 0, at most n; greedy: the token with probability 1 (llama-server's
    temperature 0); the same seed draws the same tokens with or without the probabilities."""
    lc = pytest.importorskip("llama_cpp.llama_cpp")
    logits = np.random.default_rng(0).normal(size=500).astype(np.float32)
    tok, p = _chain(lc, 1.0).sample_post(None, logits, n=10)
    assert p.post and p.token == tok and len(p.top) == 10 and all(q > 0 for _, q in p.top)
    assert [q for _, q in p.top] == sorted((q for _, q in p.top), reverse=True)
    soft = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()  # temperature 1, no cut
    assert p.prob == pytest.approx(soft[tok], rel=1e-4) and p.top[0][0] == int(np.argmax(logits))
    few = _chain(lc, 1.0, top_k=3).sample_post(None, logits, n=10)[1]
    assert len(few.top) == 3 and sum(q for _, q in few.top) == pytest.approx(1.0)  # fewer: they sum to 1
    assert {t for t, _ in few.top} == set(np.argsort(-logits)[:3].tolist())
    assert _chain(lc, 0).sample_post(None, logits, n=5)[1].top == ((int(np.argmax(logits)), 1.0),)
    a, b = _chain(lc, 1.5, seed=9), _chain(lc, 1.5, seed=9)
    drawn = [a.sample_post(None, logits, n=2)[0] for _ in range(20)]
    assert drawn == [b.sample_post(None, logits, n=0)[0] for _ in range(20)] and len(set(drawn)) > 1


class _Seeded(_Engine):
    """Its reply names the seed it was sampled with; post-sampling probabilities as a chain gives them."""

    def __init__(self, n_ctx: int, n_seq: int = 1):
        super().__init__(n_ctx, n_seq)
        self.seeds: list[int] = []

    def make_sampler(self, *args, **kw):
        seed = args[3]
        self.seeds.append(seed)
        reply = [self._id(w) for w in ("yes", f"s{seed}")] + [self.EOG]

        def sample(engine, logits, row=-1):
            return reply.pop(0)

        def sample_post(engine, logits, row=-1, n=0):
            tok = sample(engine, logits, row)
            return tok, TokenProbs(tok, 0.75, ((tok, 0.75), (self._id("no"), 0.25))[:n], post=True)

        return SimpleNamespace(sample=sample, sample_post=sample_post, prime=lambda prompt: None, close=lambda: None)


def test_post_sampling_probs_are_written_as_probs():
    """post_sampling_probs: `prob` and `top_probs` where logprob and top_logprobs were, on
    /completion, its stream and the chat's logprobs; generation_settings says it."""
    with fake_client(lambda: _Seeded(n_ctx=64)) as tc:
        body = tc.post("/completion", json={"prompt": "hi", "n_probs": 2, "post_sampling_probs": True,
                                            "seed": 4}).json()
        first = body["completion_probabilities"][0]
        assert first["token"] == "yes " and first["prob"] == 0.75 and "logprob" not in first
        assert [(t["token"], t["prob"]) for t in first["top_probs"]] == [("yes ", 0.75), ("no ", 0.25)]
        assert "top_logprobs" not in first and body["generation_settings"]["post_sampling_probs"] is True
        streamed = _events(tc, "/completion", {"prompt": "hi", "n_probs": 1, "post_sampling_probs": True})
        assert [len(e["completion_probabilities"][0]["top_probs"]) for e in streamed[:-1]] == [1, 1]
        chat = tc.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 1,
                                                     "post_sampling_probs": True}).json()
        content = chat["choices"][0]["logprobs"]["content"]
        assert [(t["prob"], len(t["top_probs"])) for t in content] == [(0.75, 1), (0.75, 1)]
        # without n_probs it asks for nothing
        assert "completion_probabilities" not in tc.post("/completion", json={"prompt": "hi",
                                                                             "post_sampling_probs": True}).json()


def test_response_fields_keep_the_named_values():
    """llama-server's response_fields: only those fields of /completion's final body, a nested one
    under its whole path; a path that names nothing is left out."""
    from spark_cli.serve.llama_api import picked

    assert picked({"a": {"b": 1}, "c": 2}, ["a/b", "c", "a/x", "c/d"]) == {"a/b": 1, "c": 2}
    assert picked({"a": 1}, []) == {"a": 1}
    fields = ["content", "generation_settings/n_predict", "prompt", "no/such"]
    with _client() as tc:
        body = tc.post("/completion", json={"prompt": "hello there", "n_predict": 5, "response_fields": fields}).json()
        assert body == {"content": "yes of course ", "generation_settings/n_predict": 5, "prompt": "hello there "}
        last = _events(tc, "/completion", {"prompt": "hello", "response_fields": ["stop", "tokens_predicted"]})[-1]
        assert last == {"stop": True, "tokens_predicted": 3}
        batch = tc.post("/completion", json={"prompt": ["a", "b"], "response_fields": ["index"]}).json()
        assert batch == [{"index": 0}, {"index": 1}]
        r = tc.post("/completion", json={"prompt": "hi", "response_fields": "content"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_fields"


def test_verbose_echoes_the_native_body():
    """verbose: `__verbose` is llama-server's /completion body of the answer (the prompt's tokens
    detokenized, the text as generated); --verbose makes it the default, a request's false wins."""
    from spark_cli.serve.chat import ChatConfig, Defaults

    with _client() as tc:
        body = tc.post("/v1/chat/completions", json={**CHAT, "verbose": True}).json()
        v = body["__verbose"]
        assert v["prompt"] == "<user> hi there <assistant> " and v["content"] == "yes of course "
        assert v["stop"] is True and v["tokens_predicted"] == body["usage"]["completion_tokens"] == 3
        assert v["generation_settings"]["temperature"] == 0 and v["stop_type"] == "eos"
        assert "__verbose" not in tc.post("/v1/chat/completions", json=CHAT).json()
        done = [e for e in _events(tc, "/v1/completions", {"prompt": "hello", "verbose": True})
                if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(done) == 1 and done[0]["__verbose"]["content"] == "" and done[0]["__verbose"]["prompt"] == "hello "
        picked_only = tc.post("/v1/completions", json={"prompt": "hi", "verbose": True,
                                                       "response_fields": ["content"]}).json()
        assert picked_only["__verbose"] == {"content": "yes of course "} and picked_only["choices"][0]["text"]
    with _client(chat=ChatConfig(defaults=Defaults(temp=0, verbose=True))) as tc:
        assert "prompt" in tc.post("/v1/chat/completions", json=CHAT).json()["__verbose"]
        assert "__verbose" not in tc.post("/v1/chat/completions", json={**CHAT, "verbose": False}).json()
        events = _events(tc, "/v1/chat/completions", CHAT)
        assert [("__verbose" in e) for e in events] == [False] * (len(events) - 1) + [True]


@pytest.mark.parametrize("n_seq", [1, 2])
def test_n_choices(n_seq):
    """n > 1 (llama-server's n_cmpl): choice j samples with the seed + j, on any free slot or after
    the first on the same one; one body with every choice by index, the prompt counted once and
    every completion's tokens; streamed, each choice's chunks carry its index and one usage chunk
    counts them all. The official client reads both."""
    eng: list[_Seeded] = []

    def make() -> _Seeded:
        eng.append(_Seeded(n_ctx=64, n_seq=n_seq))
        return eng[0]

    with fake_client(make) as tc:
        client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:8080/v1", http_client=tc)
        r = client.chat.completions.create(model="m", messages=CHAT["messages"], n=2, seed=10, max_tokens=8)
        assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == [
            (0, "yes s10 ", "stop"), (1, "yes s11 ", "stop")]
        one = tc.post("/v1/chat/completions", json={**CHAT, "seed": 10}).json()["usage"]
        assert r.usage.prompt_tokens == one["prompt_tokens"] and r.usage.completion_tokens == 2 * 2
        assert eng[0].seeds == [10, 11, 10]
        comp = tc.post("/v1/completions", json={"prompt": "hi", "n_cmpl": 2, "seed": 3, "verbose": True}).json()
        assert [c["text"] for c in comp["choices"]] == ["yes s3 ", "yes s4 "]
        assert comp["__verbose"]["content"] == "yes s3 "
        stream = client.chat.completions.create(model="m", messages=CHAT["messages"], n=2, seed=5, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        text = {0: "", 1: ""}
        for ch in chunks[:-1]:
            (c,) = ch.choices
            text[c.index] += c.delta.content or ""
        assert text == {0: "yes s5 ", 1: "yes s6 "}
        assert [ch.choices[0].index for ch in chunks[:-1] if ch.choices[0].finish_reason] in ([0, 1], [1, 0])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        assert len({ch.id for ch in chunks}) == 1
        r = tc.post("/completion", json={"prompt": "hi", "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
