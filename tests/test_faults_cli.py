"""Faults around real runs: non-UTF-8 prompts, -n 0, held locks, broken profiles, failed saves.
Each asserts the one line, the exit code and that no routing counts were lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import cli_runner

from spark_cli.core import profile_store
from spark_cli.files.atomic import file_lock
from spark_cli.errors import OutputError, ProfileError, SaveError
from spark_cli.core.profile import RoutingProfile, profile_path_for

SPARK = str(Path(sys.executable).parent / "spark")
LATIN1 = "Qu'est-ce que la crème brûlée ?".encode("latin-1")


def _env(**extra) -> dict:
    return {**os.environ, "COLUMNS": "200", "SPARK_DEBUG": "", **extra}


def _link(model: Path, tmp_path: Path) -> Path:
    dst = tmp_path / model.name
    dst.symlink_to(model)
    return dst


def _errors(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [l for l in stderr.splitlines() if l.startswith("error:")]


def test_save_into_a_missing_folder_is_refused(tmp_path):
    from spark_cli.runs.chat_session import ChatSession

    fake = SimpleNamespace(to_json=lambda model: {"messages": []})
    with pytest.raises(OutputError) as e:
        ChatSession.save(fake, tmp_path / "no-such" / "chat.json")
    assert "/save" in e.value.one_line() and "does not exist" in e.value.one_line()
    assert not (tmp_path / "no-such").exists()
    assert ChatSession.save(fake, tmp_path / "chat.json").is_file()


@pytest.mark.model
def test_latin1_prompt_and_stdin_and_no_tokens(small_model, rpc_server, tmp_path):
    model = _link(small_model, tmp_path)
    rpc = ["--rpc", rpc_server.endpoint, "--vram", "2GiB", "--no-learn"]
    r = subprocess.run([os.fsencode(SPARK), b"chat", os.fsencode(model), *map(os.fsencode, rpc), b"--prompt", LATIN1,
                        b"-n", b"0", b"--json", b"--temp", b"0"], capture_output=True, env=_env(), timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "--prompt: not UTF-8; 3 undecodable bytes replaced" in err and not _errors(err)
    out = json.loads(r.stdout)
    assert out["answer"] == "" and out["figures"]["generated_tokens"] == 0  # -n 0: no tokens
    r = subprocess.run([SPARK, "chat", str(model), *rpc, "--prompt", "-", "-n", "2", "--temp", "0"],
                       input=LATIN1, capture_output=True, env=_env(), timeout=300)
    assert r.returncode == 0 and "stdin: not UTF-8" in r.stderr.decode()


@pytest.mark.model
def test_held_lock_waits_then_keeps_the_counts_for_the_next_fold(small_model, rpc_server, tmp_path):
    model = _link(small_model, tmp_path)
    path = profile_path_for(model)
    from spark_cli.core.gguf_info import load_geometry

    ident = load_geometry(model).identity()
    profile_store.fold(path, ident, profile_store.delta(ident, None, np.ones((30, 8)), 0, 10, "seed"))
    before = RoutingProfile.load(path)
    with file_lock(path):  # another process folding for longer than the timeout
        r = subprocess.run([SPARK, "chat", str(model), "--rpc", rpc_server.endpoint, "--vram", "2GiB",
                            "--temp", "0", "-n", "8", "--prompt", "What is the capital of France?"],
                           capture_output=True, text=True, env=_env(SPARK_LOCK_TIMEOUT="1"), timeout=300)
    (line,) = _errors(r.stderr)
    assert r.returncode == 1 and "waiting for" in r.stderr and "still held by another process" in line
    (pending,) = profile_store.pending_files(path)
    assert str(pending) in line
    assert RoutingProfile.load(path).tokens_decode == before.tokens_decode  # not touched, not lost
    kept = RoutingProfile.load(pending)
    assert kept.tokens_decode > 0 and kept.decode.sum() > 0
    profile_store.fold(path, ident, None)  # the next fold merges it
    after = RoutingProfile.load(path)
    assert after.decode.sum() == pytest.approx(before.decode.sum() + kept.decode.sum(), rel=1e-3)
    assert not pending.exists()


@pytest.mark.model
def test_corrupt_profile_never_blocks_chat_and_reset_starts_fresh(small_model, rpc_server, tmp_path):
    model = _link(small_model, tmp_path)
    path = profile_path_for(model)
    path.write_text('{"format": "spark-routing-profile", "version": 99}')
    r = subprocess.run([SPARK, "chat", str(model), "--rpc", rpc_server.endpoint, "--vram", "2GiB", "--temp", "0",
                        "-n", "6", "--prompt", "What is the capital of France?"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0 and not _errors(r.stderr), r.stderr
    assert "format version 99" in r.stderr and "running without it" in r.stderr and "--reset" in r.stderr
    assert path.read_text() == '{"format": "spark-routing-profile", "version": 99}'
    (pending,) = profile_store.pending_files(path)
    n_kept = RoutingProfile.load(pending).tokens_decode
    assert n_kept > 0 and str(pending) in r.stderr.replace("\n", "")
    # --no-learn runs too, and leaves everything as it is
    r = subprocess.run([SPARK, "chat", str(model), "--rpc", rpc_server.endpoint, "--vram", "2GiB", "--no-learn",
                        "-n", "1", "--prompt", "hi"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0 and "running without it" in r.stderr
    # spark profile refuses it with the way out, then --reset moves it aside and merges the kept counts
    corpus = tmp_path / "c.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    r = subprocess.run([SPARK, "profile", str(model), "--corpus", str(corpus), "--gen", "2", "--rpc", rpc_server.endpoint,
                        "--capture", "callback"], capture_output=True, text=True, env=_env(), timeout=300)
    (line,) = _errors(r.stderr)
    assert r.returncode == ProfileError.exit_code and "--reset" in line
    r = subprocess.run([SPARK, "profile", str(model), "--corpus", str(corpus), "--gen", "2", "--rpc", rpc_server.endpoint,
                        "--capture", "callback", "--reset"], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (aside,) = tmp_path.glob(path.name + ".old-*")
    assert aside.read_text() == '{"format": "spark-routing-profile", "version": 99}'
    fresh = RoutingProfile.load(path)
    assert fresh.tokens_decode == pytest.approx(n_kept + 2, rel=1e-4) and "spark chat" in fresh.sources
    assert profile_store.pending_files(path) == []


def test_profile_outputs_are_checked_before_the_run(monkeypatch, capsys, tmp_path):
    from spark_cli.commands import profile

    run = cli_runner(monkeypatch, capsys, "profile", profile.register)
    for flag in ("--trace", "--plot"):
        rc, out, err = run(tmp_path / "nowhere.gguf", "--corpus", tmp_path, flag, tmp_path)
        assert rc == 2 and f"{flag} {tmp_path}: is a directory" in err and not out.strip()


@pytest.mark.model
def test_failed_profile_save_keeps_counts_and_still_writes_the_trace(monkeypatch, capsys, tmp_path, small_model,
                                                                     rpc_server):
    from spark_cli.commands import profile

    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    model = _link(small_model, tmp_path)
    path = profile_path_for(model)
    real = profile_store.atomic_write_text

    def disk_full_beside_the_model(p, *a, **k):
        if Path(p).parent == tmp_path:
            raise SaveError(f"{p}: cannot write (the disk is full)")
        return real(p, *a, **k)

    monkeypatch.setattr(profile_store, "atomic_write_text", disk_full_beside_the_model)
    corpus = tmp_path / "c.txt"
    corpus.write_text("Paris is the capital of France. " * 6)
    (tmp_path / "out").mkdir()
    trace = tmp_path / "out" / "t.npz"
    run = cli_runner(monkeypatch, capsys, "profile", profile.register)
    rc, out, err = run(model, "--corpus", corpus, "--gen", "2", "--rpc", rpc_server.endpoint, "--capture", "callback",
                       "--trace", trace)
    assert rc == 1 and "the disk is full" in err and "this run's counts are kept in" in err
    assert not path.exists() and trace.is_file()  # the trace was still written
    (pending,) = profile_store.pending_files(path)
    assert pending.parent == tmp_path / "home" / "pending"
    kept = RoutingProfile.load(pending)
    assert kept.tokens_prefill > 0 and kept.tokens_decode == 2
