"""Losing the RPC server: one line naming it, counts kept, non-zero exit, no backtrace; and
endpoints that are not RPC servers, or never answer, are refused in time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spark_cli.native import faults
from spark_cli.errors import DeviceError, SparkError

SPARK = str(Path(sys.executable).parent / "spark")


def _env(**extra) -> dict:
    return {**os.environ, "COLUMNS": "200", "SPARK_DEBUG": "", **extra}


class _FakeServer:
    """A TCP listener that answers like an HTTP server, or never answers at all."""

    def __init__(self, mode: str):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.mode = mode
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if self.mode == "http":
                c.recv(64)
                c.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
                c.close()

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _line(err: SparkError) -> str:
    s = err.one_line()
    assert "\n" not in s
    return s


def test_probe_refuses_a_server_that_never_answers():
    srv = _FakeServer("silent")
    try:
        t0 = time.monotonic()
        with pytest.raises(SparkError) as e:
            faults.probe_rpc(srv.endpoint, timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert srv.endpoint in _line(e.value) and "did not answer the RPC hello within" in _line(e.value)
    finally:
        srv.close()


def test_probe_refuses_something_that_is_not_an_rpc_server():
    srv = _FakeServer("http")
    try:
        with pytest.raises(SparkError) as e:
            faults.probe_rpc(srv.endpoint, timeout=2)
        assert "not a ggml RPC server" in _line(e.value)
    finally:
        srv.close()


def test_probe_refuses_a_closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    ep = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    with pytest.raises(SparkError, match="no RPC server answers there"):
        faults.probe_rpc(ep)


@pytest.mark.model
def test_probe_accepts_a_real_server(rpc_server):
    assert faults.probe_rpc(rpc_server.endpoint)[0] == faults.RPC_PROTO_MAJOR


def test_abort_message_names_the_lost_server(monkeypatch):
    monkeypatch.setattr(faults, "_endpoints", ["127.0.0.1:1"])
    e = faults.describe("/x/ggml-rpc.cpp:566: Remote RPC server crashed or returned malformed response")
    assert e.exit_code == 1
    assert _line(e).startswith("lost the RPC server 127.0.0.1:1 (Remote RPC server crashed")
    assert "spark rpc-server --port 1" in _line(e)


def test_keepers_run_newest_first_and_survive_a_failing_one():
    calls = []

    def bad():
        raise OSError("disk gone")

    with faults.keeper(lambda: calls.append("outer") or "kept A"), faults.keeper(bad):
        notes = faults.run_keepers()
    assert notes[0].startswith("could not keep everything (OSError: disk gone") and notes[1] == "kept A"
    assert faults.run_keepers() == [] and calls == ["outer"]


@pytest.mark.model
@pytest.mark.parametrize("mode", ["silent", "http"])
def test_chat_with_a_stranger_as_rpc_is_one_line(small_model, tmp_path, mode):
    srv = _FakeServer(mode)
    try:
        r = subprocess.run([SPARK, "chat", str(small_model), "--rpc", srv.endpoint, "--prompt", "hi", "-n", "2"],
                           capture_output=True, text=True, env=_env(SPARK_RPC_TIMEOUT="1"), timeout=120)
    finally:
        srv.close()
    want = "did not answer the RPC hello" if mode == "silent" else "not a ggml RPC server"
    assert r.returncode == DeviceError.exit_code and want in r.stderr and srv.endpoint in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def _start_server(port_file: Path | None = None) -> tuple[subprocess.Popen, str]:
    from spark_cli.native.rpc import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spark_cli.native.rpc_main", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ep = f"127.0.0.1:{port}"
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, ep
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("rpc server did not start")


def _kill_when(proc: subprocess.Popen, cond, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _assert_one_line_loss(stderr: str, ep: str) -> str:
    lines = [l for l in stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, stderr
    assert f"lost the RPC server {ep}" in lines[0]
    for junk in ("Traceback", "gdb", "backtrace", "#0 ", "ggml-rpc.cpp"):
        assert junk not in stderr, stderr
    return lines[0]


@pytest.mark.model
def test_chat_keeps_its_counts_when_the_server_is_killed(small_model, tmp_path):
    from spark_cli.core.profile import RoutingProfile, profile_path_for

    model = tmp_path / small_model.name
    model.symlink_to(small_model)
    proc, ep = _start_server()
    out = tmp_path / "out.txt"
    with open(out, "w") as so, open(tmp_path / "err.txt", "w") as se:
        chat = subprocess.Popen([SPARK, "chat", str(model), "--rpc", ep, "--vram", "2GiB", "--temp", "0",
                                 "-n", "2000", "-c", "2048", "--prompt", "Write a very long story about a dragon."],
                                stdout=so, stderr=se, env=_env())
        _kill_when(proc, lambda: out.stat().st_size > 60 or chat.poll() is not None)
        rc = chat.wait(120)
    err = (tmp_path / "err.txt").read_text()
    line = _assert_one_line_loss(err, ep)
    assert rc == 1
    prof = RoutingProfile.load(profile_path_for(model))  # what the answer routed so far is kept
    assert prof.tokens_decode > 0 and prof.decode.sum() > 0 and "spark chat" in prof.sources
    assert "folded into" in line


@pytest.mark.model
def test_bench_writes_its_partial_report_when_the_server_is_killed(small_model, tmp_path):
    import psutil

    model = tmp_path / small_model.name
    model.symlink_to(small_model)
    proc, ep = _start_server()
    rss0 = psutil.Process(proc.pid).memory_info().rss
    report = tmp_path / "bench.json"
    with open(tmp_path / "err.txt", "w") as se:
        bench = subprocess.Popen([SPARK, "bench", str(model), "--rpc", ep, "--vram", "2GiB", "--ctx", "512",
                                  "-p", "32", "-n", "400", "-r", "2", "--json", "-o", str(report),
                                  "--configs", "resident"],
                                 stdout=subprocess.DEVNULL, stderr=se, env=_env())
        # a model is on the server once its memory grew by a few hundred MiB: the runs are under way
        _kill_when(proc, lambda: bench.poll() is not None
                   or psutil.Process(proc.pid).memory_info().rss - rss0 > 300 << 20)
        time.sleep(0)
        rc = bench.wait(240)
    err = (tmp_path / "err.txt").read_text()
    line = _assert_one_line_loss(err, ep)
    assert rc == 1 and f"partial report in {report}" in line
    data = json.loads(report.read_text())
    assert data["interrupted"] is True and any("device lost" in n for n in data["notes"])


@pytest.mark.model
def test_profile_keeps_finished_chunks_when_the_server_is_killed(small_model, tmp_path):
    from spark_cli.core.profile import RoutingProfile, profile_path_for

    model = tmp_path / small_model.name
    model.symlink_to(small_model)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(80):
        (corpus / f"{i:02d}.txt").write_text(f"Document {i}: the quick brown fox jumps over the lazy dog. " * 8)
    proc, ep = _start_server()
    out = tmp_path / "out.txt"
    with open(out, "w") as so, open(tmp_path / "err.txt", "w") as se:
        run = subprocess.Popen([SPARK, "profile", str(model), "--corpus", str(corpus), "--gen", "4", "--rpc", ep,
                                "--capture", "callback"], stdout=so, stderr=se, env=_env())
        path = profile_path_for(model)
        started: list[float] = []

        def some_chunks_done() -> bool:  # the progress bar is not drawn to a file: the line, then a while
            if not started and "profiling 80 chunks" in out.read_text():
                started.append(time.monotonic())
            return run.poll() is not None or bool(started and time.monotonic() - started[0] > 60)

        _kill_when(proc, some_chunks_done)
        rc = run.wait(120)
    err = (tmp_path / "err.txt").read_text()
    line = _assert_one_line_loss(err, ep)
    assert rc == 1 and "tokens of" in line and "folded into" in line
    kept = RoutingProfile.load(path)
    assert kept.tokens_prefill > 0 and kept.prefill.sum() > 0 and "device lost" in kept.sources[-1]
