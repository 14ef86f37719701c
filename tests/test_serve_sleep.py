"""--sleep-idle-seconds (llama-server's sleeping on idle): the engine is freed after that long with
nothing to do and opened again, the way the server started, by the next request that needs it;
/health, /props (is_sleeping), /models and /metrics answer meanwhile without waking it, /metrics
from the snapshot taken as it fell asleep. And --host with several addresses."""

from __future__ import annotations

import queue
import socket
import subprocess
import sys
import time

import pytest

from test_serve_hostile import _Engine

from spark_cli.serve import server
from spark_cli.serve.sleep import WAKE, IdleSleep

httpx = pytest.importorskip("httpx")

IDLE = 0.3
CHAT = {"messages": [{"role": "user", "content": "hi there"}], "temperature": 0}


class _Counted(_Engine):
    """The fake engine, counting how many were opened and freed."""

    opened: list["_Counted"] = []

    def __init__(self) -> None:
        super().__init__(n_ctx=256)
        self.closed = False
        self.eos_token = -1
        _Counted.opened.append(self)

    def chat_template(self, tools: bool):
        return None

    def close(self) -> None:
        self.closed = True


def _wait_asleep(tc, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if tc.get("/props").json()["is_sleeping"]:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not fall asleep")


@pytest.fixture
def counted():
    _Counted.opened = []
    return _Counted.opened


def test_idle_engine_is_freed_and_opened_again_by_the_next_request(counted):
    from _serve_client import fake_client

    with fake_client(_Counted, sleep_idle=IDLE) as tc:
        first = tc.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
        assert tc.get("/props").json()["is_sleeping"] is False
        _wait_asleep(tc)
        assert len(counted) == 1 and counted[0].closed
        # these answer asleep and leave it asleep, past the idle time too
        time.sleep(2 * IDLE)
        assert tc.get("/health").json() == {"status": "ok"}
        card = tc.get("/models").json()["data"][0]
        assert card["id"] == "fake.gguf" and card["meta"]["n_ctx"] == 256
        props = tc.get("/props").json()
        assert props["is_sleeping"] is True and props["default_generation_settings"]["n_ctx"] == 256
        assert len(counted) == 1
        # a generation wakes it: a new engine, the same answer
        again = tc.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
        assert again == first == "yes of course "
        assert len(counted) == 2 and not counted[1].closed
        assert tc.get("/props").json()["is_sleeping"] is False


@pytest.mark.parametrize("path,body,key", [
    ("/tokenize", {"content": "hello world"}, "tokens"),
    ("/detokenize", {"tokens": []}, "content"),
    ("/chat/completions/input_tokens", CHAT, "input_tokens"),
    ("/apply-template", CHAT, "prompt"),
])
def test_a_reader_of_the_model_wakes_it(counted, path, body, key):
    from _serve_client import fake_client

    with fake_client(_Counted, sleep_idle=IDLE) as tc:
        _wait_asleep(tc)
        r = tc.post(path, json=body)
        assert r.status_code == 200 and key in r.json(), r.text
        assert tc.get("/props").json()["is_sleeping"] is False and len(counted) == 2
        _wait_asleep(tc)  # and it sleeps again after the idle time
        assert counted[1].closed


def test_metrics_asleep_are_the_snapshot_and_the_window_is_reported_once(counted):
    from _serve_client import fake_client

    with fake_client(_Counted, sleep_idle=IDLE) as tc:
        tc.post("/v1/chat/completions", json=CHAT)
        _wait_asleep(tc)
        first = tc.get("/metrics").text
        assert "llamacpp:tokens_predicted_total 3\n" in first
        assert "llamacpp:predicted_tokens_seconds 0\n" not in first  # the last generation's rate
        second = tc.get("/metrics").text
        assert "llamacpp:predicted_tokens_seconds 0\n" in second  # nothing ran since
        assert tc.get("/metrics").text == second and tc.get("/props").json()["is_sleeping"] is True
        tc.post("/tokenize", json={"content": "hi"})  # wakes it: the window is not reported again
        assert tc.get("/props").json()["is_sleeping"] is False
        assert "llamacpp:predicted_tokens_seconds 0\n" in tc.get("/metrics").text


def test_a_reload_that_fails_answers_503_and_ends_the_server(counted):
    from _serve_client import fake_client

    def open_once():
        if counted:
            raise RuntimeError("the device is gone")
        return _Counted()

    with fake_client(open_once, sleep_idle=IDLE) as tc:
        _wait_asleep(tc)
        r = tc.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and "the device is gone" in r.json()["error"]["message"]
        assert tc.get("/health").status_code == 503 and tc.post("/tokenize", json={"content": "a"}).status_code == 503


def test_without_the_flag_it_never_sleeps(counted):
    from _serve_client import fake_client

    with fake_client(_Counted) as tc:
        time.sleep(3 * IDLE)
        assert tc.get("/props").json()["is_sleeping"] is False and not counted[0].closed


def test_a_reader_keeps_it_awake_and_wakes_it_once():
    jobs: queue.Queue = queue.Queue()
    idle = IdleSleep(0.01, jobs)
    assert idle.acquire()
    time.sleep(0.05)
    assert not idle.fall_asleep()  # a reader holds it
    idle.release()
    assert not idle.fall_asleep()  # its request was work: the idle time starts again
    time.sleep(0.05)
    assert idle.fall_asleep() and idle.asleep
    assert not idle.acquire(wake=False)  # /props, /metrics: left asleep
    assert idle.acquire() and idle.acquire()
    assert jobs.get_nowait() is WAKE and jobs.empty()  # one wake for both
    idle.woke()
    assert not idle.asleep
    jobs.put(object())
    time.sleep(0.05)
    idle.release(), idle.release()
    assert not idle.fall_asleep()  # a job waits
    assert IdleSleep(None, queue.Queue()).left() is None


def test_several_hosts_are_bound_on_one_port():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    assert server.hosts(" 127.0.0.1, ::1 ,") == ["127.0.0.1", "::1"]
    with pytest.raises(Exception, match="no address"):
        server.hosts(" , ")
    socks = server.bind_all(["127.0.0.1", "::1"], 0)
    try:
        port = socks[0].getsockname()[1]
        assert [s.getsockname()[:2] for s in socks] == [("127.0.0.1", port), ("::1", port)]
        assert socks[1].getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        for host in ("127.0.0.1", "::1"):
            with socket.create_connection((host, port), timeout=5):
                pass
    finally:
        for s in socks:
            s.close()
    assert server.url_host("::1") == "[::1]" and server.url_host("127.0.0.1") == "127.0.0.1"


def test_sleep_idle_seconds_zero_is_refused_and_backend_sampling_accepted():
    # NOTE: -bs and --backend-sampling parse (no effect: the same sampler chain, on the CPU); 0 seconds is refused
    r = subprocess.run([sys.executable, "-m", "spark_cli.cli", "serve", "-bs", "--backend-sampling",
                        "--sleep-idle-seconds", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--sleep-idle-seconds 0: give a number of seconds" in r.stderr, r.stderr


@pytest.mark.model
def test_a_woken_server_answers_as_before_on_the_expert_cache(small_model, tmp_path):
    """The demo model on the RPC stand-in (cached MoE layers): after a sleep the engine, its RPC
    connection and its expert cache are opened again, and a sampled answer is the same."""
    from test_serve import _start, _stop

    from spark_cli.native.rpc import RpcServer

    model = tmp_path / small_model.name
    model.symlink_to(small_model)
    rpc = RpcServer(threads=1).start()
    srv = _start(model, rpc, tmp_path, "--sleep-idle-seconds", "1", "--no-learn")
    body = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0.8, "seed": 7, "cache_prompt": False,
            "return_tokens": True}
    try:
        with srv.http(key=None) as h:
            first = h.post("/completion", json=body).json()
            uploads = srv.metrics()["spark:expert_cache_uploads_total"]
            assert uploads > 0
            deadline = time.monotonic() + 30
            while not h.get("/props").json()["is_sleeping"]:
                assert time.monotonic() < deadline, "the server did not fall asleep"
                time.sleep(0.1)
            again = h.post("/completion", json=body).json()
            assert h.get("/props").json()["is_sleeping"] is False
        assert (again["content"], again["tokens"]) == (first["content"], first["tokens"]) and first["tokens"]
        assert srv.metrics()["spark:expert_cache_uploads_total"] > uploads  # counted on from the first engine
    finally:
        _stop(srv)
        rpc.stop()


def test_a_requests_backend_sampling_is_a_boolean_with_no_effect():
    from spark_cli.serve.llama_api import NativeCompletionRequest
    from spark_cli.serve.protocol import ApiError, parse

    assert parse(NativeCompletionRequest, b'{"prompt": "a", "backend_sampling": true}').backend_sampling is True
    with pytest.raises(ApiError, match="backend_sampling"):
        parse(NativeCompletionRequest, b'{"prompt": "a", "backend_sampling": "yes"}')
