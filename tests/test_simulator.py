"""Cache policies replayed on traces: exact LRU semantics, stock steps, Belady optimality."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_cli.errors import PlanError
from spark_cli.core.simulator import DEFAULT_POLICY, PolicyParams, cold_hit_rate, miss_ratio_curve, simulate
from spark_cli.core.trace import RoutingTrace

BOTH = ("prefill", "decode")


def make_trace(steps: list[list[list[int]]], n_expert: int, layers: int = 1) -> RoutingTrace:
    """steps: per step, its token rows of k ids; a 1-token step is decode. Layer l routes e+l."""
    rows, phase, step = [], [], []
    for i, s in enumerate(steps):
        for r in s:
            rows.append([[(e + l) % n_expert for e in r] for l in range(layers)])
            phase.append(1 if len(s) == 1 else 0)
            step.append(i)
    return RoutingTrace(np.array(rows).reshape(len(rows), layers, -1), phase, step, n_expert, "fp")


def reference_pinned_lru(steps, k, slots, pinned):
    """The design text, slot by slot: lowest free slot, else least recently touched."""
    pin = set(pinned)
    n = slots - len(pin)
    slot_expert = [None] * n
    touched = [0] * n
    clock = hits = misses = stock = 0
    for s in steps:
        if len(s) * k > n:
            stock += 1
            continue
        distinct = list(dict.fromkeys(e for r in s for e in r))
        resident = {e: i for i, e in enumerate(slot_expert) if e is not None}
        now = set()
        miss = []
        for e in distinct:
            if e in pin:
                hits += 1
            elif e in resident:
                hits += 1
                clock += 1
                touched[resident[e]] = clock
                now.add(resident[e])
            else:
                miss.append(e)
        for e in miss:
            free = [i for i, x in enumerate(slot_expert) if x is None]
            if free:
                i = free[0]
            else:
                i = min((j for j in range(n) if j not in now), key=lambda j: touched[j])
            slot_expert[i] = e
            clock += 1
            touched[i] = clock
            now.add(i)
            misses += 1
    order = sorted((touched[i], e) for i, e in enumerate(slot_expert) if e is not None)
    return hits, misses, stock, tuple(sorted(pin)) + tuple(e for _, e in order)


def optimal_misses(steps, k, cap):
    """Fewest misses over every eviction choice (demand paging), by dynamic programming."""
    states = {frozenset(): 0}
    for s in steps:
        if len(s) * k > cap:
            continue
        need = frozenset(e for r in s for e in r)
        nxt: dict[frozenset, int] = {}
        for res, cost in states.items():
            c = cost + len(need - res)
            extra = sorted(res - need)
            keep = min(cap - len(need), len(extra))
            for kept in itertools.combinations(extra, keep):
                key = need | frozenset(kept)
                nxt[key] = min(nxt.get(key, c), c)
        states = nxt
    return min(states.values())


def token(n_expert, k):
    return st.lists(st.integers(0, n_expert - 1), min_size=k, max_size=k, unique=True)


def step_lists(n_expert, k, max_tokens=3, max_steps=40):
    return st.lists(st.lists(token(n_expert, k), min_size=1, max_size=max_tokens),
                    min_size=1, max_size=max_steps)


def test_lru_hand_example():
    # S=2, k=1: 0 m, 1 m, 0 h, 2 m (evicts 1), 1 m (evicts 0)
    t = make_trace([[[0]], [[1]], [[0]], [[2]], [[1]]], n_expert=4)
    r = simulate(t, "lru", 2)
    s = r.layers[0]
    assert (s.hits, s.misses, s.uploads, s.stock_steps) == (1, 4, 4, 0)
    assert s.final_resident == (2, 1)
    assert r.hit_rate == pytest.approx(1 / 5)
    assert r.uploads_per_token == pytest.approx(4 / 5)


@settings(max_examples=150, deadline=None)
@given(steps=step_lists(8, 2), slots=st.integers(2, 8), n_pin=st.integers(0, 3), data=st.data())
def test_pinned_lru_matches_reference(steps, slots, n_pin, data):
    n_pin = min(n_pin, slots)
    pinned = data.draw(st.lists(st.integers(0, 7), min_size=n_pin, max_size=n_pin, unique=True))
    t = make_trace(steps, n_expert=8, layers=2)
    r = simulate(t, "lru-pinned", slots, pinned={0: pinned, 1: pinned}, phases=BOTH)
    for layer in (0, 1):
        shifted = [[[(e + layer) % 8 for e in row] for row in s] for s in steps]
        hits, misses, stock, resident = reference_pinned_lru(shifted, 2, slots, pinned)
        got = r.layers[layer]
        assert (got.hits, got.misses, got.stock_steps) == (hits, misses, stock)
        assert got.uploads == misses + len(pinned)
        assert got.final_resident == resident


def test_stock_step_rule_leaves_state_untouched():
    # S=4, P=1, k=2: a 2-token step needs 4 > 3 LRU slots -> stock; a decode step (2) is cached
    steps = [[[1, 2]], [[3, 4], [5, 6]], [[1, 2]], [[3, 4]]]
    t = make_trace(steps, n_expert=8)
    s = simulate(t, "lru-pinned", 4, pinned={0: [1]}, phases=BOTH).layers[0]
    assert s.stock_steps == 1 and s.cached_steps == 3 and s.stock_accesses == 4
    # step 0: 1 pinned hit, 2 miss; step 2: 1, 2 hits; step 3: 3, 4 miss although the stock step saw them
    assert (s.hits, s.misses) == (3, 3)
    assert s.uploads == 4
    assert s.final_resident == (1, 2, 3, 4)
    assert s.hit_rate == pytest.approx(3 / 10)  # stock accesses count as served from host
    # decode only: the prefill step is not replayed at all
    d = simulate(t, "lru-pinned", 4, pinned={0: [1]}).layers[0]
    assert d.stock_steps == 0 and (d.hits, d.misses) == (3, 3)


def test_decode_stock_when_slots_below_k():
    t = make_trace([[[0, 1]], [[0, 1]]], n_expert=4)
    s = simulate(t, "lru", 1).layers[0]
    assert (s.hits, s.misses, s.stock_steps, s.stock_steps_decode) == (0, 0, 2, 2)
    assert miss_ratio_curve(t, 0, [1, 2], "lru") == [1.0, 0.5]


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady"])
@settings(max_examples=60, deadline=None)
@given(steps=step_lists(6, 2), extra=st.integers(0, 3))
def test_large_cache_only_compulsory_misses(policy, steps, extra):
    t = make_trace(steps, n_expert=6)
    k = 2
    slots = max(6, 3 * k) + extra  # >= E, and every step of <= 3 tokens fits
    s = simulate(t, policy, slots, phases=BOTH).layers[0]
    assert s.stock_steps == 0
    assert s.misses == len({e for st_ in steps for r in st_ for e in r})
    assert s.hits + s.misses == sum(len({e for r in st_ for e in r}) for st_ in steps)


@settings(max_examples=200, deadline=None)
@given(steps=step_lists(7, 2, max_tokens=2, max_steps=30), slots=st.integers(2, 6))
def test_belady_never_worse_than_lru_or_lfu(steps, slots):
    t = make_trace(steps, n_expert=7)
    b = simulate(t, "belady", slots, phases=BOTH).layers[0]
    for policy in ("lru", "lfu"):
        o = simulate(t, policy, slots, phases=BOTH).layers[0]
        assert o.stock_steps == b.stock_steps
        assert b.misses <= o.misses


@settings(max_examples=120, deadline=None)
@given(steps=step_lists(6, 2, max_tokens=2, max_steps=12), slots=st.integers(2, 5))
def test_belady_is_optimal_on_small_traces(steps, slots):
    t = make_trace(steps, n_expert=6)
    b = simulate(t, "belady", slots, phases=BOTH).layers[0]
    assert b.misses == optimal_misses(steps, 2, slots)


def test_belady_keeps_pinned_and_evicts_furthest():
    # cap 2 (S=3, P=1 pinned 9): 0 1 2 0 1 -> at 2, 0 is used next (step 3), 1 after: evict 1
    t = make_trace([[[0]], [[1]], [[2]], [[0]], [[9]], [[1]]], n_expert=10)
    s = simulate(t, "belady", 3, pinned={0: [9]}).layers[0]
    assert (s.hits, s.misses, s.uploads) == (2, 4, 5)
    assert 9 in s.final_resident


@pytest.mark.parametrize("half_life,evicted", [(0, 1), (1, 0)])
def test_lfu_counts_and_ageing(half_life, evicted):
    # cap 2: 0 0 1 2. Without ageing 0 has 2 uses, 1 has 1: evict 1. Halving after each
    # step leaves 0 at 0.375 and 1 at 0.5: evict 0.
    t = make_trace([[[0]], [[0]], [[1]], [[2]]], n_expert=4)
    s = simulate(t, "lfu", 2, params=PolicyParams(window=half_life)).layers[0]
    assert (s.hits, s.misses) == (1, 3)
    assert set(s.final_resident) == {0, 1, 2} - {evicted}


def test_lfu_ties_broken_by_least_recent():
    t = make_trace([[[0]], [[1]], [[2]]], n_expert=4)
    s = simulate(t, "lfu", 2, params=PolicyParams(window=0)).layers[0]
    assert set(s.final_resident) == {1, 2}


def test_totals_and_bytes_per_token():
    # layer 0 routes e, layer 1 routes e+1 (mod 4); S=2, k=1, decode only
    t = make_trace([[[0]], [[1]], [[0]], [[2]]], n_expert=4, layers=2)
    r = simulate(t, "lru", {0: 2, 1: 1}, bytes_per_expert={0: 100, 1: 10})
    # layer 0: m m h m -> 3 misses; layer 1 (1 slot): 1 2 1 3 -> 4 misses
    assert (r.layers[0].misses, r.layers[1].misses) == (3, 4)
    assert (r.misses, r.hits, r.uploads_decode) == (7, 1, 7)
    assert r.uploads_per_token == pytest.approx(7 / 4)
    assert r.bytes_per_token == pytest.approx((3 * 100 + 4 * 10) / 4)
    only0 = simulate(t, "lru", {0: 2})
    assert list(only0.layers) == [0]


def test_miss_ratio_curve_matches_simulate_and_falls():
    rng = np.random.default_rng(7)
    p = 1.0 / np.arange(1, 17) ** 1.2
    steps = [[list(rng.choice(16, size=2, replace=False, p=p / p.sum()))] for _ in range(400)]
    t = make_trace(steps, n_expert=16)
    curve = miss_ratio_curve(t, 0, range(2, 17), "lru")
    assert all(a >= b for a, b in zip(curve, curve[1:]))  # LRU is a stack algorithm
    assert curve[-1] == pytest.approx(len({e for s in steps for e in s[0]}) / 800)
    for slots, value in zip(range(2, 17), curve):
        assert value == pytest.approx(1 - simulate(t, "lru", slots).hit_rate)


def test_rejections():
    t = make_trace([[[0]]], n_expert=4)
    with pytest.raises(PlanError, match="unknown policy"):
        simulate(t, "fifo", 2)
    with pytest.raises(PlanError, match="lru-pinned"):
        simulate(t, "lru", 2, pinned={0: [1]})
    with pytest.raises(PlanError, match="do not fit"):
        simulate(t, "lru-pinned", 1, pinned={0: [1, 2]})


def test_cold_hit_rate_hand_example():
    # layer 0 routes e, layer 1 routes e+1; decode rows [0,1], [2,3]; the prefill row is ignored
    t = make_trace([[[0, 1], [0, 1]], [[0, 1]], [[2, 3]]], n_expert=4, layers=2)
    # layer 0 occurrences 0 1 2 3 with {0, 2} resident: 2 cold; layer 1 occurrences 1 2 3 0
    # with {1} resident: 3 cold -> 5 of 8
    assert cold_hit_rate(t, {0: {0, 2}, 1: {1}}) == pytest.approx(5 / 8)
    assert cold_hit_rate(t, {0: {0, 1, 2, 3}}) == pytest.approx(4 / 8)  # layer 1 holds nothing


def test_not_run_layer_steps_are_skipped():
    ids = np.array([[[0], [1]], [[2], [-1]]])  # layer 1 not reached in step 1
    t = RoutingTrace(ids, [1, 1], [0, 1], 4, "fp")
    r = simulate(t, "lru", 2)
    assert (r.layers[0].misses, r.layers[1].misses, r.layers[1].cached_steps) == (2, 1, 1)


# ---------------------------------------------------------------- policies of issue 12

from spark_cli.core.simulator import (ALIASES, DEFAULT_POLICY, FIXED_MISS_PATHS, ONLINE_POLICIES, POLICIES,  # noqa: E402
                                 LayerCache, canonical_policy)

ALL = ("lru-pinned", "lfu-aged", "slru", "tinylfu", "belady")
PARAMS = PolicyParams(window=4, protected_num=1, protected_den=2)


def _replay_checked(steps, n_expert, slots, pinned, policy, miss_path, max_admit, params=PARAMS):
    """Drive LayerCache step by step (decode = one-token steps) and check the invariants."""
    cache = LayerCache(n_expert, slots, pinned, policy, miss_path, max_admit, params)
    nxt = None
    if policy == "belady":
        from spark_cli.core.simulator import _next_uses

        nxt = _next_uses([list(dict.fromkeys(e for r in s for e in r)) for s in steps])
    pinned_slots = list(cache.slot_expert[: len(pinned)])
    pending: set[int] = set()  # cpu: experts admitted since the start of the last decode step
    hits = misses = 0
    for t, s in enumerate(steps):
        distinct = list(dict.fromkeys(e for r in s for e in r))
        decode = len(s) == 1
        lands = miss_path == "cpu" and decode  # last decode step's admissions become usable
        before = {e: cache.expert_slot[e] for e in distinct if cache.expert_slot[e] >= 0
                  and (lands or not cache.slot_pending[cache.expert_slot[e]])}
        o = cache.step(distinct, decode, nxt[t] if nxt else None)
        assert o.hits == [e for e in distinct if e in o.hits] and o.misses == [e for e in distinct if e in o.misses]
        assert sorted(o.hits + o.misses) == sorted(distinct)
        assert set(o.hits) == set(before)  # hits are exactly the ready residents
        for e, slot in before.items():  # a slot used by this step is never evicted
            assert cache.expert_slot[e] == slot and cache.slot_expert[slot] == e
        assert not set(o.evicted) & set(distinct)
        assert cache.slot_expert[: len(pinned)] == pinned_slots  # pinned slots never move
        if miss_path == "cpu":
            if decode:
                pending = set()  # they land at the start of a decode step
            assert not set(o.hits) & pending  # lagged: never read before the next decode step
            if not decode:
                assert not o.admitted and not o.evicted
            assert len(o.admitted) <= max_admit
            assert len(o.admitted) + o.skipped == (len(o.misses) if decode else 0)
            pending |= {e for e, _ in o.admitted}
            assert not set(o.hits) & {e for e, _ in o.admitted}
        else:
            assert [e for e, _ in o.admitted] == o.misses
        assert len({e for e in cache.slot_expert if e >= 0}) == sum(e >= 0 for e in cache.slot_expert)
        hits += len(o.hits)
        misses += len(o.misses)
    return hits, misses


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("miss_path", FIXED_MISS_PATHS)
@settings(max_examples=60, deadline=None)
@given(steps=step_lists(8, 2, max_tokens=2, max_steps=40), slots=st.integers(4, 7), n_pin=st.integers(0, 2),
       max_admit=st.integers(1, 3))
def test_policy_invariants(policy, miss_path, steps, slots, n_pin, max_admit):
    pinned = list(range(7, 7 - n_pin, -1))
    cap = slots - n_pin
    steps = [s for s in steps if len(s) * 2 <= cap]  # cached steps only (stock steps never reach step())
    _replay_checked(steps, 8, slots, pinned, policy, miss_path, max_admit)


@pytest.mark.parametrize("miss_path", FIXED_MISS_PATHS)
@settings(max_examples=300, deadline=None)
@given(steps=step_lists(7, 2, max_tokens=2, max_steps=30), slots=st.integers(2, 6), max_admit=st.integers(2, 3))
def test_belady_never_worse_than_online_policies(miss_path, steps, slots, max_admit):
    # NOTE: in the cpu path, a step that misses more distinct experts than max_admit must choose which
    # to admit, and bypass-Belady is then a heuristic, not a bound (a scheduling problem; hypothesis
    # found a 9-step counterexample with max_admit = k = 2): the bound is checked on steps that can
    # admit every miss. A prompt step (read-only there) between decode steps breaks it too (an
    # 8-step counterexample: Belady admits for the next decode use, LRU's older slot serves the
    # prompt step), so the cpu path's bound is checked on decode steps.
    if miss_path == "cpu":
        steps = [s for s in steps if len(s) == 1 and len({e for r in s for e in r}) <= max_admit] or [[[0]]]
    t = make_trace(steps, n_expert=7)
    kw = dict(phases=BOTH, miss_path=miss_path, max_admit=max_admit, params=PARAMS)
    b = simulate(t, "belady", slots, **kw).layers[0]
    for policy in ONLINE_POLICIES:
        o = simulate(t, policy, slots, **kw).layers[0]
        assert o.stock_steps == b.stock_steps
        assert b.misses <= o.misses, policy


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("miss_path", FIXED_MISS_PATHS)
def test_policies_are_deterministic(policy, miss_path):
    rng = np.random.default_rng(3)
    p = 1.0 / np.arange(1, 13) ** 1.1
    steps = [[list(rng.choice(12, size=3, replace=False, p=p / p.sum()))] for _ in range(300)]
    t = make_trace(steps, n_expert=12, layers=2)
    a = simulate(t, policy, 7, pinned={0: [0], 1: [1]}, miss_path=miss_path, params=PARAMS)
    b = simulate(t, policy, 7, pinned={0: [0], 1: [1]}, miss_path=miss_path, params=PARAMS)
    assert a.layers == b.layers


@settings(max_examples=100, deadline=None)
@given(steps=step_lists(8, 2, max_tokens=3, max_steps=40), slots=st.integers(2, 8), n_pin=st.integers(0, 2))
def test_generic_lru_matches_fast_lru(steps, slots, n_pin):
    from spark_cli.core.simulator import _run

    pin = list(range(n_pin)) if n_pin <= slots else []
    cap = slots - len(pin)
    cached = [list(dict.fromkeys(e for r in s for e in r)) for s in steps if len(s) * 2 <= cap]
    dec = [True] * len(cached)
    fast = _run(cached, dec, 8, slots, pin, "lru-pinned", "upload", 2, PARAMS)
    cache = LayerCache(8, slots, pin, "lru-pinned")
    misses = [len(cache.step(d).misses) for d in cached]
    assert fast.misses.tolist() == misses
    assert fast.resident == cache.resident()


def test_lfu_aged_integer_halving_by_hand():
    # cap 2, window 2: counts after each step (halving after steps 2 and 4):
    # s1: 0 -> {0:1}; s2: 0 -> {0:2} halve {0:1}; s3: 1 -> {0:1, 1:1}; s4: 1 -> {1:2} halve {0:0, 1:1}
    # s5: 2 miss: victim min (count, tick): 0 (count 0) -> evicted
    t = make_trace([[[0]], [[0]], [[1]], [[1]], [[2]]], n_expert=4)
    s = simulate(t, "lfu-aged", 2, params=PolicyParams(window=2)).layers[0]
    assert (s.hits, s.misses) == (2, 3)
    assert s.final_resident == (1, 2)
    c = LayerCache(4, 2, (), "lfu-aged", params=PolicyParams(window=2))
    for e in (0, 0, 1, 1):
        c.step([e])
    assert c.freq == [0, 1, 0, 0] and c.age == 0


def test_slru_protects_reused_experts():
    # cap 3, protected 1 of 3 (num 1, den 2 -> 1): 0 0 (0 protected) 1 2 3 -> evicts 1 (probation LRU),
    # then 4 evicts 2: 0 stays although it is the least recent
    half = PolicyParams(protected_num=1, protected_den=2)
    t = make_trace([[[0]], [[0]], [[1]], [[2]], [[3]], [[4]], [[0]]], n_expert=5)
    s = simulate(t, "slru", 3, params=half).layers[0]
    assert (s.hits, s.misses) == (2, 5)
    lru = simulate(t, "lru", 3).layers[0]
    assert (lru.hits, lru.misses) == (1, 6)
    c = LayerCache(5, 3, (), "slru", params=half)
    for e in (0, 0, 1, 1, 2, 2):  # promoting 1 then 2 demotes the older protected one
        c.step([e])
    assert [c.slot_seg[c.expert_slot[e]] for e in (0, 1, 2)] == [0, 0, 1]


def test_cpu_path_lag_bound_and_admission():
    # cap 2, k 1, max_admit 1: 0 1 0 1: step 1 admits 0 (pending), step 2 admits 1, step 3 hits 0
    t = make_trace([[[0]], [[1]], [[0]], [[1]]], n_expert=4)
    s = simulate(t, "lru", 2, miss_path="cpu", max_admit=1).layers[0]
    assert (s.hits, s.misses, s.cpu_experts, s.admissions, s.admit_skipped) == (2, 2, 2, 2, 0)
    # an expert routed in two consecutive steps misses twice: admitted at step 1, usable at step 2
    t2 = make_trace([[[0, 1]], [[0, 1]], [[0, 1]]], n_expert=4)
    s2 = simulate(t2, "lru", 2, miss_path="cpu", max_admit=1).layers[0]
    # step 1: 0 admitted, 1 skipped (bound); step 2: 0 hit, 1 admitted; step 3: both hit
    assert (s2.hits, s2.misses, s2.admissions, s2.admit_skipped) == (3, 3, 2, 1)
    up = simulate(t2, "lru", 2).layers[0]
    assert (up.hits, up.misses, up.cpu_experts, up.admit_skipped) == (4, 2, 0, 0)
    # tinylfu declines a one-off miss against a frequent victim; lru admits it
    steps = [[[0]], [[1]], [[0]], [[1]], [[0]], [[1]], [[2]], [[0]], [[1]]]
    t3 = make_trace(steps, n_expert=4)
    tl = simulate(t3, "tinylfu", 2, miss_path="cpu", params=PolicyParams(window=0)).layers[0]
    lr = simulate(t3, "lru", 2, miss_path="cpu").layers[0]
    assert tl.admit_skipped == 1 and tl.misses == 3  # 0, 1 compulsory; 2 computed on the CPU
    assert lr.misses == 5  # 2 evicts 0, whose return evicts 1: both miss again


def test_cpu_prefill_steps_are_read_only():
    # cap 4, k 1: decode 0 (admitted), decode 1 (0 lands), prefill [0, 2] (hit 0, miss 2: not
    # admitted, 0 not touched), decode 2 (miss: admitted now)
    t = make_trace([[[0]], [[1]], [[0], [2]], [[2]]], n_expert=4)
    s = simulate(t, "lru", 4, miss_path="cpu", phases=BOTH).layers[0]
    assert (s.hits, s.misses, s.admissions) == (1, 4, 3)
    assert (s.hits_decode, s.misses_decode, s.admissions_decode) == (0, 3, 3)


def test_policy_names_and_aliases():
    assert DEFAULT_POLICY in ONLINE_POLICIES and set(ONLINE_POLICIES) <= set(POLICIES)
    assert canonical_policy("lfu") == "lfu-aged" == ALIASES["lfu"]
    t = make_trace([[[0]], [[1]]], n_expert=4)
    assert simulate(t, "lfu", 2).policy == "lfu-aged"
    with pytest.raises(PlanError, match="unknown miss path"):
        simulate(t, "lru", 2, miss_path="gpu")
    with pytest.raises(PlanError, match="invalid policy parameters"):
        PolicyParams(protected_num=3, protected_den=2)


def test_decode_steps_with_a_miss_are_counted_once_each():
    """miss_steps_decode: the decode steps that miss at least one expert (each waits on its reads,
    cost_model.file_tier_tg), however many experts it misses."""
    from spark_cli.core import ram_tier

    ids = np.array([[[0, 1]], [[0, 1]], [[2, 3]], [[2, 0]]], dtype=np.int32)  # one layer, k = 2
    n = ids.shape[0]
    trace = RoutingTrace(ids, np.ones(n, np.uint8), np.arange(n, dtype=np.int32), 8, "synthetic")
    sim = simulate(trace, DEFAULT_POLICY, {0: 2}, {}, phases=("prefill", "decode"), ram_tier=True)
    # two LRU slots: [0 1] misses both, [0 1] hits, [2 3] misses both, [2 0] misses 0 (2 and 3 evicted it)
    assert (sim.misses_decode, sim.miss_steps_decode) == (5, 3)
    m = ram_tier.decode_misses({0: 2}, {}, trace)
    assert (m.per_token, m.steps_per_token) == (5 / 4, 3 / 4)
