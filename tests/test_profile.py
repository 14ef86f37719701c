"""RoutingProfile: ageing and merge arithmetic, file format, refusals, crash-safe writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from spark_cli.errors import ProfileError
from spark_cli.core.profile import (FORMAT_VERSION, RoutingProfile, merge, profile_path_for,
                               update_file)
from spark_cli.core.trace import RoutingTrace

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"arch": "toymoe", "n_layer": 2, "n_expert": 4, "n_expert_used": 2,
         "fingerprint": "a" * 40, "tensor_layout_hash": "b" * 16}
OTHER = dict(MODEL, fingerprint="c" * 40)


def counts(*rows):
    return np.array(rows, dtype=np.float64)


def test_profile_path_beside_model(tmp_path):
    assert profile_path_for(tmp_path / "m.gguf") == tmp_path / "m.gguf.spark-profile.json"


def test_add_ages_history_first():
    p = RoutingProfile.empty(MODEL, half_life_tokens=100)
    d1 = counts([4, 0, 2, 2], [0, 0, 0, 0])
    p.add(counts([1, 1, 1, 1], [0, 0, 0, 0]), d1, tokens_prefill=10, tokens_decode=100, source="chat")
    assert np.array_equal(p.decode, d1) and p.tokens_decode == 100
    d2 = counts([0, 8, 0, 0], [0, 0, 0, 0])
    p.add(None, d2, tokens_prefill=6, tokens_decode=100, source="chat")  # one half-life
    assert p.decode.tolist() == [[2, 8, 1, 1], [0, 0, 0, 0]]
    assert p.prefill.tolist() == [[0.5, 0.5, 0.5, 0.5], [0, 0, 0, 0]]
    assert (p.tokens_prefill, p.tokens_decode) == (11.0, 150.0)
    # no decode tokens: the prefill tokens age it, 200 tokens = two half-lives
    p.add(counts([0, 0, 0, 4], [0, 0, 0, 0]), None, tokens_prefill=200, tokens_decode=0, source="bench")
    assert p.decode.tolist() == [[0.5, 2, 0.25, 0.25], [0, 0, 0, 0]]
    assert p.prefill.tolist() == [[0.125, 0.125, 0.125, 4.125], [0, 0, 0, 0]]
    assert (p.tokens_prefill, p.tokens_decode) == (202.75, 37.5)
    assert p.sources == ["chat", "bench"]


def test_half_life_zero_never_ages():
    p = RoutingProfile.empty(MODEL, half_life_tokens=0)
    for _ in range(3):
        p.add(None, counts([1, 0, 0, 0], [0, 0, 0, 0]), 0, 1_000_000)
    assert p.decode[0, 0] == 3 and p.tokens_decode == 3_000_000


def test_add_rejects_bad_counts():
    p = RoutingProfile.empty(MODEL)
    with pytest.raises(ProfileError, match="shape"):
        p.add(None, np.zeros((3, 4)), 0, 1)
    with pytest.raises(ProfileError, match="non-negative"):
        p.add(None, -np.ones((2, 4)), 0, 1)


def test_merge_exact():
    a = RoutingProfile.empty(MODEL, half_life_tokens=100)
    a.add(counts([1, 1, 1, 1], [0, 0, 0, 0]), counts([8, 4, 0, 0], [0, 0, 0, 0]), 40, 50,
          "profile corpus wiki")
    a.created = "2024-01-01T00:00:00+00:00"
    b = RoutingProfile.empty(MODEL, half_life_tokens=100)
    b.add(None, counts([0, 0, 2, 2], [0, 0, 0, 0]), 0, 200, "chat")
    m = merge(a, b)
    # a aged by b's 200 decode tokens (two half-lives: x 0.25), plus b
    assert m.decode.tolist() == [[2, 1, 2, 2], [0, 0, 0, 0]]
    assert m.prefill.tolist() == [[0.25, 0.25, 0.25, 0.25], [0, 0, 0, 0]]
    assert (m.tokens_prefill, m.tokens_decode) == (10.0, 212.5)
    assert m.sources == ["profile corpus wiki", "chat"]
    assert m.created == "2024-01-01T00:00:00+00:00"
    assert a.decode.tolist() == [[8, 4, 0, 0], [0, 0, 0, 0]]  # inputs untouched
    with pytest.raises(ProfileError, match="different models"):
        merge(a, RoutingProfile.empty(OTHER))


def test_round_trip_is_exact(tmp_path):
    rng = np.random.default_rng(3)
    p = RoutingProfile.empty(MODEL)
    p.add(rng.random((2, 4)) * 1e3, rng.random((2, 4)) / 3, 17, 1234, "bench")
    path = tmp_path / "m.gguf.spark-profile.json"
    p.save(path)
    d = json.loads(path.read_text())
    assert d["version"] == FORMAT_VERSION and d["model"] == MODEL
    assert len(d["decode"]) == 2 and len(d["decode"][0]) == 4
    q = RoutingProfile.load(path, expect=MODEL)
    assert np.array_equal(q.decode, p.decode) and np.array_equal(q.prefill, p.prefill)
    assert (q.tokens_prefill, q.tokens_decode, q.half_life_tokens) == (17, 1234, 1_000_000)
    assert (q.created, q.updated, q.sources) == (p.created, p.updated, ["bench"])


def test_profile_of_another_model_refused(tmp_path):
    path = tmp_path / "p.json"
    RoutingProfile.empty(OTHER).save(path)
    with pytest.raises(ProfileError) as e:
        RoutingProfile.load(path, expect=MODEL)
    line = e.value.one_line()
    assert f"profile {path} belongs to model toymoe 2x4 (fingerprint cccc" in line
    assert line.endswith("run spark profile on this model or pass --profile")
    before = path.read_bytes()
    with pytest.raises(ProfileError, match="belongs to model"):
        update_file(path, MODEL, lambda p: None)
    assert path.read_bytes() == before  # not overwritten


@pytest.mark.parametrize("content,match", [
    (None, "not found"),
    ("{not json", "corrupt"),
    ("[1, 2]", "not a Spark routing profile"),
    ('{"format": "spark-routing-profile", "version": 99}', "format version 99"),
])
def test_load_errors_are_one_line(tmp_path, content, match):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ProfileError, match=match) as e:
        RoutingProfile.load(path)
    assert str(path) in e.value.one_line() and "\n" not in e.value.one_line()


def test_load_rejects_wrong_shape_and_negative(tmp_path):
    path = tmp_path / "p.json"
    d = RoutingProfile.empty(MODEL).to_json()
    d["decode"] = [[1, 2, 3]]
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="corrupt: decode has shape"):
        RoutingProfile.load(path)
    d = RoutingProfile.empty(MODEL).to_json()
    d["prefill"][0][0] = -1
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="negative"):
        RoutingProfile.load(path)


def test_update_file_creates_then_ages(tmp_path):
    path = tmp_path / "p.json"
    dec = counts([0, 2, 0, 0], [2, 0, 0, 0])
    p1 = update_file(path, MODEL, lambda p: p.add(None, dec, 0, 1_000_000, "chat"))
    assert np.array_equal(RoutingProfile.load(path).decode, dec) and p1.tokens_decode == 1_000_000
    update_file(path, MODEL, lambda p: p.add(None, dec, 0, 1_000_000, "chat"))
    q = RoutingProfile.load(path, expect=MODEL)
    assert np.array_equal(q.decode, dec * 1.5) and q.tokens_decode == 1_500_000


def test_add_trace_and_uniform():
    ids = np.array([[[0, 1], [-1, -1]], [[1, 2], [-1, -1]], [[3, 1], [-1, -1]]])
    t = RoutingTrace(ids, [0, 0, 1], [0, 0, 1], 4, MODEL["fingerprint"])
    p = RoutingProfile.empty(MODEL).add_trace(t, "profile corpus x")
    assert p.prefill.tolist() == [[1, 2, 1, 0], [0, 0, 0, 0]]
    assert p.decode.tolist() == [[0, 1, 0, 1], [0, 0, 0, 0]]
    assert (p.tokens_prefill, p.tokens_decode) == (2, 1)
    with pytest.raises(ProfileError, match="another model"):
        RoutingProfile.empty(OTHER).add_trace(t)
    u = RoutingProfile.uniform(MODEL)
    assert np.all(u.decode == 0.5) and u.sources == ["uniform prior"]


SLOW_CHILD = r"""
import os, sys, time
import numpy as np
from spark_cli.core.profile import RoutingProfile

real_fdopen = os.fdopen

class HalfThenStall:
    # writes half of the profile, says so, then hangs until killed
    def __init__(self, f):
        self.f = f
    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        print("half", flush=True)
        time.sleep(60)
        return self.f.write(data[len(data) // 2:])
    def __getattr__(self, name):
        return getattr(self.f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

os.fdopen = lambda *a, **k: HalfThenStall(real_fdopen(*a, **k))
model = dict(arch="toymoe", n_layer=48, n_expert=256, n_expert_used=8, fingerprint="a" * 40)
p = RoutingProfile.empty(model)
p.add(None, np.full((48, 256), 7.0), 0, 100, "new")
p.save(sys.argv[1])
"""

BIG_MODEL = dict(arch="toymoe", n_layer=48, n_expert=256, n_expert_used=8, fingerprint="a" * 40)


def _child(code: str, path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, text=True)


def _old_profile(path: Path) -> bytes:
    p = RoutingProfile.empty(BIG_MODEL)
    p.add(None, np.full((48, 256), 1.0), 0, 100, "old")
    p.save(path)
    return path.read_bytes()


def test_kill_mid_write_keeps_old_profile(tmp_path):
    path = tmp_path / "m.gguf.spark-profile.json"
    old = _old_profile(path)
    proc = _child(SLOW_CHILD, path)
    try:
        assert proc.stdout.readline().strip() == "half"
        temps = [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]
        assert temps and 0 < temps[0].stat().st_size < len(old)  # really mid-write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert path.read_bytes() == old
    p = RoutingProfile.load(path, expect=BIG_MODEL)
    assert p.sources == ["old"] and p.decode[0, 0] == 1.0
    # the dead writer's lock is gone: a new update goes through
    update_file(path, BIG_MODEL, lambda q: q.add(None, np.zeros((48, 256)), 0, 1, "after"))
    assert RoutingProfile.load(path).sources == ["old", "after"]


LOOP_CHILD = r"""
import sys
import numpy as np
from spark_cli.core.profile import RoutingProfile
model = dict(arch="toymoe", n_layer=48, n_expert=256, n_expert_used=8, fingerprint="a" * 40)
p = RoutingProfile.empty(model)
p.add(None, np.random.default_rng(0).random((48, 256)), 0, 100, "new")
print("ready", flush=True)
while True:
    p.save(sys.argv[1])
"""


@pytest.mark.parametrize("delay", [0.05, 0.13, 0.31])
def test_kill_during_real_saves_leaves_a_whole_profile(tmp_path, delay):
    path = tmp_path / "m.gguf.spark-profile.json"
    _old_profile(path)
    proc = _child(LOOP_CHILD, path)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    p = RoutingProfile.load(path, expect=BIG_MODEL)  # old or new, never half
    assert p.sources in (["old"], ["new"])


# ---------------------------------------------------------------- the ring of recent decode steps


def _trace(rows, phase, step, fp="a" * 40):
    """rows: per token row, layer 0 ids (layer 1 routes e+1 mod 4)."""
    ids = np.array([[r, [(e + 1) % 4 for e in r]] for r in rows], dtype=np.int16)
    return RoutingTrace(ids, phase, step, 4, fp)


def test_recent_ring_keeps_decode_steps_and_round_trips(tmp_path, monkeypatch):
    import spark_cli.core.profile as prof

    p = RoutingProfile.empty(MODEL)
    # a 2-token prefill step, then 3 decode steps
    t = _trace([[0, 1], [2, 3], [0, 2], [1, 3], [0, 3]], [0, 0, 1, 1, 1], [0, 0, 1, 2, 3])
    p.add_trace(t, "t")
    assert p.recent_layers == (0, 1) and p.recent.shape == (3, 2, 2)
    assert p.recent[:, 0].tolist() == [[0, 2], [1, 3], [0, 3]]
    assert p.tokens_decode == 3 and p.tokens_prefill == 2
    path = tmp_path / "p.json"
    p.save(path)
    d = json.loads(path.read_text())
    assert d["version"] == FORMAT_VERSION == 2 and d["recent"]["dtype"] == "uint8" and d["recent"]["steps"] == 3
    q = RoutingProfile.load(path)
    assert np.array_equal(q.recent, p.recent) and q.recent_layers == p.recent_layers
    rt = q.recent_trace()
    assert rt.n_decode == 3 and np.array_equal(rt.ids, t.ids[2:]) and rt.moe_layers() == [0, 1]
    # bounded: the oldest steps fall out
    monkeypatch.setattr(prof, "RECENT_MAX_STEPS", 4)
    more = _trace([[1, 2], [2, 3], [3, 0]], [1, 1, 1], [0, 1, 2])
    q.add_recent(more)
    assert q.recent[:, 0].tolist() == [[0, 3], [1, 2], [2, 3], [3, 0]]
    # merge: b's ring follows a's
    m = merge(p, RoutingProfile.empty(MODEL).add_trace(more))
    assert m.recent[:, 0].tolist() == [[0, 3], [1, 2], [2, 3], [3, 0]]
    with pytest.raises(ProfileError, match="another model"):
        p.add_recent(_trace([[0, 1]], [1], [0], fp="c" * 40))


def test_recent_capacity_fits_the_byte_budget():
    from spark_cli.core.profile import RECENT_MAX_BYTES, RECENT_MAX_STEPS

    p = RoutingProfile.empty(dict(MODEL, n_layer=48, n_expert=512))
    assert p.recent_capacity(48, 8) == RECENT_MAX_BYTES // (48 * 8 * 2) < RECENT_MAX_STEPS
    assert p.recent_capacity(2, 2) == RECENT_MAX_STEPS


def test_version_1_profiles_still_load_and_bad_rings_are_refused(tmp_path):
    p = RoutingProfile.empty(MODEL)
    d = p.to_json()
    d["version"] = 1
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(d))
    assert RoutingProfile.load(path).recent is None
    p.add_trace(_trace([[0, 1], [2, 3]], [1, 1], [0, 1]))
    d = p.to_json()
    d["recent"]["steps"] = 3
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="recent"):
        RoutingProfile.load(path)
    d["recent"]["steps"], d["recent"]["ids"] = 2, "!!"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match="recent"):
        RoutingProfile.load(path)
