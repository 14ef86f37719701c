"""The RAM tier: the budget (cgroups v1 and v2), the placement, the native file tier's exactness,
and a capped end-to-end run against stock's page cache in a memory cgroup."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from spark_cli.core import ram_tier
from spark_cli.core.gguf_info import load_geometry
from spark_cli.errors import PlanError
from spark_cli.runs import host_ram, memcg

MiB = 1 << 20


@pytest.fixture(scope="module")
def qwen36():
    from spark_cli.models.fixtures import build_fixture

    return load_geometry(build_fixture("qwen3.6-35b-a3b-q4_k_m"))


def test_plan_leaves_a_model_that_fits_alone(qwen36):
    assert ram_tier.plan(qwen36, qwen36.file_size * 2, "--ram") is None


def test_plan_places_resident_weights_slots_and_the_file(qwen36):
    budget = 8 << 30  # a 21 GB model on 8 GiB
    counts = np.zeros((qwen36.n_layer, qwen36.n_expert), dtype=np.uint64)
    counts[:, 17] = 100
    counts[:, 3] = 50
    tier = ram_tier.plan(qwen36, budget, "--ram", counts)
    assert tier is not None
    assert tier.resident_bytes == ram_tier.resident_bytes(qwen36)
    assert tier.resident_bytes + tier.bank_bytes <= budget
    assert budget - (tier.resident_bytes + tier.bank_bytes) < sum(l.expert_bytes for l in tier.layers)  # spent
    assert [l.il for l in tier.layers] == list(qwen36.moe_layers)
    assert 0.2 < tier.resident_share < 0.5
    first = tier.layers[0]
    assert first.pinned == (17, 3)  # the hottest, by count; experts never routed are not pinned
    k = qwen36.n_expert_used
    assert all(l.n_slots - len(l.pinned) >= 2 * k for l in tier.layers)
    assert tier.n_stage == qwen36.n_expert and tier.stage_bytes == ram_tier.stage_bytes(qwen36)
    assert "read from the model file" in tier.line()


def test_plan_refuses_a_budget_below_the_resident_weights_in_one_line(qwen36):
    with pytest.raises(PlanError) as e:
        ram_tier.plan(qwen36, 1 << 30, "--ram")
    msg = e.value.one_line()
    assert "\n" not in msg and "--ram" in msg and "non-expert weights" in msg
    need = ram_tier.minimum(qwen36)
    assert ram_tier.plan(qwen36, need, "--ram") is not None
    with pytest.raises(PlanError):
        ram_tier.plan(qwen36, need - 1, "--ram")


def _v1_tree(tmp: Path, limit: int, usage: int, inactive: int) -> tuple[Path, Path]:
    root = tmp / "cg"
    d = root / "memory" / "box" / "job"
    d.mkdir(parents=True)
    for path, lim in ((d, limit), (d.parent, memcg_no_limit()), (root / "memory", memcg_no_limit())):
        (path / "memory.limit_in_bytes").write_text(f"{lim}\n")
        (path / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (path / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {inactive}\n")
    proc = tmp / "cgroup"
    proc.write_text("5:cpu:/\n4:memory:/box/job\n0::/\n")
    return proc, root


def memcg_no_limit() -> int:
    return 9223372036854771712


def test_cgroup_v1_headroom_is_limit_less_working_set(tmp_path):
    proc, root = _v1_tree(tmp_path, 700 * MiB, 300 * MiB, 100 * MiB)
    free, where = host_ram.cgroup_free(proc, root)
    assert free == 500 * MiB and where == "memory cgroup /box/job"
    # the process's own resident pages count even when they are still inactive page cache
    assert host_ram.cgroup_free(proc, root, own_rss=350 * MiB)[0] == 350 * MiB


def test_cgroup_v2_takes_the_tightest_ancestor(tmp_path):
    root = tmp_path / "cg"
    child = root / "user.slice" / "spark.scope"
    child.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for d, mx, cur in ((child, "max", 10 * MiB), (child.parent, str(600 * MiB), 200 * MiB)):
        (d / "memory.max").write_text(mx + "\n")
        (d / "memory.current").write_text(f"{cur}\n")
        (d / "memory.stat").write_text(f"inactive_file {50 * MiB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/spark.scope\n")
    free, where = host_ram.cgroup_free(proc, root)
    assert free == 450 * MiB and where == "memory cgroup /user.slice"


def test_no_limited_cgroup_means_none(tmp_path):
    proc, root = _v1_tree(tmp_path, memcg_no_limit(), 300 * MiB, 0)
    assert host_ram.cgroup_free(proc, root) is None
    assert host_ram.cgroup_free(tmp_path / "missing", root) is None


def _greedy(engine, n: int) -> tuple[list[int], np.ndarray]:
    logits = engine.eval(engine.vocab.tokenize("Write a short story about a cat who learns to fly."), logits="last")
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = engine.eval([out[-1]])
    return out, np.array(logits, copy=True)


def _mapped_bytes(path: Path) -> int:
    """Bytes of this process's address space mapped from the file (/proc/self/maps)."""
    real, total = str(Path(path).resolve()), 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == real:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            total += hi - lo
    return total


@pytest.mark.model
def test_file_tier_is_bit_identical_and_reads_the_misses(small_model):
    """Every MoE layer on the CPU with 3 RAM slots of 8 (top-2): misses read from the file, logits
    bit-identical to the same run with every expert mapped (same kernels: plain layout, ubatch 1)."""
    from spark_cli.native.engine import Engine, EngineOptions
    from spark_cli.native.expert_cache import CacheLayer
    from spark_cli.runs.bench import cache_total

    g = load_geometry(small_model)
    base = EngineOptions(small_model, n_ctx=256, n_threads=2, device="none", repack=False, n_ubatch=1)
    with Engine(base) as e:
        ref = _greedy(e, 12)
    cached = dataclasses.replace(base, cache_layers=[CacheLayer(il, 3, (0,)) for il in g.moe_layers], file_tier=True,
                                 file_readers=3)
    before = _mapped_bytes(small_model)  # NOTE: other tests' engines may still map the same file
    with Engine(cached) as e:
        mapped = _mapped_bytes(small_model) - before
        got = _greedy(e, 12)
        st = cache_total(e)
    assert got[0] == ref[0]
    assert np.array_equal(got[1], ref[1])
    eb = g.layers[g.moe_layers[0]].expert_bytes_per_expert
    # only the file tier's expert tensors are left in the mapping: the resident weights moved to
    # anonymous memory, which the kernel cannot reclaim under the cap (and their bytes are unchanged)
    assert 0 < mapped <= eb * g.n_expert * len(g.moe_layers) + 2 * 4096 * 3 * len(g.moe_layers)
    assert st.misses > 0 and st.steps_stock == 0 and st.cpu_experts == 0
    assert st.bytes_uploaded == st.uploads * eb  # every miss and pin read whole from the file


@pytest.mark.model
def test_read_ahead_is_exact_and_replays_as_the_predictor_says(small_model):
    """Read-ahead (one expert a layer, no gate): logits bit-identical to the same tier without it; the
    native reads ahead, and the misses they covered, equal core/prefetch.py's replay of the same
    routing (the predictor's integer arithmetic, learned online); a covered miss is not read again."""
    from spark_cli.core import prefetch
    from spark_cli.core.capture import records_to_trace
    from spark_cli.native.engine import Engine, EngineOptions
    from spark_cli.native.expert_cache import CacheLayer, CacheStats

    g = load_geometry(small_model)
    layers = [CacheLayer(il, 3, (0,)) for il in g.moe_layers]
    base = EngineOptions(small_model, n_ctx=256, n_threads=2, device="none", repack=False, n_ubatch=1,
                         cache_layers=layers, file_tier=True, trace=True)
    with Engine(base) as e:
        ref = _greedy(e, 12)
        trace = records_to_trace(e.cache.trace_records(), g.n_layer, g.n_expert, g.fingerprint)
        off = CacheStats.total(e.cache.stats().values())
    with Engine(dataclasses.replace(base, read_ahead=1)) as e:
        got = _greedy(e, 12)
        on = CacheStats.total(e.cache.stats().values())
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    want = prefetch.replay(trace, {l.il: l.n_slots for l in layers}, {l.il: l.pinned for l in layers},
                           {il: g.layers[il].expert_bytes_per_expert for il in g.moe_layers}, prefetch.AheadParams(1))
    assert on.misses == off.misses == want.misses  # the policy is unchanged, and replayed exactly
    assert on.ahead_reads == want.reads_ahead > 0
    assert on.ahead_used == want.covered > 0
    assert on.uploads == off.uploads - on.ahead_used  # a covered miss is copied, not read


@pytest.mark.model
def test_a_prompt_warms_the_free_slots_as_replayed(small_model):
    """A prompt too large for the RAM slots fills the free ones (its most routed misses) instead of
    only staging them: logits bit-identical to the tier without a RAM limit on its slots (all 8 in
    RAM), the native hits and misses equal the simulator's replay of the same trace with the prompt
    (and core/prefetch.py's decode misses equal it), and the warmed slots cost the decode misses."""
    from spark_cli.core import prefetch
    from spark_cli.core.capture import records_to_trace
    from spark_cli.core.simulator import DEFAULT_POLICY, simulate
    from spark_cli.native.engine import Engine, EngineOptions
    from spark_cli.native.expert_cache import CacheLayer
    from spark_cli.runs.bench import cache_total

    g = load_geometry(small_model)
    whole = EngineOptions(small_model, n_ctx=256, n_threads=2, device="none", repack=False, file_tier=True,
                          cache_layers=[CacheLayer(il, g.n_expert, ()) for il in g.moe_layers])
    with Engine(whole) as e:
        ref = _greedy(e, 10)
    layers = [CacheLayer(il, 4, (0,)) for il in g.moe_layers]
    with Engine(dataclasses.replace(whole, cache_layers=layers, trace=True)) as e:
        got = _greedy(e, 10)
        trace = records_to_trace(e.cache.trace_records(), g.n_layer, g.n_expert, g.fingerprint)
        st = cache_total(e)
    assert got[0] == ref[0] and np.array_equal(got[1], ref[1])
    slots, pinned = {l.il: l.n_slots for l in layers}, {l.il: l.pinned for l in layers}
    sim = simulate(trace, DEFAULT_POLICY, slots, pinned, phases=("prefill", "decode"), ram_tier=True)
    assert trace.n_rows > trace.n_decode  # the prompt is one step, too large for the 3 LRU slots
    assert (st.hits, st.misses) == (sum(l.hits for l in sim.layers.values()), sum(l.misses for l in sim.layers.values()))
    # the pins, the slots the prompt warmed, the decode misses
    assert st.uploads == sum(l.uploads for l in sim.layers.values())
    assert sum(l.admissions - l.admissions_decode for l in sim.layers.values()) > 0
    eb = g.layers[g.moe_layers[0]].expert_bytes_per_expert
    assert st.bytes_uploaded == st.uploads * eb
    ahead = prefetch.replay(trace, slots, pinned, {il: eb for il in slots}, prefetch.AheadParams(0))
    assert ahead.misses == sum(l.misses_decode for l in sim.layers.values())
    cold = simulate(trace.decode_steps(), DEFAULT_POLICY, slots, pinned)  # the slots as a cold start leaves them
    assert sum(l.misses_decode for l in sim.layers.values()) <= sum(l.misses_decode for l in cold.layers.values())


@pytest.mark.model
def test_three_tiers_are_bit_identical_on_the_stand_in(small_model, rpc_server):
    """Three tiers on the RPC stand-in GPU: half the MoE layers resident on the device, a quarter cached
    there (device slots, the CPU miss path), a quarter host layers in the RAM tier (RAM slots, misses
    read from the file). Logits bit-identical to the same placement with every host expert mapped."""
    from spark_cli.native.engine import Engine, EngineOptions
    from spark_cli.native.expert_cache import CacheLayer
    from spark_cli.core.simulator import MissPath
    from spark_cli.runs.bench import cache_total

    g = load_geometry(small_model)
    moe = list(g.moe_layers)
    host, cached = moe[:len(moe) // 4], moe[len(moe) // 4:len(moe) // 2]
    dev = [CacheLayer(il, 4, (), MissPath.CPU) for il in cached]
    base = EngineOptions(small_model, n_ctx=256, n_threads=2, rpc=[rpc_server.endpoint], repack=False, n_ubatch=1,
                         host_layers=host, cache_layers=dev)
    with Engine(base) as e:
        ref = _greedy(e, 12)
    ram = [CacheLayer(il, 3, (1,), in_ram=True) for il in host]
    with Engine(dataclasses.replace(base, cache_layers=[*dev, *ram], file_tier=True, file_readers=2)) as e:
        got = _greedy(e, 12)
        st = e.cache.stats()
    assert got[0] == ref[0]
    assert np.array_equal(got[1], ref[1])
    ram_reads = sum(st[il].uploads for il in host)
    assert ram_reads > len(host) and sum(st[il].cpu_experts for il in host) == 0  # the RAM tier reads its misses
    assert sum(st[il].cpu_experts for il in cached) > 0  # the device tier computes its misses on the CPU


@pytest.mark.model
def test_in_ram_needs_the_file(small_model, rpc_server):
    from spark_cli.errors import NativeError
    from spark_cli.native.engine import Engine, EngineOptions
    from spark_cli.native.expert_cache import CacheLayer

    g = load_geometry(small_model)
    il = g.moe_layers[0]
    base = EngineOptions(small_model, n_ctx=256, n_threads=1, rpc=[rpc_server.endpoint], repack=False)
    with pytest.raises(NativeError, match="file_path"):
        Engine(dataclasses.replace(base, cache_layers=[CacheLayer(il, 4, in_ram=True)]))


@pytest.mark.model
def test_file_tier_refuses_what_it_cannot_serve(small_model, tmp_path):
    from spark_cli.errors import NativeError
    from spark_cli.native.engine import Engine, EngineOptions
    from spark_cli.native.expert_cache import CacheLayer
    from spark_cli.core.simulator import MissPath

    g = load_geometry(small_model)
    il = g.moe_layers[0]
    base = EngineOptions(small_model, n_ctx=256, n_threads=1, device="none", repack=False)
    with pytest.raises(NativeError, match="file tier"):  # the CPU miss path has nothing to compute from
        Engine(dataclasses.replace(base, cache_layers=[CacheLayer(il, 4, (), MissPath.CPU)], file_tier=True))
    with pytest.raises(NativeError, match="GPU-type device"):  # no file: CPU layers are not cached
        Engine(dataclasses.replace(base, cache_layers=[CacheLayer(il, 4)]))
    with pytest.raises(NativeError, match="RAM budget"):
        Engine(dataclasses.replace(base, cache_layers=[CacheLayer(il, 4)], file_tier=True, host_budget=MiB))


def _cgroup_or_skip() -> None:
    try:
        memcg.make(256 * MiB, "spark-test-probe").remove()
    except memcg.CgroupError as e:
        pytest.skip(f"no memory cgroup can be made here: {e.one_line()}")


@pytest.mark.model
def test_capped_run_is_exact_reads_less_than_stock_and_stays_under_the_cap(small_model):
    """The small model (447 MB file) in a 430 MiB cgroup: Spark finds the cap itself, runs the RAM tier,
    gives stock's tokens and reads fewer bytes from the disk; the cgroup's peak is within the cap."""
    from spark_cli.runs import ram_bench

    _cgroup_or_skip()
    cap = 430 * MiB
    b = ram_bench.run(small_model, cap, reps=1, n_prompt=64, n_gen=16, threads=2, n_ctx=256,
                      configs=("stock", "spark"))
    stock, spark = b.of("stock"), b.of("spark")
    assert len(stock) == 1 and len(spark) == 1, [r.error for r in b.runs]
    assert b.exact() is True
    assert 0 < spark[0].resident_share < 1, spark[0].tier
    assert spark[0].file_bytes_per_token > 0
    assert spark[0].read_bytes_per_token < stock[0].read_bytes_per_token
    assert all(r.peak <= cap and r.oom_kills == 0 for r in b.runs)


def test_bench_cap_is_enforced_by_the_cgroup(tmp_path):
    """A process that allocates past the cap is stopped by the cgroup, and the peak stays within it."""
    import sys

    _cgroup_or_skip()
    cap = 64 * MiB
    with memcg.make(cap, "spark-test-cap") as cg:
        p = cg.run([sys.executable, "-c", "b = bytearray(200 << 20); print(len(b))"], capture_output=True)
        assert p.returncode != 0
        assert 0 < cg.peak() <= cap
        assert cg.oom_kills() >= 1


@pytest.fixture
def plan_cli(monkeypatch, capsys, tmp_path):
    from conftest import cli_runner
    from spark_cli.commands import plan as plan_cmd

    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    return cli_runner(monkeypatch, capsys, "plan", plan_cmd.register)


def test_plan_on_a_fixture_bigger_than_ram_places_and_prices_the_tiers(plan_cli, qwen36, tmp_path):
    """spark plan --ram on the 21 GB Qwen3.6 header: RAM (resident + slots), the file; the profile's
    trace replayed into bytes per token, priced by the disk once it is known."""
    import json

    from spark_cli.core.cost_model import DiskCosts
    from spark_cli.core.trace import DECODE, TraceBuilder
    from spark_cli.runs import disk_costs
    from spark_cli.runs.disk_costs import READERS

    path = Path(qwen36.path)
    rc, out, err = plan_cli(path, "--ram", "12GiB")
    assert rc == 0, err
    assert "RAM:" in out and "file:" in out and "no decode routing" in out
    # a recorded trace: every token routes to the same 8 experts of each layer, but for one that changes
    b = TraceBuilder(n_layer=qwen36.n_layer, k=qwen36.n_expert_used, n_expert=qwen36.n_expert,
                     fingerprint=qwen36.fingerprint)
    for t in range(40):
        for il in qwen36.moe_layers:
            b.add(il, 1, 8, "decode", np.array([[0, 1, 2, 3, 4, 5, 6, 8 + t]], dtype=np.int32))
    tr = tmp_path / "t.npz"
    b.build().save(tr)
    disk = DiskCosts(disk_costs.read_size(qwen36), READERS, 2e9, 1e-4)
    kept = disk_costs.cache_file(tmp_path / "home", path, disk.read_bytes, READERS)
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps(dataclasses.asdict(disk)))
    rc, out, err = plan_cli(path, "--ram", "12GiB", "--trace", tr, "--json")
    assert rc == 0, err
    d = json.loads(out)["ram_tier"]
    assert d["resident_bytes"] + d["bank_bytes"] <= 12 << 30 and 0 < d["resident_share"] < 1
    assert d["file_bytes"] > 0
    n_moe = len(qwen36.moe_layers)
    # 40 tokens, each with one new expert a layer: every one a miss (slots >> 8: nothing evicted)
    assert d["misses_per_token"] == pytest.approx(n_moe * (40 + 7) / 40)
    assert d["miss_steps_per_token"] == pytest.approx(n_moe)  # every layer's step misses, each waits its reads
    eb = np.mean([qwen36.layers[il].expert_bytes_per_expert for il in qwen36.moe_layers])
    assert d["file_bytes_per_token"] == pytest.approx(d["misses_per_token"] * eb)
    assert d["disk_bound_tok_s"] == pytest.approx(2e9 / d["file_bytes_per_token"])
    # read-ahead, as chat would decide it: no uncapped speed kept for this model yet
    assert d["read_ahead"]["ahead"] == 0 and "uncapped speed" in d["read_ahead"]["why"]


@pytest.mark.model
def test_bench_refuses_a_cap_it_cannot_run_under_in_one_line(monkeypatch, capsys, small_model):
    from conftest import cli_runner
    from spark_cli.commands import bench as bench_cmd

    run = cli_runner(monkeypatch, capsys, "bench", bench_cmd.register)
    for cap in ("garbage", "1MiB"):
        rc, out, err = run(small_model, "-dev", "none", "--ram", cap)
        assert rc != 0 and "--ram" in err and len(err.strip().splitlines()) == 1, err


def test_ram_fit_moves_cached_layers_to_the_host_until_the_host_weights_fit(qwen36):
    """--vram 8GiB places every layer it cannot hold whole as cached; with --ram the cached layers'
    experts (kept whole in RAM) must fit: the lowest-numbered go to the host (RAM slots, the file)."""
    from spark_cli.core import planner

    req = planner.PlanRequest(8 << 30, 8192)
    free = planner.plan_for(qwen36, req).plan

    def tiers(plan):
        return ([l.index for l in plan.layers if l.mode == "cached"], [l.index for l in plan.layers if l.mode == "host"])

    cached0, host0 = tiers(free)
    need0 = ram_tier.three_tier_need(qwen36, cached0, host0)
    ram = need0 // 2
    fitted = planner.plan_for(qwen36, dataclasses.replace(req, ram_bytes=ram)).plan
    cached, host = tiers(fitted)
    assert ram_tier.three_tier_need(qwen36, cached, host) <= ram < need0
    assert len(cached) < len(cached0) and len(host) > len(host0)
    assert min(host) < min(cached)  # stock's order: the lowest-numbered layers on the host
    assert fitted.breakdown["total"] <= 8 << 30
    with pytest.raises(PlanError, match="--ram"):
        planner.plan_for(qwen36, dataclasses.replace(req, ram_bytes=ram_tier.three_tier_need(qwen36, [], [])))


def test_ram_fit_keeps_the_placement_its_last_round_fitted(qwen36, monkeypatch):
    """A placement that fits after the last round of moves is the plan, not a refusal (the loop checks a
    round's placement at the next round's start: the last one is checked after it)."""
    from spark_cli.core import planner

    req = planner.PlanRequest(8 << 30, 8192)
    free = planner.plan_for(qwen36, req).plan
    cached = [l.index for l in free.layers if l.mode == "cached"]
    ram = ram_tier.three_tier_need(qwen36, cached, [l.index for l in free.layers if l.mode == "host"]) // 2
    calls = []
    real = planner._plan_device
    monkeypatch.setattr(planner, "_plan_device", lambda g, r: calls.append(r.forced_host) or real(g, r))
    strict = dataclasses.replace(req, ram_bytes=ram, ram_strict=True)
    planner.plan_for(qwen36, strict)
    rounds = len(set(calls)) - 1  # the placements the fit made after the first: its rounds of moves
    assert rounds >= 1
    monkeypatch.setattr(planner, "MAX_RAM_ROUNDS", rounds)  # exactly as many: the last is the one that fits
    fitted = planner.plan_for(qwen36, strict).plan
    tiers = [[l.index for l in fitted.layers if l.mode == m] for m in ("cached", "host")]
    assert ram_tier.three_tier_need(qwen36, *tiers) <= ram


def test_plan_with_vram_and_ram_prints_three_tiers(plan_cli, qwen36):
    import json

    path = Path(qwen36.path)
    rc, out, err = plan_cli(path, "--vram", "8GiB", "--ram", "6GiB", "-c", "8192")
    assert rc == 0, err
    assert "device:" in out and "RAM:" in out and "file:" in out and "host layers" in out
    rc, out, err = plan_cli(path, "--vram", "8GiB", "--ram", "6GiB", "-c", "8192", "--json")
    assert rc == 0, err
    d = json.loads(out)["ram_tier"]
    assert 0 < d["device_share"] < 1 and d["file_bytes"] > 0
    assert d["resident_bytes"] + d["bank_bytes"] <= 6 << 30
    rc, out, err = plan_cli(path, "--vram", "8GiB", "--ram", "64MiB", "-c", "8192")
    assert rc != 0 and "--ram" in err and len(err.strip().splitlines()) == 1, err


def test_ram_residency_cap_leaves_that_share_of_the_tier_experts(qwen36):
    """--ram-residency SHARE: at that cap Spark's own budget (cgroup headroom less the runtime, the
    measured KV cache and compute buffers and the margin) gives the RAM tier SHARE of its experts."""
    from spark_cli.runs.ram_bench import DeviceShape, RamRun, residency_cap
    from spark_cli.runs.session import RAM_MARGIN

    bill = {"model": qwen36.total_expert_bytes + ram_tier.resident_bytes(qwen36), "context": 1 << 30,
            "compute": 1 << 29}
    base = RamRun("base", True, rss_runtime=300 << 20, host_bill=bill)
    for share in (0.4, 0.6):
        cap = residency_cap(qwen36, base, share)
        budget = cap - base.rss_runtime - bill["context"] - bill["compute"] - RAM_MARGIN
        tier = ram_tier.plan(qwen36, budget, "test")
        assert tier is not None and tier.resident_share == pytest.approx(share, abs=0.01)
    dev = DeviceShape("127.0.0.1:1", 10)
    host = [il for il in qwen36.moe_layers if il < 10]
    cap = residency_cap(qwen36, base, 0.5, dev)
    resident = bill["model"] - ram_tier.expert_bytes(qwen36, host)
    budget = cap - base.rss_runtime - bill["context"] - bill["compute"] - RAM_MARGIN
    tier = ram_tier.plan(qwen36, budget, "test", layers=host, resident=resident)
    assert tier is not None and tier.resident_share == pytest.approx(0.5, abs=0.01)
