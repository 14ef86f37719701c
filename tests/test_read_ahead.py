"""runs/read_ahead.py: chat and serve read ahead where the cost model, on the profile's routing, the
kept disk costs and the uncapped speed, prices it faster; off, saying which figure is missing, else."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from spark_cli.core import prefetch
from spark_cli.core.cost_model import DiskCosts
from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.ram_tier import RamLayer, RamTier
from spark_cli.core.trace import RoutingTrace
from spark_cli.native.engine import EngineOptions
from spark_cli.runs import disk_costs, read_ahead, session

E, K, N_LAYER, EB = 16, 4, 4, 1_000_000


@pytest.fixture(scope="module")
def model():
    from spark_cli.models.fixtures import build_fixture

    path = build_fixture("qwen3.6-35b-a3b-q4_k_m")
    return Path(path), load_geometry(path)


def _trace(ids: np.ndarray) -> RoutingTrace:
    n = ids.shape[0]
    return RoutingTrace(ids, np.ones(n, np.uint8), np.arange(n, dtype=np.int32), E, "synthetic")


def _mapped(rng: np.random.Generator, n: int) -> RoutingTrace:
    """Layer 0 random; layer l+1 routes perm[a] for each a layer l routes: predictable."""
    perm = rng.permutation(E)
    ids = np.empty((n, N_LAYER, K), np.int64)
    for t in range(n):
        ids[t, 0] = rng.choice(E, K, replace=False)
        for l in range(1, N_LAYER):
            ids[t, l] = perm[ids[t, l - 1]]
    return _trace(ids)


def _random(rng: np.random.Generator, n: int) -> RoutingTrace:
    return _trace(np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(N_LAYER)]) for _ in range(n)]))


TIER = RamTier(0, "test", 0, tuple(RamLayer(il, 8, (), EB) for il in range(N_LAYER)), N_LAYER * E * EB, 0, 0)


def _keep_disk(home: Path, path: Path, g, bytes_per_s: float = 1e9) -> DiskCosts:
    """A kept disk figure: 1 ms to read one EB-byte expert at 1 GB/s."""
    disk = DiskCosts(disk_costs.read_size(g), disk_costs.READERS, bytes_per_s, 1e-3)
    f = disk_costs.cache_file(home, path, disk.read_bytes, disk.depth)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(dataclasses.asdict(disk)))
    return disk


def test_reads_ahead_where_the_next_layer_is_predictable_and_its_compute_hides_the_reads(model, tmp_path):
    path, g = model
    disk = _keep_disk(tmp_path, path, g)
    d = read_ahead.decide(path, g, TIER, _mapped(np.random.default_rng(1), 300), 50.0, tmp_path)  # 5 ms a layer
    assert d.ahead == 1, d.line
    assert d.min_prob == prefetch.break_even(EB, disk, 1 / 50.0 / N_LAYER)
    assert "one expert a layer" in d.line and "misses read ahead" in d.line


def test_stays_off_where_it_does_not_pay(model, tmp_path):
    path, g = model
    _keep_disk(tmp_path, path, g)
    d = read_ahead.decide(path, g, TIER, _random(np.random.default_rng(2), 300), 2000.0, tmp_path)  # 0.125 ms a layer
    assert d.ahead == 0 and d.min_prob == 0
    assert "the cost model gives it" in d.line


def test_stays_off_and_says_which_figure_is_missing(model, tmp_path):
    path, g = model
    mapped = _mapped(np.random.default_rng(3), 100)
    assert "no decode routing steps" in read_ahead.decide(path, g, TIER, None, 50.0, tmp_path).line
    no_disk = read_ahead.decide(path, g, TIER, mapped, 50.0, tmp_path)
    assert no_disk.ahead == 0 and "read speed" in no_disk.line and "spark bench" in no_disk.line
    _keep_disk(tmp_path, path, g)
    no_base = read_ahead.decide(path, g, TIER, mapped, None, tmp_path)
    assert no_base.ahead == 0 and "uncapped speed" in no_base.line


def test_the_uncapped_speed_is_kept_per_model_and_threads(tmp_path):
    read_ahead.keep_uncapped(tmp_path, "f" * 32, 2, 37.5, 45.0)
    assert read_ahead.kept_uncapped(tmp_path, "f" * 32, 2) == 37.5
    assert read_ahead.kept_uncapped(tmp_path, "f" * 32, 2, stock=True) == 45.0
    read_ahead.keep_uncapped(tmp_path, "f" * 32, 3, 30.0, None)  # stock's not measured: Spark's stands in
    assert read_ahead.kept_uncapped(tmp_path, "f" * 32, 3, stock=True) == 30.0
    assert read_ahead.kept_uncapped(tmp_path, "f" * 32, 1) is None
    assert read_ahead.kept_uncapped(tmp_path, "e" * 32, 2) is None


def test_the_engine_options_carry_the_decision(tmp_path):
    base = EngineOptions(model_path=tmp_path / "m.gguf")
    on = session.with_ram_tier(base, TIER, None, read_ahead.AheadDecision(1, 1234, "x"))
    assert on.file_tier and (on.read_ahead, on.ahead_min_prob) == (1, 1234)
    off = session.with_ram_tier(base, TIER, None, read_ahead.off("test"))
    assert off.file_tier and (off.read_ahead, off.ahead_min_prob) == (0, 0)
    assert session.with_ram_tier(base, None, None, read_ahead.AheadDecision(1, 1, "x")) is base
