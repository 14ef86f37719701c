"""Skew statistics, greedy placement, held-out cold-hit and the heatmap file."""

from __future__ import annotations

import numpy as np
import pytest

from spark_cli.errors import PlanError
from spark_cli.core.profile import RoutingProfile
from spark_cli.core.report import (coverage_curve, greedy_placement, heatmap_png, held_out_cold_hit,
                              layer_skew)
from spark_cli.core.trace import RoutingTrace

FP = "f" * 40


def decode_trace(experts: list[int], n_expert: int = 4) -> RoutingTrace:
    """k=1; layer 0 is MoE, layer 1 dense; one decode step per expert id."""
    ids = np.array([[[e], [-1]] for e in experts])
    n = len(experts)
    return RoutingTrace(ids, np.ones(n), np.arange(n), n_expert, FP)


def test_skew_numbers():
    counts = np.array([[1, 1, 1, 1], [0, 5, 0, 0], [2, 1, 1, 0], [0, 0, 0, 0]], dtype=float)
    s = layer_skew(counts, k=2)
    assert [x.layer for x in s] == [0, 1, 2]  # layer 3 never routed
    assert (s[0].entropy_bits, s[0].entropy_norm, s[0].top_k_share) == (2.0, 1.0, 0.5)
    assert s[0].coverage.tolist() == [0.25, 0.5, 0.75, 1.0]
    assert (s[1].entropy_bits, s[1].entropy_norm, s[1].top_k_share) == (0.0, 0.0, 1.0)
    assert s[2].entropy_bits == pytest.approx(1.5) and s[2].entropy_norm == pytest.approx(0.75)
    assert s[2].top_k_share == pytest.approx(0.75) and s[2].routed == 4
    assert coverage_curve(np.zeros(3)).tolist() == [0, 0, 0]


@pytest.mark.parametrize("budget,expected", [
    (150, {0: {0}, 1: {0}}),  # the floor only
    (300, {0: {0, 1}, 1: {0, 1}}),  # l1e1 (8/50) before l0e1 (6/100); l0e2 no longer fits
    (320, {0: {0, 1}, 1: {0, 1}}),
    (350, {0: {0, 1}, 1: {0, 1, 2}}),  # skips l0e2 and l0e3 (100 B), takes l1e2 (50 B)
])
def test_greedy_placement_by_count_per_byte(budget, expected):
    counts = np.array([[10, 6, 1, 0], [9, 8, 0, 0], [50, 50, 50, 50]], dtype=float)
    got = greedy_placement(counts, [100, 50, 1], budget, floor_k=1, moe_layers=[0, 1])
    assert got == expected


def test_greedy_placement_floor_must_fit():
    counts = np.ones((2, 4))
    with pytest.raises(PlanError, match="cannot hold 2 experts"):
        greedy_placement(counts, {0: 100, 1: 100}, 399, floor_k=2, moe_layers=[0, 1])


def test_held_out_cold_hit_by_hand():
    train = decode_trace([0, 0, 0, 1, 1, 2])  # counts 3 2 1 0
    test = decode_trace([0, 2, 2, 3, 1])  # counts 1 1 2 1
    rows = held_out_cold_hit(train, test, {0: 100}, residencies=(0.25, 0.5, 0.75))
    # 4 experts x 100 B: budgets 100, 200, 300 -> placements {0}, {0,1}, {0,1,2}
    assert [r.budget_bytes for r in rows] == [100, 200, 300]
    assert [r.resident_experts for r in rows] == [1, 2, 3]
    # test occurrences 0 2 2 3 1: cold 2 2 3 1 -> 4/5; 2 2 3 -> 3/5; 3 -> 1/5
    assert [r.cold_hit for r in rows] == pytest.approx([4 / 5, 3 / 5, 1 / 5])
    # oracle from test counts: {2}, {2, 0} (tie 0/1/3 -> lower id), {2, 0, 1}
    assert [r.oracle_cold_hit for r in rows] == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    # a profile holding the same counts gives the same placement
    model = {"arch": "t", "n_layer": 2, "n_expert": 4, "n_expert_used": 1, "fingerprint": FP}
    prof = RoutingProfile.empty(model).add_trace(train)
    again = held_out_cold_hit(prof, test, [100, 0], residencies=(0.25, 0.5, 0.75))
    assert [r.cold_hit for r in again] == [r.cold_hit for r in rows]


def test_held_out_after_split():
    t = decode_trace([1, 1, 1, 2, 1, 3, 1, 1])
    train, test = t.split(0.5)  # train 1 1 1 2, test 1 3 1 1
    (row,) = held_out_cold_hit(train, test, [100, 0], residencies=(0.25,))
    assert row.cold_hit == pytest.approx(1 / 4)  # only expert 1 resident; 3 misses


def test_heatmap_png_written_atomically(tmp_path):
    counts = np.arange(24, dtype=float).reshape(3, 8)
    counts[1] = 0  # a dense layer must not divide by zero
    path = tmp_path / "out" / "heat.png"
    heatmap_png(counts, path, "decode routing")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["heat.png"]
