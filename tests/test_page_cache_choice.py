"""runs/page_cache_choice.py: a CPU run over its RAM runs the RAM tier, or stock's mapping where the cost
model prices the page cache faster (narrow read-around, a cache that holds most routed experts)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from spark_cli.core import page_cache, ram_tier
from spark_cli.core.cost_model import DiskCosts
from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.options import LoadFlags
from spark_cli.core.trace import RoutingTrace
from spark_cli.runs import disk_costs, page_cache_choice, session

@pytest.fixture(scope="module")
def setup(small_model):
    g = load_geometry(small_model)
    tier = ram_tier.plan(g, ram_tier.resident_bytes(g) + g.total_expert_bytes // 2, "test")
    rng = np.random.default_rng(0)
    hot = rng.permutation(g.n_expert)[:g.n_expert // 2 + 1]  # a skewed routing: most tokens from a few experts
    ids = np.stack([np.stack([rng.choice(hot, g.n_expert_used, replace=False) for _ in range(g.n_layer)])
                    for _ in range(32)])
    trace = RoutingTrace(ids, np.ones(32, np.uint8), np.arange(32, dtype=np.int32), g.n_expert, g.fingerprint)
    return Path(small_model), g, tier, trace


def _keep(home: Path, path: Path, g, faults: bool, bytes_per_s: float, depth: int) -> None:
    c = DiskCosts(disk_costs.read_size(g), depth, bytes_per_s, 1e-3)
    f = disk_costs.cache_file(home, path, c.read_bytes, c.depth, faults=faults)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(dataclasses.asdict(c)))


def _window(monkeypatch, size: int) -> None:
    monkeypatch.setattr(page_cache, "read_ahead_window", lambda dev: (size, "test"))


@pytest.mark.model
def test_narrow_read_around_and_room_for_the_hot_experts_choose_the_mapping(setup, tmp_path, monkeypatch):
    """A narrow window, a page cache that holds the staging slices' bytes too, and faults served faster
    than the tier's reads (a disk whose read-around is cheap): the mapping."""
    path, g, tier, trace = setup
    _window(monkeypatch, 128 << 10)
    _keep(tmp_path, path, g, False, 1e9, disk_costs.READERS)
    _keep(tmp_path, path, g, True, 3e9, 2)
    d = page_cache_choice.decide(path, g, tier, trace, 40.0, 40.0, 2, tmp_path)
    assert not d.use_tier, d.line
    assert d.page_cache_tg > d.tier_tg * (1 + page_cache_choice.MIN_GAIN)
    assert "mapped as stock maps it" in d.line and "128 KiB" in d.line


@pytest.mark.model
def test_wide_read_around_keeps_the_tier(setup, tmp_path, monkeypatch):
    """A read-around window as large as a layer's expert tensors: each page-cache miss reads and evicts
    experts nobody routed, and the tier's exact reads win."""
    path, g, tier, trace = setup
    _window(monkeypatch, 64 << 20)
    _keep(tmp_path, path, g, False, 1e9, disk_costs.READERS)
    _keep(tmp_path, path, g, True, 1e9, 2)
    d = page_cache_choice.decide(path, g, tier, trace, 40.0, 40.0, 2, tmp_path)
    assert d.use_tier, d.line
    assert d.tier_tg > d.page_cache_tg
    # each is priced from its own uncapped speed: a faster stock raises the mapping's price only
    faster = page_cache_choice.decide(path, g, tier, trace, 40.0, 80.0, 2, tmp_path)
    assert faster.tier_tg == d.tier_tg and faster.page_cache_tg > d.page_cache_tg


@pytest.mark.model
def test_a_missing_figure_keeps_the_tier_and_says_how_to_measure_it(setup, tmp_path):
    path, g, tier, trace = setup
    _keep(tmp_path, path, g, False, 1e9, disk_costs.READERS)  # no fault rate kept
    d = page_cache_choice.decide(path, g, tier, trace, 40.0, 40.0, 2, tmp_path)
    assert d.use_tier and "spark bench MODEL --ram-residency" in d.line
    d = page_cache_choice.decide(path, g, tier, None, 40.0, 40.0, 2, tmp_path)
    assert d.use_tier and "spark profile" in d.line


@pytest.mark.model
def test_an_explicit_ram_budget_keeps_the_tier(setup):
    path, g, tier, _ = setup
    d = session.resolve_tier_choice(path, g, session.ProfileInfo(path, None), LoadFlags(ram=1 << 30), tier, None)
    assert d.use_tier and "--ram" in d.line


def _bench(stock_pred: float, spark_pred: float):
    from spark_cli.runs import ram_bench

    tokens = [1, 2, 3]
    runs = [ram_bench.RamRun("stock", True, tokens=tokens, tg_tok_s=20.0, pp_tok_s=50.0, predicted_tg_tok_s=stock_pred),
            ram_bench.RamRun("spark", True, tokens=tokens, tg_tok_s=16.0, pp_tok_s=50.0, predicted_tg_tok_s=spark_pred)]
    return ram_bench.RamBench(700 << 20, runs)


def test_the_bench_verdict_says_spark_maps_the_file_where_the_page_cache_is_predicted_faster():
    from spark_cli.commands import bench_ram

    mapped = bench_ram.verdict(_bench(28.0, 19.0))
    assert bench_ram.mapping_chosen(_bench(28.0, 19.0))
    assert "Spark maps the file as stock does (1.00x)" in mapped and "0.80x stock's tg" in mapped
    tier = bench_ram.verdict(_bench(19.5, 19.0))  # within MIN_GAIN: the tier
    assert not bench_ram.mapping_chosen(_bench(19.5, 19.0))
    assert "Spark generates 0.80x stock's speed" in tier


@pytest.mark.model
def test_the_mapping_chosen_keeps_the_weights_in_the_mapping(setup, monkeypatch):
    """Where the page cache is chosen for weights that do not fit RAM, the run maps them as stock with
    --no-repack: repacking would copy every expert out of the mapping into memory the run does not have."""
    path, g, tier, _ = setup
    monkeypatch.setattr(session, "resolve_ram_tier", lambda *a: tier)
    flags = LoadFlags(device="none")
    info = session.ProfileInfo(path, None)
    for use_tier in (False, True):
        decision = page_cache_choice.TierDecision(use_tier, "test", 1.0, 2.0)
        monkeypatch.setattr(session, "resolve_tier_choice", lambda *a: decision)
        where = session.resolve_placement(path, g, info, flags, plan_path=None, vram_text=None)
        assert (where.ram is None, where.mapped) == (not use_tier, not use_tier)
        opts = session.with_ram_tier(session.engine_options(path, g, where.plan, flags, n_ctx=where.n_ctx, learn=False),
                                     where.ram, g, where.ahead, where.mapped)
        assert opts.repack == use_tier and opts.file_tier == use_tier


@pytest.mark.model
def test_a_device_plan_prices_its_host_layers_tier_against_the_page_cache(setup, rpc_server, monkeypatch):
    """Three tiers: a device plan whose host layers do not fit RAM prices their RAM tier against the page
    cache from the plan's priced tg; where the mapping wins the plan runs as planned, its host weights
    mapped and not repacked, and the run says why."""
    path, g, tier, trace = setup
    monkeypatch.setattr(session, "resolve_device_ram_tier", lambda *a: tier)
    seen = []

    def decide(model, geometry, t, tr, base_tg, stock_tg, threads, home):
        seen.append((t, base_tg, stock_tg))
        return page_cache_choice.TierDecision(False, "RAM tier: off, test", 1.0, 2.0)

    monkeypatch.setattr(page_cache_choice, "decide", decide)
    from spark_cli.core import planner

    flags = LoadFlags(rpc=rpc_server.endpoint, ctx_size=512)
    vram = str(planner.fixed_bytes(g, 512) + g.total_expert_bytes // 2 + (8 << 20))
    where = session.resolve_placement(path, g, session.ProfileInfo(path, None), flags, plan_path=None, vram_text=vram)
    priced = (where.plan.predicted or {}).get("tg_tok_s")
    assert seen == [(tier, priced, priced)]
    assert where.ram is None and where.mapped and "RAM tier: off, test" in where.warnings
    opts = session.with_ram_tier(session.engine_options(path, g, where.plan, flags, n_ctx=where.n_ctx, learn=False),
                                 where.ram, g, where.ahead, where.mapped)
    assert not opts.repack and not opts.file_tier and opts.cache_layers  # the plan's device cache, as planned
