"""Router mode (`spark serve` with no MODEL, llama-server's router): the queue's eviction rules on
made-up children (fast), the router's own endpoints and errors without any child (fast), and the
real thing on the tiny llama (model tier): load on demand, a chat routed and streamed, LRU eviction
with --models-max 1, unload, the router's key (the children's is not it), and no child left after
the router stops, nor after it is killed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spark_cli.serve.router_models import RouterModel
from spark_cli.serve.router_pool import LOADED, UNLOADED, Pool, PoolConfig

httpx = pytest.importorskip("httpx")

KEY = "sk-router"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def _pool(names: str, models_max: int) -> tuple[Pool, list[str]]:
    """A pool whose children are made up: request_stop records the victim instead of signalling one."""
    pool = Pool({n: RouterModel(n, "models_dir", Path(f"/m/{n}.gguf")) for n in names}, PoolConfig((), models_max=models_max))
    stopped: list[str] = []

    def stop(name: str, kill: bool = False) -> None:
        stopped.append(name)
        pool.instances[name].stopping = True

    pool.request_stop = stop  # type: ignore[method-assign]
    return pool, stopped


def _loaded(pool: Pool, name: str, last_used: float, busy: int = 0) -> None:
    inst = pool.instances[name]
    inst.status, inst.last_used, inst.req_count, inst.port = LOADED, last_used, busy, 1


def test_the_queue_evicts_idle_models_only_lru_first_and_once_per_model():
    pool, stopped = _pool("abcd", 2)
    _loaded(pool, "a", 1.0, busy=1)
    _loaded(pool, "b", 2.0)
    assert not pool.has_capacity()
    for _ in range(3):  # three requests for one missing model: one entry, one eviction
        pool.join("c")
        pool.tick()
    assert [(e.model, e.waiters) for e in pool.queue] == [("c", 3)] and stopped == ["b"]  # a is busy: kept
    pool.join("d")
    pool.tick()
    assert stopped == ["b"]  # d waits: a is busy, b is already on its way out
    assert not pool.try_claim("c")  # b still runs: no slot yet
    pool.instances["b"].status, pool.instances["b"].stopping = UNLOADED, False
    assert not pool.try_claim("d") and pool.try_claim("c")  # FIFO: the head's turn
    pool.instances["a"].req_count = 0
    pool.tick()  # c is claimed (counts as taken), d needs a slot, a is idle now
    assert stopped == ["b", "a"]
    for _ in range(3):
        pool.leave("c")
    assert [e.model for e in pool.queue] == ["d"]


def test_a_model_a_queued_request_wants_is_not_a_victim():
    pool, stopped = _pool("ab", 1)
    _loaded(pool, "a", 1.0)
    pool.join("a")  # a request for a, which is stopping or loading again, is in line
    pool.join("b")
    pool.tick()
    assert stopped == []
    assert pool.pick_victim() is None


def _app(tmp_path, **kw):
    from starlette.testclient import TestClient

    from spark_cli.serve.router import RouterState, create_router_app

    models = {"tiny": RouterModel("tiny", "models_dir", tmp_path / "tiny.gguf"),
              "gone": RouterModel("gone", "preset", None, "o/x: not in llama.cpp's cache", options={"hf-repo": "o/x"},
                                  aliases=("g",))}
    pool = Pool(models, PoolConfig((sys.executable, "-c", "raise SystemExit(3)"), models_max=2))
    state = RouterState(pool, lambda: models, autoload=kw.pop("autoload", True), models_max=2, build_info="spark-x")
    return TestClient(create_router_app(state, **kw), base_url="http://127.0.0.1:8080", raise_server_exceptions=False)


def test_router_endpoints_and_errors_without_children(tmp_path):
    with _app(tmp_path, api_key=KEY) as tc:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert tc.get("/health").json() == {"status": "ok"}  # public
        r = tc.post("/v1/chat/completions", json={**CHAT, "model": "tiny"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        props = tc.get("/props", headers=auth).json()
        assert props["role"] == "router" and props["max_instances"] == 2 and props["models_autoload"] is True
        cards = {c["id"]: c for c in tc.get("/models", headers=auth).json()["data"]}
        assert cards["tiny"]["status"]["value"] == "unloaded" and cards["tiny"]["source"] == "models_dir"
        assert cards["gone"]["aliases"] == ["g"] and "[gone]\nhf-repo = o/x\n" == cards["gone"]["status"]["preset"]
        for body, status, text in (({"messages": []}, 400, "model name is missing"),
                                   ({"model": "nope"}, 400, "model 'nope' not found"),
                                   ({"model": "g"}, 500, "not in llama.cpp's cache")):  # by alias: missing file
            r = tc.post("/v1/chat/completions", json=body, headers=auth)
            assert r.status_code == status and text in r.json()["error"]["message"], r.text
        r = tc.post("/v1/chat/completions", content=b"{not json", headers=auth)
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
        r = tc.post("/v1/messages", json={"model": "nope"}, headers=auth)  # Anthropic's error shape there
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert tc.post("/models/load", json={"model": "nope"}, headers=auth).status_code == 404
        assert tc.post("/models/unload", json={"model": "tiny"}, headers=auth).json()["error"]["message"] == \
            "model is not running"
        assert tc.post("/models", json={"model": "o/x:Q8_0"}, headers=auth).status_code == 501  # never downloads
        assert tc.get("/metrics", headers=auth).status_code == 400  # ?model= missing
        assert tc.get("/v1/stream?conv_id=x", headers=auth).status_code == 404
        assert tc.delete("/v1/stream?conv_id=x", headers=auth).status_code == 204


def test_a_child_that_fails_to_start_frees_its_slot_and_says_why(tmp_path):
    with _app(tmp_path) as tc:
        r = tc.post("/tokenize", json={"model": "tiny", "content": "hi"})
        assert r.status_code == 500 and "failed to load" in r.json()["error"]["message"]
        card = next(c for c in tc.get("/models").json()["data"] if c["id"] == "tiny")
        assert card["status"]["value"] == "unloaded" and card["status"]["failed"] and card["status"]["exit_code"] == 3
        assert tc.get("/health").status_code == 200  # the router goes on


def test_no_autoload_answers_400_until_loaded(tmp_path):
    with _app(tmp_path, autoload=False) as tc:
        r = tc.post("/v1/chat/completions", json={**CHAT, "model": "tiny"})
        assert r.status_code == 400 and "not loaded" in r.json()["error"]["message"]
        assert tc.get("/props").json()["models_autoload"] is False


# ---------------------------------------------------------------- the real router on the tiny llama


SPARK = [sys.executable, "-c", "from spark_cli.cli import run; run()"]


def _spark_cli_root() -> str:
    import spark_cli

    return str(Path(spark_cli.__file__).resolve().parents[1])


def _children(marker: str) -> list[int]:
    """Processes (not this one) whose command line names `marker` (the test's models folder)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.info["pid"] != os.getpid() and any(marker in a for a in p.info["cmdline"] or ()):
                out.append(p.info["pid"])
    return out


@pytest.fixture
def router(tmp_path):
    from spark_cli.models.tiny_models import build_tiny_model
    from spark_cli.native.rpc import free_port

    model = build_tiny_model("llama")
    models = tmp_path / "models"
    models.mkdir()
    for name in ("a", "b"):
        (models / f"{name}.gguf").symlink_to(model)
    procs: list[subprocess.Popen] = []

    def start(*extra: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        log = open(tmp_path / f"router-{port}.log", "wb")
        env = {**os.environ, "LLAMA_CACHE": str(tmp_path / "cache"), "PYTHONPATH": _spark_cli_root(), "SPARK_DEBUG": ""}
        proc = subprocess.Popen([*SPARK, "serve", "--models-dir", str(models), "--port", str(port), "-dev", "none",
                                 "-c", "256", "-t", "1", "--no-learn", "--no-repack", *extra],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        end = time.time() + 60
        while time.time() < end:
            assert proc.poll() is None, (tmp_path / f"router-{port}.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url
            time.sleep(0.1)
        raise AssertionError("the router did not come up")

    yield start, str(models)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    for pid in _children(str(models)):
        os.kill(pid, signal.SIGKILL)


def _status(url: str, auth: dict) -> dict[str, str]:
    return {c["id"]: c["status"]["value"] for c in httpx.get(url + "/models", headers=auth, timeout=30).json()["data"]}


def _wait(url: str, auth: dict, model: str, want: str, timeout: float = 60) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if _status(url, auth).get(model) == want:
            return
        time.sleep(0.1)
    raise AssertionError(f"{model} never {want}: {_status(url, auth)}")


@pytest.mark.model
def test_router_loads_routes_evicts_unloads_and_leaves_no_child(router):
    start, marker = router
    proc, url = start("--models-max", "1", "--api-key", KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "a"}, timeout=30).status_code == 401
    assert _status(url, auth) == {"a": "unloaded", "b": "unloaded"}
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "a"}, headers=auth, timeout=120)
    assert r.status_code == 200 and r.json()["model"] == "a" and r.json()["choices"][0]["message"]["content"], r.text
    assert _status(url, auth) == {"a": "loaded", "b": "unloaded"}
    # the child answers only the router: the router's key is not its key
    card = next(c for c in httpx.get(url + "/models", headers=auth).json()["data"] if c["id"] == "a")
    args = card["status"]["args"]
    child = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    assert httpx.get(child + "/v1/models", headers=auth, timeout=30).status_code == 401
    # --models-max 1: b's request unloads a (least recently used, idle); streamed through as it comes
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "model": "b", "stream": True}, headers=auth,
                      timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["model"] == "b"
    _wait(url, auth, "a", "unloaded")
    assert _status(url, auth)["b"] == "loaded"
    r = httpx.post(url + "/tokenize", json={"model": "b", "content": "hello world"}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"]
    assert httpx.post(url + "/models/unload", json={"model": "b"}, headers=auth).json() == {"success": True}
    _wait(url, auth, "b", "unloaded")
    assert httpx.post(url + "/models/load", json={"model": "a"}, headers=auth).json() == {"success": True}
    _wait(url, auth, "a", "loaded")
    assert len(_children(marker)) == 2  # the router and a's child
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert _children(marker) == []


@pytest.mark.model
def test_a_killed_routers_children_stop_on_their_own(router):
    start, marker = router
    proc, url = start()
    assert httpx.post(url + "/models/load", json={"model": "b"}).json() == {"success": True}
    _wait(url, {}, "b", "loaded")
    proc.kill()  # no chance to stop its children: they see their stdin close
    proc.wait(timeout=30)
    end = time.time() + 30
    while _children(marker) and time.time() < end:
        time.sleep(0.2)
    assert _children(marker) == []
