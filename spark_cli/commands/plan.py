"""`spark plan`: a VRAM budget and a routing profile in, a placement and its VRAM bill out."""

from __future__ import annotations

from pathlib import Path

import typer

from ..options import LoadFlags
from .common import JSON_HELP, console, err_console, model_flags, model_or_demo


def _save(plan, output: Path) -> None:
    from ..errors import PlanError

    if output.is_dir():
        raise PlanError(f"-o {output}: is a directory", hint="give a file name, e.g. -o plan.json")
    try:
        plan.save(output)
    except OSError as e:
        raise PlanError(f"-o {output}: cannot write the plan ({e.strerror or e})") from None


def trace_replay_line(trace, plan) -> str:
    """The plan replayed on the trace: static cold-hit, then misses with the LRU slots."""
    from ..simulator import cold_hit_rate, simulate

    if trace.n_decode == 0:
        return "on the trace: no decode rows to replay"
    cold = cold_hit_rate(trace, plan.hot_set())
    cached = [l for l in plan.layers if l.mode == "cached"]
    moe = [l for l in plan.layers if l.mode in ("resident", "cached")]
    if not cached or not moe:
        return f"on the trace ({trace.n_decode} decode rows, in-sample): cold-hit {100 * cold:.1f}%"
    sim = simulate(trace, "lru-pinned", {l.index: l.slots for l in cached},
                   pinned={l.index: l.pinned for l in cached})
    miss = sum(1.0 - s.hit_rate_decode for s in sim.layers.values()) / len(moe)
    return (f"on the trace ({trace.n_decode} decode rows, in-sample): cold-hit {100 * cold:.1f}%, "
            f"with the LRU slots {100 * miss:.1f}% of experts need an upload "
            f"({sim.uploads_per_token:.1f} uploads per token)")


def register(app: typer.Typer) -> None:
    @app.command("plan")
    @model_flags
    def plan_cmd(
        model: Path = typer.Argument(None, help="GGUF model (default: the built-in demo model)",
                                     show_default=False),
        vram_text: str = typer.Option(None, "--vram", help="device budget, e.g. 16GiB (default: the device's "
                                      "free memory minus a margin; required without a GPU)"),
        profile_path: Path = typer.Option(None, "--profile", help="routing profile (default: the one beside "
                                          "the model; a uniform prior when there is none)"),
        trace_path: Path = typer.Option(None, "--trace", help="routing trace .npz: size LRU slots from "
                                        "its miss-ratio curves"),
        output: Path = typer.Option(None, "--output", "-o", help="write the plan JSON here (for --plan)"),
        as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
        flags: LoadFlags = None,
    ) -> None:
        """Place experts for a VRAM budget and show the bill (no GPU needed with --vram)."""
        from .. import devices, render_plan, session
        from ..options import context_size
        from ..profile import RoutingProfile
        from ..trace import RoutingTrace

        say = err_console if as_json else console
        path = model_or_demo(model)
        geometry = session.open_geometry(path)
        # NOTE: a dry run with --vram needs no device (and does not load llama.cpp)
        devs = [] if vram_text else devices.select(devices.parse(flags.device, flags.rpc))
        budget = session.resolve_budget(vram_text, devs)
        ctx = context_size(flags.ctx_size, geometry.context_length)
        if not geometry.known_family:
            say.print(f"[yellow]warning:[/] architecture {geometry.arch!r} is not in models.toml: experts "
                      "found from tensor names only; check the placement")
        if geometry.context_length and ctx > geometry.context_length:
            say.print(f"[yellow]warning:[/] --ctx-size {ctx} is beyond the model's trained context "
                      f"{geometry.context_length}")

        info = session.load_profile(path, geometry, profile_path)
        trace = RoutingTrace.load(trace_path, expect_fingerprint=geometry.fingerprint) if trace_path else None
        if info.profile is not None:
            p = info.profile
            routing = (f"profile {info.path.name}: {p.tokens_decode:,.0f} decode + "
                       f"{p.tokens_prefill:,.0f} prefill tokens")
        elif trace is not None:
            info = session.ProfileInfo(info.path, RoutingProfile.empty(geometry.identity()).add_trace(
                trace, f"trace {trace_path.name}"))
            routing = f"no profile at {info.path.name}: routing counts from the trace {trace_path.name}"
        else:
            routing = (f"no profile at {info.path.name}: uniform prior "
                       "(run `spark profile` to learn which experts are hot)")
        plan = session.make_plan_for(path, geometry, budget.bytes, ctx, info, flags.type_k or "f16",
                                     flags.type_v or "f16", trace=trace, n_ubatch=session.ubatch_size(flags))

        if output is not None:
            _save(plan, output)
        if as_json:
            typer.echo(plan.to_json())
            if output is not None:
                say.print(f"wrote {output}")
            return

        g = geometry
        console.print(f"[bold]{path.name}[/]: {g.arch}, {g.n_layer} layers, {len(g.moe_layers)} MoE, "
                      f"{g.n_expert} experts (top-{g.n_expert_used}), "
                      f"{render_plan.fmt_bytes(g.total_expert_bytes)} of experts")
        console.print(routing + (f"; LRU slots sized from the trace {trace_path.name}" if trace else ""),
                      soft_wrap=True)
        console.print(render_plan.layer_table(plan))
        console.print(render_plan.budget_table(plan, budget.source))
        host = sum(l.host_bytes for l in plan.layers)
        if host:
            console.print(f"host RAM: {render_plan.fmt_bytes(host)} of experts of cached layers", soft_wrap=True)
        console.print(render_plan.cold_hit_line(plan), soft_wrap=True)
        if trace is not None:
            console.print(trace_replay_line(trace, plan), soft_wrap=True)
        for line in render_plan.stock_lines(plan):
            console.print(line, soft_wrap=True)
        if output is not None:
            console.print(f"wrote {output} (use it with --plan {output})")
