"""`spark serve`: the real server process on the RPC stand-in, driven by the official `openai`
client: answers equal to `spark chat`, streaming, concurrency, cancellation, bad requests,
metrics, keys, self-tuning on SIGTERM, and a dying RPC server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from test_chat import _FakeEngine, _min_budget

from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.profile import RoutingProfile, profile_path_for
from spark_cli.native.rpc import RpcServer, free_port
from spark_cli.serve.app import ServerState, create_app
from spark_cli.native.generate import StopFilter
from spark_cli.serve.learn import Learner
from spark_cli.serve.protocol import ApiError, ChatRequest, parse
from spark_cli.serve.stats import ServerStats
from spark_cli.serve.worker import Worker

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

SPARK = str(Path(sys.executable).parent / "spark")
KEY = "sk-test-serve"
N_CTX = 512
QUEUE = 8
# NOTE: greedy answers far from a tie (top-2 logit margins >= 0.8 at every step): with the demo
# model's Jinja template (a default system prompt) answers near a tie change with the KV prefix reused
PROMPTS = ("What is the capital of Japan?", "What is two plus two?")
N_PREDICT = 6
COUNTING = "1, 2, 3, 4, 5,"  # greedy keeps counting: a generation that does not end by itself
THREADS = 1  # NOTE: on a shared 2-core machine, spinning thread pools of 2 collapse under load

def _env() -> dict:
    return {**os.environ, "COLUMNS": "160", "SPARK_DEBUG": ""}


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    model: Path
    log: Path
    rpc: RpcServer
    health_seen: list[int] = field(default_factory=list)
    served_prompt: int = 0  # prompt tokens evaluated (not reused), from usage
    served_completion: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str | None = KEY, timeout: float = 600) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=timeout)

    def http(self, key: str | None = KEY) -> "httpx.Client":
        return httpx.Client(base_url=self.url, timeout=120,
                            headers={"Authorization": f"Bearer {key}"} if key else {})

    def count(self, usage) -> None:
        self.served_prompt += usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
        self.served_completion += usage.completion_tokens

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        with self.http() as h:
            r = h.get("/metrics")
        assert r.status_code == 200
        return {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _budget(model: Path) -> int:
    """The cache's floor plus half the expert bytes: cached layers with a few LRU slots."""
    g = load_geometry(model)
    return _min_budget(g, N_CTX) + g.total_expert_bytes // 2


def _start(model: Path, rpc: RpcServer, tmp: Path, *extra: str) -> Server:
    port = free_port()
    log = tmp / f"serve-{port}.log"
    args = [SPARK, "serve", str(model), "--rpc", rpc.endpoint, "--vram", str(_budget(model)), "-c", str(N_CTX),
            "-t", str(THREADS), "--port", str(port), *extra]
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=_env())
    srv = Server(proc, port, model, log, rpc)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            srv.health_seen.append(httpx.get(srv.url + "/health", timeout=5).status_code)
        except httpx.TransportError:
            pass  # not listening yet
        if srv.health_seen[-1:] == [200]:
            return srv
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("the server did not become ready: " + log.read_text())


def _stop(srv: Server) -> None:
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait(timeout=30)


def _chat_reference(model: Path, rpc: RpcServer, prompt: str) -> dict:
    r = subprocess.run([SPARK, "chat", str(model), "--rpc", rpc.endpoint, "--vram", str(_budget(model)),
                        "-c", str(N_CTX), "-t", str(THREADS), "--temp", "0", "-n", str(N_PREDICT), "--prompt", prompt,
                        "--json", "--no-learn"], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def model(small_model, tmp_path_factory) -> Path:
    """A symlink in a fresh folder: the profile lands beside it, not in the shared cache."""
    d = tmp_path_factory.mktemp("serve")
    m = d / small_model.name
    m.symlink_to(small_model)
    return m


@pytest.fixture(scope="module")
def rpc():
    # NOTE: the server holds its RPC connection for its lifetime, and ggml's RPC server takes one
    # client at a time: this module has its own
    srv = RpcServer(threads=THREADS).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def references(model, rpc) -> dict[str, dict]:
    """`spark chat --prompt` greedy answers, run before the server holds the RPC server."""
    return {p: _chat_reference(model, rpc, p) for p in PROMPTS}


@pytest.fixture(scope="module")
def server(model, rpc, references, tmp_path_factory):
    srv = _start(model, rpc, model.parent, "--api-key", KEY, "--queue", str(QUEUE), "--learn-every", "0")
    yield srv
    _stop(srv)


# ---------------------------------------------------------------- without a model


@pytest.mark.parametrize("pieces,stops,want,matched", [
    (["Hello", " wor", "ld"], [], "Hello world", None),
    (["Hello", " wor", "ld", "!"], ["world"], "Hello ", "world"),
    (["a", "b", "<", "/", "x", ">", "c"], ["</x>"], "ab", "</x>"),
    (["a<", "b", "<", "/y"], ["</x>"], "a<b</y", None),  # a held-back prefix that did not complete
    (["one two", " three"], ["three", "two"], "one ", "two"),  # the earliest in the text, not in the list
])
def test_stop_filter(pieces, stops, want, matched):
    f = StopFilter(stops)
    out = "".join(f.feed(p) for p in pieces) + f.flush()
    assert out == want and f.matched == matched and f.hit is (matched is not None)


@pytest.mark.parametrize("body,where", [
    (b"{", "not valid JSON"),
    (b'"text"', "JSON object"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages.0.content:"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_k": -1}', "top_k:"),
    (b'{"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}', "presence_penalty:"),
    (b'{"messages": [{"role": "user", "content": "x"}], "mirostat": 2}', "mirostat: not supported"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n: Input should be greater than or equal to 1"),
    (b'{"messages": [{"role": "user", "content": "x"}], "samplers": ["top_k", "mirostat"]}',
     "samplers: unknown sampler 'mirostat'"),
    (b'{"messages": [{"role": "user", "content": "x"}], "samplers": "tk"}', "samplers: spark serve runs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"the": "x"}}', "logit_bias:"),
    (b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1e400}}', "logit_bias: token 5"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs requires logprobs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": true}', "top_logprobs:"),
    (b'{"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}',
     "Cannot have 2 or more assistant messages at the end"),
])
def test_parse_names_the_problem(body, where):
    with pytest.raises(ApiError) as e:
        parse(ChatRequest, body)
    assert e.value.status == 400 and where in e.value.message


def test_parse_takes_null_as_unset():
    r = parse(ChatRequest, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], '
                           b'"temperature": null, "max_tokens": null, "stop": null, "stream": true}')
    assert (r.temperature, r.asked_limit, r.stops, r.stream) == (None, None, [], True)  # the server's defaults
    assert r.message_dicts() == [{"role": "user", "content": "hi"}]


def test_text_parts_join_with_a_newline_as_llama_servers():
    r = parse(ChatRequest, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "What is"}, '
                           b'{"type": "text", "text": "the best book"}]}]}')
    assert r.message_dicts() == [{"role": "user", "content": "What is\nthe best book"}]


def test_a_continued_messages_parts_join_with_a_blank_line_as_llama_servers():
    r = parse(ChatRequest, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", '
                           b'"text": "b"}]}, {"role": "assistant", "content": [{"type": "text", "text": "Wh"}, '
                           b'{"type": "text", "text": "ill"}]}]}')
    assert r.prefill and [m["content"] for m in r.message_dicts()] == ["a\nb", "Wh\n\nill"]


class _SlowLoadingEngine(_FakeEngine):
    def bank_bytes(self) -> int:
        return 0


def test_health_is_503_while_loading_then_serves():
    from starlette.testclient import TestClient

    gate = threading.Event()

    def open_engine():
        assert gate.wait(30)
        return _SlowLoadingEngine(n_ctx=64)

    stats = ServerStats()
    worker = Worker(open_engine, set(), stats, Learner(Path("none.gguf"), None, enabled=False), max_queue=2)
    worker.start()
    chat = {"messages": [{"role": "user", "content": "hi there"}], "temperature": 0}
    try:
        with TestClient(create_app(ServerState(worker, stats, "fake.gguf")), base_url="http://127.0.0.1") as tc:
            r = tc.get("/health")
            assert r.status_code == 503 and r.json()["error"] == {
                "message": "Loading model", "type": "unavailable_error", "code": 503, "param": None}
            assert tc.post("/v1/chat/completions", json=chat).status_code == 503
            gate.set()
            assert worker.ready.wait(30)
            assert tc.get("/health").json() == {"status": "ok"}
            r = tc.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "yes of course "
            assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        gate.set()
        worker.shutdown(1)


# ---------------------------------------------------------------- the basics


@pytest.mark.model
def test_health_models_and_keys(server):
    assert server.health_seen[-1] == 200 and 500 not in server.health_seen
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no key needed
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model.name]
    card = models.data[0].model_dump()
    assert card["object"] == "model" and card["owned_by"] == "spark" and card["created"] > 0
    g = load_geometry(server.model)  # llama-server's meta (the training context), and the one served
    assert card["meta"] == {"n_ctx_train": g.context_length, "n_embd": g.n_embd, "size": g.file_size,
                            "n_vocab": card["meta"]["n_vocab"], "n_ctx": N_CTX} and card["meta"]["n_vocab"] > 0
    for path in ("/v1/models", "/metrics", "/v1/chat/completions"):
        with server.http(key=None) as h:
            r = h.get(path) if path != "/v1/chat/completions" else h.post(path, json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()


@pytest.mark.model
def test_chat_non_streaming_and_streaming(server, references):
    c = server.client()
    ref = references[PROMPTS[0]]
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    r = c.chat.completions.create(model="anything", messages=msgs, temperature=0, max_tokens=N_PREDICT)
    assert r.object == "chat.completion" and r.model == "anything"
    assert r.choices[0].message.content == ref["answer"]
    assert r.usage.completion_tokens == ref["figures"]["generated_tokens"]
    assert r.usage.prompt_tokens == ref["figures"]["prompt_tokens"]
    assert r.choices[0].finish_reason == ("length" if ref["figures"]["stop"] == "length" else "stop")
    server.count(r.usage)

    chunks = list(c.chat.completions.create(model="x", messages=msgs, temperature=0, max_tokens=N_PREDICT,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref["answer"] and len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    # the same messages again: everything but the last prompt token comes from the KV cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    server.count(chunks[-1].usage)


@pytest.mark.model
def test_completions_and_stop(server):
    c = server.client()
    r = c.completions.create(model="x", prompt=COUNTING, temperature=0, max_tokens=6)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.choices[0].text.startswith(" 6, 7") and r.usage.completion_tokens == 6
    server.count(r.usage)
    s = c.completions.create(model="x", prompt=COUNTING, temperature=0, max_tokens=12, stop=[" 8"])
    assert s.choices[0].text == " 6, 7," and s.choices[0].finish_reason == "stop"
    server.count(s.usage)


@pytest.mark.model
def test_continued_conversation_reuses_the_kv_prefix(server):
    c = server.client()
    first = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": PROMPTS[0]}]
    a = c.chat.completions.create(model="x", messages=first, temperature=0, max_tokens=N_PREDICT)
    server.count(a.usage)
    follow = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": "And of Italy?"}]
    b = c.chat.completions.create(model="x", messages=follow, temperature=0, max_tokens=N_PREDICT)
    server.count(b.usage)
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached >= a.usage.prompt_tokens and b.usage.prompt_tokens - cached < 20


# ---------------------------------------------------------------- many clients


@pytest.mark.model
def test_concurrent_clients_get_complete_answers(server, references):
    """8 clients x 3 requests at once: each answer equals spark chat's (greedy)."""
    results: list[tuple[str, str, str, object]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        c = server.client()
        try:
            for j in range(3):
                prompt = PROMPTS[(i + j) % len(PROMPTS)]
                msgs = [{"role": "user", "content": prompt}]
                if i % 2:
                    chunks = list(c.chat.completions.create(model="x", messages=msgs, temperature=0,
                                                            max_tokens=N_PREDICT, stream=True,
                                                            stream_options={"include_usage": True}))
                    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
                    usage = chunks[-1].usage
                else:
                    r = c.chat.completions.create(model="x", messages=msgs, temperature=0, max_tokens=N_PREDICT)
                    text, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
                with lock:
                    results.append((prompt, text, finish, usage))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    wall = time.perf_counter() - t0
    assert not errors, errors
    assert len(results) == 24
    for prompt, text, finish, usage in results:
        ref = references[prompt]
        assert text == ref["answer"], (prompt, text)
        assert usage.completion_tokens == ref["figures"]["generated_tokens"]
        assert finish in ("stop", "length")
        server.count(usage)
    tokens = sum(u.completion_tokens for *_, u in results)
    print(f"\nserve concurrency: 24 requests in {wall:.1f} s: {24 / wall:.2f} requests/s, "
          f"{tokens / wall:.1f} generated tokens/s")


# ---------------------------------------------------------------- refusals


BIG = "word " * 1500


@pytest.mark.model
@pytest.mark.parametrize("case,path,body,status,kind", [
    ("malformed JSON", "/v1/chat/completions", b"{\"messages\": [", 400, "invalid_request_error"),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, "invalid_request_error"),
    ("no messages", "/v1/chat/completions", {"model": "x"}, 400, "invalid_request_error"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, "invalid_request_error"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "invalid_request_error"),
    ("content a number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "invalid_request_error"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "invalid_request_error"),
    ("temperature 3", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3},
     400, "invalid_request_error"),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "invalid_request_error"),
    ("top_p 1.5", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "invalid_request_error"),
    ("n 0", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400,
     "invalid_request_error"),
    ("five stops", "/v1/completions", {"prompt": "hi", "stop": list("abcde")}, 400, "invalid_request_error"),
    ("over the context", "/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}, 400,
     "exceed_context_size_error"),
    ("over the size limit", "/v1/completions", {"prompt": "x" * (2 << 20)}, 413, "invalid_request_error"),
    ("unknown path", "/v1/nothing", {}, 404, "not_found_error"),
])
@pytest.mark.model
def test_bad_request_is_an_openai_error(server, case, path, body, status, kind):
    with server.http() as h:
        r = h.post(path, content=body) if isinstance(body, bytes) else h.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["code"] == status and err["message"], err
    assert "Traceback" not in r.text and "\n" not in err["message"]


@pytest.mark.model
def test_bad_request_through_the_client(server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                                temperature=5)


# ---------------------------------------------------------------- metrics


@pytest.mark.model
def test_metrics_count_the_served_tokens(server):
    m = server.metrics()
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:prompt_seconds_total",
                 "llamacpp:tokens_predicted_seconds_total", "llamacpp:requests_processing",
                 "llamacpp:requests_deferred", "spark:expert_cache_hits_total", "spark:expert_cache_misses_total",
                 "spark:expert_cache_uploads_total", "spark:expert_cache_uploaded_bytes_total",
                 "spark:expert_cache_cpu_experts_total", "spark:expert_cache_hit_ratio",
                 "spark:device_bytes_planned"):
        assert name in m, name
    assert m["llamacpp:tokens_predicted_total"] == server.served_completion > 0
    assert m["llamacpp:prompt_tokens_total"] == server.served_prompt > 0
    assert m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0
    hits, misses = m["spark:expert_cache_hits_total"], m["spark:expert_cache_misses_total"]
    assert hits > 0 and misses > 0 and m["spark:expert_cache_hit_ratio"] == pytest.approx(hits / (hits + misses))
    assert m["spark:expert_cache_uploads_total"] > 0 and m["spark:expert_cache_uploaded_bytes_total"] > 0
    assert m["spark:device_bytes_planned"] > 0 and m["llamacpp:tokens_predicted_seconds_total"] > 0


# ---------------------------------------------------------------- cancellation and a full queue


@pytest.mark.model
def test_disconnect_cancels_then_next_is_served(server):
    c = server.client()
    before = server.metrics()["llamacpp:tokens_predicted_total"]
    with c.completions.create(model="x", prompt=COUNTING, temperature=0, max_tokens=120, stream=True) as stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break  # leaving the block closes the connection
    r = c.completions.create(model="x", prompt=COUNTING, temperature=0, max_tokens=4)
    assert r.choices[0].text and " 6, 7, 8".startswith(r.choices[0].text) and r.usage.completion_tokens == 4
    cancelled = server.metrics()["llamacpp:tokens_predicted_total"] - before - 4
    assert 4 <= cancelled < 60, cancelled  # stopped soon after the client left, far from 120


@pytest.mark.model
def test_full_queue_answers_503(server):
    c = server.client()
    statuses: list[int] = []
    lock = threading.Lock()

    def waiter() -> None:
        with server.http() as h:
            r = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        with lock:
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert r.json()["error"]["type"] == "unavailable_error"

    with c.completions.create(model="x", prompt=COUNTING, temperature=0, max_tokens=400, stream=True) as holder:
        next(iter(holder))  # the worker is busy with this one now
        threads = [threading.Thread(target=waiter) for _ in range(QUEUE + 2)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while time.time() < deadline and statuses.count(503) < 2:
            time.sleep(0.05)
        assert server.metrics()["llamacpp:requests_deferred"] == QUEUE
    for t in threads:
        t.join(timeout=120)
    assert sorted(statuses) == [200] * QUEUE + [503] * 2


# ---------------------------------------------------------------- stopping and learning


@pytest.mark.model
def test_sigterm_finishes_in_flight_and_folds_the_counts(server):
    g = load_geometry(server.model)
    prof_path = profile_path_for(server.model)
    assert not prof_path.exists()  # --learn-every 0: nothing folded before exit
    served = server.metrics()["llamacpp:tokens_predicted_total"]
    c = server.client()
    with c.completions.create(model="x", prompt=COUNTING, temperature=0, max_tokens=16, stream=True,
                              stream_options={"include_usage": True}) as stream:
        chunks = []
        for ch in stream:
            if not chunks:
                server.proc.send_signal(signal.SIGTERM)
            chunks.append(ch)
    assert chunks[-1].usage.completion_tokens == 16  # the request in flight was finished
    assert server.proc.wait(timeout=60) == 0, server.log.read_text()
    served += 16
    prof = RoutingProfile.load(prof_path)
    assert prof.tokens_decode == served
    assert prof.decode.sum() == served * g.n_expert_used * len(g.moe_layers)
    assert prof.sources == ["spark serve"]
    log = server.log.read_text()
    assert "learned" in log and "Traceback" not in log


@pytest.mark.model
def test_dying_rpc_server_keeps_folded_counts_and_exits_nonzero(small_model, tmp_path):
    m = tmp_path / small_model.name
    m.symlink_to(small_model)
    g = load_geometry(m)
    rpc = RpcServer(threads=THREADS).start()
    try:
        srv = _start(m, rpc, tmp_path, "--learn-every", "0.5")
        try:
            c = srv.client()
            r = c.completions.create(model="x", prompt=COUNTING, temperature=0, max_tokens=5)
            deadline = time.time() + 30
            while time.time() < deadline and not profile_path_for(m).exists():
                time.sleep(0.1)
            folded = RoutingProfile.load(profile_path_for(m))
            assert folded.tokens_decode == r.usage.completion_tokens  # folded while serving
            got: list[str] = []
            with pytest.raises(openai.APIError, match="lost the RPC server"):
                with c.completions.create(model="x", prompt=COUNTING, temperature=0, max_tokens=400,
                                          stream=True) as stream:
                    for ch in stream:
                        if not got:
                            rpc.stop()  # the device goes away mid-answer
                        got.append(ch.choices[0].text)
            rc = srv.proc.wait(timeout=60)
            log = srv.log.read_text()
            assert rc == 1 and "Traceback" not in log, log
            assert "error: lost the RPC server" in log and "folded into the profile" in log and got
            after = RoutingProfile.load(profile_path_for(m))
            assert after.tokens_decode > folded.tokens_decode  # the tokens streamed before the loss too
            assert after.decode.sum() == pytest.approx(after.tokens_decode * g.n_expert_used * len(g.moe_layers))
        finally:
            _stop(srv)
    finally:
        rpc.stop()


# ---------------------------------------------------------------- the command line


@pytest.fixture
def spark(monkeypatch, capsys):
    from conftest import cli_runner

    from spark_cli.commands import serve as serve_cmd

    return cli_runner(monkeypatch, capsys, "serve", serve_cmd.register)


@pytest.mark.model
@pytest.mark.parametrize("case", ["missing", "miss-path", "port-taken", "rpc-and-cpu"])
def test_bad_command_line_is_one_line(case, spark, small_model, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        args = {
            "missing": [tmp_path / "nope.gguf"],
            "miss-path": [small_model, "--miss-path", "sideways"],
            "port-taken": [small_model, "--device", "cpu", "--port", taken.getsockname()[1]],
            "rpc-and-cpu": [small_model, "--device", "cpu", "--rpc", "127.0.0.1:1"],
        }[case]
        rc, out, err = spark(*args)
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc != 0 and out == ""  # each error type has its exit code
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    want = {"missing": "no such", "miss-path": "--miss-path: unknown miss path 'sideways'", "port-taken": "cannot listen",
            "rpc-and-cpu": "contradict"}[case]
    assert want in lines[0]
