"""`spark demo-model` (build the demo/tiny GGUFs) and `spark demo` (the main job on the demo model)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Callable

import typer
from rich.markup import escape

from ..core import plan_file
from ..core.gguf_info import load_geometry
from ..core.units import fmt_bytes
from ..errors import UsageError
from ..files.atomic import check_folder
from ..files.corpus import bundled_corpus
from ..files.paths import spark_home
from ..native import devices
from ..native.rpc import RpcServer
from ..runs.bench import residency_budget
from .common import console
from .help import SparkCommand
from .runner import run_argv


def demo_model_cmd(
    n_expert: int = typer.Option(16, "--experts", "-E", help="experts per layer"),
    n_used: int = typer.Option(4, "--experts-used", "-k", help="experts used per token"),
    seed: int = typer.Option(0, "--seed", help="router seed"),
    router: str = typer.Option("fit", "--router", help="fit (fit to SmolLM2's hidden states on bundled "
                               "training text: experts group tokens by content) or random (a seeded "
                               "random matrix, the router before demo format 2)"),
    tiny: str = typer.Option(None, "--tiny", help="build a tiny random model of this architecture (or variant, "
                             "e.g. qwen35moe-split) instead"),
    fixture: str = typer.Option(None, "--fixture", help="build a real-sized geometry fixture without weights "
                                "(a sparse GGUF for `spark plan`), e.g. qwen3.6-35b-a3b-q4_k_m; `list` "
                                "lists them"),
    out_dir: Path = typer.Option(None, "--out-dir", help="folder (default: $SPARK_HOME/models)"),
) -> None:
    """Build (or reuse) the upcycled SmolLM2 MoE demo model; prints its path on the last line."""
    from ..models.demo_model import build_demo_model
    from ..models.tiny_models import TINY_MODELS, build_tiny_model

    from ..models.demo_router import ROUTERS

    if seed < 0:
        raise UsageError(f"--seed {seed}: give 0 or more")
    if router not in ROUTERS:
        raise UsageError(f"--router {router}: expected one of {', '.join(ROUTERS)}")
    if out_dir is not None:
        check_folder(out_dir, "--out-dir")
    if fixture is not None:
        _fixture(fixture, tiny, out_dir)
        return
    if tiny is not None:
        if tiny not in TINY_MODELS:
            raise UsageError(f"--tiny {tiny}: unknown architecture", hint="one of " + ", ".join(TINY_MODELS))
        with console.status(f"building tiny {tiny} model ..."):
            path = build_tiny_model(tiny, seed=seed, out_dir=out_dir)
    else:
        if not (1 <= n_used <= n_expert <= 256) or n_expert < 2:
            raise UsageError(f"--experts {n_expert} --experts-used {n_used}: need 1 <= k <= E and "
                             "2 <= E <= 256 (a MoE model routes among at least two experts)")
        with console.status(f"building demo model E={n_expert} k={n_used}, {router} router ..."):
            path = build_demo_model(n_expert=n_expert, n_expert_used=n_used, seed=seed, out_dir=out_dir,
                                    router=router)
    console.print(f"{path.stat().st_size / 2**20:.0f} MiB", style="dim")
    print(path)


def _fixture(name: str, tiny: str | None, out_dir: Path | None) -> None:
    """`--fixture NAME`: build one geometry fixture and print its path; `--fixture list`: the names."""
    from ..models.fixtures import FIXTURES, build_fixture, disk_bytes

    if tiny is not None:
        raise UsageError("--fixture and --tiny: give one of them")
    if name == "list":
        for spec in FIXTURES.values():
            print(f"{spec.name}\t{spec.title} ({spec.arch})")
        return
    if name not in FIXTURES:
        raise UsageError(f"--fixture {name}: unknown fixture", hint="one of " + ", ".join(FIXTURES) + " (or list)")
    with console.status(f"writing the {name} fixture header ..."):
        path = build_fixture(name, out_dir=out_dir)
    console.print(f"{fmt_bytes(path.stat().st_size)} apparent, {fmt_bytes(disk_bytes(path))} on disk "
                  "(no weights: plan it, do not run it)", style="dim")
    print(path)


# The chat step's question. Its greedy answer is right, and every token of it leads the runner-up by
# at least tests/_answers.ROBUST_MARGIN logits on the kernels at hand (tests/test_demo_model.py checks it
# through chat_argv), so AVX2 and AVX-512 rounding cannot send it elsewhere. "What is the capital of
# France?" failed that check: a near-tie on the first token, garbage on AVX-512.
QUESTION = "Name the capital city of France."
ANSWER_WORD = "Paris"
ANSWER_TOKENS = 24


def chat_argv(model: Path, *extra: str) -> list[str]:
    """The demo's chat step: one greedy answer to QUESTION, as JSON on stdout."""
    return ["chat", str(model), "--prompt", QUESTION, "--temp", "0", "-n", str(ANSWER_TOKENS), "--json", *extra]


def _chat_answer(spark: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str | None]:
    """Run the chat step with its stdout captured: (exit code, the answer or None)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = spark(argv)
    lines = out.getvalue().strip().splitlines()
    try:
        return rc, json.loads(lines[-1])["answer"] if lines else None
    except (ValueError, KeyError, TypeError):
        return rc, None


def _plan_line(plan_path: Path, residency: float) -> str:

    plan = plan_file.load(plan_path)
    cached = [l for l in plan.layers if l.mode == "cached"]
    moe = [l for l in plan.layers if l.mode in ("resident", "cached", "host")]
    cold = "" if plan.predicted_cold_hit is None else f", predicted cold-hit {100 * plan.predicted_cold_hit:.1f}%"
    return (f"plan: {residency:.0%} of the expert bytes on the device: {len(cached)} of {len(moe)} MoE layers "
            f"cached ({sum(len(l.pinned) for l in cached)} experts pinned, {sum(l.lru_slots for l in cached)} "
            f"LRU slots){cold}")


def _bench_line(report: dict) -> str:
    configs = {c["name"]: c for c in report["configs"]}
    spark, stock = configs.get("spark"), configs.get(report.get("baseline") or "")
    if spark is None or spark["tg_tok_s"] is None or stock is None or stock["tg_tok_s"] is None:
        return "bench: Spark or stock did not run (see the tables above)"
    target = report["targets"]["tg_vs_stock"]
    ceiling = spark["ratios"].get("tg_vs_ceiling")
    return (f"bench: Spark generates {spark['tg_tok_s']['median']:.1f} tok/s, {target['value']:.2f}x the best "
            f"stock offload ({stock['label']}, {stock['tg_tok_s']['median']:.1f} tok/s) on the same budget"
            + (f", {ceiling:.2f}x all-resident" if ceiling is not None else "")
            + f": the {target['target']:g}x target {'met' if target['met'] else 'not met'}")


def closing_lines(plan_path: Path, residency: float, answer: str | None, bench_path: Path) -> list[str]:
    """What the demo showed, a line each: the plan, the answer, the bench's verdict against stock."""
    out = [_plan_line(plan_path, residency) if plan_path.is_file() else "plan: not written",
           f"answer: {answer.strip()!r}" if answer else "answer: none"]
    if bench_path.is_file():
        out.append(_bench_line(json.loads(bench_path.read_text(encoding="utf-8"))))
    return out


def demo_cmd(
    ctx: typer.Context,
    rpc: str = typer.Option(None, "--rpc", help="use this RPC server instead of a local stand-in GPU"),
    residency: float = typer.Option(0.6, "--residency", min=0.05, max=1.0,
                                    help="share of expert bytes the budget holds on the device"),
    quick: bool = typer.Option(False, "--quick", help="shorter profile and bench (for smoke tests)"),
) -> None:
    """The main job on the demo model: profile -> plan -> one answer -> bench against stock offload."""
    from ..models.demo_model import build_demo_model

    root = ctx.find_root().command

    def spark(argv: list[str]) -> int:  # each step as its own command line, through the same error boundary
        return run_argv(root, argv)

    out = spark_home() / "demo"
    out.mkdir(parents=True, exist_ok=True)
    console.rule("1/5 demo model")
    with console.status("building the demo model (first run only) ..."):
        model = build_demo_model()
    g = load_geometry(model)
    console.print(f"{model} ({model.stat().st_size / 2**20:.0f} MiB): {g.arch}, {len(g.moe_layers)} MoE layers, "
                  f"{g.n_expert} experts, {g.n_expert_used} used per token")
    server = None
    if rpc is None and not devices.local_gpus():
        server = RpcServer().start()
        rpc = server.endpoint
        console.print(f"no GPU here: using an RPC stand-in GPU on {rpc}")
    dev = ["--rpc", rpc] if rpc else []
    ctx = 2048
    budget = residency_budget(g, ctx, residency)
    trace = out / "demo-trace.npz"
    plan = out / "demo-plan.json"
    bench_json = out / "demo-bench.json"
    answer = None
    steps = [
        ("2/5 profile: routing on the bundled corpus",
         ["profile", str(model), "--corpus", str(bundled_corpus()), "--gen", "4" if quick else "16",
          "--trace", str(trace), "--held-out", "0.25", "--plot", str(out / "demo-heatmap.png"), *dev]),
        (f"3/5 plan: {residency:.0%} of the expert bytes on the device",
         ["plan", str(model), "--vram", str(budget), "-c", str(ctx), "--trace", str(trace), "-o", str(plan)]),
        ("4/5 chat: one answer through the expert cache", chat_argv(model, "--plan", str(plan), *dev)),
        ("5/5 bench: Spark against stock llama.cpp offload, same budget",
         ["bench", str(model), "--vram", str(budget), "-c", str(ctx), "-p", "64" if quick else "256",
          "-n", "8" if quick else "48", "-r", "1" if quick else "3", "--ceiling", "-o", str(bench_json),
          "--plot", str(out / "demo-bench.png"), *dev]),
    ]
    try:
        for title, argv in steps:
            console.rule(title)
            if argv[0] == "chat":
                rc, answer = _chat_answer(spark, argv)
                console.print(f"{QUESTION}\n[bold]{escape(answer or '')}[/]")
            else:
                rc = spark(argv)
            if rc != 0:
                raise typer.Exit(rc)
    finally:
        if server:
            server.stop()
    console.rule("done")
    for line in closing_lines(plan, residency, answer, bench_json):
        console.print(line, soft_wrap=True, markup=False)
    console.print(f"outputs in {out}: demo-plan.json, demo-trace.npz, demo-heatmap.png, demo-bench.json, "
                  f"demo-bench.png; profile beside the model", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("demo", cls=SparkCommand)(demo_cmd)
    app.command("demo-model", cls=SparkCommand)(demo_model_cmd)
