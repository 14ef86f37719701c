#!/usr/bin/env python3
"""docs/what-fits.md's table: Spark's plan and stock `--n-cpu-moe N` per fixture and budget.

Builds the geometry fixtures (sparse GGUFs, a few MB each; models/fixtures.py), plans each one with
`planner.plan_for` at every budget (uniform routing prior: no profile) and prints a Markdown table:
the share of expert bytes Spark keeps on the device (resident experts + cache slots), its layers
(resident / cached / host), the device bill, and the smallest `--n-cpu-moe N` whose stock bill fits.

With --predict-for CARD (default rtx-4060-ti-16gb) the plans are priced in time for that card's published
figures and the constants fitted to public measurements (core/device_table.py; --cold-hit, --host-bandwidth,
--host-cores: the assumptions; no CPU calibration is read: the table is for the stated host) and the table
adds the predicted generation tok/s of Spark's plan and of stock's --n-cpu-moe N: predictions, not
measurements (`--predict-for none`: placed by hits alone, no speed columns).

With --ram 32,64,128 (GiB) it prints the three-tier table instead: each fixture at each --vram budget and
RAM size, planned as `spark plan F --vram SIZE --ram SIZE` plans it (`planner.plan_for` with ram_bytes, then
`session.resolve_device_ram_tier`): the share of expert bytes served from the device, from RAM and from the
model file, the RAM the weights take, and with --predict-for the predicted tg with the file reads added at an
assumed disk (--disk-gbs) and an assumed uniform routing. The RAM the weights may use is the RAM less
--os-ram GiB (assumed: the OS and the run's host buffers).

Usage: .venv/bin/python scripts/what_fits.py [--vram 8,12,16,24] [-c 8192] [--fixtures a,b] [--out-dir DIR]
       [--predict-for CARD] [--cold-hit 0.1] [--host-bandwidth GB/s] [--host-cores 8] [--pcie 4x8]
       [--ram 32,64,128 [--os-ram 4] [--disk-gbs 3]]
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spark_cli.commands.plan_ram import served_from, three_tier_tg  # noqa: E402
from spark_cli.core import device_table, ram_tier  # noqa: E402
from spark_cli.core.cost_model import DiskCosts  # noqa: E402
from spark_cli.core.gguf_info import ModelGeometry, load_geometry  # noqa: E402
from spark_cli.core.options import DEFAULT_CTX, LoadFlags  # noqa: E402
from spark_cli.core.planner import Plan, PlanRequest, plan_for  # noqa: E402
from spark_cli.core.units import GiB, fmt_bytes  # noqa: E402
from spark_cli.errors import PlanError  # noqa: E402
from spark_cli.models.fixtures import FIXTURES, build_fixture  # noqa: E402
from spark_cli.runs import disk_costs, session  # noqa: E402
from spark_cli.runs.disk_costs import READERS  # noqa: E402


def request(g: ModelGeometry, budget: int, n_ctx: int, predict: dict | None,
            ram_bytes: int | None = None) -> PlanRequest:
    """What the script asks planner.plan_for: the budget, no profile, with `predict` the card's costs and the
    assumed cold-hit; `ram_bytes`: the RAM the weights may use (`spark plan --ram`; None: no bound)."""
    costs = None
    if predict is not None:
        costs = device_table.predicted_costs(predict["card"], g, predict["host_gb_s"], predict["host_cores"])
    return PlanRequest(budget_bytes=budget, n_ctx=n_ctx, costs=costs,
                       assumed_cold_hit=predict["cold_hit"] if predict else None, ram_bytes=ram_bytes)


def plan_row(g, budget: int, n_ctx: int, predict: dict | None = None) -> dict:
    """One (fixture, budget) cell: Spark's residency and bill, stock's N, and with `predict` (card,
    cold_hit, host_gb_s, host_cores) both predicted tg tok/s; `error` when no plan fits."""
    try:
        res = plan_for(g, request(g, budget, n_ctx, predict))
        plan = res.plan
    except PlanError as e:
        return {"error": e.message if hasattr(e, "message") else str(e)}
    by_layer = {l.index: l for l in g.layers}
    on_device = 0
    modes = {"resident": 0, "cached": 0, "host": 0}
    for lp in plan.layers:
        if lp.mode in modes:
            modes[lp.mode] += 1
        if lp.mode == "resident":
            on_device += by_layer[lp.index].expert_bytes
        elif lp.mode == "cached":
            on_device += lp.slots * by_layer[lp.index].expert_bytes_per_expert
    speed = {a.name: a.prediction.tg_tok_s for a in res.alternatives if a.prediction is not None}
    return {"residency": on_device / g.total_expert_bytes, "modes": modes, "bill": plan.breakdown["total"],
            "stock": plan.stock, "n_moe": len(g.moe_layers), "tg": speed}


def table(names: list[str], budgets: list[int], n_ctx: int, out_dir: Path | None, predict: dict | None = None) -> str:
    speed_cols = " Spark tg tok/s (predicted) | stock tg tok/s (predicted) |" if predict else ""
    lines = [f"| model (file size) | VRAM | Spark: experts on the device | Spark layers resident / cached / host "
             f"| Spark device bill | stock `--n-cpu-moe N` (device bill) |{speed_cols}",
             "|---|---|---|---|---|---|" + ("---|---|" if predict else "")]
    for name in names:
        g = load_geometry(build_fixture(name, out_dir=out_dir))
        for i, budget in enumerate(budgets):
            label = f"{FIXTURES[name].title} ({fmt_bytes(g.file_size)})" if i == 0 else ""
            r = plan_row(g, budget, n_ctx, predict)
            if "error" in r:
                lines.append(f"| {label} | {budget / GiB:.4g} GiB | does not fit | - | - | - |"
                             + (" - | - |" if predict else ""))
                continue
            m, s = r["modes"], r["stock"]
            stock = (f"{s.n_cpu_moe} of {r['n_moe']} ({fmt_bytes(s.device_bytes)})" if s.fits else
                     f"does not fit even with --cpu-moe ({fmt_bytes(s.cpu_moe_device_bytes)})")
            speeds = ""
            if predict:
                tg = r["tg"]
                best_stock = tg.get("resident") or tg.get("n-cpu-moe")
                speeds = f" {tg['spark']:.0f} | {best_stock:.0f} |" if best_stock else f" {tg['spark']:.0f} | - |"
            lines.append(f"| {label} | {budget / GiB:.4g} GiB | {100 * r['residency']:.0f}% "
                         f"| {m['resident']} / {m['cached']} / {m['host']} | {fmt_bytes(r['bill'])} | {stock} |{speeds}")
    return "\n".join(lines)


# ---------------------------------------------------------------- three tiers: the device, RAM and the file


@dataclass(frozen=True)
class RamAssumptions:
    """What the three-tier table assumes, not measures: the RAM the OS keeps, the disk, the routing."""

    os_ram: int  # bytes of a machine's RAM not given to the weights (the OS, the run's host buffers)
    disk_gb_s: float  # the disk's read rate at READERS reads in flight, GB/s (1e9 bytes)

    def weights_budget(self, ram: int) -> int:
        """The RAM the weights may use on a machine with `ram` bytes: `spark plan --ram`'s SIZE."""
        return max(0, ram - self.os_ram)

    def disk(self, g: ModelGeometry) -> DiskCosts:
        """The assumed disk as file_tier_tg reads it (latency_s 0: no wait per step beyond the bytes assumed)."""
        return DiskCosts(disk_costs.read_size(g), READERS, self.disk_gb_s * 1e9, 0.0)

    def line(self) -> str:
        return (f"assumed, not measured: the weights may use the RAM less {self.os_ram / GiB:g} GiB (the OS and the "
                f"run's host buffers; --os-ram); the disk reads {self.disk_gb_s:g} GB/s (an NVMe's sequential read at "
                f"{READERS} reads in flight; --disk-gbs); uniform routing (no profile): a host layer with s of n "
                f"experts in RAM slots misses k(1 - s/n) of its k routed experts a token, each read from the file")


@dataclass(frozen=True)
class RamCell:
    """One (fixture, VRAM, RAM) cell of the three-tier table; `error`: the planner's one line (no plan)."""

    ram: int  # the machine's RAM
    budget: int  # the RAM the weights may use (RamAssumptions.weights_budget)
    error: str | None = None
    plan: Plan | None = None
    tier: ram_tier.RamTier | None = None  # None: every host weight fits in RAM, nothing read from the file
    device: float = 0.0  # shares of the routed-expert bytes, each counted once, where it is served from
    in_ram: float = 0.0
    in_file: float = 0.0
    ram_used: int = 0  # bytes of RAM the weights take: the host bill, or the RAM tier's resident bytes and banks
    misses: float = 0.0  # experts read from the file per decode token (assumed uniform routing)
    tg: float | None = None  # predicted tok/s with the file reads (None: not predicted)

    def file_bytes_per_token(self) -> float:
        return self.misses * ram_tier.mean_expert_bytes(self.tier) if self.tier is not None else 0.0


def uniform_miss_steps(g: ModelGeometry, tier: ram_tier.RamTier) -> float:
    """Layer steps per decode token with at least one miss under uniform routing: a layer with s of n
    experts in slots routes its k experts all from them with chance C(s, k) / C(n, k) (ASSUMED routing)."""
    k, n = g.n_expert_used, g.n_expert
    return sum(1.0 - math.comb(l.n_slots, k) / math.comb(n, k) for l in tier.layers)


def uniform_misses(g: ModelGeometry, tier: ram_tier.RamTier | None) -> float:
    """Experts per decode token the RAM tier reads from the file under uniform routing: a layer with s of n
    experts in slots finds each of its k routed experts there with chance s/n (ASSUMED routing)."""
    if tier is None:
        return 0.0
    return sum(g.n_expert_used * (1.0 - l.n_slots / g.n_expert) for l in tier.layers)


def ram_used(g: ModelGeometry, plan: Plan, tier: ram_tier.RamTier | None) -> int:
    """RAM the plan's weights take: the host bill (session.planned_host_bill: no dry run for a fixture),
    or with a RAM tier its resident weights and banks (slots, guard and staging slices)."""
    if tier is None:
        return session.planned_host_bill(g, plan)["model"]
    return tier.resident_bytes + tier.bank_bytes


def ram_cell(g: ModelGeometry, vram: int, ram: int, n_ctx: int, assume: RamAssumptions,
             predict: dict | None = None) -> RamCell:
    """What `spark plan F --vram VRAM --ram (RAM - os_ram)` places: the one planner with the RAM bound, then
    the one RAM tier (session.resolve_device_ram_tier); the planner's PlanError as the cell's `error`."""
    budget = assume.weights_budget(ram)
    try:
        plan = plan_for(g, request(g, vram, n_ctx, predict, ram_bytes=budget)).plan
        tier = session.resolve_device_ram_tier(g, session.ProfileInfo(Path(g.path), None), LoadFlags(ram=budget),
                                               plan)
    except PlanError as e:
        return RamCell(ram, budget, error=e.message)
    device, in_ram, in_file = served_from(g, plan, tier)
    misses = uniform_misses(g, tier)
    tg = None
    if predict is not None:
        tg = (three_tier_tg(plan, ram_tier.DecodeMisses(misses, uniform_miss_steps(g, tier)), tier, assume.disk(g))
              if tier is not None else plan.predicted["tg_tok_s"])
    return RamCell(ram, budget, plan=plan, tier=tier, device=device, in_ram=in_ram, in_file=in_file,
                   ram_used=ram_used(g, plan, tier), misses=misses, tg=tg)


def _slots(g: ModelGeometry, tier: ram_tier.RamTier | None) -> str:
    if tier is None:
        return "all (fits)"
    counts = sorted({l.n_slots for l in tier.layers})
    return f"{counts[0]}{'-' + str(counts[-1]) if len(counts) > 1 else ''} of {g.n_expert}"


def ram_row(g: ModelGeometry, label: str, vram: int, cells: list[RamCell], predict: bool) -> str:
    """One row for RAM sizes that place alike (same_row): their sizes and budgets side by side."""
    c = cells[0]
    head = f"| {label} | {vram / GiB:g} GiB | {', '.join(f'{x.ram / GiB:g}' for x in cells)} GiB |"
    if c.error is not None:
        return head + f" does not fit: {c.error} | - | - | - | - |" + (" - |" if predict else "")
    modes = [l.mode for l in c.plan.layers]
    reads = (f"{c.misses:.0f} experts, {fmt_bytes(int(c.file_bytes_per_token()))}" if c.tier is not None else "none")
    speed = f" {c.tg:.1f} |" if predict else ""
    return (head + f" {100 * c.device:.0f}% / {100 * c.in_ram:.0f}% / {100 * c.in_file:.0f}% "
            f"| {modes.count('resident')} / {modes.count('cached')} / {modes.count('host')} "
            f"| {fmt_bytes(c.ram_used)} of {' / '.join(fmt_bytes(x.budget) for x in cells)} "
            f"| {_slots(g, c.tier)} | {reads} |{speed}")


def same_row(g: ModelGeometry, a: RamCell, b: RamCell) -> bool:
    """Whether two RAM sizes place alike: a row that differs only in the RAM and the budget (a PlanError names
    its budget: never alike)."""
    def body(c: RamCell) -> str:
        return ram_row(g, "", 0, [replace(c, ram=0, budget=0)], c.tg is not None).split("|", 4)[4]
    return body(a) == body(b)


def ram_rows(g: ModelGeometry, label: str, vram: int, cells: list[RamCell], predict: bool) -> list[str]:
    """A fixture's rows at one VRAM budget: consecutive RAM sizes that place alike share a row."""
    groups: list[list[RamCell]] = []
    for c in cells:
        if groups and same_row(g, groups[-1][0], c):
            groups[-1].append(c)
        else:
            groups.append([c])
    return [ram_row(g, label if i == 0 else "", vram, grp, predict) for i, grp in enumerate(groups)]


def ram_table_header(predict: bool) -> list[str]:
    speed = " tg tok/s (predicted, assumed disk) |" if predict else ""
    return ["| model (file size) | VRAM | RAM | experts from device / RAM / file | layers resident / cached / host "
            "| RAM the weights take (of what they may use) | RAM slots per host layer "
            f"| file reads per token (assumed routing) |{speed}",
            "|---|---|---|---|---|---|---|---|" + ("---|" if predict else "")]


def ram_table(names: list[str], vrams: list[int], rams: list[int], n_ctx: int, out_dir: Path | None,
              assume: RamAssumptions, predict: dict | None = None) -> str:
    lines = ram_table_header(bool(predict))
    for name in names:
        g = load_geometry(build_fixture(name, out_dir=out_dir))
        label = f"{FIXTURES[name].title} ({fmt_bytes(g.file_size)})"
        for vram in vrams:
            lines += ram_rows(g, label, vram, [ram_cell(g, vram, ram, n_ctx, assume, predict) for ram in rams],
                              bool(predict))
            label = ""
    return "\n".join(lines)


def main_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vram", default="8,12,16,24", help="budgets in GiB, comma-separated")
    ap.add_argument("-c", "--ctx", type=int, default=DEFAULT_CTX, help="context size (default: Spark's)")
    ap.add_argument("--fixtures", default=",".join(FIXTURES), help="fixture names, comma-separated")
    ap.add_argument("--out-dir", type=Path, default=None, help="where the fixtures go (default: $SPARK_HOME/models)")
    ap.add_argument("--predict-for", default="rtx-4060-ti-16gb", help="card whose published figures price the "
                    "plans (none: placed by hits alone)")
    ap.add_argument("--cold-hit", type=float, default=0.2, help="assumed share of routed experts a cached layer "
                    "misses with k slots (no profile)")
    ap.add_argument("--host-bandwidth", type=float, default=None, help="host GB/s (default: not given, the "
                    "CPU rate of the public measurements' hosts)")
    ap.add_argument("--host-cores", type=int, default=8, help="host CPU cores")
    ap.add_argument("--pcie", default=None, help="the link the card's slot gives it, GENxLANES, e.g. 4x8 "
                    "(default: the card's own)")
    ap.add_argument("--ram", default=None, help="RAM sizes in GiB, comma-separated: print the three-tier table "
                    "(device, RAM, file) for each --vram budget instead")
    ap.add_argument("--os-ram", type=float, default=4.0, help="GiB of the RAM assumed taken by the OS and the run's "
                    "host buffers: the weights may use the rest (spark plan --ram); default 4")
    ap.add_argument("--disk-gbs", type=float, default=3.0, help=f"assumed disk read rate, GB/s at {READERS} reads in "
                    "flight (an NVMe's sequential read); default 3")
    return ap


def predict_settings(a: argparse.Namespace) -> dict | None:
    """--predict-for and the host it assumes (None: --predict-for none)."""
    if a.predict_for == "none":
        return None
    card = device_table.card(a.predict_for)
    if a.pcie is not None:
        try:
            card = card.on_pcie(a.pcie)
        except ValueError as e:
            raise SystemExit(f"what_fits.py: --pcie {a.pcie!r}: {e}; give GENxLANES, e.g. 4x8") from None
    return {"card": card, "cold_hit": a.cold_hit, "host_gb_s": a.host_bandwidth, "host_cores": a.host_cores}


def assumptions(a: argparse.Namespace) -> RamAssumptions | None:
    """The three-tier table's assumptions (None: no --ram, the one-tier table)."""
    return RamAssumptions(int(a.os_ram * GiB), a.disk_gbs) if a.ram is not None else None


def main(argv: list[str] | None = None) -> int:
    a = main_parser().parse_args(argv)
    budgets = [int(float(x) * GiB) for x in a.vram.split(",")]
    assume, predict = assumptions(a), predict_settings(a)
    if assume is not None:
        print(assume.line() + "\n")
    if predict is not None:
        host = device_table.Host(a.host_bandwidth, a.host_cores).describe(device_table.fitted())
        print(f"predicted from published figures, not measured: {predict['card'].describe()}; {host}; "
              f"assumed cold-hit {a.cold_hit:g} at k slots; {device_table.ASSUMPTIONS}\n")
    print(f"n_ctx {a.ctx}, f16 KV cache, n_ubatch 512, no routing profile (uniform prior)\n")
    if assume is not None:
        rams = [int(float(x) * GiB) for x in a.ram.split(",")]
        print(ram_table(a.fixtures.split(","), budgets, rams, a.ctx, a.out_dir, assume, predict))
    else:
        print(table(a.fixtures.split(","), budgets, a.ctx, a.out_dir, predict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
