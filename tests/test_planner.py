"""planner: budgets, monotone hot sets, byte accounting, stock baseline, plan files."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from _geometry import MiB, make_geometry
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_cli.core import plan_file, vram
from spark_cli.errors import PlanError
from spark_cli.core.plan_file import PLAN_VERSION
from spark_cli.core.planner import Plan, stage_slices, staging_bytes, stock_baseline
from spark_cli.core.planner import _make_plan as make_plan  # the greedy under plan_for

GiB = 1 << 30
SETTINGS = settings(max_examples=int(os.environ.get("SPARK_HYP_EXAMPLES", "60")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fixed_bytes(g, n_ctx: int = 4096, tk: str = "f16", tv: str = "f16") -> int:
    return (g.device_global_bytes + sum(l.nonexpert_bytes for l in g.layers if not l.is_nextn)
            + vram.kv_cache_bytes(g, n_ctx, tk, tv) + vram.compute_buffer_bytes(g, n_ctx)
            + vram.DEVICE_OVERHEAD_BYTES)


def floor_bytes(g, max_slots: int | None = None, stage: int | None = None) -> int:
    """k slots and a guard per cached layer, and the staging slices when a layer is cached
    (stage: their count; None: the planner's for the default miss path)."""
    k, total, cached = g.n_expert_used, 0, False
    for i in g.moe_layers:
        b, n = g.layers[i].expert_bytes_per_expert, g.n_expert
        resident = k + 1 >= n or (max_slots is not None and max_slots < k)
        total += n * b if resident else (k + 1) * b
        cached = cached or not resident
    stage = stage_slices(g.n_expert, k, "auto") if stage is None else stage
    return total + (staging_bytes(g, stage) if cached else 0)


def full_bytes(g) -> int:
    return fixed_bytes(g) + sum(g.n_expert * g.layers[i].expert_bytes_per_expert for i in g.moe_layers)


@st.composite
def scenarios(draw, feasible: bool = False):
    """Geometry, profile, miss function, slot cap and two budgets; feasible: budgets >= the floor."""
    n_layer = draw(st.integers(1, 6))
    n_expert = draw(st.sampled_from([4, 8, 16, 32]))
    k = draw(st.integers(1, min(n_expert, 6)))
    dense = draw(st.sets(st.integers(0, n_layer - 1), max_size=n_layer - 1))
    bpe = draw(st.lists(st.integers(1, 40).map(lambda m: m * MiB // 4), min_size=n_layer, max_size=n_layer))
    nextn = draw(st.integers(0, 1)) if n_layer > 1 else 0
    g = make_geometry(n_layer=n_layer, n_expert=n_expert, k=k, bpe=bpe, dense=tuple(dense),
                      shared=draw(st.sampled_from([0, MiB])), nextn=nextn, bias=draw(st.sampled_from([0, 4096])))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    profile = None
    if draw(st.booleans()):
        profile = rng.zipf(1.5, size=(n_layer, n_expert)).astype(float) * (rng.random((n_layer, n_expert)) > 0.2)
    miss = None
    if draw(st.booleans()):
        decay = rng.uniform(0.5, 8.0, size=n_layer)
        miss = lambda l, p, s: float(np.exp(-(p + s) / decay[l]))  # noqa: E731
    max_slots = draw(st.sampled_from([None, None, k, k + 3]))
    span = full_bytes(g) - fixed_bytes(g)
    lo = fixed_bytes(g) + floor_bytes(g, max_slots) if feasible else fixed_bytes(g) - span // 10 - 1
    hi = full_bytes(g) + span // 10
    fractions = draw(st.lists(st.floats(0, 1), min_size=2, max_size=2))
    budgets = sorted(int(lo + f * (hi - lo)) for f in fractions)
    return g, profile, miss, max_slots, budgets


def hot_sets(plan: Plan) -> dict[int, frozenset[int]]:
    return plan.hot_set()


def check_plan(g, plan: Plan, budget: int, max_slots: int | None) -> None:
    b = plan.breakdown
    assert b["total"] <= budget
    assert b["total"] == sum(v for key, v in b.items() if key != "total")
    per_layer = sum(l.device_bytes for l in plan.layers)
    staged = staging_bytes(g, plan.stage_slices)  # shared by the cached layers of one shape
    assert plan.stage_slices == 0 or any(l.mode == "cached" for l in plan.layers)
    assert per_layer + staged + b["weights_global"] + b["kv_cache"] + b["compute"] + b["overhead"] == b["total"]
    assert b["weights_global"] == g.device_global_bytes
    for lp in plan.layers:
        lg = g.layers[lp.index]
        bpe, n = lg.expert_bytes_per_expert, g.n_expert
        if lp.mode == "skipped":
            assert lg.is_nextn and lp.device_bytes == lp.host_bytes == 0
        elif lp.mode == "dense":
            assert not lg.is_moe and lp.device_bytes == lg.nonexpert_bytes
        elif lp.mode == "resident":
            assert lp.device_bytes == lg.nonexpert_bytes + n * bpe and lp.host_bytes == 0
        elif lp.mode == "host":  # as stock --n-cpu-moe: expert weights and biases on the host
            assert lg.is_moe and not lp.pinned and lp.slots == 0
            assert lp.device_bytes == lg.nonexpert_bytes - lg.expert_bias_bytes
            assert lp.host_bytes == lg.expert_bytes + lg.expert_bias_bytes
        else:
            assert lp.mode == "cached" and lg.is_moe
            assert lp.lru_slots >= g.n_expert_used
            assert lp.slots + 1 < n
            assert len(set(lp.pinned)) == len(lp.pinned) and all(0 <= e < n for e in lp.pinned)
            assert lp.device_bytes == lg.nonexpert_bytes + (lp.slots + 1) * bpe
            assert lp.host_bytes == n * bpe
            if max_slots is not None:
                assert lp.slots <= max_slots
    assert b["experts_resident"] + b["expert_banks"] == staged + sum(
        lp.device_bytes - g.layers[lp.index].nonexpert_bytes for lp in plan.layers if lp.mode in ("resident", "cached"))


@SETTINGS
@given(scenarios())
def test_budget_respected_or_refused(s) -> None:
    g, profile, miss, max_slots, budgets = s
    for budget in budgets:
        stock_cpu_moe = fixed_bytes(g) - sum(g.layers[i].expert_bias_bytes for i in g.moe_layers)
        try:
            plan = make_plan(g, budget, 4096, profile, miss_fn=miss, max_slots_per_layer=max_slots)
        except PlanError as e:
            assert stock_cpu_moe > budget  # refused only where stock --cpu-moe does not fit either
            assert "over by" in e.message and "\n" not in e.one_line()
            continue
        assert stock_cpu_moe <= budget
        check_plan(g, plan, budget, max_slots)
        # host layers only below the cache floor (every layer that can be cached at k slots and a guard,
        # beside the staging slices: the plan's, or the default miss path's where it caches no layer).
        # NOTE: one way only: where resident layers cost less than cached ones with their staging (few
        # experts), a plan may fit under that floor without host layers
        cached = any(l.mode == "cached" for l in plan.layers)
        need = fixed_bytes(g) + floor_bytes(g, max_slots, plan.stage_slices if cached else None)
        host = [l.index for l in plan.layers if l.mode == "host"]
        assert not host or need > budget
        loaded = [i for i in g.moe_layers if not g.layers[i].is_nextn]
        assert host == loaded[: len(host)]  # the lowest-numbered MoE layers, as --n-cpu-moe
        if profile is None:
            assert plan.predicted_cold_hit is None
        else:
            assert 0.0 <= plan.predicted_cold_hit <= 1.0


@SETTINGS
@given(scenarios(feasible=True))
def test_hot_set_grows_with_budget(s) -> None:
    g, profile, miss, max_slots, (b1, b2) = s
    p1 = make_plan(g, b1, 4096, profile, miss_fn=miss, max_slots_per_layer=max_slots)
    p2 = make_plan(g, b2, 4096, profile, miss_fn=miss, max_slots_per_layer=max_slots)
    h1, h2 = hot_sets(p1), hot_sets(p2)
    for layer, hot in h1.items():
        assert hot <= h2[layer]
    for a, b in zip(p1.layers, p2.layers):
        if a.mode == "resident":
            assert b.mode == "resident"
        if a.mode == b.mode == "cached":
            assert b.pinned[: len(a.pinned)] == a.pinned
            assert a.lru_slots <= b.lru_slots
    if profile is not None:
        assert p2.predicted_cold_hit <= p1.predicted_cold_hit + 1e-12


def test_floor_without_miss_ratio() -> None:
    g = make_geometry(n_layer=4, n_expert=16, k=4)
    budget = fixed_bytes(g) + floor_bytes(g, stage=0) + 25 * MiB
    plan = make_plan(g, budget, 4096, miss_path="cpu")  # no staging slices: the floor alone
    cached = [l for l in plan.layers if l.mode == "cached"]
    assert len(cached) == 3 and all(l.lru_slots == 4 for l in cached)
    assert sum(len(l.pinned) for l in cached) == 2  # 25 MiB left buys two 10 MiB pins
    assert plan.breakdown["expert_banks"] == (3 * 5 + 2) * 10 * MiB and plan.stage_slices == 0


def test_pins_follow_profile_and_predict_cold_hit() -> None:
    g = make_geometry(n_layer=3, n_expert=8, k=2, dense=())
    counts = np.zeros((3, 8))
    counts[0] = [0, 50, 0, 30, 10, 5, 5, 0]
    counts[1] = [1, 1, 1, 1, 1, 1, 1, 93]
    counts[2] = [10] * 8
    budget = fixed_bytes(g) + floor_bytes(g, stage=0) + 3 * 10 * MiB
    plan = make_plan(g, budget, 4096, counts, miss_path="cpu")  # no staging slices: the floor alone
    pins = {l.index: l.pinned for l in plan.layers}
    # gains per byte: layer1 e7 (.93), layer0 e1 (.5), layer0 e3 (.3); layer 2 is 1/8 each
    assert pins == {0: (1, 3), 1: (7,), 2: ()}
    expected = np.mean([1 - 0.8, 1 - 0.93, 1.0])
    assert plan.predicted_cold_hit == pytest.approx(expected)


def test_uniform_prior_makes_whole_layers_resident() -> None:
    g = make_geometry(n_layer=4, n_expert=8, k=2, dense=())
    budget = fixed_bytes(g) + floor_bytes(g) + 2 * 5 * 10 * MiB
    plan = make_plan(g, budget, 4096)
    assert [l.mode for l in plan.layers] == ["resident", "resident", "cached", "cached"]
    assert plan.predicted_cold_hit is None


def test_replayed_miss_buys_policy_slots() -> None:
    g = make_geometry(n_layer=3, n_expert=32, k=2, dense=())
    calls: dict[tuple[int, int, int], int] = {}

    def miss(layer: int, pins: int, slots: int) -> float:
        calls[(layer, pins, slots)] = calls.get((layer, pins, slots), 0) + 1
        return max(0.0, 1.0 - (pins + slots) / 12) if layer == 1 else 0.9 ** (pins + slots)

    counts = np.ones((3, 32))  # flat profile: pins are worth 1/32 each
    budget = fixed_bytes(g) + floor_bytes(g) + 10 * 10 * MiB
    plan = make_plan(g, budget, 4096, counts, miss_fn=miss)
    assert plan.layers[1].lru_slots > 2
    assert max(calls.values()) == 1
    without = make_plan(g, budget, 4096, counts)
    assert all(l.lru_slots == 2 for l in without.layers)


def test_max_slots_forces_residency_jump() -> None:
    g = make_geometry(n_layer=2, n_expert=16, k=2, dense=())
    plan = make_plan(g, full_bytes(g), 4096, max_slots_per_layer=4)
    assert all(l.mode == "resident" for l in plan.layers)
    small = make_plan(g, fixed_bytes(g) + floor_bytes(g) + 40 * MiB, 4096, max_slots_per_layer=4)
    assert all(l.slots <= 4 for l in small.layers)


def test_refuses_when_fixed_costs_do_not_fit() -> None:
    g = make_geometry()
    need = fixed_bytes(g, 32768)
    with pytest.raises(PlanError) as e:
        make_plan(g, need - GiB // 4, 32768)
    msg = e.value.one_line()
    assert msg.startswith("--vram ") and "the model without experts needs" in msg
    assert "kv_cache" in msg and "n_ctx 32768" in msg and "over by 256.0 MiB" in msg


def test_below_the_cache_floor_layers_stay_on_the_host() -> None:
    g = make_geometry(n_layer=4, n_expert=8, k=2, bias=4096)  # layer 0 dense, 1-3 MoE; 30 MiB floor each
    fixed = fixed_bytes(g)
    plan = make_plan(g, fixed + floor_bytes(g) - GiB // 50, 4096)  # 20 MiB short: layer 1 to the host
    assert [l.mode for l in plan.layers] == ["dense", "host", "cached", "cached"]
    assert plan.breakdown["weights_layers_nonexpert"] == sum(l.nonexpert_bytes for l in g.layers) - 4096
    assert [(o.pattern, o.target) for o in plan.overrides if o.target == "CPU"] == \
        [(r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU")]  # llama.cpp's --n-cpu-moe 2
    counts = np.ones((4, 8))
    p2 = make_plan(g, fixed - 3 * 4096, 4096, counts)  # exactly stock --cpu-moe
    assert [l.mode for l in p2.layers] == ["dense", "host", "host", "host"]
    assert p2.predicted_cold_hit == 1.0 and p2.breakdown["total"] == fixed - 3 * 4096
    assert p2.stock.cpu_moe_fits
    with pytest.raises(PlanError, match="the model without experts needs"):
        make_plan(g, fixed - 3 * 4096 - 1, 4096)
    assert plan_file.from_json(plan_file.to_json(p2)) == p2


def test_profile_shape_checked() -> None:
    g = make_geometry()
    with pytest.raises(PlanError, match="profile: shape"):
        make_plan(g, 8 * GiB, 4096, np.ones((3, 8)))


def test_stock_baseline_by_hand() -> None:
    # layer 0 dense, layers 1-3 MoE with 8 x 10 MiB experts (80 MiB each), 4 KiB of expert biases
    g = make_geometry(n_layer=4, n_expert=8, k=2, bias=4096)
    fixed = fixed_bytes(g)
    s = stock_baseline(g, fixed + 2 * 80 * MiB, fixed)
    assert (s.n_cpu_moe, s.fits) == (2, True)  # layers 0 and 1 on the CPU, 2 and 3 on the device
    assert s.device_bytes == fixed + 2 * 80 * MiB - 4096  # layer 1 biases follow its experts
    assert s.override_patterns == (r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps",
                                   r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps")
    assert s.cpu_moe_device_bytes == fixed - 3 * 4096 and s.cpu_moe_fits
    pat = re.compile(s.override_patterns[1])
    assert pat.search("blk.1.ffn_gate_up_exps.weight") and pat.search("blk.1.ffn_down_exps.bias")
    assert not pat.search("blk.11.ffn_down_exps.weight") and not pat.search("blk.1.ffn_down_shexp.weight")
    assert stock_baseline(g, fixed + 3 * 80 * MiB, fixed).n_cpu_moe == 0
    none = stock_baseline(g, fixed - 3 * 4096 - 1, fixed)
    assert (none.n_cpu_moe, none.fits, none.cpu_moe_fits) == (4, False, False)
    plan = make_plan(g, fixed + 2 * 80 * MiB, 4096)
    assert plan.stock == s


def test_plan_carries_the_expert_overrides() -> None:
    g = make_geometry(n_layer=5, n_expert=8, k=2, nextn=1, bias=4096)
    plan = make_plan(g, fixed_bytes(g) + floor_bytes(g) + 50 * MiB, 4096)
    assert [l.mode for l in plan.layers] == ["dense", "resident", "cached", "cached", "skipped"]
    assert [o.target for o in plan.overrides] == ["host"]
    rx = re.compile(plan.overrides[0].pattern)
    names = [t.name for l in g.layers for t in l.experts]
    # exactly the expert weights of the cached layers: planned host bytes == bytes the pattern moves
    moved = sum(t.n_bytes for l in g.layers for t in l.experts if rx.search(t.name))
    assert moved == sum(l.host_bytes for l in plan.layers)
    assert {n for n in names if rx.search(n)} == {t.name for il in (2, 3) for t in g.layers[il].experts}
    assert not rx.search("blk.2.ffn_gate_up_exps.bias") and not rx.search("blk.12.ffn_gate_up_exps.weight")
    assert plan_file.from_json(plan_file.to_json(plan)).overrides == plan.overrides


def test_json_round_trip_and_identity(tmp_path: Path) -> None:
    g = make_geometry(n_layer=4, n_expert=8, k=2)
    counts = np.arange(32, dtype=float).reshape(4, 8)
    plan = make_plan(g, fixed_bytes(g) + floor_bytes(g) + 100 * MiB, 4096, counts, "q8_0", "q8_0")
    d = json.loads(plan_file.to_json(plan))
    assert d["version"] == PLAN_VERSION and d["model"] == g.identity()
    assert set(d["breakdown"]) >= {"weights_global", "expert_banks", "kv_cache", "total"}
    assert plan_file.from_json(plan_file.to_json(plan)) == plan
    path = tmp_path / "p" / "plan.json"
    plan_file.save(plan, path)
    assert plan_file.load(path, g.identity()) == plan
    other = make_geometry(n_layer=4, n_expert=8, k=2, fingerprint="0" * 64)
    with pytest.raises(PlanError, match=r"plan is for another model \(fingerprint ffffffffffff != 000000000000\)"):
        plan_file.load(path, other.identity())
    d["version"] = 99
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=f"version: expected {PLAN_VERSION}, got 99"):
        plan_file.load(path)
    path.write_text("{not json")
    with pytest.raises(PlanError, match="not JSON"):
        plan_file.load(path)
    with pytest.raises(PlanError, match="cannot read plan"):
        plan_file.load(tmp_path / "missing.json")


# ---------------------------------------------------------------- planning by replay (issue 12)

from spark_cli.core.planner import PlanRequest, held_out_check, plan_for, replayed_miss  # noqa: E402
from spark_cli.core.trace import RoutingTrace  # noqa: E402


def _skewed_trace(g, n: int, seed: int, drift: bool = False) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    k, E = g.n_expert_used, g.n_expert
    ids = np.full((n, g.n_layer, k), -1, dtype=np.int16)
    for l in g.moe_layers:
        perm = rng.permutation(E)
        w = 1.0 / np.arange(1, E + 1) ** rng.uniform(0.3, 1.5)
        for t in range(n):
            if drift and t % 40 == 0:
                perm = rng.permutation(E)  # a new hot set: recency pays, pins do not
            ids[t, l] = perm[rng.choice(E, k, replace=False, p=w / w.sum())]
    return RoutingTrace(ids, np.ones(n), np.arange(n), E, g.fingerprint)


@settings(max_examples=int(os.environ.get("SPARK_HYP_EXAMPLES", "25")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), frac=st.floats(0.0, 1.0), drift=st.booleans(),
       policy=st.sampled_from(["lru", "lfu-aged", "tinylfu"]))
def test_replay_plan_never_worse_than_both_baselines(seed, frac, drift, policy) -> None:
    g = make_geometry(n_layer=3, n_expert=8, k=2)
    tr = _skewed_trace(g, 120, seed, drift)
    lo = fixed_bytes(g)  # stock --cpu-moe (no expert biases here): every layer on the host
    budget = int(lo + frac * (full_bytes(g) - lo))
    res = plan_for(g, PlanRequest(budget, 4096, trace=tr, policy=policy))
    plan, by = res.plan, {c.name: c for c in res.candidates}
    assert set(by) == {"replay", "pins+k", "all-slots"}
    assert plan.predicted_miss <= min(by["pins+k"].miss, by["all-slots"].miss) + 1e-12
    assert plan.policy == policy and plan.breakdown["total"] <= budget
    assert all(not c.plan.layers[i].pinned for c in [by["all-slots"]] for i in range(g.n_layer))
    again = plan_for(g, PlanRequest(budget, 4096, trace=tr, policy=policy)).plan
    assert again == plan  # deterministic
    # auto (the request's default) admits as the cpu path does, and replays it
    assert replayed_miss(plan, tr, "cpu") == pytest.approx(plan.predicted_miss)
    assert res.replay_steps == 120 and res.candidate(res.chosen).layers == plan.layers


def test_replay_prices_slots_when_the_hot_set_moves() -> None:
    g = make_geometry(n_layer=3, n_expert=16, k=2, dense=())
    tr = _skewed_trace(g, 400, 1, drift=True)
    budget = fixed_bytes(g) + floor_bytes(g) + 3 * 6 * 10 * MiB
    res = plan_for(g, PlanRequest(budget, 4096, trace=tr, policy="lru"))
    plan, by = res.plan, {c.name: c.miss for c in res.candidates}
    assert plan.predicted_miss == min(by.values())
    assert by["all-slots"] < by["pins+k"]  # pins bet on a hot set that moves away
    c = held_out_check(g, PlanRequest(budget, 4096, trace=tr, policy="lru"))
    assert c is not None and (c.train_steps, c.test_steps) == (280, 120)
    assert 0.0 <= c.belady <= c.measured <= 1.0 and 0.0 <= c.oracle <= 1.0
    assert held_out_check(g, PlanRequest(budget, 4096, trace=tr.rows(0, 1), policy="lru")) is None


def test_staging_slices_per_expert_shape() -> None:
    """The auto and upload paths hold STAGE_STEPS * k staging slices per expert shape, priced in
    expert_banks once a layer is cached; the cpu path holds none; an all-resident plan holds none."""
    g = make_geometry(n_layer=4, n_expert=16, k=2, dense=())
    budget = fixed_bytes(g) + floor_bytes(g) + 30 * MiB
    auto = make_plan(g, budget, 4096)
    cpu = make_plan(g, budget, 4096, miss_path="cpu")
    bpe = g.layers[0].expert_bytes_per_expert
    assert auto.stage_slices == 8 and cpu.stage_slices == 0
    assert staging_bytes(g, 8) == 8 * bpe  # one shape: the layers share the slices
    banks = lambda p: sum((l.slots + 1) * bpe for l in p.layers if l.mode == "cached")  # noqa: E731
    assert auto.breakdown["expert_banks"] == banks(auto) + 8 * bpe
    assert cpu.breakdown["expert_banks"] == banks(cpu)
    assert banks(cpu) > banks(auto)  # the staging bytes came out of the slots
    assert make_plan(g, full_bytes(g), 4096).stage_slices == 0
    again = plan_file.from_json(plan_file.to_json(auto))
    assert again.stage_slices == 8 and again == auto


def test_staging_slices_stop_at_the_most_misses_a_step_can_have() -> None:
    """A step misses at most the experts outside a layer's slots: with 8 experts and at least 4
    slots a layer, STAGE_STEPS * k = 8 slices would leave some never filled, so the plan holds
    n_expert - (fewest slots) and spends the rest on slots and pins."""
    g = make_geometry(n_layer=4, n_expert=8, k=2, dense=())
    budget = fixed_bytes(g) + floor_bytes(g) + 25 * MiB
    plan = make_plan(g, budget, 4096)
    cached = [l for l in plan.layers if l.mode == "cached"]
    assert cached and stage_slices(8, 2, "auto") == 8
    assert plan.stage_slices == 8 - min(l.slots for l in cached) < 8
    full = make_plan(g, budget, 4096, stage=8)  # the slices as many as STAGE_STEPS * k
    assert full.stage_slices == 8 and full.breakdown["total"] <= budget
    slots = lambda p: sum(l.slots for l in p.layers if l.mode == "cached")  # noqa: E731
    assert slots(plan) > slots(full) or [l.mode for l in plan.layers].count("resident") > \
        [l.mode for l in full.layers].count("resident")
    assert plan.breakdown["total"] <= budget


def test_parallel_sequences_are_priced_and_recorded() -> None:
    """-np 4 prices four sequences: for a hybrid model at -c 4096 the attention layers keep the same
    4096 cells (4 streams of 1024, or one unified stream), the recurrent state is held 4 times, so the
    bill grows by exactly 3 states. n_parallel and kv_unified round-trip through the plan file; a plan
    file from before them loads as 1 and false."""
    state = 3 * MiB + 17
    g = make_geometry(n_layer=4, n_expert=8, k=2, kv_heads=(0, 0, 0, 2), recurrent_state=state)
    budget = fixed_bytes(g, 4096) + floor_bytes(g) + 200 * MiB
    one = plan_for(g, PlanRequest(budget, 4096)).plan
    assert (one.n_parallel, one.kv_unified) == (1, False)
    for unified in (False, True):
        four = plan_for(g, PlanRequest(budget, 4096, n_parallel=4, kv_unified=unified)).plan
        assert (four.n_parallel, four.kv_unified) == (4, unified)
        assert four.breakdown["kv_cache"] - one.breakdown["kv_cache"] == 3 * state
        assert four.breakdown["kv_cache"] == vram.kv_cache_bytes(g, 4096, n_seq=4, unified=unified)
        d = json.loads(plan_file.to_json(four))
        assert (d["n_parallel"], d["kv_unified"]) == (4, unified)
        assert plan_file.from_json(plan_file.to_json(four)) == four
    old = json.loads(plan_file.to_json(one))
    del old["n_parallel"], old["kv_unified"]
    again = plan_file.from_json(json.dumps(old))
    assert (again.n_parallel, again.kv_unified) == (1, False) and again == one
    for bad in ({"n_parallel": 0}, {"n_parallel": 257}, {"kv_unified": 1}):
        with pytest.raises(PlanError, match=next(iter(bad))):
            plan_file.from_json(json.dumps({**old, **bad}))
