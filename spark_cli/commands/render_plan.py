"""Rich renderables for a Plan: the per-layer table, the VRAM bill, the stock baseline.

Kept apart from planner.py so the planner stays free of rich.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from ..core import units
from ..core.placement import STOCK_EXPS_REGEX
from ..core.planner import LayerPlan, Plan, StockBaseline
from ..core.units import fmt_bytes

COMPRESS_OVER = 16  # layers; above this, runs of identical rows share one line
SHOW_PINNED_IDS = 8


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


@dataclass(frozen=True)
class LayerRun:
    first: int
    last: int
    layer: LayerPlan  # the first layer of the run
    same_pins: bool = True  # every layer of the run pins the same experts

    @property
    def label(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


def _key(l: LayerPlan) -> tuple:
    return (l.mode, len(l.pinned), l.slots, l.device_bytes, l.host_bytes, l.device)


def device_label(plan: Plan, d: int) -> str:
    """A device of the plan as the tables name it."""
    name = plan.per_device[d].name if d < len(plan.per_device) else ""
    return name or f"device {d}"


def layer_runs(plan: Plan, compress_over: int = COMPRESS_OVER) -> list[LayerRun]:
    """One run per layer, or runs of consecutive identical rows (same mode, pin count,
    slots and bytes; pinned ids may differ) when the model has many layers."""
    runs: list[LayerRun] = []
    compress = len(plan.layers) > compress_over
    for l in plan.layers:
        if compress and runs and _key(runs[-1].layer) == _key(l) and runs[-1].last + 1 == l.index:
            r = runs[-1]
            runs[-1] = LayerRun(r.first, l.index, r.layer, r.same_pins and r.layer.pinned == l.pinned)
        else:
            runs.append(LayerRun(l.index, l.index, l))
    return runs


def _pinned_text(run: LayerRun) -> str:
    l = run.layer
    if l.mode != "cached":
        return "-"
    n = len(l.pinned)
    if n == 0:
        return "0"
    each = "" if run.first == run.last else " each"
    if run.same_pins and n <= SHOW_PINNED_IDS:
        return f"{n}{each}: " + " ".join(str(e) for e in l.pinned)
    return f"{n}{each}"


def layer_table(plan: Plan, compress_over: int = COMPRESS_OVER) -> Table:
    n_expert = int(plan.model["n_expert"])
    t = Table(title="placement per layer", title_justify="left")
    t.add_column("layer", justify="right")
    t.add_column("placement")
    t.add_column("pinned", justify="right")
    t.add_column("LRU slots", justify="right")
    several = len(plan.per_device) > 1
    if several:
        t.add_column("on")
    t.add_column("device", justify="right")
    t.add_column("host", justify="right")
    for run in layer_runs(plan, compress_over):
        l = run.layer
        mode = {"resident": f"resident ({n_expert} experts)", "cached": "host + cache",
                "host": "host only (as --n-cpu-moe)"}.get(l.mode, l.mode)
        style = {"resident": "green", "cached": "cyan", "host": "yellow", "skipped": "dim"}.get(l.mode, "")
        many = run.first != run.last
        on = [device_label(plan, l.device)] if several else []
        t.add_row(run.label, f"[{style}]{mode}[/]" if style else mode, _pinned_text(run),
                  str(l.lru_slots) if l.mode == "cached" else "-", *on,
                  fmt_bytes(l.device_bytes) + (" each" if many else ""),
                  (fmt_bytes(l.host_bytes) + (" each" if many else "")) if l.host_bytes else "-")
    return t


def devices_table(plan: Plan, budget_source: str) -> Table:
    """The VRAM bill of a plan over several devices: per device, planned and (when the plan was
    measured) what the dry run measured on it, against that device's own budget."""
    devs = plan.per_device
    measured = any(d.measured is not None for d in devs)
    out = f" (output layer on {device_label(plan, plan.output_device)})"
    t = Table(title="VRAM bill per device" + (": planned and measured" if measured else "") + out,
              title_justify="left", caption=f"budgets: {budget_source}; split: "
              + ("-sm none" if plan.split_mode == "none" else
                 "-ts " + ",".join(f"{v:g}" for v in plan.tensor_split)),
              caption_justify="left")
    t.add_column("component")
    for i, _ in enumerate(devs):
        t.add_column(f"{device_label(plan, i)} planned", justify="right")
        if measured:
            t.add_column("measured", justify="right")
    layers = [[l for l in plan.layers if l.device == i and l.mode in ("resident", "cached", "host")]
              for i in range(len(devs))]
    rows = [("weights + resident experts", lambda b: b["weights_global"] + b["weights_layers_nonexpert"]
             + b["experts_resident"], "model"),  # NOTE: llama.cpp counts them as one
            ("expert banks", lambda b: b["expert_banks"], "banks"),
            ("KV cache", lambda b: b["kv_cache"], "context"),
            ("compute buffer", lambda b: b["compute"], "compute"),
            ("overhead", lambda b: b["overhead"], None)]
    for name, planned, kind in rows:
        cells = [name]
        for d in devs:
            cells.append(fmt_bytes(planned(d.breakdown)))
            if measured:
                cells.append(fmt_bytes(d.measured[kind]) if d.measured is not None and kind else "")
        t.add_row(*cells)
    t.add_section()
    for name, f, g in (("[bold]total[/]", lambda d: d.breakdown["total"],
                        lambda d: d.measured["total"] + d.breakdown["overhead"]),
                       ("free", lambda d: d.budget_bytes - d.breakdown["total"],
                        lambda d: d.budget_bytes - d.measured["total"] - d.breakdown["overhead"]),
                       ("budget", lambda d: d.budget_bytes, None)):
        cells = [name]
        for d in devs:
            cells.append(fmt_bytes(f(d)))
            if measured:
                cells.append(fmt_bytes(g(d)) if g is not None and d.measured is not None else "")
        t.add_row(*cells)
    cells = ["MoE layers resident / cached / host"]
    for i, _ in enumerate(devs):
        ls = layers[i]
        cells.append(f"{sum(l.mode == 'resident' for l in ls)} / {sum(l.mode == 'cached' for l in ls)} / "
                     f"{sum(l.mode == 'host' for l in ls)}")
        if measured:
            cells.append("")
    t.add_row(*cells)
    return t


def budget_table(plan: Plan, budget_source: str) -> Table:
    """The VRAM bill: every component of the breakdown against the budget, and beside it what
    the dry run measured on the device (llama.cpp's breakdown) when the plan was measured.
    Several devices: devices_table."""
    if len(plan.per_device) > 1:
        return devices_table(plan, budget_source)
    b, budget = plan.breakdown, plan.budget_bytes
    bill = plan.measured_bill()
    dev = bill.device(bill.device_names()[0]) if bill is not None and bill.device_names() else None
    resident = [l for l in plan.layers if l.mode == "resident"]
    cached = [l for l in plan.layers if l.mode == "cached"]
    slots = sum(l.slots for l in cached)
    pins = sum(len(l.pinned) for l in cached)
    title = "VRAM bill" + (f" ({bill.device_names()[0]}: planned and measured)" if dev else "")
    t = Table(title=title, title_justify="left")
    t.add_column("component")
    t.add_column("planned", justify="right")
    if dev:
        t.add_column("measured", justify="right")
    t.add_column("of budget", justify="right")
    t.add_column("detail")
    weights = b["weights_global"] + b["weights_layers_nonexpert"]
    measured_compute = plan.fit_rounds > 0
    rows = [
        ("weights", weights, None, f"global {fmt_bytes(b['weights_global'])} + per-layer non-expert "
                                   f"{fmt_bytes(b['weights_layers_nonexpert'])}"),
        ("resident experts", b["experts_resident"], None, f"{len(resident)} layers, all experts"),
        ("expert banks", b["expert_banks"], dev and dev["banks"],
         f"{len(cached)} cached layers: {pins} pinned + {slots - pins} LRU slots + {len(cached)} guard"),
        ("KV cache", b["kv_cache"], dev and dev["context"], f"K {plan.type_k} / V {plan.type_v}, n_ctx {plan.n_ctx}"
         + (f", {plan.n_parallel} sequences" + (" (unified)" if plan.kv_unified else "") if plan.n_parallel > 1 else "")),
        ("compute buffer", b["compute"], dev and dev["compute"],
         f"{'measured' if measured_compute else 'estimate'}, n_ubatch {plan.n_ubatch}"),
        ("overhead", b["overhead"], None, "CUDA context, cuBLAS, allocator (estimate, not measurable)"),
    ]
    for name, n, m, detail in rows:
        if dev and name == "weights":
            m = dev["model"]  # llama.cpp counts weights and resident experts as one
            detail += " + resident experts"
        cells = [name, fmt_bytes(n)] + ([fmt_bytes(m) if m is not None else ""] if dev else [])
        t.add_row(*cells, _pct(n, budget), detail)
    t.add_section()
    total_m = [f"[bold]{fmt_bytes(dev['total'] + b['overhead'])}[/]"] if dev else []
    t.add_row("[bold]total[/]", f"[bold]{fmt_bytes(b['total'])}[/]", *total_m, _pct(b["total"], budget), "")
    free_m = [fmt_bytes(budget - dev["total"] - b["overhead"])] if dev else []
    t.add_row("free", fmt_bytes(budget - b["total"]), *free_m, _pct(budget - b["total"], budget), "left unspent")
    t.add_row("budget", fmt_bytes(budget), *([""] if dev else []), "100.0%", budget_source)
    return t


def measured_line(plan: Plan) -> str:
    """How the bill was measured, or why it was not."""
    bill = plan.measured_bill()
    if bill is None:
        return ("not measured (no device for a dry run: pass --rpc or -dev): the compute buffer "
                "and overhead are estimates")
    parts = [f"{n} {fmt_bytes(bill.device(n)['total'])}" for n in bill.device_names()]
    rounds = f"{plan.fit_rounds} round{'s' * (plan.fit_rounds != 1)}"
    if len(plan.per_device) > 1:
        per = ", ".join(f"{device_label(plan, i)} {fmt_bytes(d.measured['total']) if d.measured else '-'} of "
                        f"{fmt_bytes(d.breakdown['total'] - d.breakdown['overhead'])} planned"
                        for i, d in enumerate(plan.per_device))
        return (f"measured by a dry run (llama.cpp no_alloc, {rounds}), without the overhead: {per}; "
                f"host {fmt_bytes(bill.host()['total'])}")
    planned = plan.breakdown["total"] - plan.breakdown["overhead"]
    return (f"measured by a dry run (llama.cpp no_alloc, {rounds}): "
            f"{', '.join(parts)} on the device, planned {fmt_bytes(planned)}, "
            f"host {fmt_bytes(bill.host()['total'])}")


def uniform_cold_hit(plan: Plan) -> float:
    """Cold-hit rate if routing were uniform: a cached layer misses (E - P) / E."""
    n = int(plan.model["n_expert"])
    rates = [0.0 if l.mode == "resident" else 1.0 - len(l.pinned) / n
             for l in plan.layers if l.mode in ("resident", "cached", "host")]
    return sum(rates) / len(rates) if rates else 0.0


def cold_hit_line(plan: Plan) -> str:
    if plan.predicted_cold_hit is None:
        return (f"predicted cold-hit rate: {100 * uniform_cold_hit(plan):.1f}% if routing is uniform "
                "(no profile; the LRU slots catch part of it)")
    return (f"predicted cold-hit rate: [bold]{100 * plan.predicted_cold_hit:.1f}%[/] of routed decode experts "
            "are neither resident nor pinned (from the routing counts; the LRU slots catch part of it)")


def stock_cpu_layers(plan: Plan, stock: StockBaseline | None = None) -> tuple[int, int]:
    """(MoE layers whose experts stock llama.cpp keeps on the CPU, MoE layers)."""
    s = stock or plan.stock
    moe = [l.index for l in plan.layers if l.mode in ("resident", "cached", "host")]
    return sum(1 for i in moe if i < s.n_cpu_moe), len(moe)


def compact_ot(stock: StockBaseline) -> str:
    """One `-ot` value equivalent to --n-cpu-moe N (an alternation over the layers)."""
    if stock.n_cpu_moe <= 0:
        return ""
    alt = "|".join(str(i) for i in range(stock.n_cpu_moe))
    layers = alt if stock.n_cpu_moe == 1 else f"({alt})"
    return f"blk\\.{layers}{STOCK_EXPS_REGEX}=CPU"


def stock_lines(plan: Plan) -> list[str]:
    """What stock llama.cpp does with the same budget, for comparison."""
    s = plan.stock
    budget = fmt_bytes(plan.budget_bytes)
    cpu, moe = stock_cpu_layers(plan)
    out = []
    if s.fits and s.n_cpu_moe == 0:
        out.append("stock llama.cpp, same budget: every expert fits on the device "
                   f"(-ngl 99, {fmt_bytes(s.device_bytes)})")
    elif s.fits:
        out.append(f"stock llama.cpp, same budget: [bold]-ngl 99 --n-cpu-moe {s.n_cpu_moe}[/] "
                   f"({fmt_bytes(s.device_bytes)} of {budget}): the experts of {cpu} of {moe} MoE layers "
                   f"run on the CPU ({100 * cpu / max(moe, 1):.0f}% of routed experts)")
        out.append(f"  same as -ot '{compact_ot(s)}'")
    else:
        out.append(f"stock llama.cpp, same budget: does not fit even with every expert on the CPU "
                   f"(needs {fmt_bytes(s.device_bytes)}, over by {units.shortfall(s.device_bytes - plan.budget_bytes)})")
    if s.n_cpu_moe > 0 or not s.fits:
        verdict = "fits" if s.cpu_moe_fits else "does not fit"
        out.append(f"  --cpu-moe (all experts on the CPU): {fmt_bytes(s.cpu_moe_device_bytes)}, {verdict}")
    return out


def _speed(v: float | None) -> str:
    return "-" if v is None or v == float("inf") else f"{v:.1f}"


def prediction_table(plan: Plan) -> Table | None:
    """The plan beside stock's placements for the same budget, priced by the cost model (None:
    not priced in time). Prompt speed is "-" where it is not predicted."""
    p = plan.predicted
    if not p:
        return None
    t = Table(title=f"predicted per token ({p['objective']} time chosen)", title_justify="left")
    for col in ("placement", "VRAM", "stops/tok", "tg tok/s", "pp tok/s", "tg vs stock"):
        t.add_column(col, justify="left" if col == "placement" else "right", no_wrap=col == "placement")
    alts = p.get("alternatives") or []
    stock = next((a for a in alts if a["name"] == "n-cpu-moe" and a["fits"]), None)
    for a in alts:
        if not a["fits"]:
            t.add_row(a["label"], units.gib(a["device_bytes"]), "-", "does not fit", "-", "-", style="dim")
            continue
        vs = f"{a['tg_tok_s'] / stock['tg_tok_s']:.2f}x" if stock and stock["tg_tok_s"] and a["tg_tok_s"] else "-"
        t.add_row(a["label"], units.gib(a["device_bytes"]), str(a["stops"]), _speed(a["tg_tok_s"]),
                  _speed(a["pp_tok_s"]), vs, style="bold" if a["name"] == "spark" else "")
    return t


def prediction_line(plan: Plan) -> str:
    """Where the prediction's figures come from, in one line."""
    p = plan.predicted
    if not p:
        return ("not priced in time: no device costs for this device, model and -t yet (`spark bench` measures "
                "them; --predict-for NAME uses a card's published figures): placed by hits alone")
    kind = "from this device's measured costs" if p.get("measured", True) else \
        "predicted from published figures, not measured"
    return f"priced in time, {kind}: {p['costs']}"
