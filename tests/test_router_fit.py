"""The content-fit router's math (core/router_fit.py) and the routing-realism figures (core/routing_stats.py)."""

from __future__ import annotations

import numpy as np
import pytest

from spark_cli.core import routing_stats as rs
from spark_cli.core.router_fit import ROUTER_TOP_K_MASS, _top_k_mass, fit_router, spherical_kmeans, temperature_scale
from spark_cli.core.trace import DECODE, PREFILL, RoutingTrace


def _blobs(n_groups: int, per: int, dim: int, seed: int = 0, spread: float = 0.15):
    """States around `n_groups` directions, plus a shared offset (what every token has in common)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_groups, dim))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = np.repeat(np.arange(n_groups), per)
    x = centres[labels] + spread * rng.standard_normal((len(labels), dim)) / np.sqrt(dim)
    return x + 3.0 * np.ones(dim) / np.sqrt(dim), labels


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    pairs = {(int(x), int(y)) for x, y in zip(a, b)}
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_spherical_kmeans_recovers_separated_groups():
    x, labels = _blobs(6, 40, 32)
    x = x - x.mean(axis=0)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    c, found = spherical_kmeans(x, 6, np.random.default_rng(1))
    assert np.allclose(np.linalg.norm(c, axis=1), 1.0)
    assert _same_partition(labels, found)


def test_spherical_kmeans_refuses_too_few_points():
    with pytest.raises(ValueError, match="points"):
        spherical_kmeans(np.eye(3), 4, np.random.default_rng(0))


def test_temperature_hits_the_target_mass():
    logits = np.random.default_rng(2).standard_normal((500, 16))
    s = temperature_scale(logits, 4)
    assert _top_k_mass(s * logits, 4) == pytest.approx(ROUTER_TOP_K_MASS, abs=1e-6)
    with pytest.raises(ValueError, match="target"):
        temperature_scale(logits, 4, target=0.2)  # uniform routing already gives 4/16


def test_fit_router_routes_each_group_to_its_own_expert():
    x, labels = _blobs(8, 50, 48, seed=3)
    fit = fit_router(x, 8, 2, np.random.default_rng(4))
    assert fit.rows.shape == (8, 48) and fit.rows.dtype == np.float32
    mean = x.mean(axis=0)
    # rows are orthogonal to the shared mean: the offset every token carries picks no expert
    assert np.abs(fit.rows.astype(np.float64) @ mean).max() < 1e-3 * np.linalg.norm(fit.rows) * np.linalg.norm(mean)
    top1 = np.argmax(x @ fit.rows.T.astype(np.float64), axis=1)
    assert _same_partition(labels, top1)
    assert fit.agreement == 1.0 and sorted(fit.sizes.tolist()) == [50] * 8


def test_fit_router_is_deterministic_from_the_seed():
    x, _ = _blobs(5, 30, 24, seed=5, spread=0.8)
    a = fit_router(x, 8, 2, np.random.default_rng(7)).rows
    b = fit_router(x, 8, 2, np.random.default_rng(7)).rows
    c = fit_router(x, 8, 2, np.random.default_rng(8)).rows
    assert a.tobytes() == b.tobytes() and a.tobytes() != c.tobytes()


# ---------------------------------------------------------------- routing_stats

def _trace(ids: np.ndarray, n_expert: int, phase: int = DECODE) -> RoutingTrace:
    """ids [n_rows, k] on layer 1 of a 2-layer model (layer 0 dense)."""
    n, k = ids.shape
    full = np.full((n, 2, k), -1, dtype=np.int16)
    full[:, 1, :] = ids
    return RoutingTrace(full, np.full(n, phase, np.uint8), np.arange(n, dtype=np.int32), n_expert, "fp")


def test_skew_of_uniform_and_of_concentrated_counts():
    uniform = rs.skew(np.array([[0] * 10, [5] * 10]), 2)
    assert uniform.n_top == 2 and uniform.entropy_norm == [pytest.approx(1.0)]
    assert uniform.top_share == [pytest.approx(0.2)]
    hot = rs.skew(np.array([[0] * 10, [40, 40] + [2] * 8]), 2)
    assert hot.mean_top_share == pytest.approx(80 / 96) and hot.mean_entropy < 0.7


def test_recent_overlap():
    same = _trace(np.tile([[1, 2]], (20, 1)), 8)
    assert rs.recent_overlap(same) == 1.0
    # expert pairs cycling with period 10 > window 8: nothing of the last 8 tokens comes back
    cycle = np.array([[2 * (i % 10) % 20, (2 * (i % 10) + 1) % 20] for i in range(40)])
    assert rs.recent_overlap(_trace(cycle, 20)) == 0.0
    assert rs.recent_overlap(_trace(cycle, 20), window=10) == 1.0
    assert rs.recent_overlap(same, phases=("prefill",)) == 0.0  # no prefill rows


def test_uniform_overlap_matches_random_routing():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(4000)])
    assert rs.recent_overlap(_trace(ids, 16)) == pytest.approx(rs.uniform_overlap(16, 4), abs=0.01)
    assert rs.uniform_overlap(16, 4) == pytest.approx(1 - 0.75 ** 8)


def test_placement_blind_profile_and_shift():
    # prose routes experts 0-3, code 4-7; the profile is prose
    prose = _trace(np.tile([[0, 1], [2, 3]], (30, 1)), 8, PREFILL)
    code = _trace(np.tile([[4, 5], [6, 7]], (30, 1)), 8, PREFILL)
    train = prose.counts()
    bpe = [0, 100]
    same = rs.placement(train, prose, bpe, residency=0.5)
    assert same.resident_experts == 4 and same.uniform == 0.5
    assert same.profile == 0.0 and same.oracle == 0.0
    shift = rs.placement(train, code, bpe, residency=0.5)
    assert shift.profile == 1.0 and shift.oracle == 0.0
    assert rs.placement(train, prose, bpe, 0.5, phases=("decode",)).profile == 0.0  # no decode rows: nothing cold


def test_routing_distance():
    a = np.array([[0, 0], [10, 0]])
    assert rs.routing_distance(a, a) == 0.0
    assert rs.routing_distance(a, np.array([[0, 0], [0, 3]])) == 1.0
    assert rs.routing_distance(a, np.array([[5, 5], [1, 1]])) == pytest.approx(0.5)
    assert rs.routing_distance(a, np.zeros((2, 2))) == 0.0
