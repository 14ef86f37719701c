"""`spark bench --ram SIZE`: the file tier against stock's page cache under one RAM cap (runs/ram_bench.py)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..core import units
from ..core.options import LoadFlags
from ..files.atomic import atomic_write_text
from ..runs import ram_bench
from ..errors import UsageError
from .common import console, err_console

MIN_CAP = 128 << 20  # the runtime of one worker (Python, llama.cpp's libraries) alone takes about this

KEYS = (("pp_tok_s", "pp tok/s", "{:.2f}"), ("tg_tok_s", "tg tok/s", "{:.2f}"),
        ("pp_read_bytes_per_token", "pp disk read / token", "bytes"),
        ("read_bytes_per_token", "disk read / token", "bytes"), ("major_faults_per_token", "major faults / token", "{:.1f}"),
        ("file_bytes_per_token", "file tier read / token", "bytes"),
        ("replayed_bytes_per_token", "replayed / token", "bytes"), ("hit_rate", "RAM hit rate", "{:.1%}"),
        ("file_read_s_per_token", "read wait / token", "ms"), ("predicted_read_s_per_token", "predicted read wait", "ms"),
        ("ahead_recall", "misses read ahead", "{:.0%}"), ("ahead_precision", "reads ahead used", "{:.0%}"),
        ("resident_share", "experts in RAM", "{:.0%}"), ("peak", "cgroup peak", "bytes"),
        ("predicted_tg_tok_s", "predicted tg tok/s", "{:.2f}"))


def _fmt(v, how: str) -> str:
    if v is None:
        return "-"
    if how == "ms":
        return f"{v * 1e3:.1f} ms"
    return units.fmt_bytes(int(v)) if how == "bytes" else how.format(v)


def verdict(b: ram_bench.RamBench) -> str:
    """One line: the tier against stock, or, where the cost model prices the page cache faster (what chat
    and serve then run), that Spark maps the file as stock does, and what the tier measured."""
    tg, pp, exact = b.ratio("tg_tok_s"), b.ratio("pp_tok_s"), b.exact()
    if tg is None:
        return "no comparison: a configuration did not finish (see the errors above)"
    same = "the same tokens" if exact else "DIFFERENT TOKENS (a bug: report it)"
    oom = "no run was OOM-killed" if not any(r.oom_kills for r in b.runs) else "a run was OOM-killed"
    cap = units.fmt_bytes(b.cap)
    if mapping_chosen(b):
        tier, mapped = b.median("spark", "predicted_tg_tok_s"), b.median("stock", "predicted_tg_tok_s")
        return (f"under {cap}: Spark maps the file as stock does (1.00x): the page cache is predicted faster here "
                f"({mapped:.2f} against the tier's {tier:.2f} tok/s); its RAM tier measured {tg:.2f}x stock's tg, "
                f"{pp:.2f}x pp, {same}; {oom}")
    return f"under {cap}: Spark generates {tg:.2f}x stock's speed, prompts at {pp:.2f}x, {same}; {oom}"


def mapping_chosen(b: ram_bench.RamBench) -> bool:
    """Whether chat and serve would map the file under this cap: the page cache predicted MIN_GAIN faster
    than the tier (runs/page_cache_choice's rule, on the bench's own figures)."""
    from ..runs.page_cache_choice import prefers_mapping

    tier, mapped = b.median("spark", "predicted_tg_tok_s"), b.median("stock", "predicted_tg_tok_s")
    return bool(tier and mapped and prefers_mapping(tier, mapped))


def ahead_line(b: ram_bench.RamBench) -> str | None:
    """What read-ahead did: spark-ahead's tg against spark's, and its accuracy (None: not run)."""
    a, s = b.median("spark-ahead", "tg_tok_s"), b.median("spark", "tg_tok_s")
    if not a or not s:
        return None
    rec, prec = b.median("spark-ahead", "ahead_recall"), b.median("spark-ahead", "ahead_precision")
    gate = b.of("spark-ahead")[0].ahead_min_prob / (1 << 16)
    acc = (f"{rec:.0%} of the misses read ahead, {prec:.0%} of the reads ahead used"
           if rec is not None and prec is not None else "nothing read ahead")
    return (f"read-ahead (one expert a layer, predicted chance at least {gate:.2f}): tg {a / s:.2f}x Spark's "
            f"without it; {acc}")


def prediction_ratios(b: ram_bench.RamBench) -> dict[str, float]:
    """Each configuration's median predicted tg over its median measured tg (where both exist)."""
    out = {}
    for c in ram_bench.CONFIGS:
        pred, meas = b.median(c, "predicted_tg_tok_s"), b.median(c, "tg_tok_s")
        if pred and meas:
            out[c] = pred / meas
    return out


def table(b: ram_bench.RamBench, md: bool) -> str | Table:
    heads = ["configuration", *(h for _, h, _ in KEYS)]
    rows = [[c, *(_fmt(b.median(c, k), how) for k, _, how in KEYS)] for c in ram_bench.CONFIGS if b.of(c)]
    if md:
        lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    t = Table(title=f"spark bench --ram {units.fmt_bytes(b.cap)} (medians, each run in its own memory cgroup)")
    for h in heads:
        t.add_column(h, justify="left" if h == "configuration" else "right")
    for r in rows:
        t.add_row(*r)
    return t


def device_shape(path: Path, flags: LoadFlags, n_ctx: int, budget: Callable[[list, int], tuple[int, str]],
                 stack: contextlib.ExitStack) -> ram_bench.DeviceShape | None:
    """Three tiers with --rpc (auto: a local stand-in started here, outside the runs' cgroups): every run
    on that device with stock's --n-cpu-moe N for the budget (--vram, --residency or the device's)."""
    if not flags.rpc:
        return None
    from ..core import planner
    from ..core.gguf_info import load_geometry
    from ..native import devices, rpc as rpc_mod
    from ..runs import session

    endpoint = flags.rpc
    if endpoint == "auto":
        endpoint = stack.enter_context(rpc_mod.RpcServer(threads=flags.threads).start()).endpoint
    devs = devices.select(devices.parse(None, endpoint))
    if not devs:
        raise UsageError(f"--rpc {flags.rpc}: no device answered", hint="start the RPC server, or use --rpc auto")
    g = load_geometry(path)
    bytes_, _ = budget(devs, n_ctx)
    stock = planner.stock_baseline(g, bytes_, planner.fixed_bytes(g, n_ctx, **session.kv_settings(flags)))
    if not stock.fits:
        raise UsageError(f"--rpc with --ram: stock --cpu-moe does not fit {units.fmt_bytes(bytes_)} of device memory",
                         hint="raise --vram or --residency")
    return ram_bench.DeviceShape(endpoint, stock.n_cpu_moe)


def run_cmd(path: Path, flags: LoadFlags, n_prompt: int, n_gen: int, reps: int, as_json: bool, output: Path | None,
            md: bool, residency: float | None = None, budget: Callable[[list, int], tuple[int, str]] | None = None) -> None:
    """Every configuration under the cap (--ram, or --ram-residency's), interleaved; the table, the
    verdict, -o/--json."""
    if flags.ram is not None and flags.ram < MIN_CAP:
        raise UsageError(f"--ram {units.fmt_bytes(flags.ram)}: too small a cap for any run (the runtime alone "
                         f"takes more)", hint=f"give at least {units.fmt_bytes(MIN_CAP)}: a little less than the model file")
    with contextlib.ExitStack() as stack:
        n_ctx = ram_bench.run_context(flags.ctx_size or 512, n_prompt, n_gen)
        device = device_shape(path, flags, n_ctx, budget, stack) if budget is not None else None
        _run_and_show(path, flags, n_prompt, n_gen, reps, as_json, output, md, device, residency)


def _run_and_show(path: Path, flags: LoadFlags, n_prompt: int, n_gen: int, reps: int, as_json: bool,
                  output: Path | None, md: bool, device: ram_bench.DeviceShape | None, residency: float | None) -> None:
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=err_console, transient=True) as prog:
        cap = units.fmt_bytes(flags.ram) if flags.ram is not None else f"--ram-residency {residency:g}"
        task = prog.add_task(f"runs under {cap}", total=ram_bench.total_runs(reps, ram_bench.CONFIGS))

        def on_run(i: int, n: int, r: ram_bench.RamRun) -> None:
            prog.update(task, completed=i)
            if not r.ok:
                err_console.print(f"[yellow]warning:[/] {r.config}: {escape(r.error)}", soft_wrap=True)

        b = ram_bench.run(path, flags.ram, reps=reps, n_prompt=n_prompt, n_gen=n_gen, threads=flags.threads,
                          n_ctx=flags.ctx_size or 512, device=device, residency=residency, on_run=on_run)
    d = b.to_dict()
    if output is not None:
        atomic_write_text(output, json.dumps(d, indent=1) + "\n", flag="-o")
    if as_json:
        print(json.dumps(d))
        return
    tier = next((r.tier for r in b.of("spark")), "")
    out = console
    out.print(table(b, md))
    if tier:
        out.print(f"[dim]{escape(tier)}[/]", soft_wrap=True)
    if b.base is not None and b.base.ok and b.disk is not None:
        same = {True: "the same tokens as", False: "OTHER TOKENS THAN", None: "not compared with"}[b.exact_vs_uncapped()]
        faults = (f" ({units.fmt_bytes(int(b.faults.bytes_per_s))}/s faulted through the mapping, {b.faults.depth} "
                  f"threads)" if b.faults is not None else "")
        stock = (f"; stock uncapped {b.stock_base.tg_tok_s:.2f} tg, {b.stock_base.pp_tok_s:.2f} pp"
                 if b.stock_base is not None and b.stock_base.ok else "")
        out.print(f"physical limits: uncapped {b.base.tg_tok_s:.2f} tok/s tg, {b.base.pp_tok_s:.2f} pp (Spark, no cap: "
                  f"{same} the capped runs){stock}; the disk {units.fmt_bytes(int(b.disk.bytes_per_s))}/s at "
                  f"{units.fmt_bytes(b.disk.read_bytes)} reads, {b.disk.depth} in flight{faults}",
                  soft_wrap=True, markup=False)
    ratios = prediction_ratios(b)
    if ratios:
        out.print("tg predicted over measured: " + ", ".join(f"{c} {r:.2f}" for c, r in ratios.items()),
                  soft_wrap=True, markup=False)
    out.print(verdict(b), soft_wrap=True, markup=False)
    ahead = ahead_line(b)
    if ahead:
        out.print(ahead, soft_wrap=True, markup=False)
