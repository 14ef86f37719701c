"""`spark serve` against hostile clients (issue 22): connections that send nothing or half a
request, a low descriptor limit, Host/Origin checks, CORS preflights, the key's scheme, and
bodies that json.loads accepts but nothing downstream can take. The app-level cases run on a
fake engine (fast tier); the socket cases start the real server process (model tier)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import cli_runner
from test_chat import _FakeEngine

from _serve_client import fake_client

httpx = pytest.importorskip("httpx")

SPARK = str(Path(sys.executable).parent / "spark")
KEY = "sk-hostile"
CHAT = {"messages": [{"role": "user", "content": "hi there"}], "temperature": 0}


class _Engine(_FakeEngine):
    def bank_bytes(self) -> int:
        return 0


def _client(**state):
    return fake_client(lambda: _Engine(n_ctx=256), **state)


# ---------------------------------------------------------------- 4. auth defaults, Host, Origin, CORS


def test_host_origin_cors_and_the_bearer_scheme():
    with _client(api_key=KEY, cors=("http://localhost:3000",), allowed_hosts=("spark.lan",)) as tc:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert tc.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        assert tc.get("/v1/models", headers={"Authorization": f"BEARER  {KEY}"}).status_code == 200
        assert tc.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401
        # DNS rebinding: a page's own name in Host
        r = tc.get("/v1/models", headers={**auth, "Host": "evil.example:8080"})
        assert r.status_code == 400 and "--allowed-hosts evil.example" in r.json()["error"]["message"]
        for host in ("localhost:8080", "127.0.0.1:8080", "[::1]:8080", "spark.lan:8080", "192.168.1.9"):
            assert tc.get("/v1/models", headers={**auth, "Host": host}).status_code == 200, host
        # CSRF: a text/plain POST from another site is refused before it reaches the engine
        r = tc.post("/v1/chat/completions", content=json.dumps(CHAT),
                    headers={**auth, "Origin": "https://evil.example", "Content-Type": "text/plain"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        # an allowed origin: the preflight is answered before the key check, the answer carries the header
        r = tc.options("/v1/chat/completions", headers={"Origin": "http://localhost:3000",
                                                         "Access-Control-Request-Method": "POST",
                                                         "Access-Control-Request-Headers": "authorization,content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = tc.post("/v1/chat/completions", json=CHAT, headers={**auth, "Origin": "http://localhost:3000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        # another origin's preflight: answered (as llama-server's) without the allow headers, so the browser
        # sends nothing; its request itself is refused
        r = tc.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                         "Access-Control-Request-Method": "POST"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert "access-control-allow-methods" not in r.headers
    with _client(api_key=KEY, cors=("localhost",)) as tc:  # llama-server's --cors-origins localhost
        for origin, ok in (("http://localhost", True), ("http://127.0.0.1:3000", True), ("http://[::1]:8080", True),
                           ("http://localhost.evil.com", False), ("http://notlocalhost", False)):
            r = tc.options("/completions", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
            assert r.status_code == 200 and (r.headers.get("access-control-allow-origin") == origin) == ok, origin
            r = tc.get("/v1/models", headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
            assert r.status_code == (200 if ok else 403), origin
    with _client() as tc:  # no key: still no cross-origin POST
        r = tc.post("/v1/chat/completions", content=json.dumps(CHAT),
                    headers={"Origin": "http://attacker.test", "Content-Type": "text/plain"})
        assert r.status_code == 403


@pytest.mark.parametrize("argv,env", [(["--api-key", ""], {}), ([], {"SPARK_API_KEY": ""}),
                                      (["--api-key", "  "], {})])
def test_empty_api_key_is_refused(monkeypatch, capsys, tmp_path, argv, env):
    from spark_cli.commands import serve

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run = cli_runner(monkeypatch, capsys, "serve", serve.register)
    rc, out, err = run(tmp_path / "m.gguf", *argv)
    assert rc == 2 and "the key is empty" in err and "Traceback" not in err, err


def test_non_loopback_host_without_a_key_warns(monkeypatch, capsys, tmp_path):
    from spark_cli.commands import serve

    monkeypatch.delenv("SPARK_API_KEY", raising=False)
    run = cli_runner(monkeypatch, capsys, "serve", serve.register)
    rc, _, err = run(tmp_path / "missing.gguf", "--host", "0.0.0.0")
    assert rc == 3 and "reachable from other machines" in err and "no --api-key" in err


# ---------------------------------------------------------------- 5. bodies that json.loads accepts


BAD_BODIES = {
    "deep": b'{"messages": ' + b"[" * 10000 + b"]" * 10000 + b"}",
    "long-int": b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"7" * 5000 + b"}",
    "int-past-int32": b'{"messages": [{"role": "user", "content": "hi"}], "top_k": 4294967304}',
    "surrogate": b'{"messages": [{"role": "user", "content": "a \\ud800 b"}]}',
    "surrogate-key": b'{"messages": [{"role": "user", "content": "hi"}], "\\udfff": 1}',
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_hostile_bodies_are_400_in_the_openai_shape(case, stream):
    body = BAD_BODIES[case]
    if stream:
        body = body[:-1] + b', "stream": true}'
    with _client() as tc:
        for path in ("/v1/chat/completions", "/v1/completions"):
            raw = body if "chat" in path else body.replace(b'"messages": ', b'"prompt": "x", "m": ', 1)
            r = tc.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            err = r.json()["error"]
            assert err["code"] == 400 and err["type"] == "invalid_request_error" and err["message"], err


# ---------------------------------------------------------------- 3. connections that never finish a request

READ_TIMEOUT = 1.5


def _serve(model: Path, tmp: Path, *extra: str, nofile: int | None = None):
    from spark_cli.native.rpc import free_port

    port = free_port()
    log = tmp / f"serve-{port}.log"
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    with open(log, "wb") as f:
        proc = subprocess.Popen([SPARK, "serve", str(model), "-dev", "none", "-c", "256", "-t", "1", "--no-learn",
                                 "--port", str(port), "--read-timeout", str(READ_TIMEOUT), *extra],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "SPARK_DEBUG": ""},
                                preexec_fn=limit)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc, port, log
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not become ready: " + log.read_text())


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.fixture
def served(small_model, tmp_path):
    model = tmp_path / small_model.name
    model.symlink_to(small_model)
    procs = []

    def start(*extra, nofile=None):
        proc, port, log = _serve(model, tmp_path, *extra, nofile=nofile)
        procs.append(proc)
        return port, log
    yield start
    for p in procs:
        p.kill()
        p.wait(timeout=30)


@pytest.mark.model
def test_idle_half_header_and_half_body_connections_are_closed(served):
    port, log = served("--api-key", KEY)
    half = {"nothing": b"", "half-header": b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthor",
            "half-body": (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"mess")}
    socks = {}
    for name, data in half.items():
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(data)
        socks[name] = s
    t0 = time.monotonic()
    for name, s in socks.items():
        with s:
            assert _closed_within(s, READ_TIMEOUT + 5), f"{name}: still open after {time.monotonic() - t0:.1f} s"
    assert time.monotonic() - t0 < READ_TIMEOUT + 5
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    assert "Traceback" not in log.read_text()


@pytest.mark.model
def test_low_descriptor_limit_refuses_once_and_recovers(served):
    port, log = served(nofile=160)
    idle = []
    try:
        for _ in range(300):  # more than the descriptors the server has
            with contextlib.suppress(OSError):
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        deadline = time.time() + READ_TIMEOUT + 20
        ok = False
        while time.time() < deadline and not ok:  # the idle ones are closed by the read deadline
            with contextlib.suppress(httpx.TransportError):
                ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            time.sleep(0.2)
        assert ok, log.read_text()[-2000:]
    finally:
        for s in idle:
            s.close()
    text = log.read_text()
    assert text.count("refusing new connections") == 1, text[-2000:]
    assert "Traceback" not in text and "Too many open files" not in text and len(text) < 20_000
