"""`spark plan MODEL --ram SIZE`: what sits where when the weights do not fit RAM (core/ram_tier.py)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.markup import escape

from ..core import ram_tier, units
from ..core.cost_model import file_tier_tg
from ..files.paths import spark_home
from ..runs import disk_costs, read_ahead


def device_share(geometry, plan) -> float:
    """Share of the routed-expert bytes a device plan keeps on the device (resident layers, cache slots)."""
    on = sum(ram_tier.expert_bytes(geometry, [l.index]) if l.mode == "resident" else
             l.slots * geometry.layers[l.index].expert_bytes_per_expert if l.mode == "cached" else 0
             for l in plan.layers)
    return on / geometry.total_expert_bytes if geometry.total_expert_bytes else 0.0


def served_from(g, plan, tier: ram_tier.RamTier | None) -> tuple[float, float, float]:
    """Shares of the routed-expert bytes served from the device (resident layers, device slots), from RAM
    (a cached layer's host copy beyond its device slots; a host layer's RAM slots, or all its experts
    where they fit) and from the model file (a RAM-tier layer's experts beyond its slots)."""
    total = g.total_expert_bytes
    slots = {l.il: l.n_slots for l in tier.layers} if tier is not None else {}
    ram = files = 0
    for lp in plan.layers:
        per, whole = g.layers[lp.index].expert_bytes_per_expert, ram_tier.expert_bytes(g, [lp.index])
        if lp.mode == "cached":
            ram += whole - lp.slots * per
        elif lp.mode == "host" and lp.index in slots:
            ram += slots[lp.index] * per
            files += whole - slots[lp.index] * per
        elif lp.mode == "host":
            ram += whole
    return device_share(g, plan), ram / total, files / total


def three_tier_tg(plan, misses: "ram_tier.DecodeMisses | None", tier, disk) -> float | None:
    """tok/s of a device plan priced in time with its host layers' misses read from the file
    (cost_model.file_tier_tg); None where a figure is missing."""
    base = (plan.predicted or {}).get("tg_tok_s") if plan is not None else None
    if not base or misses is None or disk is None:
        return None
    return 1.0 / file_tier_tg(1.0 / base, misses.per_token, ram_tier.mean_expert_bytes(tier), disk,
                              miss_steps_per_token=misses.steps_per_token)


def show(path: Path, geometry, counts, trace, budget: int, as_json: bool, say, *, tier=None, plan=None,
         threads: int | None = None) -> None:
    """The RAM tier for `budget` bytes of weights: resident, RAM slots, file; the bytes read per
    decode token (the trace replayed through the slots) and, where the disk was measured (spark
    bench --ram), the decode speed the reads alone allow. With a device `plan` (three tiers) `tier`
    is its host layers' (session.resolve_device_ram_tier) and the device's share is printed first."""
    if plan is None:
        tier = ram_tier.plan(geometry, budget, "--ram", counts)
    dev = device_share(geometry, plan) if plan is not None else None
    if dev is not None and not as_json:
        modes = [l.mode for l in plan.layers]
        say.print(f"  device: {dev:.0%} of the experts ({modes.count('resident')} layers resident, "
                  f"{modes.count('cached')} cached, {modes.count('host')} on the host; spark plan without --ram "
                  "shows the bill)", soft_wrap=True, markup=False)
    if tier is None:
        msg = (f"--ram {units.fmt_bytes(budget)}: the weights ({units.fmt_bytes(ram_tier.resident_bytes(geometry) + geometry.total_expert_bytes)}) "
               "fit: every expert stays in RAM, nothing is read from the file") if plan is None else \
              f"--ram {units.fmt_bytes(budget)}: the plan's host weights fit: nothing is read from the file"
        print(json.dumps({"ram_tier": None, "device_share": dev})) if as_json else say.print(msg, soft_wrap=True, markup=False)
        return
    misses = ram_tier.replay(tier, trace)
    per_token = misses.per_token * ram_tier.mean_expert_bytes(tier) if misses is not None else None
    disk = disk_costs.kept(path, disk_costs.read_size(geometry), disk_costs.READERS, spark_home())
    ceiling = disk.bytes_per_s / per_token if disk and per_token else None
    ahead = read_ahead.decide(path, geometry, tier, trace, read_ahead.uncapped_tg(spark_home(), geometry.fingerprint,
                                                                                plan, threads), spark_home())
    if as_json:
        print(json.dumps({"ram_tier": {
            "budget": tier.budget, "resident_bytes": tier.resident_bytes, "bank_bytes": tier.bank_bytes,
            "resident_share": tier.resident_share, "device_share": dev, "file_bytes": tier.total_expert_bytes - sum(
                l.n_slots * l.expert_bytes for l in tier.layers),
            "layers": [{"il": l.il, "slots": l.n_slots, "pinned": list(l.pinned)} for l in tier.layers],
            "misses_per_token": misses.per_token if misses else None,
            "miss_steps_per_token": misses.steps_per_token if misses else None, "file_bytes_per_token": per_token,
            "disk_bytes_per_s": disk.bytes_per_s if disk else None, "disk_bound_tok_s": ceiling,
            "predicted_tg_tok_s": three_tier_tg(plan, misses, tier, disk),
            "read_ahead": {"ahead": ahead.ahead, "min_prob": ahead.min_prob, "why": ahead.line}}}))
        return
    held = sum(l.n_slots * l.expert_bytes for l in tier.layers)
    say.print(f"RAM tier for --ram {units.fmt_bytes(budget)} ({path.name}):", markup=False)
    what = "non-expert weights" if plan is None else "other host weights (cached layers' experts, the embeddings)"
    layers = "a layer" if plan is None else f"a layer, {len(tier.layers)} host layers"
    say.print(f"  RAM:  {units.fmt_bytes(tier.resident_bytes)} {what}, {units.fmt_bytes(tier.bank_bytes)} of "
              f"expert slots ({tier.layers[0].n_slots} of {geometry.n_expert} experts {layers}, "
              f"{len(tier.layers[0].pinned)} pinned; staging included)", soft_wrap=True, markup=False)
    file_bytes = tier.total_expert_bytes - held
    say.print(f"  file: {units.fmt_bytes(file_bytes)} of experts "
              f"({file_bytes / geometry.total_expert_bytes:.0%}), read when routed", soft_wrap=True, markup=False)
    if per_token is None:
        say.print("  bytes read per token: no decode routing steps to replay yet (spark profile MODEL --corpus PATH --gen N records them; a chat folds only counts)",
                  soft_wrap=True, markup=False)
    else:
        say.print(f"  bytes read per token: {units.fmt_bytes(int(per_token))} ({misses.per_token:.1f} missed experts a token, "
                  "the profile's recent decode steps replayed)", soft_wrap=True, markup=False)
    if ceiling is not None:
        say.print(f"  the disk ({units.fmt_bytes(int(disk.bytes_per_s))}/s at {disk.depth} reads in flight) bounds "
                  f"decode at {ceiling:.1f} tok/s for the reads alone", soft_wrap=True, markup=False)
    tg = three_tier_tg(plan, misses, tier, disk)
    if tg is not None:
        say.print(f"  predicted tg: {tg:.1f} tok/s (the device plan's {plan.predicted['tg_tok_s']:.1f}, "
                  "plus the file reads its host layers wait for)", soft_wrap=True, markup=False)
    else:
        say.print(f"  [dim]{escape('the disk is not measured yet: spark bench --ram SIZE measures it and prices the tier')}[/]", soft_wrap=True)
    say.print(f"  {ahead.line}", soft_wrap=True, markup=False)
