"""`spark chat [MODEL]`: an interactive session on the planned placement, or one-shot --prompt."""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import sys
import threading
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ..core.options import LoadFlags
from ..errors import SparkError, UsageError
from ..files.text_input import read_stream, replaced_note, utf8_text
from ..files.atomic import check_output
from ..native import devices as native_devices
from ..native.expert_cache import CacheStats
from ..runs import session
from ..runs.chat_session import ChatSession, Sampling
from ..runs.run import engine_run
from .common import (JINJA_HELP, MISS_PATH_HELP, TEMPLATE_FILE_HELP, chat_templates, console, err_console, model_flags,
                     model_or_demo, parse_miss_path, run_inputs)
from .help import SparkCommand
from .render_plan import fmt_bytes
from .tables import Whole

HELP = ("/stats  per-layer cache table    /reset  forget the conversation    /system TEXT  set the system prompt\n"
        "/save FILE  conversation as JSON    /exit  leave (or Ctrl-D)    Ctrl-C stops an answer")


# ---------------------------------------------------------------- memory


class _VramMeter:
    """Device memory this process took: free before loading minus free now; the plan's
    total where the device does not report a change (the RPC stand-in reports host RAM)."""

    def __init__(self, dev, plan):
        self.dev, self.plan = dev, plan
        self.before = self._free() if dev is not None else None

    def _free(self) -> int | None:
        free, total = native_devices.free_memory(self.dev)
        return free if total else None

    def __call__(self) -> tuple[int | None, str]:
        if self.dev is None:
            return None, ""
        now = self._free()
        if self.before is not None and now is not None and self.before > now:
            return self.before - now, "measured"
        if self.plan is not None:
            return int(self.plan.breakdown["total"]), "planned"
        return None, ""


# ---------------------------------------------------------------- rendering


def _fmt_bytes(n: int | None) -> str:

    return "-" if n is None else fmt_bytes(n)


def figures_line(f) -> str:
    """One line after each answer: speeds, cache hit rate, uploads, VRAM."""
    parts = []
    pt, gt = f.prompt_tps, f.gen_tps
    parts.append(f"prompt {pt:.1f} tok/s ({f.prompt_tokens} tok)" if pt else f"prompt {f.prompt_tokens} tok")
    parts.append(f"generation {gt:.1f} tok/s ({f.generated_tokens} tok)" if gt else
                 f"generation {f.generated_tokens} tok")
    if f.cached_layers:
        hr = f.hit_rate
        parts.append(f"cache hit {100 * hr:.1f}%" if hr is not None else "cache hit -")
        parts.append(f"{f.cache.uploads} uploads ({_fmt_bytes(f.cache.bytes_uploaded)})")
        if f.cache.cpu_expert_bytes:
            parts.append(f"CPU experts {_fmt_bytes(f.cache.cpu_expert_bytes)}")
    if f.vram_bytes is not None:
        parts.append(f"VRAM {_fmt_bytes(f.vram_bytes)}" + (" (plan)" if f.vram_source == "planned" else ""))
    if f.stop in ("interrupted", "context", "length"):
        parts.append({"interrupted": "stopped", "context": "context full", "length": "-n reached"}[f.stop])
    return " · ".join(parts)


def start_summary(path: Path, geometry, devices: list, plan, info, meter: _VramMeter, n_ctx: int,
                  sampling, cpu_reason: str | None, budget_source: str, ram=None) -> Table:
    g = geometry
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("model", f"{escape(path.name)}: {g.arch}, {g.n_layer} layers, {len(g.moe_layers)} MoE, "
                       f"{g.n_expert} experts (top-{g.n_expert_used})")
    if devices:
        d = devices[0]
        rpc_note = ", RPC stand-in GPU" if d.name.startswith("RPC") else ""
        t.add_row("device", escape(f"{d.name} ({d.description})") + rpc_note)
    else:
        where = "every expert in host RAM" if ram is None else \
            f"{ram.resident_share:.0%} of the experts in RAM slots, the rest read from the model file"
        t.add_row("device", f"CPU: {cpu_reason}; stock CPU path, {where}")
    if plan is not None:
        used, src = meter()
        used_text = f"{_fmt_bytes(used)} in use (measured)" if src == "measured" else \
            "in use: not reported by this device"
        t.add_row("VRAM", f"planned {_fmt_bytes(plan.breakdown['total'])} of {_fmt_bytes(plan.budget_bytes)} "
                          f"({budget_source}); {used_text}")
        res = [l for l in plan.layers if l.mode == "resident"]
        cached = [l for l in plan.layers if l.mode == "cached"]
        pins = sum(len(l.pinned) for l in cached)
        lru = sum(l.lru_slots for l in cached)
        host = [l for l in plan.layers if l.mode == "host"]
        t.add_row("experts", f"{len(res)} MoE layers resident, {len(cached)} cached: {pins} pinned experts + "
                             f"{lru} LRU cache slots (of {len(cached) * g.n_expert} experts in host RAM)"
                             + (f", {len(host)} on the CPU as --n-cpu-moe" if host else ""))
        p = plan.predicted
        t.add_row("priced", escape(f"in time: predicted {p['tg_tok_s']:.1f} tok/s generation, {p['stops']} stops "
                                   f"a token ({p['costs']})") if p and p.get("tg_tok_s") else
                  "by hits alone: no device costs for this device, model and -t yet (spark bench measures them)")
    t.add_row("profile", escape(info.summary()))
    samp = "greedy" if sampling.temp <= 0 else \
        f"temp {sampling.temp:g}, top-k {sampling.top_k}, top-p {sampling.top_p:g}, min-p {sampling.min_p:g}, " \
        f"seed {sampling.seed}"
    if sampling.repeat_penalty != 1.0:
        samp += f", repeat penalty {sampling.repeat_penalty:g} over {sampling.repeat_last_n}"
    t.add_row("session", f"context {n_ctx} tokens, {samp}")
    return t


def stats_table(chat, plan) -> Table | str:
    """Per-layer hits, misses, uploads of the cached layers, and a total row."""
    if not chat.cached_layers:
        return "no expert cache in this run: " + ("every expert is resident on the device" if plan is not None
                                                  else "stock CPU path")
    stats = chat.layer_stats()
    by_index = {l.index: l for l in plan.layers} if plan is not None else {}
    t = Table(title="expert cache per layer (since start)", title_justify="left")
    for name in ("layer", "pinned", "LRU slots", "miss path", "hits", "misses", "hit rate", "uploads", "uploaded",
                 "upload ms", "syncs", "blocking", "async", "CPU experts", "CPU bytes", "steps cached", "steps stock"):
        t.add_column(name, justify="right")
    paths = chat.engine.cache.miss_paths()

    def row(label, s, pinned="", lru="", path=""):
        hr = s.hit_rate
        return (label, pinned, lru, path, str(s.hits), str(s.misses), f"{100 * hr:.1f}%" if hr is not None else "-",
                str(s.uploads), _fmt_bytes(s.bytes_uploaded), f"{s.upload_us / 1000:.1f}", str(s.syncs),
                _fmt_bytes(s.blocking_upload_bytes), _fmt_bytes(s.async_upload_bytes), str(s.cpu_experts),
                _fmt_bytes(s.cpu_expert_bytes), str(s.steps_cached), str(s.steps_stock))

    tot = CacheStats.total(stats[il] for il in chat.cached_layers if il in stats)
    for il in sorted(chat.cached_layers):
        s = stats.get(il)
        if s is None:
            continue
        l = by_index.get(il)
        t.add_row(*row(str(il), s, str(len(l.pinned)) if l else "", str(l.lru_slots) if l else "", paths.get(il, "")))
    t.add_section()
    t.add_row(*row("[bold]all[/]", tot))
    return t


# ---------------------------------------------------------------- the command


def _interactive(chat, plan, model_name: str) -> None:
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass

    with contextlib.suppress(AttributeError, ValueError):
        sys.stdin.reconfigure(errors="surrogateescape")  # a non-UTF-8 line is replaced, not an exception
    console.print(f"[dim]{HELP}[/]")
    while True:
        try:
            line, bad = utf8_text(input("> "))
            if bad:
                console.print(f"[yellow]{escape(replaced_note('input', bad))}[/]")
        except EOFError:
            console.print()
            return
        except KeyboardInterrupt:
            console.print("\n[dim](Ctrl-D or /exit to leave)[/]")
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            arg = arg.strip()
            if cmd in ("/exit", "/quit"):
                return
            if cmd == "/stats":
                console.print(Whole(stats_table(chat, plan)))
                t = chat.totals()
                threads = f", {t.cpu_threads} CPU threads" if t.cpu_threads else ""
                console.print(f"[dim]session: {t.prompt_tokens} prompt + {t.generated_tokens} generated tokens, "
                              f"{t.cache.uploads} uploads ({_fmt_bytes(t.cache.bytes_uploaded)}){threads}[/]")
            elif cmd == "/reset":
                chat.reset()
                console.print("[dim]conversation cleared[/]")
            elif cmd == "/system":
                chat.set_system(arg)
                console.print(f"[dim]system prompt {'set' if arg else 'cleared'}[/]")
            elif cmd == "/save":
                if not arg:
                    console.print("[red]usage:[/] /save FILE")
                    continue
                try:
                    check_output(arg, "/save", inputs=run_inputs(chat.engine.opts.model_path))
                    console.print(f"[dim]saved {escape(str(chat.save(arg, model_name)))}[/]")
                except SparkError as e:
                    console.print(f"[bold red]error:[/] {escape(e.one_line())}")
            elif cmd == "/help":
                console.print(f"[dim]{HELP}[/]")
            else:
                console.print(f"[red]unknown command {escape(cmd)}[/] [dim](/help lists them)[/]")
            continue
        _answer(chat, text, interactive=True)


def _answer(chat, text: str, interactive: bool, stream: bool = True):

    stop = threading.Event()

    def on_sigint(*_) -> None:
        if stop.is_set():  # a second Ctrl-C: the answer is stuck, leave
            raise KeyboardInterrupt
        stop.set()

    old = signal.signal(signal.SIGINT, on_sigint) if interactive else None

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    say = console if interactive else err_console
    try:
        ans = chat.answer(text, on_text=write if stream else None, should_stop=stop.is_set,
                          on_notice=lambda msg: say.print(f"[yellow]{escape(msg)}[/]"))
    except SparkError as e:
        if not interactive:
            raise
        console.print(f"[bold red]error:[/] {escape(e.one_line())}")
        return None
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    if stream:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if ans.error:
        if not interactive:
            raise SparkError(f"the answer failed: {ans.error}")
        console.print(f"[bold red]error:[/] the answer failed: {escape(ans.error)} [dim](session kept)[/]")
    if ans.figures.stop == "interrupted":
        console.print("[yellow]stopped[/]")
    if stream:
        say.print(f"[dim]{figures_line(ans.figures)}[/]", soft_wrap=True)
    return ans


@model_flags
def chat_cmd(
    model: Path = typer.Argument(None, help="GGUF model (default: the built-in demo model)", show_default=False),
    plan_path: Path = typer.Option(None, "--plan", help="placement from spark plan -o (default: plan now)"),
    vram_text: str = typer.Option(None, "--vram", help="device budget for planning now, e.g. 16GiB "
                                  "(default: the device's free memory minus a margin)"),
    n_predict: int = typer.Option(-1, "--n-predict", "-n", help="tokens per answer at most (-1: until done)"),
    temp: float = typer.Option(0.8, "--temp", min=0.0, help="temperature (0: greedy, deterministic)"),
    top_k: int = typer.Option(40, "--top-k", min=0, help="top-k sampling (0: off)"),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="top-p sampling (1.0: off)"),
    min_p: float = typer.Option(0.05, "--min-p", min=0.0, max=1.0, help="min-p sampling (0.0: off)"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", min=0.0,
                                         help="penalize repeated tokens (1.0: off)"),
    repeat_last_n: int = typer.Option(64, "--repeat-last-n", min=-1,
                                      help="tokens the penalty looks back on (0: off, -1: the context)"),
    seed: int = typer.Option(-1, "--seed", "-s", help="sampling seed (-1: random)"),
    system: str = typer.Option(None, "--system-prompt", "-sys", help="system prompt"),
    prompt: str = typer.Option(None, "--prompt", "-p", help="one-shot: answer this prompt and exit "
                               "('-' reads stdin)"),
    as_json: bool = typer.Option(False, "--json", help="one-shot: print {answer, figures} as JSON on stdout"),
    learn: bool = typer.Option(True, "--learn/--no-learn", help="fold this session's routing into the "
                               "model's profile on exit"),
    miss_path_choice: str = typer.Option(None, "--miss-path", help=MISS_PATH_HELP + " (default: the plan's, else auto)"),
    template_file: Path = typer.Option(None, "--chat-template-file", help=TEMPLATE_FILE_HELP),
    jinja: bool = typer.Option(True, "--jinja/--no-jinja", help=JINJA_HELP),
    flags: LoadFlags = None,
) -> None:
    """Chat with a model on the planned placement; --prompt answers once (for scripts)."""

    _check_flags(as_json, prompt, n_predict)
    miss_choice = parse_miss_path(miss_path_choice) if miss_path_choice is not None else None
    templates = chat_templates(template_file, jinja)
    one_shot = prompt is not None
    say = err_console if one_shot else console
    prompt, system = _texts(prompt, system)
    path = model_or_demo(model)
    geometry = session.open_geometry(path)
    info = session.load_profile(path, geometry)
    if info.warning():
        say.print(f"[yellow]warning:[/] {escape(info.warning())}", soft_wrap=True)
    where = session.resolve_placement(path, geometry, info, flags, plan_path=plan_path, vram_text=vram_text,
                                      miss_path=miss_choice)
    for w in where.warnings:
        say.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True)
    devices, plan = where.devices, where.plan
    opts = session.with_ram_tier(session.engine_options(path, geometry, plan, flags, n_ctx=where.n_ctx, learn=learn),
                                 where.ram, geometry, where.ahead, where.mapped)
    opts.chat_templates = templates
    meter = _VramMeter(devices[0] if devices else None, plan)
    sampling = Sampling(temp, top_k, top_p, seed if seed >= 0 else secrets.randbelow(1 << 31), n_predict,
                        min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n)
    chat = None
    fold_error = None

    def keep_on_loss() -> str | None:  # the device died mid-session: fold what was learned
        return _keep(path, geometry, chat, say) if learn and chat is not None else None

    with engine_run(opts, where.miss_path, geometry.fingerprint, keep=keep_on_loss,
                    on_why=lambda why: err_console.print(f"[dim]{escape(why)}[/]", soft_wrap=True),
                    loading=console.status(f"loading {path.name} ...") if not one_shot else None) as engine:
        chat = ChatSession(engine, sampling, system=system, cached_layers={c.il for c in opts.cache_layers},
                           vram_probe=meter if devices else None)
        try:
            if one_shot:
                chat.check_fits(prompt)  # a prompt that cannot fit: one error line, no summary
            if not one_shot or not as_json:
                say.print(start_summary(path, geometry, engine.devices, plan, info, meter, engine.n_ctx,
                                        sampling, where.cpu_reason, where.budget_source, where.ram))
            if one_shot:
                ans = _answer(chat, prompt, interactive=False, stream=not as_json)
                if as_json:
                    typer.echo(json.dumps({"answer": ans.text, "figures": ans.figures.to_dict()},
                                          ensure_ascii=False))
            else:
                _interactive(chat, plan, path.name)
        finally:
            try:
                fold_error = _fold_at_exit(path, geometry, chat, say) if learn else None
            finally:
                chat.close()
    if fold_error is not None:
        if info.problem is None:
            raise fold_error
        # NOTE: the unusable profile was announced at the start: its counts wait in a side file
        say.print(f"[yellow]warning:[/] {escape(fold_error.one_line())}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("chat", cls=SparkCommand)(chat_cmd)


def _check_flags(as_json: bool, prompt: str | None, n_predict: int) -> None:

    if as_json and prompt is None:
        raise UsageError("--json needs --prompt", hint="spark chat MODEL --prompt 'text' --json")
    if n_predict < -1:
        raise UsageError(f"--n-predict {n_predict}: give -1 (until done), 0 or more")


def _texts(prompt: str | None, system: str | None) -> tuple[str | None, str | None]:
    """--prompt ('-': stdin) and --system-prompt as text; bytes that are not UTF-8 are replaced, with a warning."""

    bad = {}
    if prompt == "-":
        prompt, bad["stdin"] = read_stream()
    elif prompt is not None:
        prompt, bad["--prompt"] = utf8_text(prompt)
    if system is not None:
        system, bad["--system-prompt"] = utf8_text(system)
    for what, n in bad.items():
        if n:
            err_console.print(f"[yellow]warning:[/] {escape(replaced_note(what, n))}")
    return prompt, system


def _keep(path: Path, geometry, chat, say) -> str | None:
    """The device died mid-session: fold what was learned (a faults keeper's line)."""

    chat.harvest_now()
    try:
        n = _fold(path, geometry, chat, say, timeout=5.0)
    except SparkError as e:
        return e.one_line()
    return f"{n} decode tokens of routing folded into {session.profile_path_for(path)}" if n else None


def _fold_at_exit(path: Path, geometry, chat, say):
    """Fold the session's routing at exit; the SaveError (counts kept in a side file it names), or None."""

    try:
        n = _fold(path, geometry, chat, say)
    except SparkError as e:
        return e
    if n:
        say.print(f"[dim]learned: {n} decode tokens folded into {session.profile_path_for(path).name}[/]")
    return None


def _fold(path: Path, geometry, chat, say, timeout: float | None = None) -> int:
    """Self-tuning: add the session's decode routing to the profile (locked, atomic), once.
    Returns the decode tokens folded; a failed save raises SaveError naming the side file."""

    counts, tokens = chat.learned.counts, chat.learned.tokens
    if counts is None or counts.sum() <= 0:
        return 0
    chat.learned.counts, chat.learned.tokens = None, 0  # NOTE: a keeper and the normal exit must not both fold
    session.fold_into_profile(path, geometry, counts, source="spark chat", timeout=timeout,
                              on_wait=lambda msg: say.print(f"[yellow]{escape(msg)}[/]"))
    return tokens
