"""`spark plan MODEL --ram SIZE`: what sits where when the weights do not fit RAM (core/ram_tier.py)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.markup import escape

from ..core import ram_tier, units
from ..files.paths import spark_home
from ..runs import disk_costs
from ..runs.ram_bench import READERS


def show(path: Path, geometry, counts, trace, budget: int, as_json: bool, say) -> None:
    """The RAM tier for `budget` bytes of weights: resident, RAM slots, file; the bytes read per
    decode token (the trace replayed through the slots) and, where the disk was measured (spark
    bench --ram), the decode speed the reads alone allow."""
    tier = ram_tier.plan(geometry, budget, "--ram", counts)
    if tier is None:
        msg = (f"--ram {units.fmt_bytes(budget)}: the weights ({units.fmt_bytes(ram_tier.resident_bytes(geometry) + geometry.total_expert_bytes)}) "
               "fit: every expert stays in RAM, nothing is read from the file")
        print(json.dumps({"ram_tier": None})) if as_json else say.print(msg, soft_wrap=True, markup=False)
        return
    misses = ram_tier.replay(tier, trace)
    per_token = misses * ram_tier.mean_expert_bytes(tier) if misses is not None else None
    disk = disk_costs.kept(path, disk_costs.read_size(geometry), READERS, spark_home())
    ceiling = disk.bytes_per_s / per_token if disk and per_token else None
    if as_json:
        print(json.dumps({"ram_tier": {
            "budget": tier.budget, "resident_bytes": tier.resident_bytes, "bank_bytes": tier.bank_bytes,
            "resident_share": tier.resident_share, "file_bytes": geometry.total_expert_bytes - sum(
                l.n_slots * l.expert_bytes for l in tier.layers),
            "layers": [{"il": l.il, "slots": l.n_slots, "pinned": list(l.pinned)} for l in tier.layers],
            "misses_per_token": misses, "file_bytes_per_token": per_token,
            "disk_bytes_per_s": disk.bytes_per_s if disk else None, "disk_bound_tok_s": ceiling}}))
        return
    held = sum(l.n_slots * l.expert_bytes for l in tier.layers)
    say.print(f"RAM tier for --ram {units.fmt_bytes(budget)} ({path.name}):", markup=False)
    say.print(f"  RAM:  {units.fmt_bytes(tier.resident_bytes)} non-expert weights, {units.fmt_bytes(tier.bank_bytes)} of "
              f"expert slots ({tier.layers[0].n_slots} of {geometry.n_expert} experts a layer, "
              f"{len(tier.layers[0].pinned)} pinned; staging included)", soft_wrap=True, markup=False)
    say.print(f"  file: {units.fmt_bytes(geometry.total_expert_bytes - held)} of experts "
              f"({1 - tier.resident_share:.0%}), read when routed", soft_wrap=True, markup=False)
    if per_token is None:
        say.print("  bytes read per token: no decode routing to replay yet (spark profile, or a chat, records it)",
                  soft_wrap=True, markup=False)
    else:
        say.print(f"  bytes read per token: {units.fmt_bytes(int(per_token))} ({misses:.1f} missed experts a token, "
                  "the profile's recent decode steps replayed)", soft_wrap=True, markup=False)
    if ceiling is not None:
        say.print(f"  the disk ({units.fmt_bytes(int(disk.bytes_per_s))}/s at {disk.depth} reads in flight) bounds "
                  f"decode at {ceiling:.1f} tok/s for the reads alone", soft_wrap=True, markup=False)
    else:
        say.print(f"  [dim]{escape('the disk is not measured yet: spark bench --ram SIZE measures it and prices the tier')}[/]", soft_wrap=True)
