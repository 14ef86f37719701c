"""The RPC stand-in GPU: weights really live in the server, and generation matches CPU-only."""

from __future__ import annotations

import os
from types import SimpleNamespace

import psutil
import pytest

from _answers import knows_paris
from spark_cli.native.engine import Engine, EngineOptions
from spark_cli.errors import SparkError
from spark_cli.native.rpc import parse_endpoints

pytestmark = pytest.mark.model

PROMPT = "What is the capital of France?"


def _greedy(engine: Engine, n: int = 24) -> list[int]:
    prompt = engine.vocab.tokenize(engine.vocab.chat_prompt([{"role": "user", "content": PROMPT}]))
    return [s.token for s in engine.stream_generate(prompt, max_tokens=n) if s.token is not None]


def test_weights_live_in_the_server(small_model, rpc_server):
    proc = psutil.Process(rpc_server.proc.pid)
    before = proc.memory_info().rss
    with Engine(EngineOptions(small_model, n_ctx=256, rpc=[rpc_server.endpoint])) as eng:
        assert eng.devices and eng.devices[0].name.startswith("RPC")
        grown = proc.memory_info().rss - before
    size = os.path.getsize(small_model)
    # the whole model is offloaded: the server's resident memory grows by about its size
    assert grown > 0.8 * size, f"server RSS grew by {grown / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model"


def test_rpc_generation_equals_cpu(small_model, rpc_server):
    # the stand-in's server does not repack weights either (and see conftest.NO_REPACK_WHY)
    with Engine(EngineOptions(small_model, n_ctx=256, device="none", repack=False)) as eng:
        cpu_tokens = _greedy(eng)
        assert knows_paris(eng)
    with Engine(EngineOptions(small_model, n_ctx=256, rpc=[rpc_server.endpoint])) as eng:
        rpc_tokens = _greedy(eng)
        assert knows_paris(eng)
    assert len(set(cpu_tokens)) >= 4 and rpc_tokens == cpu_tokens


def test_rpc_server_is_stopped_without_leaks(small_model):
    from spark_cli.native.rpc import RpcServer

    srv = RpcServer().start()
    pid = srv.proc.pid
    srv.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_devices_asks_only_this_runs_servers(monkeypatch, capsys, rpc_server):
    """An RPC server registered earlier in the process and gone since (a test's own, a run before) is not
    asked for its memory by `spark devices --rpc` (ggml would abort on connecting to it): this machine's
    devices and the given server's are listed."""
    import json

    from conftest import cli_runner
    from spark_cli.commands import system
    from spark_cli.native.rpc import RpcServer, connect

    gone = RpcServer(threads=1).start()
    try:
        gone_names = [d.name for d in connect([gone.endpoint])]
    finally:
        gone.stop()
    ours = [d.name for d in connect([rpc_server.endpoint])]
    rc, out, err = cli_runner(monkeypatch, capsys, "devices", system.register)("--rpc", rpc_server.endpoint, "--json")
    assert rc == 0, err
    listed = {d["name"]: d for d in json.loads(out)}
    assert len(gone_names) == len(ours) == 1 and gone_names != ours
    assert ours[0] in listed and gone_names[0] not in listed and "CPU" in listed
    assert listed[ours[0]]["total"] > 0


@pytest.mark.parametrize("value", ["localhost", "host:", ":80", "a:b", "h:70000", "h:1,bad"])
def test_bad_rpc_endpoint_is_one_line_error(value):
    with pytest.raises(SparkError) as e:
        parse_endpoints(value)
    assert "--rpc" in e.value.one_line() and "\n" not in e.value.one_line()


def test_unreachable_rpc_server_is_an_error(small_model):
    from spark_cli.native.rpc import free_port

    with pytest.raises(SparkError, match="no RPC server answers"):
        Engine(EngineOptions(small_model, rpc=[f"127.0.0.1:{free_port()}"]))


def test_rpc_server_dies_with_a_killed_client():
    import subprocess
    import sys
    import time

    code = ("from spark_cli.native.rpc import RpcServer; s = RpcServer().start(); print(s.proc.pid, flush=True); "
            "import time; time.sleep(120)")
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(client.stdout.readline())
    assert psutil.pid_exists(pid)
    client.kill()
    client.wait()
    deadline = time.time() + 10
    while time.time() < deadline and psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_stand_in_spins_briefly_before_it_loads_the_library(monkeypatch):
    """OpenMP reads GOMP_SPINCOUNT when the library loads: serve sets it first (a user's value wins)."""
    from spark_cli.native import rpc

    class Loaded(Exception):
        pass

    seen = []

    def load():
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
        raise Loaded

    monkeypatch.setattr(rpc.llama_lib, "load", load)
    monkeypatch.setattr(rpc, "listen_address", lambda host, port: host)
    monkeypatch.setenv("GOMP_SPINCOUNT", "")  # NOTE: so that the value serve sets is undone after the test
    monkeypatch.delenv("GOMP_SPINCOUNT")
    with pytest.raises(Loaded):
        rpc.serve("127.0.0.1", 1)
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    with pytest.raises(Loaded):
        rpc.serve("127.0.0.1", 1)
    assert seen == [str(rpc.STAND_IN_SPINCOUNT), "5"]


@pytest.mark.parametrize("endpoints, loaded, user, want", [
    (["127.0.0.1:50052"], False, None, "stand-in"),
    (["10.1.2.3:50052", "localhost:50053"], False, None, "stand-in"),
    (["[::1]:50052"], False, None, "stand-in"),
    (["10.1.2.3:50052"], False, None, None),  # a remote server's cores are its own
    (["127.0.0.1:50052"], False, "5", "5"),  # a user's value wins
    (["127.0.0.1:50052"], True, None, None),  # too late: OpenMP read it when the library loaded
])
def test_a_client_of_a_stand_in_on_this_machine_spins_briefly(monkeypatch, endpoints, loaded, user, want):
    """A client sharing its cores with a local RPC server spins as briefly as the server (connect
    sets it before the library loads); a client of a remote server keeps OpenMP's default."""
    from spark_cli.native import rpc

    class Load:
        @staticmethod
        def cache_info():
            return SimpleNamespace(currsize=int(loaded))

    monkeypatch.setattr(rpc.llama_lib, "load", Load)
    monkeypatch.setenv("GOMP_SPINCOUNT", "")  # NOTE: undone after the test whatever the function sets
    if user is None:
        monkeypatch.delenv("GOMP_SPINCOUNT")
    else:
        monkeypatch.setenv("GOMP_SPINCOUNT", user)
    rpc.spin_briefly_beside(endpoints)
    assert os.environ.get("GOMP_SPINCOUNT") == (str(rpc.STAND_IN_SPINCOUNT) if want == "stand-in" else want)


def test_a_chatty_child_does_not_block_on_its_stderr():
    """`rpc.drain` reads a child's stderr as it comes: a child that writes more than the pipe holds
    (64 KiB) still runs to its end, and the last lines are kept for an error message."""
    import subprocess
    import sys

    from spark_cli.native.rpc import drain

    code = "import sys\nfor i in range(4000): print('x' * 60, i, file=sys.stderr)\nprint('the last line', file=sys.stderr)"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    thread, last = drain(proc.stderr)
    assert proc.wait(timeout=60) == 0  # 250 KB through a 64 KiB pipe
    thread.join(timeout=10)
    proc.stderr.close()
    assert not thread.is_alive() and last[-1] == "the last line" and len(last) == 50


def test_a_server_that_cannot_start_says_why_in_one_line(rpc_server):
    """A server that exits at start is one error naming its endpoint and its own last stderr line,
    read through the drain; a port another server holds is refused before starting, not mistaken
    for ours."""
    from spark_cli.native.rpc import RpcServer

    with pytest.raises(SparkError, match=r"rpc server on 127\.0\.0\.1:\d+ exited at start: .*--mem") as e:
        RpcServer(threads=1, mem=-5).start(timeout=60)
    assert "\n" not in str(e.value)
    host, port = rpc_server.endpoint.rsplit(":", 1)
    with pytest.raises(SparkError, match=rf"rpc server on {host}:{port}: the port is in use"):
        RpcServer(host=host, port=int(port), threads=1).start(timeout=30)
