"""`spark profile`: both capture paths agree, the run writes profile/trace/plot, Ctrl-C saves,
bad input gives one line and its exit code, merge/simulate/show work on what the run wrote."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from spark_cli.runs.profiling import (Capture, _held_out_indices, _pieces, gather, open_engine, resolve_capture,
                                 split_held_out)
from spark_cli.files.corpus import Chunk
from spark_cli.native.engine import EngineOptions
from spark_cli.errors import ModelFileError, ProfileError
from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.profile import RoutingProfile, profile_path_for
from spark_cli.core.simulator import DEFAULT_POLICY
from spark_cli.core.trace import RoutingTrace

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[1]
PROSE = ("The ferry left the harbour at seven, carrying trucks of timber, a school class on a trip, and "
         "a man who fed the gulls from the rail. By noon the fog had lifted and the far shore showed its "
         "row of white houses, each with a boat pulled up on the stones below. ") * 2
FAST = ["--threads", "1", "-dev", "none", "-nr"]  # -nr: see conftest.NO_REPACK_WHY


def spark(*args) -> tuple[int, str, str]:
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    from spark_cli.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True, scope="module")
def _wide_console():
    mp = pytest.MonkeyPatch()
    mp.setenv("COLUMNS", "200")
    yield
    mp.undo()


def _corpus(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "ferry.txt").write_text(PROSE, encoding="utf-8")
    (root / "notes.md").write_text("# Lists\n\n- keep the `heap` small\n- pop the earliest job first\n",
                                   encoding="utf-8")
    chats = [[{"role": "user", "content": "Name a river in France."},
              {"role": "assistant", "content": "The Loire."}],
             [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]]
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats), encoding="utf-8")
    (root / "old.txt").write_bytes("r\u00e9sum\u00e9 na\u00efve\n".encode("latin-1"))
    return root


@pytest.fixture(scope="module")
def run(small_model, tmp_path_factory):
    """One profiling run through the CLI, with the model linked into a temporary folder so
    that the profile lands beside it."""
    d = tmp_path_factory.mktemp("profile-run")
    model = d / "model.gguf"
    model.symlink_to(small_model)
    corpus = _corpus(d / "corpus")
    rc, out, err = spark("profile", model, "--corpus", corpus, "-c", 64, "--gen", 3, "--trace", d / "t.npz",
                         "--held-out", 0.5, "--residency", "0.5,0.75", "--plot", d / "heat.png", *FAST)
    return {"dir": d, "model": model, "rc": rc, "out": out, "err": err, "trace": d / "t.npz",
            "profile": profile_path_for(model), "heat": d / "heat.png"}


# ---------------------------------------------------------------- capture paths


def test_capture_paths_agree(small_model):
    """Native counters (and native trace) and the eval callback see the same routing."""
    g = load_geometry(small_model)
    k, n_moe = g.n_expert_used, len(g.moe_layers)
    got = {}
    for mode in ("native", "callback"):
        base = EngineOptions(small_model, n_ctx=64, n_batch=64, n_ubatch=64, device="none", n_threads=1,
                             repack=False)
        eng = open_engine(base, g, mode, keep_trace=True)
        try:
            bos = eng.vocab.tokenize("", add_special=True)
            toks = eng.vocab.tokenize(PROSE, add_special=False)
            chunks = [Chunk("a", bos + toks[:40]), Chunk("b", bos + toks[40:70])]
            cap = Capture(eng, mode, g.n_layer, g.n_expert, g.fingerprint, keep_trace=True)
            got[mode] = gather(eng, cap, chunks, gen=3, n_batch=16)  # several ubatches per chunk
        finally:
            eng.close()
    nat, cb = got["native"], got["callback"]
    n_pre = sum(len(c.tokens) for c in chunks)
    assert (nat.tokens_prefill, nat.tokens_decode) == (cb.tokens_prefill, cb.tokens_decode) == (n_pre, 6)
    assert np.array_equal(nat.prefill, cb.prefill) and np.array_equal(nat.decode, cb.decode)
    # every token routes k experts in every MoE layer, the last layer included
    assert np.all(nat.prefill.sum(axis=1)[list(g.moe_layers)] == n_pre * k)
    assert np.all(nat.decode.sum(axis=1)[list(g.moe_layers)] == 6 * k)
    assert nat.decode.sum() == 6 * k * n_moe
    assert len(nat.traces) == len(cb.traces) == 2
    for a, b in zip(nat.traces, cb.traces):
        assert np.array_equal(np.sort(a.ids, axis=2), np.sort(b.ids, axis=2))
        assert np.array_equal(a.phase, b.phase) and np.array_equal(a.step, b.step)
    assert nat.prefill.std() > 0  # the routing is not trivially uniform


def test_capture_choice(monkeypatch):
    from spark_cli.native import llama_lib
    from spark_cli.errors import NativeError

    lib = llama_lib.load()
    assert resolve_capture("auto") == ("native" if lib.has_expert_cache else "callback")
    monkeypatch.setattr(lib, "has_expert_cache", False)
    assert resolve_capture("auto") == "callback" and resolve_capture("callback") == "callback"
    with pytest.raises(NativeError, match="no expert cache"):
        resolve_capture("native")


@pytest.mark.parametrize("n,nb", [(1, 4), (2, 4), (5, 4), (9, 4), (513, 512), (1024, 512)])
def test_pieces_never_one_token(n, nb):
    pieces = _pieces(list(range(n)), nb)
    assert [t for p in pieces for t in p] == list(range(n))
    assert all(len(p) <= nb for p in pieces)
    assert n < 2 or all(len(p) >= 2 for p in pieces)


def test_held_out_split_by_chunks():
    assert _held_out_indices(5, 0.2) == {4}
    assert _held_out_indices(10, 0.5) == {1, 3, 5, 7, 9}
    assert _held_out_indices(3, 0.2) == {2}  # at least one
    traces = [RoutingTrace(np.full((2, 1, 1), i), np.ones(2), np.arange(2), 8, "f") for i in range(4)]
    train, test = split_held_out(traces, 0.5)
    assert sorted(set(train.ids.ravel())) == [0, 2] and sorted(set(test.ids.ravel())) == [1, 3]
    train, test = split_held_out(traces[:1], 0.5)  # one chunk: a row cut
    assert (train.n_rows, test.n_rows) == (1, 1)


# ---------------------------------------------------------------- the run


def test_run_writes_profile_trace_and_report(run, small_model):
    assert run["rc"] == 0, run["out"] + run["err"]
    out = run["out"]
    assert "4 documents (2 chats) from 3 files; skipped 1 non-UTF-8 files" in out
    assert "documents longer than the context were cut" in out
    assert "capture: native counters" in out
    g = load_geometry(small_model)
    p = RoutingProfile.load(run["profile"], expect=g.identity())
    assert p.tokens_prefill > 100 and 0 < p.tokens_decode <= 3 * 6
    k, n_moe = g.n_expert_used, len(g.moe_layers)
    assert p.decode.sum() == pytest.approx(p.tokens_decode * k * n_moe)
    assert p.prefill.sum() == pytest.approx(p.tokens_prefill * k * n_moe)
    tr = RoutingTrace.load(run["trace"], expect_fingerprint=g.fingerprint)
    assert tr.n_rows == p.tokens_prefill + p.tokens_decode and tr.n_decode == p.tokens_decode
    assert np.array_equal(tr.counts("decode"), p.decode) and np.array_equal(tr.counts("prefill"), p.prefill)
    assert run["heat"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "routing skew per layer, this run's decode routing" in out and "top-2 share" in out
    assert "held-out cold-hit" in out and "50%" in out and "75%" in out
    m = [line for line in out.splitlines() if line.startswith("mean over 30 MoE layers")]
    assert m and "(uniform routing: 0.250)" in m[0]
    assert "tok/s" in out


@pytest.mark.parametrize("trace_max", [None, 200])
def test_a_full_native_trace_is_reported_and_the_counts_stay_complete(small_model, tmp_path, monkeypatch, trace_max):
    """A trace too small for the run drops steps: a warning line, a JSON field, and the profile's
    counts still equal the native counters (every token routes k experts in every MoE layer)."""
    from spark_cli.runs import profiling

    monkeypatch.setattr(profiling, "TRACE_MAX", trace_max)
    model = tmp_path / "model.gguf"
    model.symlink_to(small_model)
    corpus = tmp_path / "c.txt"
    corpus.write_text(PROSE, encoding="utf-8")
    rc, out, err = spark("profile", model, "--corpus", corpus, "-c", 64, "--gen", 3, "--json", *FAST)
    assert rc == 0, out + err
    d = json.loads(out)  # stdout holds only the JSON (messages went to stderr)
    g = load_geometry(small_model)
    k, n_moe = g.n_expert_used, len(g.moe_layers)
    p = RoutingProfile.load(profile_path_for(model), expect=g.identity())
    assert (d["tokens_prefill"], d["tokens_decode"]) == (p.tokens_prefill, p.tokens_decode)
    assert p.prefill.sum() == p.tokens_prefill * k * n_moe and p.decode.sum() == p.tokens_decode * k * n_moe
    assert np.all(p.decode.sum(axis=1)[list(g.moe_layers)] == p.tokens_decode * k)
    if trace_max is None:
        assert d["trace_dropped_steps"] == 0 and "native trace full" not in err
    else:
        assert d["trace_dropped_steps"] > 0
        assert f"native trace full: {d['trace_dropped_steps']:,} steps dropped; counts are complete" in err


def test_show_reports_the_saved_profile(run):
    rc, out, _ = spark("profile", "show", run["model"])
    assert rc == 0 and str(run["profile"]) in out
    assert "sources: profile corpus" in out and "top-2 share" in out


def test_show_says_how_real_the_routing_is(run):
    rc, out, _ = spark("profile", "show", run["model"], "--held-out", run["trace"], "--residency", "0.5")
    assert rc == 0 and "how real the routing looks" in out and "top 20% (2) experts" in out
    assert "cold-hit at 50% on t.npz" in out
    rc, out, err = spark("profile", "show", run["model"], "--held-out", run["trace"], "--residency", "0.5", "--json")
    assert rc == 0 and "how real" in err
    d = json.loads(out)
    assert len(d["entropy_norm"]) == len(d["top_share"]) == 30 and d["top_experts"] == 2
    assert all(0.0 <= v <= 1.0 for v in d["entropy_norm"] + d["top_share"])
    assert d["overlap_8"] is None or 0.0 <= d["overlap_8"] <= 1.0
    (pl,) = d["placement"].values()
    assert pl["residency"] == 0.5 and pl["uniform"] == pytest.approx(1 - pl["resident_experts"] / (30 * 8))
    assert pl["oracle"] <= pl["profile"] <= pl["uniform"]  # the profile saw this text; the oracle is its own
    assert d["published"]["cold_hit_profile"] == 0.066


def test_profile_of_another_model_is_refused(run, small_model, tmp_path):
    other = RoutingProfile.empty({"arch": "qwen3moe", "n_layer": 4, "n_expert": 8, "n_expert_used": 2,
                                  "fingerprint": "ab" * 32})
    path = tmp_path / "other.json"
    other.save(path)
    before = path.read_bytes()
    t0 = time.monotonic()
    rc, out, err = spark("profile", small_model, "--corpus", run["dir"] / "corpus", "--profile", path, *FAST)
    assert rc == ProfileError.exit_code and "belongs to model qwen3moe 4x8" in err and len(err.strip().splitlines()) == 1
    assert path.read_bytes() == before and time.monotonic() - t0 < 10  # refused before profiling


def test_empty_corpus_is_one_line(small_model, tmp_path):
    (tmp_path / "blank.txt").write_text("\n \n")
    (tmp_path / "old.txt").write_bytes(b"\xff\xfe caf\xe9")
    rc, out, err = spark("profile", small_model, "--corpus", tmp_path, "--profile", tmp_path / "p.json", *FAST)
    assert rc == ProfileError.exit_code and len(err.strip().splitlines()) == 1
    assert "no text to profile (skipped 1 non-UTF-8 files, 1 empty files or records)" in err
    assert not (tmp_path / "p.json").exists()


def test_model_without_experts_is_one_line(tmp_path):
    from spark_cli.models.smollm2 import fetch_smollm2

    dense = fetch_smollm2()
    rc, out, err = spark("profile", dense, "--profile", tmp_path / "p.json")
    assert rc == ModelFileError.exit_code and len(err.strip().splitlines()) == 1 and str(dense) in err
    assert not (tmp_path / "p.json").exists()


def test_ctrl_c_keeps_what_was_gathered(small_model, tmp_path):
    corpus = tmp_path / "big"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"doc{i:02d}.txt").write_text(f"Document {i}. " + PROSE[:300], encoding="utf-8")
    prof = tmp_path / "p.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "spark_cli.cli", "profile", str(small_model), "--corpus",
                             str(corpus), "-c", "128", "--gen", "0", "--profile", str(prof), *FAST],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("profiling 30 chunks") or not line:
                break
        assert lines[-1].startswith("profiling 30 chunks"), "".join(lines) + proc.stderr.read()
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "interrupted: kept" in out
    p = RoutingProfile.load(prof)
    chunks_done = int(out.split(" chunks in ")[0].rsplit(" from ", 1)[1].split("/")[0])
    assert 1 <= chunks_done < 30 and 0 < p.tokens_prefill and p.tokens_decode == 0
    assert p.sources == ["profile big (interrupted)"]


# ---------------------------------------------------------------- merge, simulate


def test_merge(run, tmp_path):
    a = RoutingProfile.load(run["profile"])
    out = tmp_path / "c.json"
    rc, text, err = spark("profile", "merge", run["profile"], run["profile"], "-o", out)
    assert rc == 0, err
    c = RoutingProfile.load(out)
    f = 0.5 ** (a.tokens_decode / a.half_life_tokens)
    assert c.tokens_decode == pytest.approx(a.tokens_decode * (1 + f))
    assert np.allclose(c.prefill, a.prefill * (1 + f))
    other = RoutingProfile.empty({"arch": "x", "n_layer": a.shape[0], "n_expert": a.shape[1],
                                  "n_expert_used": 2, "fingerprint": "cd" * 32})
    other.save(tmp_path / "o.json")
    rc, text, err = spark("profile", "merge", run["profile"], tmp_path / "o.json", "-o", tmp_path / "d.json")
    assert rc == ProfileError.exit_code and "different models" in err and not (tmp_path / "d.json").exists()


def test_simulate(run):
    rc, out, err = spark("profile", "simulate", run["trace"], "--model", run["model"], "--slots", "2,3,4,6",
                         "--profile", run["profile"], "--json")
    assert rc == 0, err
    rows = json.loads(out)
    policies = ("lru", "lru-pinned", "lfu-aged", "slru", "tinylfu", "belady")
    assert len(rows) == 4 * len(policies)
    by = {(r["slots"], r["policy"]): r for r in rows}
    assert {r["policy"] for r in rows if r["default"]} == {DEFAULT_POLICY}
    assert sum(r["default"] for r in rows) == 4 and all(r["miss_path"] == "upload" for r in rows)
    for s in (2, 3, 4, 6):
        assert by[(s, "belady")]["hit_rate"] >= by[(s, "lru")]["hit_rate"]
        assert all(0.0 <= by[(s, p)]["hit_rate"] <= 1.0 for p in policies)
        assert by[(s, "belady")]["vs_belady"] in (None, 1.0)
        for p in ("lru", "lfu-aged", "belady"):
            r = by[(s, p)]
            assert r["uploads_per_token"] >= 0 and r["bytes_per_token"] == pytest.approx(
                r["uploads_per_token"] * 1658880)  # every layer's expert is 1658880 bytes
    assert by[(2, "lru-pinned")]["pinned"] == 0 and by[(6, "lru-pinned")]["pinned"] == 3
    assert by[(6, "lru")]["hit_rate"] >= by[(2, "lru")]["hit_rate"]
    rc, out, err = spark("profile", "simulate", run["trace"], "--slots", "4")
    assert rc == 0 and "belady" in out and "lru-pinned pins nothing" in out and "pass --model" in out
    assert "(default)" in out
    rc, out, err = spark("profile", "simulate", run["trace"], "--slots", "4", "--miss-path", "both",
                         "--policy", "lru,lfu,belady", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [(r["miss_path"], r["policy"]) for r in rows] == [
        (m, p) for m in ("upload", "cpu") for p in ("lru", "lfu-aged", "belady")]
    assert not any(r["default"] for r in rows) or DEFAULT_POLICY in ("lru", "lfu-aged")
    rc, out, err = spark("profile", "simulate", run["trace"], "--miss-path", "gpu")
    assert rc == 2 and "--miss-path gpu" in err
    # auto: the cpu path's hits, plus the per-expert split of the misses not admitted; without
    # admissions, free uploads stage every decode miss (one slice each), a CPU that costs nothing none
    rc, out, err = spark("profile", "simulate", run["trace"], "--slots", "4", "--miss-path", "auto",
                         "--policy", "lru", "--miss-costs", "100,0,0", "--max-admit", "0", "--json")
    assert rc == 0, err
    free = json.loads(out)[0]
    rc, out, err = spark("profile", "simulate", run["trace"], "--slots", "4", "--miss-path", "cpu",
                         "--policy", "lru", "--max-admit", "0", "--json")
    cpu = json.loads(out)[0]
    assert free["hit_rate"] == cpu["hit_rate"] and free["staged_per_token"] > 0
    # every decode miss staged: k = 2 distinct experts per token and layer, the misses' share of them
    n_moe = len(load_geometry(run["model"]).moe_layers)
    assert free["staged_per_token"] == pytest.approx(n_moe * 2 * (1 - cpu["hit_rate"]))
    rc, out, err = spark("profile", "simulate", run["trace"], "--slots", "4", "--miss-path", "auto",
                         "--policy", "lru", "--miss-costs", "0,0,10", "--json")
    assert rc == 0 and json.loads(out)[0]["staged_per_token"] == 0
    rc, out, err = spark("profile", "simulate", run["trace"], "--miss-path", "auto", "--miss-costs", "1,2")
    assert rc == 2 and "--miss-costs" in err and "Traceback" not in err


def test_simulate_refuses_a_trace_of_another_model(run, tmp_path):
    tr = RoutingTrace.load(run["trace"])
    RoutingTrace(tr.ids, tr.phase, tr.step, tr.n_expert, "ef" * 32).save(tmp_path / "x.npz")
    rc, out, err = spark("profile", "simulate", tmp_path / "x.npz", "--model", run["model"])
    assert rc == ProfileError.exit_code and "trace of another model" in err and len(err.strip().splitlines()) == 1


def test_simulate_marks_the_default_policy_without_a_model(tmp_path):
    rng = np.random.default_rng(5)
    n, E, k = 200, 8, 2
    ids = np.stack([[rng.choice(E, k, replace=False, p=np.arange(E, 0, -1) / 36.0) for _ in range(2)]
                    for _ in range(n)])
    path = tmp_path / "t.npz"
    RoutingTrace(ids, np.ones(n), np.arange(n), E, "ab" * 32).save(path)
    rc, out, err = spark("profile", "simulate", path, "--slots", "3,5", "--miss-path", "both", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert len(rows) == 2 * 2 * 6
    for r in rows:
        assert r["default"] == (r["policy"] == DEFAULT_POLICY)
        belady = next(b for b in rows if b["policy"] == "belady" and (b["slots"], b["miss_path"]) ==
                      (r["slots"], r["miss_path"]))
        assert r["vs_belady"] == pytest.approx(r["hit_rate"] / belady["hit_rate"])
        if r["policy"] in ("lru", "lfu-aged", "slru", "tinylfu") and r["miss_path"] == "upload":
            assert r["vs_belady"] <= 1.0 + 1e-12  # Belady is optimal in the upload path
    rc, out, err = spark("profile", "simulate", path, "--slots", "3", "--max-admit", "1", "--miss-path", "cpu")
    assert rc == 0, err
    assert "(default)" in out and "vs Belady" in out
