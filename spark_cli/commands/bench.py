"""`spark bench`: is Spark worth it on this card? Side-by-side tokens/s against stock llama.cpp
offload, every configuration within the same VRAM budget, on corpus text."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..core.options import LoadFlags, context_size
from ..core.simulator import MissPath
from ..errors import SaveError, SparkError, UsageError
from ..files.atomic import atomic_write_bytes, atomic_write_text, check_output
from ..files.corpus import bundled_corpus, read_corpus
from ..files.recovery import save_or_recover
from ..native import devices, faults, rpc as rpc_mod
from ..runs import bench, session
from ..runs.bench import (ParallelResult, accounting_rows, footnotes, infill_line, parallel_rows, prediction_rows,
                          speed_rows, stop_rows, to_markdown)
from .common import MISS_PATH_HELP, console, err_console, model_flags, model_or_demo, parse_miss_path, run_inputs
from .help import SparkCommand
from .render_plan import fmt_bytes
from .tables import Whole

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from rich.console import Console
    from rich.table import Table

    from ..runs.bench import Report, Result


def _budget(vram_text: str | None, residency: float | None, geometry, ctx: int, devs: list,
            kv: dict | None = None) -> tuple[int, str]:
    """--vram, else --residency with the run's -ctk/-ctv/-ub (kv: session.kv_settings), else the device's."""

    if vram_text and residency is not None:
        raise UsageError("--vram and --residency: give one of them")
    if residency is not None:
        return (bench.residency_budget(geometry, ctx, residency, **(kv or {})),
                f"--residency {residency:g}: everything else + {100 * residency:.0f}% of the expert bytes")
    b = session.resolve_budget(vram_text, devs)
    if len(b.per_device) > 1:
        raise UsageError(f"bench compares placements on one device; {len(b.per_device)} are selected",
                         hint="pick one with -dev (spark plan, chat and serve place a model over several)")
    return b.bytes, b.source


SPEED_CAPTION = ("tok/s: median (min-max) of the runs; pp: prompt processing, tg: generation; "
                 "x/stock: against the best stock configuration, x/ceiling: against all resident")
ACCOUNTING_CAPTION = ("per token: tg per generated token (decode steps), pp per prompt token (prompt processing); "
                      "cold-hit: routed decode experts not on the device; uploads: expert uploads; "
                      "syncs: device -> host stops; blocking/async MiB: uploads waited for / in the background; "
                      "staged: staged uploads (count, MiB); CPU MiB: host expert bytes computed on the CPU; "
                      "-: not measured or not modelled")

STOPS_CAPTION = ("per decode token: stops: times the device waits for the host (stock: its host layers; Spark: "
                 "host nodes, measured); per stop, what the stops add to all-resident's TCP traffic with the RPC "
                 "server: replies the client waited for, segments it sent (3 per command); per stop, counted by "
                 "the cache from its graph: reads (copies down) and writes (copies up); blocking: the cache's own "
                 "blocking device calls per token; MiB in/out: TCP bytes with the RPC server per token; "
                 "-: not measured, or not on RPC")


def parallel_caption(n: int) -> str:
    return (f"-np {n}: {n} corpus prompts, -n tokens each, greedy; tg: aggregate tok/s of the all-decode steps "
            f"(tokens decoded / their wall time, median of the runs), together: the {n} sequences in one batch "
            f"(one token each per step), serial: one after another, each alone; ratio: together / serial; "
            f"hit rate and uploads per decoded token: the expert cache in those steps (1: serial, {n}: together)")


def _rich_table(title: str, caption: str, data: list[dict[str, str]]) -> "Table":
    """An empty table with the columns of display rows `data` (the first left-aligned, the rest
    right), each at least as wide as its header's longest word: rich wraps a header, never cuts it."""

    t = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for col in data[0] if data else []:
        t.add_column(col, justify="left" if col == "configuration" else "right",
                     min_width=max(len(word) for word in col.split()))
    return t


def speed_table(report: "Report") -> "Table":
    """(a) prompt and generation tok/s and the ratios; a configuration that did not run is dim."""

    data = speed_rows(report)
    t = _rich_table(f"spark bench: {report.model.name} on {report.device}", SPEED_CAPTION, data)
    for r, res in zip(data, report.results):
        t.add_row(*r.values(), style="" if res.runs else "dim")
    return t


def accounting_table(report: "Report") -> "Table":
    """(b) the per-token accounting: per generated token (tg), then per prompt token (pp), each configuration."""

    data = accounting_rows(report)
    t = _rich_table("per-token accounting", ACCOUNTING_CAPTION, data)
    for r in data:
        t.add_row(*r.values(), end_section=r["phase"] == "pp")
    return t


PREDICTION_CAPTION = ("predicted: the cost model with this device's measured costs (spark plan prints the same); "
                      "pred/meas: predicted over measured tok/s; stops/tok: device stops per generated token")


def _filled_table(title: str, caption: str, data: list[dict[str, str]]) -> "Table":
    """_rich_table with `data`'s rows in it."""
    t = _rich_table(title, caption, data)
    for r in data:
        t.add_row(*r.values())
    return t


def prediction_table(report: "Report") -> "Table":
    """Predicted beside measured tok/s for every configuration the cost model priced."""

    return _filled_table("predicted and measured", PREDICTION_CAPTION, prediction_rows(report))


def stops_table(report: "Report") -> "Table":
    """A decode token's stops and their round trips, each configuration."""

    return _filled_table("stops and round trips per decode token", STOPS_CAPTION, stop_rows(report))


def parallel_table(report: "Report") -> "Table":
    """(c) -np N: N sequences decoded together against one after another."""

    data = parallel_rows(report)
    t = _rich_table(f"{report.n_parallel} sequences: together against one after another",
                    parallel_caption(report.n_parallel), data)
    if t.columns:  # the labels whole: the headers wrap instead
        t.columns[0].no_wrap = True
    for r in data:
        t.add_row(*r.values())
    return t


def _parallel_lines(report) -> list[str]:
    """-np N: do Spark's sequences decode the same tokens together as alone, and as stock's?"""
    out = []
    for r in report.results:
        p = r.parallel
        if r.config.kind != "spark" or p is None or p.tokens_match is None or r.same_as:
            continue
        if p.tokens_match:
            out.append(f"{r.config.label}: each sequence's tokens decoded together equal those decoded alone")
            continue
        ref = next((x for x in report.results if x.config.kind != "spark" and x.parallel is not None
                    and (x.parallel.serial_digest, x.parallel.together_digest) == (p.serial_digest, p.together_digest)),
                   None)
        if ref is not None:  # NOTE: llama.cpp itself is not batch-invariant; the cache matches it batch for batch
            out.append(f"{r.config.label}: tokens decoded together differ from those decoded alone, as "
                       f"{ref.config.label}'s do (llama.cpp's batched steps are not bit-identical to single ones); "
                       f"the same tokens as {ref.config.label} either way")
        else:
            out.append(f"[yellow]{r.config.label}: tokens decoded together differ from those decoded alone[/]")
    return out


def _summary_lines(report) -> list[str]:

    g = report.geometry
    out = [f"budget {fmt_bytes(report.budget_bytes)} ({report.budget_source}); "
           f"{len(g.moe_layers)} MoE layers x {g.n_expert} experts (top-{g.n_expert_used}), "
           f"{fmt_bytes(g.total_expert_bytes)} of experts; pp {report.n_prompt} tokens, "
           f"tg {report.n_gen} tokens, median (min-max) of {bench.run_counts(report)}"
           + (f"; -np {report.n_parallel}: {report.n_parallel} sequences per configuration"
              if report.n_parallel > 1 else "")]
    spark = report.result("spark")
    if spark is not None and spark.config.plan is not None:
        s = spark.config.summary(g)
        out.append(f"Spark: {100 * s['expert_residency']:.1f}% of expert bytes on the device "
                   f"({s['cached_layers']} cached layers, {len(s['host_layers'])} host layers, {s['pinned']} pinned, "
                   f"{s['lru_slots']} LRU slots)")
    if report.baseline:
        out.append(f"ratios against the best stock configuration ({report.baseline})"
                   + (f" and the ceiling ({report.ceiling})" if report.ceiling else "; no ceiling measured"))
    for key, t in report.targets().items():
        if t["value"] is not None:
            verdict = "[green]met[/]" if t["met"] else "[red]not met[/]"
            ref = "ceiling" if key.endswith("ceiling") else "best stock"
            phase = "prompt processing" if key.startswith("pp") else "generation"
            out.append(f"target: Spark {phase} >= {t['target']:g}x {ref}: {t['value']:.2f}x, {verdict}")
    digests = {r.config.name: r.tokens_digest for r in report.results if r.tokens_digest}
    if "spark" in digests and "resident" in digests:
        same = digests["spark"] == digests["resident"]
        out.append("generated tokens: Spark's equal the all-resident run's" if same else
                   "[yellow]generated tokens: Spark's differ from the all-resident run's[/]")
    out += _parallel_lines(report)
    if report.infill is not None:
        out.append(infill_line(report))

    return footnotes(report) + out + list(report.notes)


def print_report(report: "Report", to: "Console") -> None:
    """The tables, whole at any width (a log's 80 columns too), then the summary lines."""
    to.print(Whole(speed_table(report)))
    if any(r.config.predicted is not None for r in report.results):
        to.print(Whole(prediction_table(report)))
    if any(r.runs for r in report.results):
        to.print(Whole(accounting_table(report), keys=2))  # a row is a configuration and a phase
        to.print(Whole(stops_table(report)))
    if any(r.parallel is not None for r in report.results):
        to.print(Whole(parallel_table(report)))
    for line in _summary_lines(report):
        to.print(line, soft_wrap=True)


def _write_outputs(report, as_json: bool, json_path: Path | None, md: bool, plot: Path | None) -> None:

    report.finalize()
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=1))
    elif md:
        typer.echo(to_markdown(report))
        for line in _summary_lines(report):
            typer.echo(_plain(line))
    else:
        print_report(report, console)
    if json_path is not None:
        text = json.dumps(report.to_dict(), indent=1) + "\n"
        save_or_recover(lambda p: atomic_write_text(p, text, "-o"), json_path)
        err_console.print(f"wrote {json_path}")
    if plot is not None:
        _plot(report, plot)
        err_console.print(f"wrote {plot}")


def _keep_partial(report, json_path: Path | None, learn: bool) -> str | None:
    """The device was lost mid-bench: write the partial report and fold the routing measured so far."""

    report.interrupted = True
    report.notes.append("device lost: what was measured before it")
    notes = []
    if json_path is not None:
        try:
            report.finalize()
            atomic_write_text(json_path, json.dumps(report.to_dict(), indent=1) + "\n", "-o")
            notes.append(f"partial report in {json_path}")
        except SparkError as e:
            notes.append(e.one_line())
    try:
        _fold(report, learn)
    except SparkError as e:
        notes.append(e.one_line())
    return "; ".join(notes) or None


def _plain(line: str) -> str:

    return Text.from_markup(line).plain


PHASES = (("pp", "prompt processing tokens/s"), ("tg", "generation tokens/s"))


def _bar_color(kind: str) -> str:
    return "tab:orange" if kind == "spark" else "tab:gray" if kind == "stock" else "tab:green"


def _speed_panel(ax: "Axes", done: list["Result"], what: str, xlabel: str) -> None:
    """Horizontal bars of one phase's medians with min-max whiskers, each labelled with its median."""
    spreads = [getattr(r, what) for r in done]
    med = [s.median for s in spreads]
    err = [[s.median - s.min for s in spreads], [s.max - s.median for s in spreads]]
    bars = ax.barh([r.config.label for r in done], med, xerr=err,
                   color=[_bar_color(r.config.kind) for r in done], capsize=3)
    ax.bar_label(bars, labels=[f"{m:.1f}" for m in med], padding=4, fontsize=8)
    ax.set_xlabel(f"{xlabel} (median, min-max)")
    ax.set_xlim(0, max((s.max for s in spreads), default=0) * 1.25 or 1)  # room for the labels


def _parallel_panel(ax: "Axes", done: list["Result"], n: int, ylim: tuple[float, float]) -> None:
    """-np N: two bars per configuration, aggregate generation tok/s together (solid) and one
    after another (hatched), medians; rows level with the other panels' (ylim)."""

    def med(runs) -> float:

        s = ParallelResult.spread(runs)
        return s.median if s is not None else 0.0

    pos = np.arange(len(done))
    colors = [_bar_color(r.config.kind) for r in done]
    together = [med(r.parallel.together) if r.parallel else 0.0 for r in done]
    serial = [med(r.parallel.serial) if r.parallel else 0.0 for r in done]
    a = ax.barh(pos - 0.2, together, height=0.4, color=colors)
    b = ax.barh(pos + 0.2, serial, height=0.4, color=colors, alpha=0.45, hatch="//")
    for bars, vals in ((a, together), (b, serial)):
        ax.bar_label(bars, labels=[f"{v:.1f}" for v in vals], padding=4, fontsize=8)
    ax.set_yticks(pos, labels=[r.config.label for r in done])
    ax.tick_params(axis="y", labelleft=False)
    ax.set_ylim(ylim)
    ax.set_xlabel(f"generation tokens/s, {n} sequences (aggregate, median)")
    ax.set_xlim(0, max(together + serial, default=0) * 1.45 or 1)  # room for the labels and the legend
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", label=f"{n} together"),
                       Patch(facecolor="white", edgecolor="black", hatch="//", label="one after another")],
              fontsize=7, loc="best")


def speed_figure(report: "Report") -> "Figure":
    """Prompt processing and generation tok/s side by side, one bar per measured configuration;
    with -np N a third panel: N sequences together against one after another."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in report.results if r.tg is not None and r.pp is not None]
    par = any(r.parallel is not None for r in done)
    n_panels = len(PHASES) + par
    fig, axes = plt.subplots(1, n_panels, figsize=(5.5 * n_panels, 0.6 * max(len(done), 2) + 1.4))
    for ax in axes[1:len(PHASES)]:
        ax.sharey(axes[0])
        ax.tick_params(axis="y", labelleft=False)
    for ax, (what, xlabel) in zip(axes, PHASES):
        _speed_panel(ax, done, what, xlabel)
    axes[0].invert_yaxis()  # shared: the first configuration on top in both
    if par:
        _parallel_panel(axes[-1], done, report.n_parallel, axes[0].get_ylim())
    fig.suptitle(f"{report.model.name} on {report.device}, budget {report.budget_bytes / 2**30:.2f} GiB", fontsize=9)
    fig.tight_layout()
    return fig


def _plot(report: "Report", path: Path) -> None:

    import matplotlib.pyplot as plt


    fig = speed_figure(report)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    data = buf.getvalue()
    save_or_recover(lambda p: atomic_write_bytes(p, data, "--plot"), path)


@model_flags
def bench_cmd(
    model: Path = typer.Argument(None, help="GGUF model (default: the built-in demo model)", show_default=False),
    vram_text: str = typer.Option(None, "--vram", help="device budget every configuration must fit, e.g. "
                                  "16GiB (default: the device's free memory minus a margin)"),
    residency: float = typer.Option(None, "--residency", min=0.0, max=1.0,
                                    help="instead of --vram: a budget that holds this share of the expert "
                                         "bytes beside everything else, e.g. 0.6"),
    ram_residency: float = typer.Option(None, "--ram-residency", min=0.0, max=1.0,
                                        help="instead of --ram: a memory cgroup cap that leaves this share of "
                                             "the RAM tier's expert bytes resident after everything else the "
                                             "uncapped run holds, e.g. 0.6"),
    corpus_path: Path = typer.Option(None, "--corpus", help="text to run: a file or folder of "
                                     ".txt/.md/.jsonl (default: the bundled sample corpus)"),
    n_prompt: int = typer.Option(512, "--n-prompt", "-p", min=2, help="prompt-processing tokens per run"),
    n_gen: int = typer.Option(128, "--n-gen", "-n", min=1, help="generated tokens per run (greedy)"),
    reps: int = typer.Option(3, "--repetitions", "-r", min=1, help="runs per configuration, at least: up to "
                            "twice as many while generation timings spread wider than a quarter of their median"),
    as_json: bool = typer.Option(False, "--json", help="print the full report as JSON on stdout"),
    output: Path = typer.Option(None, "--output", "-o", help="write the full report as JSON here"),
    md: bool = typer.Option(False, "--md", help="print a markdown table (for an issue) instead of the rich one"),
    plot: Path = typer.Option(None, "--plot", help="write bar charts of prompt processing and generation "
                              "tok/s, side by side (PNG); with -np N > 1 a third: N sequences together "
                              "against one after another"),
    configs: str = typer.Option(None, "--configs", help="comma-separated subset of: resident, cpu-moe, "
                                "n-cpu-moe, spark-step, spark (the default), and spark-layer (the per-layer "
                                "miss rule before per-expert misses)"),
    ceiling: bool = typer.Option(False, "--ceiling", help="measure all-resident even when it is over the "
                                 "budget (a reference; needs the device memory)"),
    no_learn: bool = typer.Option(False, "--no-learn", help="do not fold this run's routing into the profile"),
    miss_path: str = typer.Option("auto", "--miss-path", help=MISS_PATH_HELP),
    infill: bool = typer.Option(False, "--infill", help="also time /infill as editor plugins send it per keystroke: "
                                f"the first token of the FIM prompt for a {bench.INFILL_PREFIX}-token prefix of the "
                                "bundled code corpus, -r times per configuration (a model without FIM tokens: a "
                                "line naming them)"),
    flags: LoadFlags = None,
) -> None:
    """Tokens/s of Spark against stock llama.cpp offload and the all-resident ceiling, same budget.
    --rpc auto starts a local RPC stand-in GPU for the run.

    With -np/--parallel N > 1 every configuration is opened with N sequences and sized for them;
    after the usual single-sequence runs, each repetition also decodes N corpus prompts (-n tokens
    each) one after another and then all N together in one batch: aggregate generation tok/s of
    both, their ratio, and the cache's hit rate and uploads per token (a third table and panel)."""

    miss_choice = parse_miss_path(miss_path)
    names = bench.parse_config_names(configs)
    if plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise SparkError("--plot: matplotlib is not installed", hint="pip install matplotlib, or drop --plot")
    for flag, out in (("-o", output), ("--plot", plot)):  # before the runs, not after them
        if out is not None:
            check_output(out, flag, inputs=run_inputs(model, corpus=corpus_path))
    if output is not None and plot is not None and Path(output).expanduser().resolve() == Path(plot).expanduser().resolve():
        raise UsageError(f"-o {output} and --plot {plot}: the same file", hint="give two paths")
    path = model_or_demo(model)
    geometry = session.open_geometry(path)
    if flags.ram is not None and ram_residency is not None:
        raise UsageError("--ram and --ram-residency: give one of them")
    if flags.ram is not None or ram_residency is not None:  # NOTE: the cap of the memory cgroup each run gets
        if infill:
            raise UsageError("--infill with --ram: the RAM-tier bench times prompt and generation only",
                             hint="run --infill without --ram / --ram-residency")
        from . import bench_ram

        return bench_ram.run_cmd(path, flags, n_prompt, n_gen, reps, as_json, output, md, ram_residency,
                                 budget=lambda devs, n_ctx: _budget(vram_text, residency, geometry, n_ctx, devs,
                                                                    session.kv_settings(flags)))
    ctx = context_size(flags.ctx_size, geometry.context_length)
    corpus = read_corpus(corpus_path or bundled_corpus())
    g = geometry

    server = None
    try:
        if flags.rpc == "auto":
            with err_console.status("starting a local RPC stand-in GPU ..."):
                server = rpc_mod.RpcServer(threads=flags.threads).start()
            flags = dataclasses.replace(flags, rpc=server.endpoint)
        base = session.engine_options(path, g, None, flags, n_ctx=ctx, learn=False)
        devs = devices.select(devices.parse(flags.device, flags.rpc))
        notes = []
        if not devs:
            names = [bench.CPU_CONFIG]
            notes.append("no GPU-type device: measured on the CPU only; use --rpc auto to compare "
                         "placements on a local RPC stand-in GPU, or --rpc HOST:PORT")
            err_console.print(f"[yellow]note:[/] {notes[-1]}")
            budget, source = 0, "no device"
        else:
            budget, source = _budget(vram_text, residency, g, ctx, devs, session.kv_settings(flags))
        if server is not None:
            notes.append("device: a local RPC stand-in GPU (--rpc auto): its speed is the CPU's; "
                         "compare the cold-hit and upload figures")
        if devs and any(n.startswith("spark") for n in names):  # the device's self-check (runs/self_check.py)
            from ..files.paths import spark_home
            from ..runs import self_check

            notes.append(self_check.bench_line(devs[0], base.rpc, spark_home()))
            err_console.print(f"note: {escape(notes[-1])}", soft_wrap=True)
        report = bench.Report(path, g, budget, source, ctx, n_prompt, n_gen, reps,
                              devs[0].name if devs else "CPU", str(corpus_path or "bundled corpus"), notes=notes,
                              cpu_threads=(base.threads, base.threads_batch), n_parallel=base.n_seq)
        if any(n.startswith("spark") for n in names):
            info = session.load_profile(path, g)
            if info.warning():
                err_console.print(f"[yellow]warning:[/] {escape(info.warning())}", soft_wrap=True)
        learn = not no_learn
        with faults.keeper(lambda: _keep_partial(report, output, learn)):
            _run(report, base, corpus, names, ceiling, learn, as_json, output, md, plot, miss_choice, infill)
    finally:
        if server is not None:
            server.stop()


def register(app: typer.Typer) -> None:
    app.command("bench", cls=SparkCommand)(bench_cmd)


def _run(report, base, corpus, names, ceiling, learn, as_json, output, md, plot,
         miss_path: MissPath = MissPath.AUTO, infill: bool = False) -> None:


    progress = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("tokens"), TimeElapsedColumn(), console=err_console)
    tasks: dict[str, int] = {}

    def on_progress(name: str, done: int, total: int) -> None:
        if name not in tasks:
            tasks[name] = progress.add_task(name, total=total)
        progress.update(tasks[name], completed=done, total=total)

    def on_status(text: str) -> None:
        if "setup" not in tasks:
            tasks["setup"] = progress.add_task(text, total=None)
        progress.update(tasks["setup"], description=text)

    try:
        with progress:
            bench.run(report, base, corpus.documents, names, ceiling=ceiling, learn=learn, progress=on_progress,
                      status=on_status, miss_path=miss_path, say=lambda line: err_console.print(escape(line),
                                                                                              soft_wrap=True),
                      infill=infill)
    except KeyboardInterrupt:
        report.interrupted = True
        report.notes.append("interrupted (Ctrl-C): what was measured so far")
        if report.results:
            _write_outputs(report, as_json, output, md, plot if any(r.runs for r in report.results) else None)
        _fold(report, learn)
        raise typer.Exit(130)
    _write_outputs(report, as_json, output, md, plot)
    _fold(report, learn)


def _fold(report, learn: bool) -> None:
    """Self-tuning: the decode routing of the Spark run joins the model's profile."""

    if not learn:
        return
    try:
        src = bench.fold(report)
    except SaveError as e:  # the counts went to a pending side file it names
        if session.load_profile(report.model, report.geometry).problem is None:
            raise
        # NOTE: the unusable profile was announced at the start: its counts wait in a side file
        err_console.print(f"[yellow]warning:[/] {escape(e.one_line())}", soft_wrap=True)
        return
    if src is not None:
        err_console.print(f"profile: {src.decode_tokens} decode tokens folded into "
                          f"{report.model.name}.spark-profile.json")
