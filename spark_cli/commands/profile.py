"""`spark profile MODEL --corpus PATH` and `spark profile merge|simulate|show`.

Profiling runs a corpus through the model and records which experts the router picks:
native routing counters when the patched library has them, else an eval callback on
`ffn_moe_topk-<il>`. Counts go into the profile beside the model (locked, atomic, aged).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from ..core import profile_store, routing_stats as rs
from ..core.gguf_info import load_geometry
from ..core.options import LoadFlags, context_size
from ..core.planner import stage_slices as planned_stage_slices
from ..core.profile import RESET_HINT, RoutingProfile, merge, profile_path_for
from ..core.report import heatmap_png, held_out_cold_hit, layer_skew
from ..core.simulator import ALIASES, DEFAULT_POLICY, FIXED_MISS_PATHS, LAYER_MISS_PATHS, MissCosts, POLICIES
from ..core.trace import RoutingTrace, concat
from ..errors import PlanError, ProfileError, SparkError, UsageError
from ..files.atomic import check_output, lock_timeout_default
from ..files.corpus import CorpusError, bundled_corpus, make_chunks, read_corpus
from ..files.recovery import save_or_recover
from ..runs import run, session
from .common import JSON_HELP, console, err_console, model_flags, model_or_demo, run_inputs
from .help import SparkCommand
from .tables import Whole
from ..runs.profiling import (CAPTURE_MODES, Gathered, StopFlag, Capture, dropped_warning, gather,  # noqa: F401
                              profiling_options, resolve_capture, split_held_out)

DEFAULT_RESIDENCIES = "0.4,0.6,0.8"


class _ModelFirstGroup(TyperGroup):
    """`spark profile MODEL ...` runs the hidden default command `run`; names of the
    subcommands (merge, simulate, show) and --help keep their meaning."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


profile_app = typer.Typer(
    cls=_ModelFirstGroup,
    subcommand_metavar="MODEL --corpus PATH | COMMAND [ARGS]...",
    no_args_is_help=True,
    add_completion=False,
    help="Learn which experts real traffic routes to: spark profile MODEL.gguf --corpus PATH.\n\n"
         "Subcommands: merge, simulate, show.",
)


def register(app: typer.Typer) -> None:
    app.add_typer(profile_app, name="profile")


def _with_recent(d, traces):
    """The run's counts plus its recent decode steps (the profile's ring)."""
    for t in traces:
        d.add_recent(t)
    return d


def _parse_floats(text: str, flag: str, lo: float, hi: float) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text}: expected comma-separated numbers, e.g. {DEFAULT_RESIDENCIES}") from None
    if not vals or any(not lo < v <= hi for v in vals):
        raise UsageError(f"{flag} {text}: each value must be in ({lo}, {hi}]")
    return vals


def _parse_ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text}: expected comma-separated integers, e.g. 4,8,16") from None
    if not vals or any(v < 1 for v in vals):
        raise UsageError(f"{flag} {text}: each value must be a positive integer")
    return vals


# ---------------------------------------------------------------- rendering


class _RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} tok/s" if speed else "- tok/s", style="progress.data.speed")


def _coverage_points(k: int, n_expert: int) -> list[int]:
    pts = {k, 2 * k, n_expert // 4, n_expert // 2}
    return sorted(p for p in pts if 1 <= p < n_expert)


def skew_report(counts: np.ndarray, k: int, title: str) -> tuple[Table, dict[str, float]]:
    """Per-layer skew table and its means (entropy / max, top-k share)."""

    counts = np.asarray(counts, dtype=np.float64)
    n_expert = counts.shape[1]
    pts = _coverage_points(k, n_expert)
    t = Table(title=title, title_justify="left")
    for col in ("layer", "routed", "entropy bits", "entropy/max", f"top-{k} share"):
        t.add_column(col, justify="right")
    for p in pts:
        t.add_column(f"top-{p} cov.", justify="right")
    rows = layer_skew(counts, k)
    for s in rows:
        t.add_row(str(s.layer), f"{s.routed:,.0f}", f"{s.entropy_bits:.2f}", f"{s.entropy_norm:.3f}",
                  f"{s.top_k_share:.3f}", *(f"{s.coverage[p - 1]:.3f}" for p in pts))
    means = {
        "layers": float(len(rows)),
        "entropy_norm": float(np.mean([s.entropy_norm for s in rows])) if rows else 0.0,
        "top_k_share": float(np.mean([s.top_k_share for s in rows])) if rows else 0.0,
        "uniform_top_k_share": min(k, n_expert) / n_expert,
    }
    return t, means


def _means_line(k: int, m: dict[str, float]) -> str:
    return (f"mean over {m['layers']:.0f} MoE layers: entropy {m['entropy_norm']:.3f} of the maximum, "
            f"top-{k} share {m['top_k_share']:.3f} (uniform routing: {m['uniform_top_k_share']:.3f})")


def _print_skew(prefill: np.ndarray, decode: np.ndarray, k: int, whose: str = "", to=None) -> tuple[np.ndarray, str]:
    """Print the per-layer skew table and its means; returns (counts, which routing)."""
    to = to or console
    counts, what = _routing_for_report(prefill, decode)
    table, means = skew_report(counts, k, f"routing skew per layer, {whose}{what} routing")
    to.print(Whole(table))
    to.print(_means_line(k, means))
    return counts, what


def _routing_for_report(prefill: np.ndarray, decode: np.ndarray) -> tuple[np.ndarray, str]:
    if decode.sum() > 0:
        return decode, "decode"
    return prefill + decode, "prefill (no decode tokens: use --gen N)"


def held_out_report(train, test, geometry, residencies: Sequence[float]) -> Table:

    bpe = {l.index: l.expert_bytes_per_expert for l in geometry.layers if l.is_moe}
    t = Table(title=f"held-out cold-hit ({train.n_rows:,} train rows, {test.n_rows:,} test rows, "
                    f"{test.n_decode:,} test decode tokens)", title_justify="left")
    for col in ("residency", "budget GiB", "resident experts", "cold-hit", "cold-hit (oracle)"):
        t.add_column(col, justify="right")
    for r in residencies:
        try:
            (h,) = held_out_cold_hit(train, test, bpe, [r])
        except PlanError:  # the budget cannot hold k experts in every MoE layer
            t.add_row(f"{r:.0%}", "-", "-", "[yellow]too small[/]", "-")
            continue
        t.add_row(f"{r:.0%}", f"{h.budget_bytes / 2**30:.2f}", f"{h.resident_experts:,}",
                  f"{h.cold_hit:.3f}", f"{h.oracle_cold_hit:.3f}")
    return t


# ---------------------------------------------------------------- commands


@profile_app.command("run", cls=SparkCommand,
                     help="Profile MODEL on a corpus (the default: `spark profile MODEL --corpus PATH`).")
@model_flags
def run_cmd(
    model: Path = typer.Argument(None, help="the .gguf model (default: the demo model)", show_default=False),
    corpus: Path = typer.Option(None, "--corpus", show_default=False,
                                help="a text file, or a folder of .txt, .md and .jsonl files "
                                     "(default: the small bundled sample)"),
    gen: int = typer.Option(16, "--gen", min=0, help="greedy tokens decoded after each chunk, so decode routing is seen"),
    trace: Path = typer.Option(None, "--trace", help="also write the routing trace (.npz) for `spark profile simulate`"),
    held_out: float = typer.Option(0.0, "--held-out", min=0.0, max=0.9,
                                   help="share of the corpus held out to test placements built from the rest"),
    residency: str = typer.Option(DEFAULT_RESIDENCIES, "--residency",
                                  help="shares of expert bytes held resident, for --held-out"),
    plot: Path = typer.Option(None, "--plot", help="write a layers x experts heatmap PNG"),
    capture: str = typer.Option("auto", "--capture", help="native (patched counters), callback (eval callback), or auto"),
    profile: Path = typer.Option(None, "--profile", help="profile file to update (default: beside the model)"),
    reset: bool = typer.Option(False, "--reset", help="move the existing profile aside (kept as "
                               ".old-DATE) and start a fresh one: for a corrupt or newer-version profile"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    flags: LoadFlags = None,
) -> None:
    say = err_console if as_json else console
    residencies = _parse_floats(residency, "--residency", 0.0, 1.0)
    if capture not in CAPTURE_MODES:
        raise UsageError(f"--capture {capture}: expected one of {', '.join(CAPTURE_MODES)}")

    inputs = run_inputs(model, profile=profile, corpus=corpus)
    for flag, out in (("--trace", trace), ("--plot", plot)):  # before the run, not after it
        if out is not None:
            check_output(out, flag, inputs=inputs)
    job = _prepare(model_or_demo(model), corpus, gen, profile, reset, flags, say)
    g, n_chunks, mode = _gather_corpus(job, flags, capture, gen, keep_trace=True, full_trace=trace is not None or held_out > 0,
                                       say=say)
    if g.tokens == 0:
        say.print("interrupted before any routing was recorded: the profile is unchanged")
        raise typer.Exit(130)
    failures: list[SparkError] = []
    saved = _save_profile(job, g, n_chunks, failures, say)
    counts, what = _report_run(job, g, trace, held_out, residencies, failures, say)
    if plot is not None:
        _save_plot(job, counts, what, plot, failures, say)
    if as_json:
        typer.echo(json.dumps({"profile": str(job.prof_path), "saved": saved is not None, "capture": mode,
                               "chunks": n_chunks, **g.summary(), "routing": what.split(" ")[0]}))
    for e in failures[:-1]:
        err_console.print(f"[bold red]error:[/] {escape(e.one_line())}", soft_wrap=True)
    if failures:
        raise failures[-1]
    if g.interrupted:
        raise typer.Exit(130)


@dataclass
class _ProfileJob:
    """What a profiling run reads: the model, its profile, the corpus; fixed before the engine opens."""

    model: Path
    geometry: Any
    ctx: int
    max_len: int
    prof_path: Path
    old: Any  # the profile before the run, or None
    corpus_path: Path
    docs: Any


def _prepare(model: Path, corpus: Path | None, gen: int, profile: Path | None, reset: bool, flags: LoadFlags,
             say) -> _ProfileJob:
    """Everything a run can refuse before it loads the model: context, profile, corpus."""

    geometry = load_geometry(model, require_moe=True)
    ctx = context_size(flags.ctx_size, geometry.context_length)
    max_len = ctx - gen
    if max_len < 16:
        raise UsageError(f"--ctx-size {ctx} leaves {max_len} tokens per chunk after --gen {gen}",
                         hint="raise -c or lower --gen")
    prof_path = Path(profile) if profile else profile_path_for(model)
    if reset:
        aside = profile_store.reset(prof_path)
        if aside is not None:
            say.print(f"moved {prof_path} aside to {aside.name}: starting a fresh profile")
    try:  # refuse early
        old = RoutingProfile.load(prof_path, expect=geometry.identity()) if prof_path.exists() else None
    except ProfileError as e:
        raise ProfileError(e.message, hint=RESET_HINT.replace("MODEL", str(model))) from None
    corpus_path = Path(corpus) if corpus else bundled_corpus()
    docs = read_corpus(corpus_path)
    say.print(f"corpus {corpus_path}{' (bundled sample)' if corpus is None else ''}: {docs.summary()}")
    for p, why in docs.unreadable[:5]:
        err_console.print(f"[yellow]warning:[/] cannot read {p}: {why}")
    if len(docs.unreadable) > 5:
        err_console.print(f"[yellow]warning:[/] ... and {len(docs.unreadable) - 5} more unreadable files")
    return _ProfileJob(model, geometry, ctx, max_len, prof_path, old, corpus_path, docs)


def _chunks(job: _ProfileJob, engine) -> list:

    prefix = engine.vocab.tokenize("", add_special=True)
    chunks = list(make_chunks(
        job.docs.documents, job.max_len,
        tokenize=lambda text, special: engine.vocab.tokenize(text, add_special=False, parse_special=special),
        render_chat=lambda msgs: engine.vocab.chat_prompt(msgs, add_generation_prompt=False),
        prefix=prefix))
    if not chunks:
        raise CorpusError(f"--corpus {job.corpus_path}: no document gives two tokens or more")
    return chunks


def _keep_on_loss(job: _ProfileJob, g: Gathered):
    """The device died: fold the chunks done so far (a faults keeper)."""

    def keep() -> str | None:
        if g.tokens == 0:
            return None
        d = profile_store.delta(job.geometry.identity(), g.prefill, g.decode, g.tokens_prefill, g.tokens_decode,
                                f"profile {job.corpus_path.name} (device lost)")
        try:
            profile_store.fold(job.prof_path, job.geometry.identity(), d, timeout=5.0)
        except SparkError as e:
            return e.one_line()
        return f"{g.tokens:,} tokens of {g.chunks_done} chunks folded into {job.prof_path}"
    return keep


def _gather_corpus(job: _ProfileJob, flags: LoadFlags, capture: str, gen: int, *, keep_trace: bool,
                   full_trace: bool, say) -> tuple[Gathered, int, str]:
    """The run sequence of profiling: open the engine, chunk the corpus, gather under the
    device-loss keeper with a progress bar (Ctrl-C keeps what was gathered)."""

    geometry = job.geometry
    mode = resolve_capture(capture)
    # NOTE: one ubatch per eval: every piece of a chunk is one prefill step
    n_batch = min(session.ubatch_size(flags), job.ctx)
    base = session.engine_options(job.model, geometry, None, flags, n_ctx=job.ctx, learn=False)
    base.n_batch = base.n_ubatch = n_batch
    g = Gathered(np.zeros((geometry.n_layer, geometry.n_expert)), np.zeros((geometry.n_layer, geometry.n_expert)))
    opts = profiling_options(base, mode, keep_trace)
    with run.engine_run(opts, "cpu", geometry.fingerprint, keep=_keep_on_loss(job, g),
                        host_layers=list(geometry.moe_layers),
                        on_why=lambda msg: say.print(f"[yellow]note:[/] {msg}")) as engine:
        chunks = _chunks(job, engine)
        where = ", ".join(d.name for d in engine.devices) or "CPU"
        say.print(f"model {job.model.name}: {len(geometry.moe_layers)} MoE layers x {geometry.n_expert} experts, "
                  f"top-{geometry.n_expert_used}; {geometry.arch} on {where}; capture: "
                  + ("native counters" if mode == "native" else "eval callback")
                  + ("" if mode == "native" or capture == "callback" else " (this build has no expert cache)"))
        total = sum(len(c.tokens) for c in chunks) + gen * len(chunks)
        n_docs_cut = _count_cut(chunks)
        say.print(f"profiling {len(chunks)} chunks of up to {job.max_len} tokens"
                  + (f" ({n_docs_cut} documents longer than the context were cut)" if n_docs_cut else "")
                  + (f", {gen} decoded tokens after each" if gen else "")
                  + ": Ctrl-C stops and keeps what was gathered")
        cap = Capture(engine, mode, geometry.n_layer, geometry.n_expert, geometry.fingerprint, keep_trace)
        cap.decode_only = not full_trace
        progress = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.completed:,.0f}/{task.total:,.0f} tok"), _RateColumn(),
                            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                            console=say)
        with StopFlag() as stop, progress:
            task = progress.add_task("profiling", total=total)
            gather(engine, cap, chunks, gen, stop,
                   advance=lambda n: progress.advance(task, n),
                   drop=lambda n: progress.update(task, total=progress.tasks[0].total - n),
                   n_batch=min(n_batch, engine.n_ubatch), into=g)
    return g, len(chunks), mode


def _save_profile(job: _ProfileJob, g: Gathered, n_chunks: int, failures: list, say):
    """Fold the run (counts and its recent decode steps) into the profile; a failure is kept for the end."""

    ident = job.geometry.identity()
    source = f"profile {job.corpus_path.name}" + (" (interrupted)" if g.interrupted else "")
    saved = None
    try:
        saved = profile_store.fold(
            job.prof_path, ident, _with_recent(profile_store.delta(ident, g.prefill, g.decode, g.tokens_prefill,
                                                                   g.tokens_decode, source), g.traces),
            timeout=lock_timeout_default(),
            on_wait=lambda msg: err_console.print(f"[yellow]{escape(msg)}[/]")).profile
    except SparkError as e:  # the counts went to a pending file; trace and plot are still written
        failures.append(e)
    rate = g.tokens / g.seconds if g.seconds > 0 else 0.0
    say.print(f"{'[yellow]interrupted:[/] kept ' if g.interrupted else 'profiled '}"
              f"{g.tokens:,} tokens ({g.tokens_prefill:,} prefill + {g.tokens_decode:,} decode) from "
              f"{g.chunks_done}/{n_chunks} chunks in {g.seconds:.1f} s: {rate:,.1f} tok/s")
    if saved is not None:
        say.print(f"{'updated' if job.old else 'new'} profile {job.prof_path}: {saved.tokens_prefill:,.0f} prefill + "
                  f"{saved.tokens_decode:,.0f} decode tokens")
    if saved is not None and saved.recent is not None:
        say.print(f"recent decode steps kept in the profile: {len(saved.recent):,} "
                  f"(at most {saved.recent_capacity(len(saved.recent_layers), saved.recent.shape[2]):,})")
    return saved


def _report_run(job: _ProfileJob, g: Gathered, trace: Path | None, held_out: float, residencies, failures: list,
                say):
    """The trace file, dropped steps, the run's skew and the held-out check; returns the counts shown."""

    if g.traces and (trace is not None or held_out > 0):
        full = concat(g.traces)
        if trace is not None:
            try:
                save_or_recover(lambda p: full.save(p, "--trace"), trace, beside=job.model.parent)
                say.print(f"trace {trace}: {full.n_rows:,} token rows")
            except SparkError as e:
                failures.append(e)
    dropped = dropped_warning(g)
    if dropped:
        err_console.print(f"[yellow]warning:[/] {escape(dropped)}", soft_wrap=True)
    counts, what = _print_skew(g.prefill, g.decode, job.geometry.n_expert_used, "this run's ", to=say)
    if held_out > 0:
        if not g.traces:
            say.print("[yellow]held-out:[/] no trace was gathered")
        else:
            train, test = split_held_out(g.traces, held_out)
            if test.n_decode == 0 or train.n_rows == 0:
                say.print("[yellow]held-out:[/] the held-out part has no decode tokens; "
                          "use --gen N and a corpus of several chunks")
            else:
                say.print(Whole(held_out_report(train, test, job.geometry, residencies)))
    return counts, what


def _save_plot(job: _ProfileJob, counts, what: str, plot: Path, failures: list, say) -> None:

    try:
        save_or_recover(lambda p: heatmap_png(counts, p, f"{job.model.name}: {what.split(' ')[0]} routing share",
                                              "--plot"), plot, beside=job.model.parent)
        say.print(f"heatmap {plot}")
    except SparkError as e:
        failures.append(e)


def _count_cut(chunks: Sequence[Any]) -> int:
    """Documents that gave more than one chunk."""
    seen: dict[str, int] = {}
    for c in chunks:
        seen[c.source] = seen.get(c.source, 0) + 1
    return sum(1 for n in seen.values() if n > 1)


@profile_app.command("merge", cls=SparkCommand)
def merge_cmd(
    a: Path = typer.Argument(..., help="older profile"),
    b: Path = typer.Argument(..., help="newer profile (a is aged by b's tokens)"),
    output: Path = typer.Option(..., "--output", "-o", help="merged profile to write"),
) -> None:
    """Merge two profiles of one model: A aged by B's tokens, plus B."""

    check_output(output, "-o", inputs=[("profile", a), ("profile", b)])
    pa, pb = RoutingProfile.load(a), RoutingProfile.load(b)
    out = merge(pa, pb)
    save_or_recover(lambda p: out.save(p, "-o"), output)
    console.print(f"merged {a} ({pa.tokens_prefill + pa.tokens_decode:,.0f} tokens) + {b} "
                  f"({pb.tokens_prefill + pb.tokens_decode:,.0f} tokens) -> {output}: "
                  f"{out.tokens_prefill:,.0f} prefill + {out.tokens_decode:,.0f} decode tokens")


from ..core.simulator import SimRow, simulate_rows  # noqa: E402,F401  (rendered here)


DEFAULT_SIM_POLICIES = "lru,lru-pinned,lfu-aged,slru,tinylfu,belady"


def simulate_table(rows: list[SimRow], title: str, staged: bool) -> Table:
    """One row per (miss path, slots, policy): hit rate, against Belady, uploads and MiB per token."""
    t = Table(title=title, title_justify="left")
    cols = ("miss path", "slots", "policy", "pinned", "hit rate", "vs Belady", "uploads/token", "MiB/token")
    for col in cols + (("staged/token",) if staged else ()):
        t.add_column(col, justify="left" if col in ("policy", "miss path") else "right")
    for r in rows:
        t.add_row(r.miss_path, str(r.slots), r.policy + (" (default)" if r.default else ""), str(r.pinned),
                  f"{r.hit_rate:.3f}", "-" if r.vs_belady is None else f"{r.vs_belady:.3f}",
                  f"{r.uploads_per_token:.2f}",
                  "-" if r.bytes_per_token is None else f"{r.bytes_per_token / 2**20:.2f}",
                  *((f"{r.staged_per_token:.2f}",) if staged else ()))
    return t


@profile_app.command("simulate", cls=SparkCommand)
def simulate_cmd(
    trace: Path = typer.Argument(..., help="a routing trace (.npz) from spark profile --trace"),
    model: Path = typer.Option(None, "--model", "-m", help="the trace's model: checks it, and gives bytes per token"),
    slots: str = typer.Option("4,8,16", "--slots", help="slot counts per cached layer to try"),
    policy: str = typer.Option(DEFAULT_SIM_POLICIES, "--policy",
                               help="policies: lru, lru-pinned, lfu-aged, slru, tinylfu, belady (the oracle)"),
    miss_path: str = typer.Option("upload", "--miss-path",
                                  help="upload (a miss is uploaded before the step), cpu (computed on the CPU, "
                                       "admitted for the next step), auto (cpu, with each step's misses split per "
                                       "expert between staging uploads and the CPU by --miss-costs), or both "
                                       "(upload and cpu)"),
    stage_slices: int = typer.Option(None, "--stage-slices", min=0, help="auto: staging slices per layer "
                                     "(default: the planner's, 4 decode steps' experts)", show_default=False),
    miss_costs: str = typer.Option("100,0,380", "--miss-costs", help="auto: microseconds a missed expert takes "
                                   "on the CPU (fixed part, per token part) and to upload, as the calibration "
                                   "measures them: FIXED,PER_TOKEN,UPLOAD"),
    serial_uploads: bool = typer.Option(False, "--serial-uploads", help="auto: uploads run before the CPU work "
                                        "(a device without a second queue), not beside it"),
    max_admit: int = typer.Option(-1, "--max-admit", help="cpu miss path: admissions per layer per decode step "
                                                          "(<0: experts used per token)"),
    profile: Path = typer.Option(None, "--profile", help="profile whose top experts lru-pinned pins (none without)"),
    pin: int = typer.Option(None, "--pin", min=0, help="experts pinned per layer by lru-pinned (default: half the slots)"),
    phases: str = typer.Option("decode", "--phases", help="decode, or all (prefill steps too, as the native cache)"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Replay a trace through cache policies: hit rate, uploads and bytes per token by slot count."""

    slot_counts = _parse_ints(slots, "--slots")
    policies = list(dict.fromkeys(ALIASES.get(p.strip(), p.strip()) for p in policy.split(",") if p.strip()))
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise UsageError(f"--policy {policy}: unknown {', '.join(bad) or 'empty list'}",
                         hint=f"use some of {', '.join(POLICIES)}")
    if miss_path not in (*LAYER_MISS_PATHS, "both"):
        raise UsageError(f"--miss-path {miss_path}: expected upload, cpu, auto or both")
    paths = FIXED_MISS_PATHS if miss_path == "both" else (miss_path,)
    costs = _miss_costs(miss_costs, not serial_uploads)
    if phases not in ("decode", "all"):
        raise UsageError(f"--phases {phases}: expected decode or all")
    geometry = load_geometry(model, require_moe=True) if model is not None else None
    tr = RoutingTrace.load(trace, expect_fingerprint=geometry.fingerprint if geometry else None)
    if geometry is not None and (tr.n_layer, tr.n_expert) != (geometry.n_layer, geometry.n_expert):
        raise ProfileError(f"trace {trace} has {tr.n_layer} layers x {tr.n_expert} experts; "
                           f"the model has {geometry.n_layer} x {geometry.n_expert}")
    if not tr.moe_layers():
        raise ProfileError(f"trace {trace} holds no routed steps")
    pinned_from = None
    if profile is not None:
        prof = RoutingProfile.load(profile)
        if prof.fingerprint != tr.fingerprint or prof.shape != (tr.n_layer, tr.n_expert):
            raise ProfileError(f"profile {profile} is of another model than trace {trace}")
        pinned_from = prof.decode if prof.decode.sum() > 0 else prof.prefill + prof.decode
    bpe = {l.index: l.expert_bytes_per_expert for l in geometry.layers if l.is_moe} if geometry else None
    k = geometry.n_expert_used if geometry else tr.k
    if min(slot_counts) < k:
        raise UsageError(f"--slots {slots}: a cached layer needs at least k = {k} slots (experts used per token)",
                         hint=f"use slot counts of {k} or more")
    n_stage = planned_stage_slices(tr.n_expert, k, "auto") if stage_slices is None else min(stage_slices, tr.n_expert)
    rows = simulate_rows(tr, slot_counts, policies, pinned_from=pinned_from, bytes_per_expert=bpe, k=k, pin=pin,
                         phases=("decode",) if phases == "decode" else ("prefill", "decode"), miss_paths=paths,
                         max_admit=max_admit, n_stage=n_stage, costs=costs)
    if as_json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
        return
    n_tok = tr.n_decode if phases == "decode" else tr.n_rows
    console.print(Whole(simulate_table(rows, f"cache simulation of {trace.name}: {n_tok:,} "
                                             f"{'decode ' if phases == 'decode' else ''}tokens, "
                                             f"{len(tr.moe_layers())} MoE layers x {tr.n_expert} experts, "
                                             f"top-{tr.k}", staged="auto" in paths), keys=3))
    if "lru-pinned" in policies and pinned_from is None:
        console.print("note: no --profile, so lru-pinned pins nothing (the same as lru)")
    if DEFAULT_POLICY not in policies:
        console.print(f"note: the default policy {DEFAULT_POLICY} is not in --policy")
    if geometry is None:
        console.print("note: pass --model for bytes per token")


def _miss_costs(text: str, concurrent: bool):
    """--miss-costs FIXED,PER_TOKEN,UPLOAD (microseconds) as the split's integer costs."""

    try:
        fixed, per_token, upload = (float(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--miss-costs {text}: expected three numbers FIXED,PER_TOKEN,UPLOAD (microseconds)",
                         hint="for example --miss-costs 60,40,380") from None
    if min(fixed, per_token, upload) < 0:
        raise UsageError(f"--miss-costs {text}: costs cannot be negative")
    return MissCosts(cpu_ns=round(per_token * 1000), upload_ns=round(upload * 1000), concurrent=concurrent,
                     cpu_expert_ns=round(fixed * 1000))


@profile_app.command("show", cls=SparkCommand)
def show_cmd(
    model: Path = typer.Argument(None, help="the .gguf model (default: the demo model)", show_default=False),
    profile: Path = typer.Option(None, "--profile", help="profile file (default: beside the model)"),
    plot: Path = typer.Option(None, "--plot", help="write a layers x experts heatmap PNG"),
    held_out: list[Path] = typer.Option(None, "--held-out", help="a routing trace (.npz) of text the profile has "
                                        "not seen: cold-hit of routing-blind vs profile placement on it "
                                        "(repeat for several, e.g. a code trace against a prose profile)"),
    residency: float = typer.Option(0.6, "--residency", min=0.01, max=1.0,
                                    help="share of expert bytes resident, for --held-out"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Report skew and coverage from the model's saved profile, and how real its routing looks."""

    if plot is not None:
        check_output(plot, "--plot", inputs=run_inputs(model, profile=profile))
    model = model_or_demo(model)
    geometry = load_geometry(model, require_moe=True)
    path = Path(profile) if profile else profile_path_for(model)
    if not path.exists():
        raise ProfileError(f"no profile for {model.name} at {path}",
                           hint=f"run: spark profile {model} --corpus PATH")
    try:
        p = RoutingProfile.load(path, expect=geometry.identity())
    except ProfileError as e:
        raise ProfileError(e.message, hint=None if profile else RESET_HINT.replace("MODEL", str(model))) from None
    tests = {str(t): RoutingTrace.load(t, expect_fingerprint=geometry.fingerprint) for t in held_out or ()}
    say = err_console if as_json else console
    say.print(f"profile {path}: {p.tokens_prefill:,.0f} prefill + {p.tokens_decode:,.0f} decode tokens "
              f"(half-life {p.half_life_tokens:,.0f} tokens), updated {p.updated}")
    if p.sources:
        say.print(f"sources: {', '.join(p.sources)}")
    counts, what = _print_skew(p.prefill, p.decode, geometry.n_expert_used, to=say)
    real = realism(p, geometry, tests, residency)
    say.print(Whole(realism_table(real, geometry.n_expert_used)))
    if as_json:
        typer.echo(json.dumps(real))
    if plot is not None:
        heatmap_png(counts, plot, f"{model.name}: {what.split(' ')[0]} routing share", "--plot")
        say.print(f"heatmap {plot}")


def realism(p, geometry, tests: dict, residency: float) -> dict[str, Any]:
    """The routing-realism figures of a profile (core/routing_stats.py) and of held-out traces on it."""

    counts, _ = _routing_for_report(p.prefill, p.decode)
    ring = p.recent_trace()
    overlap = rs.recent_overlap(ring, phases=("decode",)) if ring is not None and ring.n_rows > rs.WINDOW else None
    bpe = {l.index: l.expert_bytes_per_expert for l in geometry.layers if l.is_moe}
    train = p.prefill + p.decode
    places = {name: rs.placement(train, t, bpe, residency) for name, t in tests.items()}
    out = rs.realism_json(rs.skew(counts, geometry.n_expert_used), overlap, places)
    out["uniform_overlap"] = rs.uniform_overlap(geometry.n_expert, geometry.n_expert_used)
    out["n_expert"] = geometry.n_expert
    return out


def realism_table(real: dict[str, Any], k: int) -> Table:
    """The realism figures beside those published for real models."""
    pub = real["published"]
    t = Table(title="how real the routing looks (published figures: real models)", title_justify="left")
    for col in ("figure", "this model", "uniform routing", "published"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    n_top = real["top_experts"]
    t.add_row("entropy / max (mean over layers)", f"{real['mean_entropy_norm']:.3f}", "1.000", "-")
    t.add_row(f"share served by the top 20% ({n_top}) experts", f"{real['mean_top_share']:.3f}",
              f"{n_top / real['n_expert']:.3f}", "-")
    ov = real["overlap_8"]
    t.add_row("experts used in the previous 8 tokens (decode ring)", "-" if ov is None else f"{ov:.3f}",
              f"{real['uniform_overlap']:.3f}", f"{pub['overlap_8']:.2f} (Qwen3.5, E=256 k=8)")
    for name, pl in real["placement"].items():
        t.add_row(f"cold-hit at {pl['residency']:.0%} on {Path(name).name}: blind / profile / oracle",
                  f"{pl['uniform']:.3f} / {pl['profile']:.3f} / {pl['oracle']:.3f}", f"{pl['uniform']:.3f}",
                  f"{pub['cold_hit_uniform']:.2f} / {pub['cold_hit_profile']:.3f} (shift {pub['cold_hit_shift']:.2f})")
    return t
