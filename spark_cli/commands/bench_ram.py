"""`spark bench --ram SIZE`: the file tier against stock's page cache under one RAM cap (runs/ram_bench.py)."""

from __future__ import annotations

import json
from pathlib import Path

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
        ("file_bytes_per_token", "file tier read / token", "bytes"), ("hit_rate", "RAM hit rate", "{:.1%}"),
        ("resident_share", "experts in RAM", "{:.0%}"), ("peak", "cgroup peak", "bytes"),
        ("predicted_tg_tok_s", "predicted tg tok/s", "{:.2f}"))


def _fmt(v, how: str) -> str:
    if v is None:
        return "-"
    return units.fmt_bytes(int(v)) if how == "bytes" else how.format(v)


def verdict(b: ram_bench.RamBench) -> str:
    tg, pp, exact = b.ratio("tg_tok_s"), b.ratio("pp_tok_s"), b.exact()
    if tg is None:
        return "no comparison: a configuration did not finish (see the errors above)"
    same = "the same tokens" if exact else "DIFFERENT TOKENS (a bug: report it)"
    return (f"under {units.fmt_bytes(b.cap)}: Spark generates {tg:.2f}x stock's speed, prompts at {pp:.2f}x, "
            f"{same}; no run was OOM-killed" if not any(r.oom_kills for r in b.runs) else
            f"under {units.fmt_bytes(b.cap)}: tg {tg:.2f}x, pp {pp:.2f}x; a run was OOM-killed")


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


def run_cmd(path: Path, flags: LoadFlags, n_prompt: int, n_gen: int, reps: int, as_json: bool, output: Path | None,
            md: bool) -> None:
    """Every configuration under the cap, interleaved; the table, the verdict, -o/--json."""
    assert flags.ram is not None
    if flags.ram < MIN_CAP:
        raise UsageError(f"--ram {units.fmt_bytes(flags.ram)}: too small a cap for any run (the runtime alone "
                         f"takes more)", hint=f"give at least {units.fmt_bytes(MIN_CAP)}: a little less than the model file")
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=err_console, transient=True) as prog:
        task = prog.add_task(f"runs under {units.fmt_bytes(flags.ram)}", total=reps * len(ram_bench.CONFIGS) + 1)

        def on_run(i: int, n: int, r: ram_bench.RamRun) -> None:
            prog.update(task, completed=i)
            if not r.ok:
                err_console.print(f"[yellow]warning:[/] {r.config}: {escape(r.error)}", soft_wrap=True)

        b = ram_bench.run(path, flags.ram, reps=reps, n_prompt=n_prompt, n_gen=n_gen, threads=flags.threads,
                          n_ctx=flags.ctx_size or 512, on_run=on_run)
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
        pred, meas = b.median("spark", "predicted_tg_tok_s"), b.median("spark", "tg_tok_s")
        ratio = f"; predicted over measured {pred / meas:.2f}" if pred and meas else ""
        same = {True: "the same tokens as", False: "OTHER TOKENS THAN", None: "not compared with"}[b.exact_vs_uncapped()]
        out.print(f"physical limits: uncapped {b.base.tg_tok_s:.2f} tok/s tg, {b.base.pp_tok_s:.2f} pp (Spark, no cap: "
                  f"{same} the capped runs); the disk {units.fmt_bytes(int(b.disk.bytes_per_s))}/s at "
                  f"{units.fmt_bytes(b.disk.read_bytes)} reads, {b.disk.depth} in flight{ratio}",
                  soft_wrap=True, markup=False)
    out.print(verdict(b), soft_wrap=True, markup=False)
