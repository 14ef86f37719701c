"""`spark demo-model` (build the demo/tiny GGUFs) and `spark demo` (the main job on the demo model)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from ..core import plan_file, units
from ..core.gguf_info import load_geometry
from ..core.options import LoadFlags
from ..core.units import fmt_bytes
from ..errors import SparkError, UsageError
from ..files.atomic import atomic_write_text, check_folder
from ..files.corpus import bundled_corpus, read_corpus
from ..files.paths import spark_home
from ..native import devices
from ..native.engine import Engine
from ..native.rpc import RpcServer
from ..runs import device_costs, memcg, ram_bench, session
from ..runs.bench import make_workload, residency_budget
from . import bench_ram
from .common import console, err_console
from .help import SparkCommand
from .runner import run_argv

if TYPE_CHECKING:
    from ..core.gguf_info import ModelGeometry
    from ..core.planner import Plan


def demo_model_cmd(
    n_expert: int = typer.Option(16, "--experts", "-E", help="experts per layer"),
    n_used: int = typer.Option(4, "--experts-used", "-k", help="experts used per token"),
    seed: int = typer.Option(0, "--seed", help="router seed"),
    router: str = typer.Option("fit", "--router", help="fit (fit to SmolLM2's hidden states on bundled "
                               "training text: experts group tokens by content) or random (a seeded "
                               "random matrix, the router before demo format 2)"),
    tiny: str = typer.Option(None, "--tiny", help="build a tiny random model of this architecture (or variant, "
                             "e.g. qwen35moe-split) instead; bert-reranker: a dense BERT reranker (a classifier "
                             "head, bge's WordPiece) for `spark serve --reranking`"),
    vocab: str = typer.Option(None, "--vocab", help="with --tiny: llama.cpp's vendored tokenizer instead of "
                              "SmolLM2's: starcoder (FIM tokens, for /infill), llama-spm (SentencePiece, BOS), "
                              "bert-bge (WordPiece, CLS/SEP); from the llama-cpp-python sdist, never downloaded"),
    fixture: str = typer.Option(None, "--fixture", help="build a real-sized geometry fixture without weights "
                                "(a sparse GGUF for `spark plan`), e.g. qwen3.6-35b-a3b-q4_k_m; `list` "
                                "lists them"),
    out_dir: Path = typer.Option(None, "--out-dir", help="folder (default: $SPARK_HOME/models)"),
) -> None:
    """Build (or reuse) the upcycled SmolLM2 MoE demo model; prints its path (the only line on stdout)."""
    from ..models.demo_model import build_demo_model
    from ..models.tiny_models import TINY_MODELS, TINY_RERANKER, TINY_VOCABS, build_tiny_model

    from ..models.demo_router import ROUTERS

    if seed < 0:
        raise UsageError(f"--seed {seed}: give 0 or more")
    if router not in ROUTERS:
        raise UsageError(f"--router {router}: expected one of {', '.join(ROUTERS)}")
    if out_dir is not None:
        check_folder(out_dir, "--out-dir")
    if vocab is not None and tiny is None:
        raise UsageError("--vocab: only with --tiny (the demo model keeps SmolLM2's tokenizer)")
    if vocab is not None and vocab not in TINY_VOCABS:
        raise UsageError(f"--vocab {vocab}: unknown vocabulary", hint="one of " + ", ".join(TINY_VOCABS))
    if fixture is not None:
        _fixture(fixture, tiny, out_dir)
        return
    if tiny is not None:
        if tiny not in TINY_MODELS and tiny != TINY_RERANKER:
            raise UsageError(f"--tiny {tiny}: unknown architecture", hint="one of " + ", ".join((*TINY_MODELS,
                                                                                                TINY_RERANKER)))
        if tiny == TINY_RERANKER and vocab is not None:
            raise UsageError(f"--tiny {TINY_RERANKER} --vocab {vocab}: the reranker carries bge's WordPiece only")
        with err_console.status(f"building tiny {tiny} model{f' ({vocab} vocab)' if vocab else ''} ..."):
            path = build_tiny_model(tiny, seed=seed, out_dir=out_dir, vocab=vocab)
    else:
        if not (1 <= n_used <= n_expert <= 256) or n_expert < 2:
            raise UsageError(f"--experts {n_expert} --experts-used {n_used}: need 1 <= k <= E and "
                             "2 <= E <= 256 (a MoE model routes among at least two experts)")
        with err_console.status(f"building demo model E={n_expert} k={n_used}, {router} router ..."):
            path = build_demo_model(n_expert=n_expert, n_expert_used=n_used, seed=seed, out_dir=out_dir,
                                    router=router)
    err_console.print(f"{path.stat().st_size / 2**20:.0f} MiB", style="dim")
    print(path)  # NOTE: the only line on stdout: F=$(spark demo-model ...)


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
    with err_console.status(f"writing the {name} fixture header ..."):
        path = build_fixture(name, out_dir=out_dir)
    err_console.print(f"{fmt_bytes(path.stat().st_size)} apparent, {fmt_bytes(disk_bytes(path))} on disk "
                      "(no weights: plan it, do not run it)", style="dim")
    print(path)  # NOTE: the only line on stdout: F=$(spark demo-model --fixture NAME)


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


@dataclass(frozen=True)
class Sizes:
    """How much each timed step runs: the full demo, or --quick."""

    profile_gen: int  # decoded tokens after each corpus chunk
    bench_prompt: int  # spark bench -p / -n / -r
    bench_gen: int
    bench_reps: int
    ram_prompt: int  # the capped comparison's (spark bench --ram's -p / -n / -r)
    ram_gen: int
    ram_reps: int = 1


FULL = Sizes(16, 256, 48, 3, 128, 32)
QUICK = Sizes(4, 64, 8, 1, 32, 8)
RAM_RESIDENCY = 0.45  # the capped comparison's cap: Spark's RAM tier holds this share of the expert bytes
RAM_CONFIGS = ("stock", "spark")  # the capped comparison's configurations (bench --ram also times read-ahead)
MOE_MODES = ("resident", "cached", "host")  # a plan's modes of a MoE layer (planner.LayerPlan.mode)


@dataclass(frozen=True)
class Placement:
    """Where a placement keeps the MoE layers' experts: the words the closing lines compare."""

    n_moe: int
    host: tuple[int, ...]  # MoE layers whose experts stay on the host (stock's --n-cpu-moe shape)
    n_cached: int
    pinned: int = 0
    lru: int = 0

    @classmethod
    def of_plan(cls, plan: "Plan") -> "Placement":
        cached = [l for l in plan.layers if l.mode == "cached"]
        moe = [l for l in plan.layers if l.mode in MOE_MODES]
        return cls(len(moe), tuple(l.index for l in moe if l.mode == "host"), len(cached),
                   sum(len(l.pinned) for l in cached), sum(l.lru_slots for l in cached))

    @classmethod
    def of_bench(cls, config: dict, n_moe: int) -> "Placement":
        """A configuration of spark bench's JSON (its "placement": runs/bench.Config.summary)."""
        p = config.get("placement") or {}
        return cls(n_moe, tuple(p.get("host_layers") or ()), int(p.get("cached_layers") or 0),
                   int(p.get("pinned") or 0), int(p.get("lru_slots") or 0))

    def modes(self) -> tuple[tuple[int, ...], int]:
        return self.host, self.n_cached

    def words(self) -> str:
        resident = self.n_moe - len(self.host) - self.n_cached
        cache = f" ({self.pinned} experts pinned, {self.lru} LRU slots)" if self.n_cached else ""
        return (f"{resident} of {self.n_moe} MoE layers resident, {len(self.host)} on the host, "
                f"{self.n_cached} cached{cache}")


def _plan_line(plan: "Plan", residency: float) -> str:
    """The plan the demo made (and chat ran): its layers, and how it was priced."""
    where = Placement.of_plan(plan)
    lowest = [l.index for l in plan.layers if l.mode in MOE_MODES][:len(where.host)]
    stock = where.host and not where.n_cached and sorted(where.host) == lowest
    shape = f" (stock's --n-cpu-moe {len(where.host)} shape)" if stock else ""
    cold = "" if plan.predicted_cold_hit is None or not where.n_cached else \
        f", predicted cold-hit {100 * plan.predicted_cold_hit:.1f}%"
    pred = plan.predicted or {}
    priced = (f"priced in time, predicted {pred['tg_tok_s']:.1f} tok/s" if pred.get("tg_tok_s") else
              "placed by hits (no device costs)")
    return f"plan: {residency:.0%} of the expert bytes on the device, {priced}: {where.words()}{shape}{cold}"


def _bench_line(report: dict, plan: "Plan | None") -> str:
    """What spark bench ran as "spark" (the plan above, or another placement) and its verdict against stock."""
    configs = {c["name"]: c for c in report["configs"]}
    spark, stock = configs.get("spark"), configs.get(report.get("baseline") or "")
    if spark is None:
        return "bench: Spark did not run (see the tables above)"
    ran = Placement.of_bench(spark, int(report["model"]["n_moe_layers"]))
    if plan is not None and ran.modes() == Placement.of_plan(plan).modes():
        head = f"bench: Spark ran that placement ({ran.words()})"
    else:
        head = f"bench: Spark ran another placement than the plan above ({ran.words()})"
    if spark["tg_tok_s"] is None or stock is None or stock["tg_tok_s"] is None:
        return head + ": Spark or stock did not finish (see the tables above)"
    target = report["targets"]["tg_vs_stock"]
    ceiling = spark["ratios"].get("tg_vs_ceiling")
    return (f"{head}: {spark['tg_tok_s']['median']:.1f} tok/s, {target['value']:.2f}x the best "
            f"stock offload ({stock['label']}, {stock['tg_tok_s']['median']:.1f} tok/s) on the same budget"
            + (f", {ceiling:.2f}x all-resident" if ceiling is not None else "")
            + f": the {target['target']:g}x target {'met' if target['met'] else 'not met'}")


def closing_lines(plan_path: Path, residency: float, answer: str | None, bench_path: Path,
                  ram_line: str | None = None) -> list[str]:
    """What the demo showed, a line each: the plan, the answer, the placement bench ran and its
    verdict against stock, the RAM tier's capped comparison."""
    plan = plan_file.load(plan_path) if plan_path.is_file() else None
    out = [_plan_line(plan, residency) if plan is not None else "plan: not written",
           f"answer: {answer.strip()!r}" if answer else "answer: none"]
    if bench_path.is_file():
        out.append(_bench_line(json.loads(bench_path.read_text(encoding="utf-8")), plan))
    if ram_line:
        out.append(ram_line)
    return out


def _devices(rpc: str | None) -> tuple[list[str], LoadFlags]:
    """The one device every step uses (its flags, as argv and as LoadFlags): --rpc's, else this machine's
    first GPU (the demo starts a stand-in where it has none)."""
    if rpc:
        return ["--rpc", rpc], LoadFlags(rpc=rpc)
    first = devices.local_gpus()[0].name
    return ["-dev", first], LoadFlags(device=first)


def time_device(model: Path, g: "ModelGeometry", flags: LoadFlags, n_ctx: int, sizes: Sizes) -> str:
    """spark bench's device costs for this device, model and -t (runs/device_costs.ensure: kept under
    $SPARK_HOME/calibration, timed again or measured as bench does, with the bench step's prompt and
    decode length), so that the plan step prices its plan in time; the line that says which."""
    base = session.engine_options(model, g, None, flags, n_ctx=n_ctx, learn=False)
    cpu = dataclasses.replace(base, device="none", rpc=[], repack=False, tensor_overrides=())
    with Engine(cpu) as eng:  # NOTE: the bench's prompt, tokenized as bench does
        prompt = make_workload(eng, read_corpus(bundled_corpus()).documents, sizes.bench_prompt).pp_tokens
    cols = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=err_console, transient=True) as prog:
        tasks: dict[str, TaskID] = {}

        def on_progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = prog.add_task(label, total=total)
            prog.update(tasks[label], completed=done, total=total)

        _, why = device_costs.ensure(base, g, prompt, spark_home(), on_progress,
                                     max(sizes.bench_gen, device_costs.DECODE_TOKENS))
    return why


def compare_ram(model: Path, sizes: Sizes, out_json: Path) -> tuple[str, SparkError | None]:
    """spark bench --ram's comparison, short (runs/ram_bench.run: stock's page cache against Spark's file
    tier, each run in its own memory cgroup, -dev none) under the cap at which Spark's tier holds
    RAM_RESIDENCY of the expert bytes (ram_bench.residency_cap, from the uncapped run: about 700 MiB for
    the 807 MiB demo model): its table, and the closing line: the verdict (bench_ram.verdict), or why no
    memory cgroup could be made and how to get one, or the error that stopped it (returned beside the
    line: the demo's closing lines come first). Writes out_json."""
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*cols, console=err_console, transient=True) as prog:
            task = prog.add_task(f"runs under the cap for {RAM_RESIDENCY:.0%} of the experts in RAM",
                                 total=ram_bench.total_runs(sizes.ram_reps, RAM_CONFIGS))

            def on_run(i: int, n: int, r: ram_bench.RamRun) -> None:
                prog.update(task, completed=i)
                if not r.ok:
                    err_console.print(f"[yellow]warning:[/] {r.config}: {escape(r.error)}", soft_wrap=True)

            b = ram_bench.run(model, None, residency=RAM_RESIDENCY, reps=sizes.ram_reps, n_prompt=sizes.ram_prompt,
                              n_gen=sizes.ram_gen, configs=RAM_CONFIGS, on_run=on_run)
    except memcg.CgroupError as e:
        out_json.unlink(missing_ok=True)  # NOTE: not an earlier run's comparison beside this run's outputs
        return f"RAM tier: not compared here: {e.one_line()}", None
    except SparkError as e:
        out_json.unlink(missing_ok=True)
        return f"RAM tier: failed: {e.one_line()}", e
    atomic_write_text(out_json, json.dumps(b.to_dict(), indent=1) + "\n")
    console.print(bench_ram.table(b, md=False))
    return (f"RAM tier (a short run, {sizes.ram_reps} of each at -p {sizes.ram_prompt} -n {sizes.ram_gen}; the full "
            f"comparison: spark bench {model} --ram {-(-b.cap // (1 << 20))}MiB): {bench_ram.verdict(b)}"), None


def demo_cmd(
    ctx: typer.Context,
    rpc: str = typer.Option(None, "--rpc", help="use this RPC server instead of a local stand-in GPU"),
    residency: float = typer.Option(0.6, "--residency", min=0.05, max=1.0,
                                    help="share of expert bytes the budget holds on the device"),
    quick: bool = typer.Option(False, "--quick", help="shorter profile, bench and RAM-tier runs (for smoke tests)"),
) -> None:
    """The main job on the demo model: profile -> device costs -> plan -> one answer -> bench against stock
    offload -> the RAM tier under a memory cap."""
    from ..models.demo_model import build_demo_model

    root = ctx.find_root().command

    def spark(argv: list[str]) -> int:  # each step as its own command line, through the same error boundary
        return run_argv(root, argv)

    sizes = QUICK if quick else FULL
    out = spark_home() / "demo"
    out.mkdir(parents=True, exist_ok=True)
    console.rule("1/7 demo model")
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
    n_ctx = 2048
    budget = residency_budget(g, n_ctx, residency)
    trace = out / "demo-trace.npz"
    plan = out / "demo-plan.json"
    bench_json = out / "demo-bench.json"
    ram_json = out / "demo-ram-bench.json"
    answer = None
    try:
        dev, flags = _devices(rpc)
        steps: list[tuple[str, list[str] | Callable[[], str]]] = [
            ("2/7 profile: routing on the bundled corpus",
             ["profile", str(model), "--corpus", str(bundled_corpus()), "--gen", str(sizes.profile_gen),
              "--trace", str(trace), "--held-out", "0.25", "--plot", str(out / "demo-heatmap.png"), *dev]),
            ("3/7 device costs: the device timed, so that the plan is priced in time",
             lambda: time_device(model, g, flags, n_ctx, sizes)),
            # NOTE: --no-measure: priced and sized as the bench step plans "spark", so that both are one placement
            (f"4/7 plan: {residency:.0%} of the expert bytes on the device",
             ["plan", str(model), "--vram", str(budget), "-c", str(n_ctx), "--trace", str(trace), "--no-measure",
              "-o", str(plan), *dev]),
            ("5/7 chat: one answer through the expert cache", chat_argv(model, "--plan", str(plan), *dev)),
            ("6/7 bench: Spark against stock llama.cpp offload, same budget",
             ["bench", str(model), "--vram", str(budget), "-c", str(n_ctx), "-p", str(sizes.bench_prompt),
              "-n", str(sizes.bench_gen), "-r", str(sizes.bench_reps), "--ceiling", "-o", str(bench_json),
              "--plot", str(out / "demo-bench.png"), *dev]),
        ]
        for title, argv in steps:
            console.rule(title)
            if callable(argv):  # a step of the demo's own (its line), not a command
                console.print(argv(), soft_wrap=True, markup=False)
                continue
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
    console.rule("7/7 RAM tier: a model bigger than RAM, under a memory cgroup (CPU)")
    ram_line, ram_error = compare_ram(model, sizes, ram_json)
    console.print(ram_line, soft_wrap=True, markup=False)
    console.rule("done")
    for line in closing_lines(plan, residency, answer, bench_json, ram_line):
        console.print(line, soft_wrap=True, markup=False)
    ram_out = ", demo-ram-bench.json" if ram_json.is_file() else ""
    console.print(f"outputs in {out}: demo-plan.json, demo-trace.npz, demo-heatmap.png, demo-bench.json, "
                  f"demo-bench.png{ram_out}; profile beside the model; device costs in {spark_home() / 'calibration'}",
                  soft_wrap=True)
    if ram_error is not None:
        raise typer.Exit(ram_error.exit_code)


def register(app: typer.Typer) -> None:
    app.command("demo", cls=SparkCommand)(demo_cmd)
    app.command("demo-model", cls=SparkCommand)(demo_model_cmd)
