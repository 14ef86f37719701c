"""Whether a CPU run whose weights do not fit its RAM uses Spark's RAM tier or stock's mapping and the
kernel's page cache, decided before it loads: whichever the cost model prices faster.

Both are priced on the profile's recent decode routing from the uncapped token's time
(runs/read_ahead.uncapped_tg):
- the tier: the routing replayed through its slots (ram_tier.replay), each miss read at the disk's
  measured rate (runs/disk_costs.py);
- the page cache: the routing replayed through the kernel's lists with the disk's read-around
  window (core/page_cache.py), the bytes read at the rate measured faulting through a mapping
  (disk_costs, faults=True), the page cache holding what the tier's budget holds besides the
  resident weights.

The page cache wins where read-around is narrow and the cache holds most of the routed experts; the
tier where wide read-around windows (a large `read_ahead_kb`) read and evict experts nobody routed.
The tier runs unless the page cache is predicted MIN_GAIN faster; where a figure is missing it runs,
and says which figure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..core import page_cache, ram_tier
from ..core.cost_model import DiskCosts, file_tier_tg
from ..core.gguf_info import ModelGeometry, tensor_offsets
from ..core.trace import RoutingTrace
from . import disk_costs

MIN_GAIN = 0.05  # the page cache's predicted tg gain over the tier below which the tier runs


@dataclass(frozen=True)
class TierDecision:
    """use_tier: run the RAM tier (False: the mapping, as stock); line: what was decided and why."""

    use_tier: bool
    line: str
    tier_tg: float | None = None
    page_cache_tg: float | None = None


def page_cache_bytes_per_token(model: Path, geometry: ModelGeometry, layers: list[int], trace: RoutingTrace,
                               capacity: int) -> float | None:
    """Bytes per decode token that stock's page cache reads from the model file when it can hold
    `capacity` bytes of these layers' experts (core/page_cache.py, the disk's own read-around window)."""
    offs = tensor_offsets(model)
    slices = [page_cache.ExpertSlices(il, tuple((offs[t.name], t.bytes_per_expert) for t in geometry.layers[il].experts))
              for il in layers]
    window = page_cache.read_ahead_window(os.stat(model).st_dev)[0]
    return page_cache.bytes_read_per_token(trace, slices, capacity, window, os.path.getsize(model))


def page_cache_tg(base_tg: float, bytes_per_token: float, faults: DiskCosts) -> float:
    """tok/s of stock under the cap: the uncapped token plus its page-cache reads at the fault rate."""
    return 1.0 / (1.0 / base_tg + bytes_per_token / faults.bytes_per_s)


def prefers_mapping(tier_tg: float, page_cache_tg: float) -> bool:
    """The rule: the mapping only where the page cache is predicted MIN_GAIN faster than the tier."""
    return page_cache_tg >= tier_tg * (1.0 + MIN_GAIN)


def fault_costs(model: Path, geometry: ModelGeometry, threads: int | None, home: Path) -> DiskCosts | None:
    """The kept fault rate through a mapping at -t's depth (the compute threads fault), or None."""
    return disk_costs.kept(model, disk_costs.read_size(geometry), threads or os.cpu_count() or 1, home, faults=True)


def tier(why: str) -> TierDecision:
    return TierDecision(True, f"RAM tier: on ({why})")


def decide(model: Path, geometry: ModelGeometry, t: ram_tier.RamTier, trace: RoutingTrace | None,
           base_tg: float | None, stock_tg: float | None, threads: int | None, home: Path) -> TierDecision:
    """The RAM tier, or the mapping where the cost model prices the page cache MIN_GAIN faster on `trace`
    (each from its own uncapped speed: the tier's `base_tg`, the mapping's `stock_tg`)."""
    if trace is None or trace.n_decode == 0:
        return tier("the page cache was not priced: the profile keeps no decode routing steps (spark profile "
                    "MODEL --corpus PATH --gen N records them)")
    disk = disk_costs.kept(model, disk_costs.read_size(geometry), disk_costs.READERS, home)
    faults = fault_costs(model, geometry, threads, home)
    if disk is None or faults is None or not base_tg or not stock_tg:
        return tier("the page cache was not priced: the disk's read and fault rates and the uncapped speed on this "
                    "model and -t are measured by spark bench MODEL --ram-residency 0.6")
    m = ram_tier.replay(t, trace) or ram_tier.DecodeMisses(0.0, 0.0)
    tier_tg = 1.0 / file_tier_tg(1.0 / base_tg, m.per_token, ram_tier.mean_expert_bytes(t), disk,
                                 miss_steps_per_token=m.steps_per_token)
    read = page_cache_bytes_per_token(model, geometry, [l.il for l in t.layers], trace,
                                      max(0, t.budget - t.resident_bytes))
    mapped_tg = page_cache_tg(stock_tg, read or 0.0, faults)
    window = page_cache.read_ahead_window(os.stat(model).st_dev)[0]
    prices = (f"the cost model: {tier_tg:.1f} tok/s with the tier, {mapped_tg:.1f} with the page cache at a "
              f"{window >> 10} KiB read-around window")
    if prefers_mapping(tier_tg, mapped_tg):
        return TierDecision(False, f"RAM tier: off, the model file is mapped as stock maps it, without repacking ({prices})",
                            tier_tg, mapped_tg)
    return TierDecision(True, f"RAM tier: on ({prices})", tier_tg, mapped_tg)
