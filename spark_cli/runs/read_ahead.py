"""Whether a run's RAM tier reads ahead (core/prefetch.py), decided before it loads: the profile's
recent decode routing replayed through the tier's slots with and without one expert a layer read
ahead at the break-even gate (prefetch.choose_ahead), each priced by the cost model with the disk
as measured (runs/disk_costs.py) and the uncapped token's time. Read-ahead runs only where the
model predicts it gains at least MIN_GAIN: `spark bench --ram` measured it between 0.95x and 1.23x
by threads and share, so a small predicted gain is within what the model cannot tell apart.

The uncapped token's time: a device plan's priced tg; for a CPU run, the uncapped speed `spark
bench --ram` measured on this model and thread count, kept under SPARK_HOME/calibration
(`keep_uncapped`). Where a figure is missing the run does not read ahead, and says which.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core import prefetch, ram_tier
from ..core.gguf_info import ModelGeometry
from ..core.trace import RoutingTrace
from ..files.atomic import atomic_write_text
from . import disk_costs

MIN_GAIN = 0.05  # predicted tg gain below which read-ahead stays off


@dataclass(frozen=True)
class AheadDecision:
    """ahead: experts read ahead per RAM-tier layer and step (0: off), min_prob its gate (prefetch's
    fixed point); line: what was decided and why, for the run's warnings."""

    ahead: int
    min_prob: int
    line: str


@dataclass(frozen=True)
class UncappedSpeed:
    """A CPU run's decode speed with every weight in RAM, on one model and thread count."""

    fingerprint: str
    threads: int
    tg_tok_s: float  # Spark's (its RAM tier's shape, every expert in RAM)
    stock_tg_tok_s: float | None = None  # stock's, the model mapped (None: kept before it was measured)


def _uncapped_file(home: Path, fingerprint: str, threads: int) -> Path:
    return home / "calibration" / f"uncapped-{fingerprint[:16]}-t{threads}.json"


def keep_uncapped(home: Path, fingerprint: str, threads: int, tg_tok_s: float, stock_tg_tok_s: float | None) -> None:
    """Keep what `spark bench --ram` measured uncapped, for later runs' decisions (best effort)."""
    try:
        atomic_write_text(_uncapped_file(home, fingerprint, threads),
                          json.dumps(asdict(UncappedSpeed(fingerprint, threads, tg_tok_s, stock_tg_tok_s))) + "\n")
    except OSError:
        pass  # NOTE: decided without it next time (read-ahead off), and measured again by the next bench


def kept_uncapped(home: Path, fingerprint: str, threads: int, stock: bool = False) -> float | None:
    """The kept uncapped tok/s of this model at `threads`, Spark's (`stock`: stock's; Spark's where
    only that was kept); None: never measured."""
    try:
        d = UncappedSpeed(**json.loads(_uncapped_file(home, fingerprint, threads).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    tg = d.stock_tg_tok_s if stock and d.stock_tg_tok_s else d.tg_tok_s
    return tg if d.fingerprint == fingerprint and tg > 0 else None


def uncapped_tg(home: Path, fingerprint: str, plan, threads: int | None, stock: bool = False) -> float | None:
    """The uncapped token's speed a decision prices with: a device plan's priced tg, else the CPU speed
    spark bench --ram kept for this model at `threads` (None: all cores, as -t defaults): Spark's, or
    with `stock` stock's (what a run that maps the file as stock does runs at)."""
    if plan is not None:
        return (plan.predicted or {}).get("tg_tok_s")
    return kept_uncapped(home, fingerprint, threads or os.cpu_count() or 1, stock)


def off(why: str) -> AheadDecision:
    return AheadDecision(0, 0, f"read-ahead: off ({why})")


def decide(model: Path, geometry: ModelGeometry, tier: ram_tier.RamTier, trace: RoutingTrace | None,
           base_tg: float | None, home: Path) -> AheadDecision:
    """One expert a layer read ahead at the break-even gate, or none: whichever the cost model prices
    faster on `trace` (the profile's recent decode routing), by at least MIN_GAIN for read-ahead.
    base_tg: the uncapped tok/s (None: not known)."""
    if trace is None or trace.n_decode == 0:
        return off("the profile keeps no decode routing steps to predict from: spark profile MODEL --corpus PATH --gen N "
                   "records them")
    disk = disk_costs.kept(model, disk_costs.read_size(geometry), disk_costs.READERS, home)
    if disk is None:
        return off("this disk's read speed was never measured: spark bench MODEL --ram-residency 0.6 measures it")
    if not base_tg:
        return off("the uncapped speed on this model and -t was never measured: spark bench MODEL --ram-residency 0.6 "
                   "measures it")
    slots = {l.il: l.n_slots for l in tier.layers}
    pinned = {l.il: l.pinned for l in tier.layers}
    expert_bytes = {l.il: l.expert_bytes for l in tier.layers}
    choices = {c.params.ahead: c for c in prefetch.choose_ahead(trace, slots, pinned, expert_bytes, 1.0 / base_tg,
                                                                disk, options=(0, 1))}
    without, with_one = choices[0], choices[1]
    gain = without.tg_s / with_one.tg_s - 1.0 if with_one.tg_s > 0 else 0.0
    gate = with_one.params.min_prob / prefetch.ONE
    if gain < MIN_GAIN:
        return off(f"the cost model gives it {gain:+.0%} at a chance of at least {gate:.0%}, under {MIN_GAIN:.0%}")
    covered = with_one.replay.covered / with_one.replay.misses if with_one.replay.misses else 0.0
    return AheadDecision(1, with_one.params.min_prob,
                         f"read-ahead: one expert a layer at a chance of at least {gate:.0%} (the cost model: "
                         f"{gain:+.0%} tg, {covered:.0%} of the misses read ahead on the profile's routing)")
