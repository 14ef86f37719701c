"""Hostile input, round three: work that blocked the HTTP loop (/tokenize, /detokenize, schema
conversion), a corpus line Python cannot convert, errors that named the wrong thing (NaN,
Anthropic's empty content and `any`, a --plan or trace that is a device), fields accepted and
not honoured (id_slot, chat_template_kwargs that replace the template's own variables) and a
request framed both by Content-Length and Transfer-Encoding. The app-level cases run on a fake
engine (fast tier); the loop and socket cases start the real server process (model tier)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from conftest import cli_runner
from test_serve_hostile import _Engine, _closed_within, served  # noqa: F401 - served: a fixture

from _serve_client import fake_client

httpx = pytest.importorskip("httpx")

CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2}


def _slots_client(n_seq: int = 4):
    return fake_client(lambda: _Engine(n_ctx=256, n_seq=n_seq))


def _error(r) -> dict:
    body = r.json()
    return body["error"]


# ---------------------------------------------------------------- 8. errors that name the wrong thing


@pytest.mark.parametrize("field", ["temperature", "top_p", "repeat_penalty", "min_p", "presence_penalty"])
def test_nan_is_not_a_number_naming_the_field(field):
    raw = json.dumps(CHAT)[:-1] + f', "{field}": NaN}}'
    with _slots_client(1) as tc:
        r = tc.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and _error(r)["param"] == field, r.text
        assert _error(r)["message"].startswith(f"{field}: not a number"), r.text
        raw = '{"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
        r = tc.post("/v1/messages", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text  # Anthropic's shape
        assert r.json()["error"]["message"].startswith("temperature: not a number"), r.text


def test_anthropic_empty_content_and_any_without_tools_say_what_was_sent():
    with _slots_client(1) as tc:
        r = tc.post("/v1/messages", json={"max_tokens": 1, "messages": [{"role": "user", "content": []}]})
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and msg.startswith("messages.0.content: empty"), r.text
        r = tc.post("/v1/messages", json={"max_tokens": 1, "messages": [
            {"role": "user", "content": "hi"}, {"role": "user", "content": []}]})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages.1.content: empty"), r.text
        # a last assistant message may be empty (a prefill of nothing), as Anthropic's
        r = tc.post("/v1/messages", json={"max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": []}]})
        assert r.status_code == 200, r.text
        for tools in ([], [{"type": "web_search_20250305", "name": "web_search"}]):  # none the model can call
            r = tc.post("/v1/messages", json={"max_tokens": 1, "tool_choice": {"type": "any"}, "tools": tools,
                                              "messages": [{"role": "user", "content": "hi"}]})
            msg = r.json()["error"]["message"]
            assert r.status_code == 400 and msg.startswith('tool_choice: "any" needs tools'), r.text
            assert "required" not in msg


def test_plan_and_trace_that_are_devices_are_named_so(monkeypatch, capsys, tmp_path, small_model):
    from spark_cli.commands import profile, serve
    from spark_cli.core.trace import RoutingTrace
    from spark_cli.errors import PlanError, ProfileError
    from spark_cli.runs.session import load_plan_file

    plan, trace = tmp_path / "plan.json", tmp_path / "t.npz"
    plan.symlink_to("/dev/zero")
    trace.symlink_to("/dev/zero")
    with pytest.raises(PlanError, match=r"--plan .*plan.json: is a device, not a regular file"):
        load_plan_file(plan, None)  # type: ignore[arg-type] - refused before the geometry is read
    with pytest.raises(ProfileError, match=r"t.npz: is a device, not a regular file"):
        RoutingTrace.load(trace)
    with pytest.raises(PlanError, match="no such file"):
        load_plan_file(tmp_path / "missing.json", None)  # type: ignore[arg-type]
    run = cli_runner(monkeypatch, capsys, "profile", profile.register)
    rc, _, err = run("simulate", trace)
    assert rc == 5 and "is a device, not a regular file" in err and "not found" not in err, err
    run = cli_runner(monkeypatch, capsys, "serve", serve.register)
    rc, _, err = run(small_model, "--plan", plan, "-dev", "none", "--port", "0")
    assert rc == PlanError.exit_code and "is a device, not a regular file" in err and "no such file" not in err, err


# ---------------------------------------------------------------- 7. a corpus line Python cannot convert


def test_corpus_lines_past_int_digits_or_the_recursion_limit_are_skipped_and_counted(tmp_path):
    from spark_cli.files.corpus import read_corpus

    (tmp_path / "a.jsonl").write_text("\n".join([
        '{"text": "some words to profile"}',
        '{"text": "x", "n": ' + "7" * 5001 + "}",
        "[" * 100_000 + "]" * 100_000,
    ]) + "\n")
    corpus = read_corpus(tmp_path)
    assert len(corpus.documents) == 1 and corpus.bad_lines == 2
    assert "skipped 2 invalid .jsonl lines" in corpus.summary()


# ---------------------------------------------------------------- 9. fields accepted and not honoured


def test_id_slot_is_honoured_and_its_range_checked():
    with _slots_client(4) as tc:
        for slot in (2, 0, 3, 0):
            r = tc.post("/completion", json={"prompt": "hello there", "n_predict": 2, "id_slot": slot})
            assert r.status_code == 200 and r.json()["id_slot"] == slot, r.text
        # the same prompt again: the slot asked for, not the one that holds it
        r = tc.post("/completion", json={"prompt": "hello there", "n_predict": 2, "id_slot": 1})
        assert r.status_code == 200 and r.json()["id_slot"] == 1, r.text
        r = tc.post("/v1/chat/completions", json={**CHAT, "id_slot": 3, "verbose": True})
        assert r.status_code == 200 and r.json()["__verbose"]["id_slot"] == 3, r.text
        for bad in (4, 999, -2):
            r = tc.post("/v1/chat/completions", json={**CHAT, "id_slot": bad})
            err = _error(r)
            assert r.status_code == 400 and err["param"] == "id_slot", r.text
            assert err["message"].startswith(f"id_slot: {bad} is not a slot") and "0 to 3" in err["message"], r.text


def test_jobs_wait_for_the_slot_they_ask_for():
    from spark_cli.runs.chat_session import Sampling
    from spark_cli.serve.learn import Learner
    from spark_cli.serve.stats import ServerStats
    from spark_cli.serve.worker import Done, Job, Started, Worker

    worker = Worker(lambda: _Engine(n_ctx=256, n_seq=2), set(), ServerStats(),
                    Learner(Path("none.gguf"), None, enabled=False), max_queue=8)
    worker.start()
    try:
        assert worker.ready.wait(30)
        events: list[list] = [[] for _ in range(5)]
        jobs = [Job(events[i].append, Sampling(temp=0), text=f"hello {i}", id_slot=1 if i < 4 else -1)
                for i in range(5)]
        for job in jobs:  # four for slot 1 at once: three of them wait for it
            worker.submit(job)
        assert all(job.done.wait(30) for job in jobs)
        started = [[e for e in ev if isinstance(e, Started)] for ev in events]
        assert [s[0].slot for s in started[:4]] == [1, 1, 1, 1]
        assert all(isinstance(ev[-1], Done) for ev in events)
        assert worker.waiting() == 0
    finally:
        worker.shutdown(1)


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                 "raise_exception"])
def test_chat_template_kwargs_may_not_replace_the_templates_own_variables(key):
    injected = {"messages": [{"role": "user", "content": "INJECTED"}]}.get(key, "INJECTED")
    with _slots_client(1) as tc:
        r = tc.post("/apply-template", json={**CHAT, "chat_template_kwargs": {key: injected}})
        assert r.status_code == 400 and _error(r)["param"] == f"chat_template_kwargs.{key}", r.text
        assert _error(r)["message"].startswith(f"chat_template_kwargs.{key}: "), r.text
        r = tc.post("/apply-template", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200 and "INJECTED" not in r.text, r.text


# ---------------------------------------------------------------- 4. tokenization off the HTTP loop


def test_tokenize_content_is_bounded_by_the_context():
    from spark_cli.serve.app import MIN_TOKENIZE_BYTES, tokenize_limit

    with _slots_client(1) as tc:
        limit = tokenize_limit(256)
        assert limit == MIN_TOKENIZE_BYTES  # a small context still counts a document
        r = tc.post("/tokenize", json={"content": "a " * (limit // 2)})
        assert r.status_code == 200 and len(r.json()["tokens"]) == limit // 2, r.text[:200]
        r = tc.post("/tokenize", json={"content": "a " * (limit // 2) + "b"})
        err = _error(r)
        assert r.status_code == 400 and err["param"] == "content" and f"{limit}-byte limit" in err["message"], r.text
    assert tokenize_limit(8192) == 32 * 8192


def test_schema_conversion_runs_off_the_loop(monkeypatch):
    """A schema of 5,000 properties takes a second to become a grammar: not on the loop that answers /health."""
    import asyncio

    from spark_cli.serve import chat

    on_loop: list[bool] = []
    convert = chat.json_schema_gbnf

    def spy(schema, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return convert(schema, *args, **kwargs)

    monkeypatch.setattr(chat, "json_schema_gbnf", spy)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    with _slots_client(1) as tc:
        for body in ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
                     {"prompt": "hi", "max_tokens": 1, "json_schema": schema}):
            r = tc.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body)
            assert r.status_code == 200, r.text
    assert on_loop == [False, False]


@pytest.mark.model
def test_big_tokenize_and_detokenize_leave_the_loop_free(served):  # noqa: F811 - the fixture
    port, log = served()
    base = f"http://127.0.0.1:{port}"
    waits: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            assert httpx.get(base + "/health", timeout=30).status_code == 200
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.2)
        big = httpx.post(base + "/tokenize", json={"content": "<|im_start|>a" * 40000}, timeout=60)  # 520 KB
        within = httpx.post(base + "/tokenize", json={"content": "<|im_start|>a" * 5000}, timeout=60)
        ids = json.dumps({"tokens": [9] * 400_000}, separators=(",", ":"))  # 800 KB: ~1 s of pieces
        text = httpx.post(base + "/detokenize", content=ids, headers={"Content-Type": "application/json"},
                          timeout=60)
    finally:
        done.set()
        prober.join()
    assert len(waits) >= 3 and max(waits) < 1.0, f"/health waited {max(waits):.2f} s"
    assert big.status_code == 400 and big.json()["error"]["param"] == "content", big.text[:200]
    assert "-byte limit" in big.json()["error"]["message"]
    assert within.status_code == 200 and len(within.json()["tokens"]) == 10000, within.text[:200]
    assert text.status_code == 200 and text.json()["content"] == "<issue_comment>" * 400_000, text.text[:200]
    assert "Traceback" not in log.read_text()


# ---------------------------------------------------------------- 10. Content-Length beside Transfer-Encoding


@pytest.mark.model
def test_a_request_framed_both_ways_is_answered_once_and_the_connection_closed(served):  # noqa: F811
    port, log = served("--read-timeout", "30")  # the last one counts: only keep-alive (5 s) closes an idle one
    body = b'{"content": "hello"}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    smuggled = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"  # would be a second answer on a kept connection
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        # NOTE: a Content-Length past the body limit: the chunks are the body, not a 413
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 2000000\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked + smuggled)
        data = b""
        s.settimeout(3)
        t0 = time.monotonic()
        try:
            while chunk := s.recv(65536):
                data += chunk
            closed = True
        except (socket.timeout, ConnectionResetError):
            closed = False
        took = time.monotonic() - t0
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), data[:300]
    assert b"connection: close" in head.lower(), head
    assert json.loads(rest)["tokens"], rest[:200]
    assert data.count(b"HTTP/1.1 ") == 1, data  # the request after it is not answered
    assert closed and took < 2.0, f"closed {closed} after {took:.1f} s (keep-alive is 5 s)"
    # an ordinary request still keeps its connection
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        s.settimeout(5)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200") and b"connection: close" not in first.lower(), first
        assert not _closed_within(s, 2.0)
    assert "Traceback" not in log.read_text()
