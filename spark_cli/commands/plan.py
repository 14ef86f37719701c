"""`spark plan`: a VRAM budget and a routing profile in, a placement and its VRAM bill out."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import typer
from rich.markup import escape

from ..core import device_table, plan_file, planner
from ..core.cost_model import OBJECTIVES
from ..core.gguf_info import ModelGeometry
from ..core.options import LoadFlags, context_size
from ..core.planner import AUTO_POLICY, held_out_check, replay_path, replayed_miss
from ..core.profile import RoutingProfile
from ..core.simulator import DEFAULT_POLICY, ONLINE_POLICIES, canonical_policy, cold_hit_rate
from ..core.trace import RoutingTrace
from ..core.units import parse_sizes
from ..errors import NativeError, SparkError, UsageError
from ..files.atomic import check_output
from ..native import devices
from ..files.paths import spark_home
from ..runs import host_calibration, host_ram, session
from . import render_plan
from .common import (JSON_HELP, MISS_PATH_HELP, console, err_console, model_flags, model_or_demo, parse_miss_path,
                     run_inputs)
from .help import SparkCommand
from .tables import Whole


def _save(plan, output: Path) -> None:
    plan_file.save(plan, output, "-o")


def trace_replay_line(trace, plan) -> str:
    """The plan replayed on the trace: static cold-hit, then experts off the device with its policy."""

    if trace.n_decode == 0:
        return "on the trace: no decode rows to replay"
    cold = cold_hit_rate(trace, plan.hot_set())
    if not any(l.mode == "cached" for l in plan.layers):
        return f"on the trace ({trace.n_decode} decode rows, in-sample): cold-hit {100 * cold:.1f}%"
    miss = replayed_miss(plan, trace, replay_path(plan.miss_path))
    return (f"on the trace ({trace.n_decode} decode rows, in-sample): cold-hit {100 * cold:.1f}%, "
            f"with the {plan.policy} slots {100 * miss:.1f}% of experts are not on the device")


def policy_line(plan) -> str:
    """--policy auto's choice: each policy's replayed share of routed experts on the device."""
    if not plan.policy_replay:
        return (f"policy auto: no decode steps to replay: {plan.policy} (the default, the best on the demo "
                "model's bundled traces)")
    parts = ", ".join(f"{p} {100 * h:.1f}%" for p, h in plan.policy_replay.items())
    return f"policy auto: {parts} of routed experts on the device: [bold]{plan.policy}[/]"


def held_out_line(c, policy: str) -> str:
    return (f"held-out check: planned on the first {c.train_steps:,} decode steps, predicted "
            f"{100 * c.predicted:.1f}% of experts off the device; on the next {c.test_steps:,}: "
            f"[bold]{100 * c.measured:.1f}%[/] ({policy}), oracle {100 * c.oracle:.1f}% (a plan made on them), "
            f"Belady {100 * c.belady:.1f}% (same slots)")


def _routing(info, geometry, trace, trace_path: Path | None):
    """Where the plan's routing counts come from, in one line (a trace stands in for a missing profile)."""

    if info.profile is not None:
        p = info.profile
        return info, f"profile {info.path.name}: {p.tokens_decode:,.0f} decode + {p.tokens_prefill:,.0f} prefill tokens"
    if trace is not None:
        info = session.ProfileInfo(info.path, RoutingProfile.empty(geometry.identity()).add_trace(
            trace, f"trace {trace_path.name}"))
        return info, f"no profile at {info.path.name}: routing counts from the trace {trace_path.name}"
    return info, (f"no profile at {info.path.name}: uniform prior "
                  "(run `spark profile` to learn which experts are hot)")


def _print_plan(path: Path, g, routing: str, placed, budget_source: str, trace, replay_src: str, pol: str, req,
                check_result, host, provenance: list[str]) -> None:

    plan = placed.plan
    console.print(f"[bold]{path.name}[/]: {g.arch}, {g.n_layer} layers, {len(g.moe_layers)} MoE, "
                  f"{g.n_expert} experts (top-{g.n_expert_used}), "
                  f"{render_plan.fmt_bytes(g.total_expert_bytes)} of experts")
    console.print(routing, soft_wrap=True)
    console.print(Whole(render_plan.layer_table(plan)))
    console.print(Whole(render_plan.budget_table(plan, budget_source)))
    console.print(render_plan.measured_line(plan), soft_wrap=True)
    console.print(host.line(), soft_wrap=True)
    console.print(render_plan.cold_hit_line(plan), soft_wrap=True)
    table = render_plan.prediction_table(plan)
    if table is not None:
        console.print(Whole(table))
    console.print(render_plan.prediction_line(plan), soft_wrap=True)
    for line in provenance:  # --predict-for: which figures are measured, fitted from public reports, assumed
        console.print(f"  {line}", soft_wrap=True)
    if trace is not None:
        console.print(trace_replay_line(trace, plan), soft_wrap=True)
    if placed.candidates:
        parts = ", ".join(f"{c.name} {100 * c.miss:.1f}%" for c in placed.candidates)
        console.print(f"priced by replaying {placed.replay_steps:,} decode steps of {replay_src} through {pol}"
                      f"{' (cpu miss path)' if req.replay_path == 'cpu' else ''}: experts not on the device "
                      f"{parts}: [bold]{placed.chosen}[/] chosen", soft_wrap=True)
    if check_result is not None:
        console.print(held_out_line(check_result, pol), soft_wrap=True)
    for line in render_plan.stock_lines(plan):
        console.print(line, soft_wrap=True)


def routing_trace(info, trace: RoutingTrace | None) -> RoutingTrace | None:
    """The decode steps a RAM tier is replayed on: --trace, else the profile's recent ones."""
    return trace if trace is not None else info.profile.recent_trace() if info.profile is not None else None


def _devices(flags: LoadFlags, vram_text: str | None, measure: bool) -> list:
    """The devices to plan for: -dev/--rpc or the local GPU; with --vram and no -dev/--rpc, none when
    llama.cpp cannot be loaded (the estimate alone) or --no-measure."""

    if vram_text and not measure:
        return []
    if vram_text and not (flags.device or flags.rpc):
        try:
            return devices.select(devices.parse(None, None))
        except NativeError:
            return []
    return devices.select(devices.parse(flags.device, flags.rpc))


def _check_prediction_flags(objective: str, predict_for: str | None, host_bandwidth: float | None,
                            host_cores: int | None, cold_hit: float | None, pcie: str | None = None):
    """The flags of a plan priced in time, checked before the model is read; the --predict-for card."""

    if objective not in OBJECTIVES:
        raise UsageError(f"--objective: unknown objective {objective!r}", hint="use " + " or ".join(OBJECTIVES))
    if cold_hit is not None and not 0.0 <= cold_hit <= 1.0:
        raise UsageError(f"--cold-hit: {cold_hit:g} is not a share", hint="give a number from 0 to 1, e.g. 0.1")
    if predict_for is None:
        for flag, v in (("--host-bandwidth", host_bandwidth), ("--host-cores", host_cores), ("--pcie", pcie)):
            if v is not None:
                raise UsageError(f"{flag}: only with --predict-for", hint="name the card: --predict-for NAME")
        return None
    if host_bandwidth is not None and not host_bandwidth > 0:
        raise UsageError(f"--host-bandwidth: {host_bandwidth:g} GB/s", hint="give the host's memory bandwidth, e.g. 60")
    if host_cores is not None and host_cores < 1:
        raise UsageError(f"--host-cores: {host_cores}", hint="give a core count of 1 or more")
    card = device_table.card(predict_for)
    if pcie is not None:
        try:
            card = card.on_pcie(pcie)
        except ValueError as e:
            raise UsageError(f"--pcie: {pcie!r}: {e}", hint="give the link the card's slot runs at as GENxLANES, "
                             "e.g. 4x8 for PCIe 4.0 x8; nvidia-smi -q or lspci -vv shows it") from None
    if objective == "prompt" and card.fp32_tflops <= 0:
        raise UsageError(f"--objective prompt: {predict_for} has no compute figure to predict prompt speed from",
                         hint="measure it on the card with spark bench, or use --objective decode")
    return card


def predict_host(host_bandwidth: float | None, host_cores: int | None,
                 geometry: ModelGeometry | None = None) -> device_table.Host:
    """The host beside a --predict-for card: the flags where given, else this CPU as Spark has
    calibrated it (runs/host_calibration.py; carried over to `geometry`'s expert types), else a host
    whose bandwidth is not given (the public rigs' CPU rate: device_table.Fit.unstated_host_gb_s) and
    this machine's cores."""
    if host_bandwidth is None and host_cores is None:
        measured = host_calibration.measured_host(spark_home(), geometry)
        if measured is not None:
            return measured
    return device_table.Host(host_bandwidth, host_cores or os.cpu_count() or 1)


def _costs(card, geometry, devs: list, flags: LoadFlags, host: device_table.Host | None):
    """The device costs a plan is priced with: a card's published figures (--predict-for), else those
    `spark bench` measured for the device, model and -t; None: placed by hits alone."""
    if card is not None:
        return device_table.predicted_costs(card, geometry, host=host, ubatch=session.ubatch_size(flags))
    if not devs and (flags.device or flags.rpc):  # --no-measure: the device named is still the one priced
        devs = _devices(flags, None, True)
    return session.kept_costs(devs, geometry, flags)


@model_flags
def plan_cmd(
    model: Path = typer.Argument(None, help="GGUF model (default: the built-in demo model)",
                                 show_default=False),
    vram_text: str = typer.Option(None, "--vram", help="device budget, e.g. 16GiB (default: the device's "
                                  "free memory minus a margin; required without a GPU)"),
    profile_path: Path = typer.Option(None, "--profile", help="routing profile (default: the one beside "
                                      "the model; a uniform prior when there is none)"),
    trace_path: Path = typer.Option(None, "--trace", help="routing trace .npz to replay (default: the "
                                    "profile's ring of recent decode steps)"),
    policy: str = typer.Option("auto", "--policy", help="cache policy the plan is priced for and records: "
                               "lru, lfu-aged, slru, tinylfu, or auto (replay the trace through each with "
                               "the plan's slots and keep the best)"),
    miss_path: str = typer.Option("auto", "--miss-path", help="the miss path the plan is priced for and "
                                  "records (auto and upload hold staging slices for misses uploaded for one step); chat "
                                  "and serve's --miss-path overrides it. " + MISS_PATH_HELP),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="measure the bill with a dry run "
                                 "(llama.cpp no_alloc) on the device and fit the plan to it; needs a device "
                                 "(-dev, --rpc or a local GPU)"),
    check: bool = typer.Option(True, "--check/--no-check", help="print the held-out check (plan on 70%% "
                               "of the replayed steps, predict the rest)"),
    output: Path = typer.Option(None, "--output", "-o", help="write the plan JSON here (for --plan)"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    objective: str = typer.Option("decode", "--objective", help="the time a plan minimises when it is priced "
                                  "in time: decode (tg) or prompt (pp)"),
    predict_for: str = typer.Option(None, "--predict-for", help="price the plan for a card that is not at hand, "
                                    "from its published figures (e.g. rtx-4060-ti-16gb; an unknown name lists "
                                    "them), on the backend Spark builds there (CUDA on NVIDIA, Vulkan on AMD and "
                                    "Intel); --vram defaults to its memory"),
    host_bandwidth: float = typer.Option(None, "--host-bandwidth", help="with --predict-for: the host's memory "
                                         "bandwidth in GB/s (default: this CPU as Spark calibrated it, else the "
                                         "CPU rate of the public measurements' hosts)"),
    host_cores: int = typer.Option(None, "--host-cores", help="with --predict-for: the host's CPU cores "
                                   "(default: this machine's)"),
    pcie: str = typer.Option(None, "--pcie", help="with --predict-for: the PCIe link the card's slot gives it, "
                             "GENxLANES, e.g. 4x8 (default: the card's own; a board's second slot often has "
                             "fewer lanes, and --n-cpu-moe's prompt uploads go over it)"),
    cold_hit: float = typer.Option(None, "--cold-hit", help="without a profile: the share of routed experts "
                                   "a cached layer misses with k slots, assumed (0-1; default: the uniform "
                                   "prior's)"),
    flags: LoadFlags = None,
) -> None:
    """Place experts for a VRAM budget and show the bill (no GPU needed with --vram)."""


    say = err_console if as_json else console
    if output is not None:
        check_output(output, "-o", inputs=run_inputs(model, profile=profile_path, trace=trace_path))
    try:
        pol = AUTO_POLICY if policy in (None, AUTO_POLICY) else canonical_policy(policy)
    except SparkError as e:
        raise UsageError(f"--policy {policy}: {e.message}") from None
    if pol not in ONLINE_POLICIES + (AUTO_POLICY,):
        raise UsageError(f"--policy {policy}: a cache cannot run it", hint=f"use one of {', '.join(ONLINE_POLICIES)}")
    miss_choice = parse_miss_path(miss_path)
    card = _check_prediction_flags(objective, predict_for, host_bandwidth, host_cores, cold_hit, pcie)
    if card is not None:
        measure = False
        vram_text = vram_text or f"{card.vram_gib:g}GiB"
    if vram_text:
        parse_sizes(vram_text, flag="--vram")  # a flag error before the model is read
    path = model_or_demo(model)
    geometry = session.open_geometry(path)
    if flags.ram is not None and not (vram_text or flags.rpc or (flags.device and flags.device != "none")):
        # the RAM tier of a CPU run: what sits in RAM and in the file
        from . import plan_ram

        info = session.load_profile(path, geometry, profile_path)
        trace = RoutingTrace.load(trace_path, expect_fingerprint=geometry.fingerprint,
                                  expect_shape=(geometry.n_layer, geometry.n_expert)) if trace_path else None
        return plan_ram.show(path, geometry, session.profile_counts(info), routing_trace(info, trace), flags.ram,
                             as_json, say, threads=flags.threads)
    # NOTE: --vram needs no device; a device (when there is one) measures the bill
    devs = _devices(flags, vram_text, measure)
    sel = devices.parse(flags.device, flags.rpc)
    budget = session.resolve_budget(vram_text, devs, () if devs or sel.cpu_only else tuple(sel.names or ()))
    ctx = context_size(flags.ctx_size, geometry.context_length)
    if not geometry.known_family:
        say.print(f"[yellow]warning:[/] architecture {geometry.arch!r} is not in models.toml: experts "
                  "found from tensor names only; check the placement")
    if geometry.context_length and ctx > geometry.context_length:
        say.print(f"[yellow]warning:[/] --ctx-size {ctx} is beyond the model's trained context "
                  f"{geometry.context_length}")

    info = session.load_profile(path, geometry, profile_path)
    if info.warning():
        say.print(f"[yellow]warning:[/] {escape(info.warning())}", soft_wrap=True)
    trace = RoutingTrace.load(trace_path, expect_fingerprint=geometry.fingerprint,
                              expect_shape=(geometry.n_layer, geometry.n_expert)) if trace_path else None
    info, routing = _routing(info, geometry, trace, trace_path)
    # NOTE: the same request chat and serve make for --vram (session.resolve_placement)
    host = predict_host(host_bandwidth, host_cores, geometry) if card is not None else None
    costs = _costs(card, geometry, devs, flags, host)
    req = session.plan_request(info, budget.bytes, ctx, trace=trace, policy=pol, miss_path=miss_choice,
                               split=session.resolve_split(flags, budget), costs=costs, objective=objective,
                               **session.kv_settings(flags))
    req = replace(req, assumed_cold_hit=cold_hit, ram_bytes=flags.ram)
    replay_src = f"the trace {trace_path.name}" if trace_path else "the profile's recent decode steps"

    placed = planner.plan_for(geometry, req, session.measurer(path, geometry, flags, ctx) if devs and measure else None)
    plan = placed.plan
    if flags.ram is not None:  # three tiers: the device plan's host layers in RAM slots and the file
        from . import plan_ram

        tier = session.resolve_device_ram_tier(geometry, info, flags, plan)
        return plan_ram.show(path, geometry, session.profile_counts(info), routing_trace(info, trace), flags.ram,
                             as_json, say, tier=tier, plan=plan)
    ram_warning = host_ram.check(plan, flags)
    if ram_warning:
        say.print(f"[yellow]warning:[/] {ram_warning}", soft_wrap=True)
    priced = DEFAULT_POLICY if pol == AUTO_POLICY else pol  # auto prices with the default, then picks
    check_result = held_out_check(geometry, replace(req, policy=plan.policy)) \
        if check and placed.replay_steps and not as_json else None
    if pol == AUTO_POLICY:
        say.print(policy_line(plan), soft_wrap=True)

    if output is not None:
        _save(plan, output)
    if as_json:
        typer.echo(plan_file.to_json(plan))
        if output is not None:
            say.print(f"wrote {output}")
        return

    _print_plan(path, geometry, routing, placed, budget.source, trace, replay_src, priced, req, check_result,
                host_ram.host_ram(plan), device_table.provenance(card, host) if card is not None else [])
    if output is not None:
        console.print(f"wrote {output} (use it with --plan {output})")


def register(app: typer.Typer) -> None:
    app.command("plan", cls=SparkCommand)(plan_cmd)
