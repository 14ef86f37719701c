"""exactness.routed_diff on synthetic runs: rows compared up to each prompt's first routing
difference, and the margin the reference gave the experts the runs chose apart."""

from __future__ import annotations

import numpy as np
import pytest

from spark_cli.core.capture import TopkRecord
from spark_cli.runs.exactness import Reference, Routed, _routes, routed_diff

N_ROWS, N_VOCAB, N_EXPERT = 6, 5, 4
LAYERS = (1, 2)


def _ref(logits: np.ndarray) -> Reference:
    return Reference([[0] * N_ROWS], [logits], [[]], None, "Vulkan0")


def _run(logits: np.ndarray, ids: np.ndarray, scores: np.ndarray | None = None) -> Routed:
    return Routed([logits], [ids], None if scores is None else [scores], LAYERS)


def _setup() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(N_ROWS, N_VOCAB)).astype(np.float32)
    ids = np.tile(np.array([0, 1]), (N_ROWS, len(LAYERS), 1))  # top-2 of experts 0..3
    scores = np.tile(np.array([0.9, 0.5, 0.49, 0.1], dtype=np.float32), (N_ROWS, len(LAYERS), 1))
    return logits, ids, scores


def test_rows_before_the_first_routing_difference_are_compared():
    logits, ids, scores = _setup()
    got_logits = logits.copy()
    got_logits[1] += 0.01
    got_logits[3:] += 5.0  # from the flipped row on: different experts, not compared
    got_ids = ids.copy()
    got_ids[3, 1] = [0, 2]  # layer 2, row 3: expert 2 for expert 1 (scores 0.49 against 0.5)
    got_ids[4, 0] = [2, 3]  # a consequence: not the flip reported
    d = routed_diff(_ref(logits), _run(logits, ids, scores), _run(got_logits, got_ids, scores + 0.003))
    assert d.rows == 3
    assert d.diff == pytest.approx(0.01, rel=1e-4)
    assert d.score_shift == pytest.approx(0.003, rel=1e-3)
    assert len(d.flips) == 1
    f = d.flips[0]
    assert (f.prompt, f.row, f.il) == (0, 3, 2)
    assert f.margin == pytest.approx(0.01, rel=1e-4)


def test_a_flip_of_a_wide_margin_is_reported_with_it():
    logits, ids, scores = _setup()
    got_ids = ids.copy()
    got_ids[0, 0] = [0, 3]  # expert 3 for expert 1: 0.1 against 0.5
    d = routed_diff(_ref(logits), _run(logits, ids, scores), _run(logits, got_ids))
    assert d.rows == 0 and d.diff == 0.0
    assert d.flips[0].margin == pytest.approx(0.4, rel=1e-5)


def test_identical_routing_compares_every_row():
    logits, ids, scores = _setup()
    got_logits = logits.copy()
    got_logits[-1, 0] += 2.0
    d = routed_diff(_ref(logits), _run(logits, ids, scores), _run(got_logits, ids))
    assert d.rows == N_ROWS and d.flips == []
    assert d.diff == pytest.approx(2.0, rel=1e-5)


def test_routes_stack_steps_per_layer_and_sort_ids():
    recs = [TopkRecord(1, 0, np.array([[3, 1], [2, 0]], np.int32)), TopkRecord(2, 0, np.array([[1, 0], [3, 2]], np.int32)),
            TopkRecord(1, 1, np.array([[0, 3]], np.int32)), TopkRecord(2, 1, np.array([[2, 1]], np.int32))]
    ids, scores = _routes(recs, list(LAYERS), 3)
    assert scores is None
    assert ids.tolist() == [[[1, 3], [0, 1]], [[0, 2], [2, 3]], [[0, 3], [1, 2]]]
    with pytest.raises(AssertionError, match="routed rows"):
        _routes(recs, list(LAYERS), 4)
