"""RoutingTrace: file round trip, refusals, builder, step grouping, split and concat."""

from __future__ import annotations

import numpy as np
import pytest

from spark_cli.errors import ProfileError
from spark_cli.core.trace import RoutingTrace, TraceBuilder, concat


def _trace(fp: str = "fp-a") -> RoutingTrace:
    # 3 steps: prefill of 2 tokens, then 2 decode tokens; layer 1 is dense (-1)
    ids = np.array([
        [[0, 1], [-1, -1], [2, 3]],
        [[1, 2], [-1, -1], [3, 0]],
        [[3, 0], [-1, -1], [1, 1]],
        [[2, 0], [-1, -1], [0, 1]],
    ])
    return RoutingTrace(ids, phase=[0, 0, 1, 1], step=[5, 5, 6, 9], n_expert=4, fingerprint=fp)


def test_round_trip(tmp_path):
    t = _trace()
    path = tmp_path / "t.npz"
    t.save(path)
    u = RoutingTrace.load(path, expect_fingerprint="fp-a")
    assert u.ids.dtype == np.int16 and u.phase.dtype == np.uint8 and u.step.dtype == np.int32
    assert np.array_equal(u.ids, t.ids) and np.array_equal(u.phase, t.phase)
    assert np.array_equal(u.step, t.step)
    assert (u.n_expert, u.fingerprint) == (4, "fp-a")
    assert [p.name for p in tmp_path.iterdir()] == ["t.npz"]  # no temp file left


def test_load_refusals(tmp_path):
    t = _trace()
    path = tmp_path / "t.npz"
    t.save(path)
    with pytest.raises(ProfileError, match="trace of another model"):
        RoutingTrace.load(path, expect_fingerprint="fp-b")
    with pytest.raises(ProfileError, match="not found") as e:
        RoutingTrace.load(tmp_path / "missing.npz")
    assert "missing.npz" in e.value.one_line() and "\n" not in e.value.one_line()
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(ProfileError, match="junk.npz") as e:
        RoutingTrace.load(junk)
    assert "\n" not in e.value.one_line()
    other = tmp_path / "other.npz"
    np.savez(other, ids=t.ids)
    with pytest.raises(ProfileError, match="not a Spark trace"):
        RoutingTrace.load(other)
    bad = tmp_path / "bad.npz"
    np.savez(bad, ids=t.ids, phase=t.phase, step=t.step[::-1], n_expert=4, fingerprint="fp-a")
    with pytest.raises(ProfileError, match="corrupt.*decrease"):
        RoutingTrace.load(bad)


def test_invalid_ids_rejected():
    with pytest.raises(ProfileError, match="outside"):
        RoutingTrace(np.full((1, 1, 2), 4), [1], [0], n_expert=4, fingerprint="x")


def test_steps_and_counts():
    t = _trace()
    steps = list(t.steps(2))
    assert [p for p, _ in steps] == [0, 1, 1]
    assert [ids.tolist() for _, ids in steps] == [[[2, 3], [3, 0]], [[1, 1]], [[0, 1]]]
    assert t.moe_layers() == [0, 2]
    dec = t.counts("decode")
    assert dec[2].tolist() == [1, 3, 0, 0] and dec[1].tolist() == [0, 0, 0, 0]
    assert t.counts("prefill")[0].tolist() == [1, 2, 1, 0]
    assert t.n_decode == 2


@pytest.mark.parametrize("frac,cut", [(0.0, 0), (0.25, 2), (0.5, 2), (0.6, 3), (1.0, 4)])
def test_split_at_step_boundary(frac, cut):
    train, test = _trace().split(frac)
    assert (train.n_rows, test.n_rows) == (cut, 4 - cut)


def test_concat_renumbers_steps():
    a, b = _trace(), _trace()
    c = concat([a, b])
    assert c.n_rows == 8
    assert np.all(np.diff(c.step) >= 0)
    assert len(c.step_bounds()) - 1 == 6  # 3 steps each, kept apart
    with pytest.raises(ProfileError, match="another model"):
        concat([a, _trace("fp-b")])


def test_builder_groups_records_into_steps():
    b = TraceBuilder(n_layer=3, k=2, n_expert=4, fingerprint="fp")
    b.add(0, 2, 2, "prefill", [0, 1, 1, 2])  # ubatch 1: two tokens, layers 0 and 2
    b.add(2, 2, 2, "prefill", [[2, 3], [3, 0]])
    b.add(0, 1, 2, "decode", [3, 0])  # layer 0 again: a new step
    b.add(2, 1, 2, 1, [1, 2])
    b.add(0, 1, 2, 1, [2, 0])
    t = b.build()
    assert t.ids[:, 1].tolist() == [[-1, -1]] * 4
    assert t.ids[:, 0].tolist() == [[0, 1], [1, 2], [3, 0], [2, 0]]
    assert t.ids[3, 2].tolist() == [-1, -1]  # the last step never reached layer 2
    assert t.phase.tolist() == [0, 0, 1, 1]
    assert t.step.tolist() == [0, 0, 1, 2]
    with pytest.raises(ProfileError, match="inside a step"):
        b.add(2, 3, 2, 0, [0] * 6)
    with pytest.raises(ProfileError, match="routes outside"):
        b.add(1, 1, 2, 1, [0, 4])
