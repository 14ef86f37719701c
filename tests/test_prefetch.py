"""Read-ahead for the RAM tier (issue 45): the predictor on its own, the replay's accounting, the cost model."""

from __future__ import annotations

import numpy as np
import pytest

from spark_cli.core import prefetch
from spark_cli.core.cost_model import DiskCosts, file_tier_tg, file_tier_tg_ahead
from spark_cli.core.prefetch import AheadParams, CoRoutingPredictor
from spark_cli.core.simulator import DEFAULT_POLICY, simulate
from spark_cli.core.trace import RoutingTrace

E, K = 16, 4
DISK = DiskCosts(read_bytes=1 << 20, depth=4, bytes_per_s=1e9, latency_s=1e-3)
SLOW = DiskCosts(read_bytes=1 << 20, depth=4, bytes_per_s=1e9, latency_s=3e-3)  # a lone read waits 3 ms


def _trace(ids: np.ndarray, n_expert: int = E) -> RoutingTrace:
    n = ids.shape[0]
    return RoutingTrace(ids, np.ones(n, np.uint8), np.arange(n, dtype=np.int32), n_expert, "synthetic")


def _random_ids(rng: np.random.Generator, n: int, n_layer: int) -> np.ndarray:
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(n_layer)]) for _ in range(n)])


def _mapped_ids(rng: np.random.Generator, n: int, n_layer: int, perm: np.ndarray) -> np.ndarray:
    """Layer 0 random; layer l+1 routes perm[a] for each a that layer l routes."""
    ids = np.empty((n, n_layer, K), np.int64)
    for t in range(n):
        ids[t, 0] = rng.choice(E, K, replace=False)
        for l in range(1, n_layer):
            ids[t, l] = perm[ids[t, l - 1]]
    return ids


def test_a_deterministic_layer_mapping_is_learned_exactly():
    rng = np.random.default_rng(1)
    perm = rng.permutation(E)
    ids = _mapped_ids(rng, 400, 3, perm)
    p = CoRoutingPredictor([0, 1, 2], E, AheadParams(ahead=K))
    for t in range(300):  # warm-up
        for l in (0, 1):
            p.update(l, ids[t, l].tolist(), ids[t, l + 1].tolist())
    for t in range(300, 400):
        for l in (0, 1):
            true = set(ids[t, l + 1].tolist())
            assert set(p.predict(l, ids[t, l].tolist(), resident=())) == true
            resident = set(range(0, E, 2))  # what is resident is never read ahead; the rest of the truth is
            got = p.predict(l, ids[t, l].tolist(), resident, ahead=K)
            assert not set(got) & resident and true - resident <= set(got)
            p.update(l, ids[t, l].tolist(), ids[t, l + 1].tolist())
    assert p.predict(2, ids[0, 2].tolist(), ()) == []  # the last layer has no next one


def test_a_random_trace_is_predicted_at_about_chance():
    rng = np.random.default_rng(2)
    ids = _random_ids(rng, 2000, 2)
    p = CoRoutingPredictor([0, 1], E, AheadParams(ahead=K))
    hit = total = 0
    for t in range(ids.shape[0]):
        if t >= 200:
            got = p.predict(0, ids[t, 0].tolist(), ())
            hit += len(set(got) & set(ids[t, 1].tolist()))
            total += len(got)
        p.update(0, ids[t, 0].tolist(), ids[t, 1].tolist())
    assert total == K * 1800
    assert abs(hit / total - K / E) < 0.04  # chance: k of E


def test_predictions_are_ordered_and_bounded():
    p = CoRoutingPredictor([3, 7], 4, AheadParams(ahead=2, min_prob=prefetch.ONE // 2))
    assert p.next_layer(3) == 7 and p.next_layer(7) is None
    assert p.predict(3, [0], ()) == []  # nothing learned: no guess
    for nxt in ([1, 2], [1, 3], [1, 2], [1, 0]):
        p.update(3, [0], nxt)
    assert p.scores(3, [0]) == [prefetch.ONE // 4, prefetch.ONE, prefetch.ONE // 2, prefetch.ONE // 4]
    assert p.predict(3, [0], ()) == [1, 2]  # best first; 0 and 3 under min_prob
    assert p.predict(3, [0], {1}) == [2]
    assert p.predict(3, [0], (), ahead=1) == [1]
    assert p.predict(3, [0], (), ahead=0) == []


def test_window_halves_the_counts():
    p = CoRoutingPredictor([0, 1], 4, AheadParams(window=2))
    p.update(0, [0], [1])
    assert p.pairs[0].n[0] == 1 and p.pairs[0].co[0][1] == 1
    p.update(0, [0], [1])  # the second update halves: 2 -> 1
    assert p.pairs[0].n[0] == 1 and p.pairs[0].co[0][1] == 1 and p.pairs[0].updates == 0


def test_replay_accounting_on_a_hand_made_trace():
    # E=4, k=1, one slot per layer: every step of layer 0 misses (0, 1, 0, 1, ...); layer 1 routes 2 after 0
    # and 3 after 1, then swaps at step 4
    l0, l1 = [0, 1, 0, 1, 0, 1], [2, 3, 2, 3, 3, 2]
    ids = np.array([[[a], [b]] for a, b in zip(l0, l1)])
    r = prefetch.replay(_trace(ids, 4), {0: 1, 1: 1}, {}, {0: 100, 1: 1000}, AheadParams(ahead=2))
    # layer 1: steps 0-3 miss (2 and 3 alternate in one slot), step 4 hits 3, step 5 misses 2.
    # read ahead: nothing at steps 0-1 (nothing learned), 2 at step 2 and 3 at step 3 (used), 2 at step 4
    # (3 is resident: unused), nothing at step 5 (3 resident, 2 never followed 1)
    assert (r.tokens, r.misses, r.covered, r.reads_ahead) == (6, 6 + 5, 2, 3)
    assert r.ahead_steps == {0: 3, 1: 3}
    assert r.bytes_missed == 6 * 100 + 5 * 1000
    assert r.bytes_per_token == pytest.approx((6 * 100 + 5 * 1000 - 2 * 1000 + 3 * 1000) / 6)
    assert r.bytes_per_token_without == pytest.approx((6 * 100 + 5 * 1000) / 6)
    assert r.recall == pytest.approx(2 / 11) and r.precision == pytest.approx(2 / 3)
    assert r.unused_per_token == pytest.approx(1 / 6)
    off = prefetch.replay(_trace(ids, 4), {0: 1, 1: 1}, {}, {0: 100, 1: 1000}, AheadParams(ahead=0))
    assert (off.misses, off.covered, off.reads_ahead) == (11, 0, 0)
    assert off.bytes_per_token == off.bytes_per_token_without


def test_replay_misses_are_the_simulators():
    rng = np.random.default_rng(3)
    ids = _random_ids(rng, 303, 4)
    ids[:, 1] = -1  # a dense layer
    phase, step = np.ones(303, np.uint8), np.arange(303, dtype=np.int32)
    phase[:3], step[:3] = 0, 0  # a 3-token prompt first: too large for the LRU slots, it warms them
    trace = RoutingTrace(ids, phase, step, E, "synthetic")
    slots, pins = {0: 9, 2: 10, 3: 6}, {0: (5, 1), 2: (0,)}
    r = prefetch.replay(trace, slots, pins, dict.fromkeys(slots, 1), AheadParams(ahead=1))
    sim = simulate(trace, DEFAULT_POLICY, slots, pins, phases=("prefill", "decode"), ram_tier=True)
    assert r.misses == sum(s.misses_decode for s in sim.layers.values())
    assert sim.layers[3].admissions > sim.layers[3].admissions_decode  # the prompt filled free slots
    cold = simulate(trace, DEFAULT_POLICY, slots, pins)  # the prompt skipped: a different replay
    assert sum(s.misses_decode for s in cold.layers.values()) != r.misses
    assert r.tokens == sim.decode_tokens == 300
    assert sum(r.ahead_steps.values()) == 2 * 300  # layers 0 and 2 read ahead (for 2 and 3), 3 does not
    assert r.covered <= min(r.misses, r.reads_ahead)
    assert sim.miss_steps_decode <= sim.misses_decode and r.uncovered_steps <= sim.miss_steps_decode
    off = prefetch.replay(trace, slots, pins, dict.fromkeys(slots, 1), AheadParams(ahead=0))
    assert off.uncovered_steps == sim.miss_steps_decode > 0  # no read-ahead: every step with a miss waits


def test_cost_model_without_read_ahead_is_file_tier_tg():
    base, m, eb = 0.025, 14.6, 1658880
    want = file_tier_tg(base, m, eb, SLOW, miss_steps_per_token=9.0)
    assert file_tier_tg_ahead(base, m, 9.0, {}, eb, SLOW, 0.001) == pytest.approx(want)
    assert file_tier_tg_ahead(base, m, 9.0, {0: 29.0}, eb, SLOW, 0.001) == pytest.approx(want)


def test_a_step_with_a_miss_waits_at_least_one_read_alone():
    read = SLOW.read_bytes / SLOW.bytes_per_s  # a read's bytes at the rate in flight: about 1 ms
    assert SLOW.step_latency_s == pytest.approx(3e-3 - read)
    got = file_tier_tg(0.02, 6.0, 1e6, SLOW, miss_steps_per_token=4.0)
    assert got == pytest.approx(0.02 + 6.0 * 1e6 / 1e9 + 4.0 * (3e-3 - read))
    # a lone read no slower than its bytes at the rate in flight adds nothing per step
    assert DISK.step_latency_s == 0.0
    assert file_tier_tg(0.02, 6.0, 1e6, DISK, miss_steps_per_token=4.0) == pytest.approx(0.02 + 6e-3)


def test_predicted_tg_of_a_replay_without_read_ahead_is_file_tier_tg():
    rng = np.random.default_rng(6)
    trace = _trace(_random_ids(rng, 100, 3))
    slots, eb = dict.fromkeys(range(3), 8), dict.fromkeys(range(3), 1_500_000)
    r = prefetch.replay(trace, slots, {}, eb, AheadParams(ahead=0))
    assert r.misses > 0 and r.ahead_steps == {0: 200}
    assert r.uncovered_steps > 0
    assert prefetch.predicted_tg(r, 0.02, SLOW, 3) == pytest.approx(
        file_tier_tg(0.02, r.misses_per_token, 1_500_000, SLOW, miss_steps_per_token=r.uncovered_steps_per_token))


def test_cost_model_hides_reads_ahead_behind_a_layers_compute_only():
    read = 1e6 / DISK.bytes_per_s  # 1 ms a read
    base = 0.03
    hidden = file_tier_tg_ahead(base, 5.0, 5.0, {1: 29.0}, 1e6, DISK, overlap_s=2 * read)
    assert hidden == pytest.approx(base + 5 * read)
    waits = file_tier_tg_ahead(base, 5.0, 5.0, {0: 10.0, 3: 19.0}, 1e6, DISK, overlap_s=2 * read)
    assert waits == pytest.approx(base + 5 * read + 19 * read)  # each 3-read layer waits one read


def test_choose_ahead_reads_ahead_only_where_it_pays():
    rng = np.random.default_rng(4)
    n_layer, slots = 4, dict.fromkeys(range(4), 8)
    perm = rng.permutation(E)
    eb = dict.fromkeys(range(n_layer), 1_000_000)  # 1 ms a read on DISK
    mapped = _trace(_mapped_ids(rng, 400, n_layer, perm))
    best = prefetch.choose_ahead(mapped, slots, {}, eb, 0.02, DISK, options=(0, 1, 2))  # 5 ms a layer
    assert best[0].params.ahead > 0 and best[0].replay.recall > 0.5
    assert best[0].tg_s < next(c.tg_s for c in best if c.params.ahead == 0)
    rand = _trace(_random_ids(rng, 400, n_layer))
    best = prefetch.choose_ahead(rand, slots, {}, eb, 0.002, DISK, options=(0, 1, 2))  # 0.5 ms a layer
    assert best[0].params.ahead == 0


def test_break_even_chance_of_a_read_ahead():
    read = 1e6 / DISK.bytes_per_s
    assert prefetch.break_even(1e6, DISK, overlap_s=read) == 0  # the compute hides a read: always worth it
    assert prefetch.break_even(1e6, DISK, overlap_s=2 * read) == 0
    assert prefetch.break_even(1e6, DISK, overlap_s=0.25 * read) == 3 * prefetch.ONE // 4
    assert prefetch.break_even(1e6, DISK, overlap_s=0.0) == prefetch.ONE


def test_learn_warms_up_the_counts_as_online_updates_do():
    rng = np.random.default_rng(5)
    ids = _random_ids(rng, 50, 3)
    ids[:, 1] = -1  # a dense layer between the two MoE layers
    warm = CoRoutingPredictor([0, 2], E).learn(_trace(ids))
    online = CoRoutingPredictor([0, 2], E)
    for t in range(50):
        online.update(0, ids[t, 0].tolist(), ids[t, 2].tolist())
    assert warm.pairs[0].co == online.pairs[0].co and warm.pairs[0].n == online.pairs[0].n
    assert sum(warm.pairs[0].n) == 50 * K
