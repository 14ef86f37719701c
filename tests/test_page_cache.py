"""Stock's page cache under a RAM cap, simulated (core/page_cache.py), and the fault costs it is priced with."""

from __future__ import annotations

import os

import numpy as np
import pytest

from spark_cli.core import page_cache
from spark_cli.core.trace import DECODE, RoutingTrace

CH = page_cache.CHUNK


def _trace(steps: list[list[int]], n_expert: int = 8) -> RoutingTrace:
    """One MoE layer (layer 0), one row per decode step with these routed experts."""
    k = max(len(s) for s in steps)
    ids = np.full((len(steps), 1, k), -1, dtype=np.int16)
    for i, s in enumerate(steps):
        ids[i, 0, :len(s)] = s
    return RoutingTrace(ids, np.full(len(steps), DECODE, np.uint8), np.arange(len(steps), dtype=np.int32), n_expert, "t")


# one expert tensor of 8 experts, one chunk each, at chunk 4 of a 16-chunk file
LAYER = [page_cache.ExpertSlices(0, ((4 * CH, CH),))]
SIZE = 16 * CH


def test_a_cache_that_holds_the_working_set_reads_nothing_in_the_steady_state():
    t = _trace([[0, 1], [1, 2], [0, 2]])
    assert page_cache.bytes_read_per_token(t, LAYER, 8 * CH, CH, SIZE) == 0


def test_a_cache_too_small_reads_every_miss_and_the_window_reads_the_neighbours():
    t = _trace([[0], [3], [6]])  # three experts, a cache of one chunk: each step misses
    one = page_cache.bytes_read_per_token(t, LAYER, CH, CH, SIZE)
    assert one == CH
    # a two-chunk window reads a neighbour with each miss (the windows do not overlap); a two-chunk
    # cache holds one window, so each step still misses
    wide = page_cache.bytes_read_per_token(t, LAYER, 2 * CH, 2 * CH, SIZE)
    assert wide == 2 * CH


def test_read_around_pollution_costs_hits_that_a_narrow_window_keeps():
    """A hot expert touched every step, a cold one at a different place each step: with a narrow window
    the hot one stays; with a window as wide as the cache, the neighbours read around the cold misses
    push it out, and it is read again."""
    t = _trace([[0, c] for c in (2, 4, 6, 3, 5, 7)])
    narrow = page_cache.bytes_read_per_token(t, LAYER, 4 * CH, CH, SIZE)
    wide = page_cache.bytes_read_per_token(t, LAYER, 4 * CH, 4 * CH, SIZE)
    assert narrow == CH  # the cold expert only
    assert wide > 2 * CH


def test_no_decode_steps_is_none():
    t = RoutingTrace(np.zeros((1, 1, 1), np.int16), np.zeros(1, np.uint8), np.zeros(1, np.int32), 8, "t")
    assert page_cache.bytes_read_per_token(t, LAYER, CH, CH, SIZE) is None


def test_read_ahead_window_comes_from_sysfs_or_is_the_kernel_default(tmp_path):
    got, where = page_cache.read_ahead_window(os.stat(tmp_path).st_dev)
    assert got > 0 and got % 4096 == 0
    if "read_ahead_kb" in where:
        assert got == int(open(where).read()) << 10
    else:
        assert got == page_cache.KERNEL_DEFAULT_WINDOW
    assert page_cache.read_ahead_window(os.makedev(0, 9999))[0] == page_cache.KERNEL_DEFAULT_WINDOW


@pytest.mark.model
def test_fault_costs_count_the_bytes_the_kernel_read(small_model):
    """Faulting a slice in through the mapping reads at least the slice (its read-around too), and the
    figure is kept under its own name, apart from the pread figure."""
    from spark_cli.runs import disk_costs

    c = disk_costs.measure(small_model, 64 << 10, 2, n=8, faults=True)
    assert c.bytes_per_s > 0 and c.latency_s > 0 and c.depth == 2
    home = small_model.parent / "home-for-names"
    assert disk_costs.cache_file(home, small_model, 4096, 2, faults=True).name.startswith("fault-costs-")
    assert disk_costs.cache_file(home, small_model, 4096, 2).name.startswith("disk-costs-")


@pytest.mark.model
def test_bench_remeasures_the_disk_in_place_of_the_kept_figure(small_model, tmp_path):
    """A shared disk's speed drifts: remeasure (what spark bench --ram calls) measures now and keeps
    that figure in place of an older one, which chat and serve then read."""
    import dataclasses
    import json

    from spark_cli.core.cost_model import DiskCosts
    from spark_cli.runs import disk_costs

    stale = DiskCosts(64 << 10, 2, 1.0, 9.0)  # 1 byte/s: no disk is this slow
    f = disk_costs.cache_file(tmp_path, small_model, stale.read_bytes, stale.depth)
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps(dataclasses.asdict(stale)))
    assert disk_costs.kept(small_model, stale.read_bytes, stale.depth, tmp_path) == stale
    got = disk_costs.remeasure(small_model, stale.read_bytes, stale.depth, tmp_path)
    assert got.bytes_per_s > 1e3 and got.latency_s < 9.0
    assert disk_costs.kept(small_model, stale.read_bytes, stale.depth, tmp_path) == got


@pytest.mark.model
def test_stock_prediction_is_the_uncapped_speed_when_the_cache_holds_every_expert(small_model):
    """ram_bench.predict_stock_tg: a cap that holds every expert predicts the uncapped speed; a cap
    that holds few predicts less, by the bytes the replay reads at the measured fault rate."""
    from spark_cli.core.cost_model import DiskCosts
    from spark_cli.core.gguf_info import load_geometry
    from spark_cli.runs import ram_bench

    g = load_geometry(small_model)
    rng = np.random.default_rng(0)
    trace = [[il, rng.choice(g.n_expert, g.n_expert_used, replace=False).tolist()] for _ in range(16) for il in g.moe_layers]
    bill = {"model": g.file_size, "context": 8 << 20, "compute": 8 << 20, "total": g.file_size + (16 << 20)}
    base = ram_bench.RamRun("base", True, tg_tok_s=40.0, trace=trace, rss_runtime=100 << 20, host_bill=bill)
    faults = DiskCosts(4096, 2, 100e6, 0.001)
    roomy = ram_bench.predict_stock_tg(small_model, g, base, 50.0, 4 * g.file_size, faults)
    assert roomy == pytest.approx(50.0)  # stock's own uncapped speed, not Spark's traced base's
    tight_cap = (100 << 20) + (16 << 20) + (g.file_size - sum(g.layers[il].expert_bytes for il in g.moe_layers)) \
        + sum(g.layers[il].expert_bytes for il in g.moe_layers) // 4
    read = ram_bench.stock_bytes_per_token(small_model, g, base, tight_cap)
    assert read > 0
    assert ram_bench.predict_stock_tg(small_model, g, base, 50.0, tight_cap, faults) == pytest.approx(1 / (1 / 50 + read / 100e6))
