#!/usr/bin/env python3
"""docs/what-fits.md's table: Spark's plan and stock `--n-cpu-moe N` per fixture and budget.

Builds the geometry fixtures (sparse GGUFs, a few MB each; models/fixtures.py), plans each one with
`planner.plan_for` at every budget (uniform routing prior: no profile) and prints a Markdown table:
the share of expert bytes Spark keeps on the device (resident experts + cache slots), its layers
(resident / cached / host), the device bill, and the smallest `--n-cpu-moe N` whose stock bill fits.

With --predict-for CARD (default rtx-4060-ti-16gb) the plans are priced in time for that card's published
figures (core/device_table.py; --cold-hit, --host-bandwidth, --host-cores: the assumptions) and the table
adds the predicted generation tok/s of Spark's plan and of stock's --n-cpu-moe N: predictions, not
measurements (`--predict-for none`: placed by hits alone, no speed columns).

Usage: .venv/bin/python scripts/what_fits.py [--vram 8,12,16,24] [-c 8192] [--fixtures a,b] [--out-dir DIR]
       [--predict-for CARD] [--cold-hit 0.1] [--host-bandwidth 60] [--host-cores 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spark_cli.core import device_table  # noqa: E402
from spark_cli.core.gguf_info import load_geometry  # noqa: E402
from spark_cli.core.options import DEFAULT_CTX  # noqa: E402
from spark_cli.core.planner import PlanRequest, plan_for  # noqa: E402
from spark_cli.core.units import GiB, fmt_bytes  # noqa: E402
from spark_cli.errors import PlanError  # noqa: E402
from spark_cli.models.fixtures import FIXTURES, build_fixture  # noqa: E402


def plan_row(g, budget: int, n_ctx: int, predict: dict | None = None) -> dict:
    """One (fixture, budget) cell: Spark's residency and bill, stock's N, and with `predict` (card,
    cold_hit, host_gb_s, host_cores) both predicted tg tok/s; `error` when no plan fits."""
    costs = None
    if predict is not None:
        costs = device_table.predicted_costs(predict["card"], g, predict["host_gb_s"], predict["host_cores"])
    try:
        res = plan_for(g, PlanRequest(budget_bytes=budget, n_ctx=n_ctx, costs=costs,
                                      assumed_cold_hit=predict["cold_hit"] if predict else None))
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vram", default="8,12,16,24", help="budgets in GiB, comma-separated")
    ap.add_argument("-c", "--ctx", type=int, default=DEFAULT_CTX, help="context size (default: Spark's)")
    ap.add_argument("--fixtures", default=",".join(FIXTURES), help="fixture names, comma-separated")
    ap.add_argument("--out-dir", type=Path, default=None, help="where the fixtures go (default: $SPARK_HOME/models)")
    ap.add_argument("--predict-for", default="rtx-4060-ti-16gb", help="card whose published figures price the "
                    "plans (none: placed by hits alone)")
    ap.add_argument("--cold-hit", type=float, default=0.2, help="assumed share of routed experts a cached layer "
                    "misses with k slots (no profile)")
    ap.add_argument("--host-bandwidth", type=float, default=device_table.DEFAULT_HOST_GB_S, help="host GB/s")
    ap.add_argument("--host-cores", type=int, default=8, help="host CPU cores")
    a = ap.parse_args(argv)
    budgets = [int(float(x) * GiB) for x in a.vram.split(",")]
    predict = None
    if a.predict_for != "none":
        card = device_table.card(a.predict_for)
        predict = {"card": card, "cold_hit": a.cold_hit, "host_gb_s": a.host_bandwidth, "host_cores": a.host_cores}
        print(f"predicted from published figures, not measured: {card.describe()}; host {a.host_bandwidth:g} GB/s, "
              f"{a.host_cores} cores; assumed cold-hit {a.cold_hit:g} at k slots; {device_table.ASSUMPTIONS}\n")
    print(f"n_ctx {a.ctx}, f16 KV cache, n_ubatch 512, no routing profile (uniform prior)\n")
    print(table(a.fixtures.split(","), budgets, a.ctx, a.out_dir, predict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
