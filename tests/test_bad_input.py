"""Bad input gives one line and a non-zero exit, never a traceback: non-UTF-8 text, odd paths,
out-of-range options, traces and plans that do not fit the model."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from conftest import cli_runner

from spark_cli.files.corpus import read_corpus
from spark_cli.errors import PlanError, ProfileError, SparkError
from spark_cli.files.text_input import read_stream, utf8_text

LATIN1 = "café crème".encode("latin-1")  # b'caf\xe9 cr\xe8me'


def _argv_text(raw: bytes) -> str:
    return os.fsdecode(raw)  # as Python decodes sys.argv: surrogate escapes


def test_latin1_argument_becomes_replacement_characters():
    text, bad = utf8_text(_argv_text(LATIN1))
    assert bad == 2 and text == "caf\ufffd cr\ufffdme"
    text.encode("utf-8")  # the tokenizer can take it
    assert utf8_text("plain ascii é") == ("plain ascii é", 0)
    assert utf8_text("lone \ud800 surrogate") == ("lone \ufffd surrogate", 1)


def test_latin1_stdin_is_replaced_not_raised():
    text, bad = read_stream(io.BytesIO(LATIN1))
    assert bad == 2 and "\ufffd" in text
    assert read_stream(io.BytesIO("ok é".encode())) == ("ok é", 0)


def test_corpus_line_with_a_lone_surrogate_is_skipped_and_counted(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "good one"}\n{"text": "bad \\ud800 one"}\n'
                 '{"messages": [{"role": "user", "content": "\\udfff"}]}\n{"text": "good two"}\n')
    c = read_corpus(f)
    assert [d.text for d in c.documents] == ["good one", "good two"]
    assert c.bad_lines == 2 and "2 invalid .jsonl lines" in c.summary()


def test_non_utf8_plan_file_is_one_line(tmp_path):
    from spark_cli.core import plan_file

    p = tmp_path / "plan.json"
    p.write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(PlanError) as e:
        plan_file.load(p)
    assert "not UTF-8" in e.value.one_line() and "\n" not in e.value.one_line()


def test_trace_with_the_right_fingerprint_but_wrong_layers(tmp_path):
    from spark_cli.core.trace import RoutingTrace

    ids = np.zeros((4, 3, 2), dtype=np.int16)
    t = RoutingTrace(ids, np.zeros(4, np.uint8), np.arange(4, dtype=np.int32), 8, "a" * 64)
    t.save(tmp_path / "t.npz")
    with pytest.raises(ProfileError) as e:
        RoutingTrace.load(tmp_path / "t.npz", expect_fingerprint="a" * 64, expect_shape=(30, 8))
    assert "has 3 layers x 8 experts; the model has 30 x 8" in e.value.one_line()


# ---------------------------------------------------------------- rpc-server and --rpc


@pytest.mark.parametrize("port", [70000, 65536, 0, -1])
def test_rpc_server_port_out_of_range(port):
    from spark_cli.native.rpc import listen_address

    with pytest.raises(SparkError, match=r"--port .*: a TCP port is 1 to 65535"):
        listen_address("127.0.0.1", port)


def test_rpc_server_ipv6_is_an_honest_error():
    from spark_cli.native.rpc import listen_address, parse_endpoints

    with pytest.raises(SparkError, match="binds IPv4 addresses only"):
        listen_address("::1", 50052)
    with pytest.raises(SparkError, match="not an IPv4 address"):
        listen_address("my-host", 50052)
    assert listen_address("localhost", 50052) == "127.0.0.1"
    with pytest.raises(SparkError, match="IPv4 only"):
        parse_endpoints("[::1]:50052")


def test_rpc_server_command_refuses_before_serving(monkeypatch, capsys):
    from spark_cli.commands import system

    run = cli_runner(monkeypatch, capsys, "rpc-server", system.register)
    for args, want in ((("--port", "70000"), "1 to 65535"), (("--port", "-5"), "1 to 65535"),
                       (("--host", "::1"), "IPv4 addresses only")):
        rc, out, err = run(*args)
        assert rc == 2 and want in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert "spark rpc-server on" not in out


# ---------------------------------------------------------------- demo-model


@pytest.mark.parametrize("args,want", [
    (("--seed", "-1"), "--seed -1: give 0 or more"),
    (("-E", "1", "-k", "1"), "2 <= E <= 256"),
    (("--tiny", ""), "unknown architecture"),
    (("--router", "learned"), "--router learned: expected one of fit, random"),
])
def test_demo_model_bad_options(monkeypatch, capsys, tmp_path, args, want):
    from spark_cli.commands import demo

    monkeypatch.setenv("SPARK_HOME", str(tmp_path))
    run = cli_runner(monkeypatch, capsys, "demo-model", demo.register)
    rc, out, err = run(*args)
    assert rc == 2 and want in err and len(err.strip().splitlines()) == 1 and not out.strip()
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_demo_model_out_dir_is_a_file(monkeypatch, capsys, tmp_path):
    from spark_cli.commands import demo

    f = tmp_path / "f"
    f.write_text("keep me")
    run = cli_runner(monkeypatch, capsys, "demo-model", demo.register)
    rc, _, err = run("--tiny", "qwen3moe", "--out-dir", f)
    assert rc == 2 and "--out-dir" in err and "is a file, not a folder" in err
    assert f.read_text() == "keep me"


def test_spark_home_a_file_is_one_line(monkeypatch, capsys, tmp_path):
    from spark_cli.commands import demo

    f = tmp_path / "home"
    f.write_text("x")
    monkeypatch.setenv("SPARK_HOME", str(f))
    run = cli_runner(monkeypatch, capsys, "demo-model", demo.register)
    rc, _, err = run("--tiny", "qwen3moe")
    assert rc == 2 and "SPARK_HOME" in err and "is a file" in err and "Traceback" not in err


# ---------------------------------------------------------------- profile merge / simulate


def _profile(path, tokens=10.0):
    from spark_cli.core.profile import RoutingProfile

    model = {"arch": "x", "n_layer": 2, "n_expert": 4, "n_expert_used": 2, "fingerprint": "b" * 64}
    p = RoutingProfile.empty(model).add(None, np.ones((2, 4)), 0, tokens, "t")
    p.save(path)
    return p


@pytest.mark.parametrize("where", ["directory", "under_a_file", "fifo", "device"])
def test_merge_output_that_is_not_a_file(monkeypatch, capsys, tmp_path, where):
    from spark_cli.commands import profile

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _profile(a), _profile(b)
    if where == "directory":
        out = tmp_path / "d"
        out.mkdir()
    elif where == "under_a_file":
        out = a / "merged.json"
    elif where == "fifo":
        out = tmp_path / "fifo"
        os.mkfifo(out)
    else:
        out = tmp_path / "full"
        out.symlink_to("/dev/null")
    run = cli_runner(monkeypatch, capsys, "profile", profile.register)
    rc, _, err = run("merge", a, b, "-o", out)
    assert rc == 2 and f"-o {out}" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_merge_follows_a_symlink_and_keeps_the_mode(monkeypatch, capsys, tmp_path):
    from spark_cli.commands import profile
    from spark_cli.core.profile import RoutingProfile

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _profile(a, 10), _profile(b, 5)
    target = tmp_path / "shared.json"
    target.write_text("old")
    os.chmod(target, 0o644)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    run = cli_runner(monkeypatch, capsys, "profile", profile.register)
    old = os.umask(0o077)
    try:
        rc, _, err = run("merge", a, b, "-o", link)
    finally:
        os.umask(old)
    assert rc == 0, err
    assert link.is_symlink() and RoutingProfile.load(target).tokens_decode == pytest.approx(15, rel=1e-4)
    assert os.stat(target).st_mode & 0o777 == 0o644


def test_merge_disk_full_keeps_a_recovery_file(monkeypatch, capsys, tmp_path):
    import errno

    from spark_cli.files import atomic
    from spark_cli.commands import profile
    from spark_cli.core.profile import RoutingProfile

    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _profile(a, 10), _profile(b, 5)
    out = tmp_path / "out" / "m.json"
    out.parent.mkdir()
    real_replace = os.replace

    def full(src, dst):
        if str(dst).startswith(str(out.parent)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", full)
    run = cli_runner(monkeypatch, capsys, "profile", profile.register)
    rc, _, err = run("merge", a, b, "-o", out)
    (kept,) = (tmp_path / "home" / "recovery").glob("*.json")
    assert rc == 1 and "the disk is full" in err and str(kept) in err.replace("\n", "")
    assert RoutingProfile.load(kept).tokens_decode == pytest.approx(15, rel=1e-4)


def test_simulate_slots_below_k(monkeypatch, capsys, tmp_path):
    from spark_cli.commands import profile
    from spark_cli.core.trace import RoutingTrace

    ids = np.tile(np.array([[0, 1], [2, 3]], dtype=np.int16), (4, 1, 1)).reshape(4, 2, 2)
    RoutingTrace(ids, np.ones(4, np.uint8), np.arange(4, dtype=np.int32), 4, "c" * 64).save(tmp_path / "t.npz")
    run = cli_runner(monkeypatch, capsys, "profile", profile.register)
    rc, _, err = run("simulate", tmp_path / "t.npz", "--slots", "1,4")
    assert rc == 2 and "at least k = 2 slots" in err


def test_plan_output_fifo_is_refused_before_planning(monkeypatch, capsys, tmp_path, small_model):
    from spark_cli.commands import plan

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = cli_runner(monkeypatch, capsys, "plan", plan.register)
    rc, out, err = run(small_model, "--vram", "2GiB", "-o", fifo)
    assert rc == 2 and "is a FIFO" in err and not out.strip()


def test_plan_runs_beside_a_corrupt_profile(monkeypatch, capsys, tmp_path, small_model):
    from spark_cli.commands import plan

    model = tmp_path / small_model.name
    model.symlink_to(small_model)
    prof = tmp_path / (small_model.name + ".spark-profile.json")
    prof.write_text('{"format": "spark-routing-profile", "version": 7}')
    run = cli_runner(monkeypatch, capsys, "plan", plan.register)
    rc, out, err = run(model, "--vram", "2GiB", "--json")
    assert rc == 0 and json.loads(out)["layers"]
    assert "format version 7" in err and "--reset" in err
    assert prof.read_text() == '{"format": "spark-routing-profile", "version": 7}'


def test_bench_outputs_are_checked_before_the_runs(monkeypatch, capsys, tmp_path):
    from spark_cli.commands import bench

    run = cli_runner(monkeypatch, capsys, "bench", bench.register)
    rc, out, err = run(tmp_path / "no.gguf", "--json", "-o", tmp_path / "missing" / "b.json")
    assert rc == 2 and "-o" in err and "does not exist" in err and not out.strip()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rc, _, err = run(tmp_path / "no.gguf", "--json", "-o", fifo)
    assert rc == 2 and "is a FIFO" in err


def test_demo_model_disk_full_is_one_line(monkeypatch, capsys, tmp_path):
    import errno

    from spark_cli.models import gguf_write
    from spark_cli.commands import demo

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_write.os, "fsync", full)
    run = cli_runner(monkeypatch, capsys, "demo-model", demo.register)
    rc, out, err = run("--tiny", "qwen3moe", "--out-dir", tmp_path)
    assert rc == 1 and "cannot write the model (the disk is full)" in err and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []  # no half model left
