"""`spark bench --ram SIZE`: Spark's file tier against stock's page cache, under one RAM cap.

Each run is a fresh process inside a memory cgroup capped at SIZE (memcg.py), the model file's
page cache dropped before it, configurations interleaved (stock, spark, stock, spark, ...):
- stock: llama.cpp as users run it today, the model mapped and the kernel's page cache deciding what
  stays (the cache not attached: the graph is stock llama.cpp's), weights not repacked (repacking
  would copy them out of the mapping into RAM, which a capped run cannot hold);
- spark: the RAM tier the run picks by itself inside the cgroup (session.resolve_ram_tier: the
  cgroup's headroom less the measured KV cache and compute buffers), misses read from the file.
Both run the bench's workload (bench.make_workload: -p tokens of the corpus for prompt processing,
then -n greedy tokens after its generation prompt); a run reports its tokens, prompt and generation
speed, bytes read from storage and major faults per token of each phase (the kernel's /proc/self/io
and getrusage), the file tier's hits and bytes read, and the cgroup's peak against the cap. The worker is this module's
`main` (python -m spark_cli.runs.ram_bench), so the cap covers its whole life.
"""

from __future__ import annotations

import dataclasses
import os
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..core.capture import TopkRecord, records_to_trace
from ..core.cost_model import DiskCosts, file_tier_tg
from ..core.gguf_info import load_geometry
from ..core import ram_tier
from ..core.trace import DECODE
from ..files.paths import spark_home
from ..errors import SparkError
from . import disk_costs, memcg, page_cache_choice, read_ahead

CONFIGS = ("stock", "spark", "spark-ahead")  # spark-ahead: Spark's tier with read-ahead (one expert a layer, gated)
SPARK = ("spark", "spark-ahead")
BASE = "base"  # Spark with no cap: the uncapped speed, and the trace the prediction replays


@dataclass
class RamRun:
    config: str
    ok: bool
    error: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    pp_tok_s: float = 0.0
    tg_tok_s: float = 0.0
    read_bytes_per_token: float = 0.0  # storage reads during generation, per generated token
    major_faults_per_token: float = 0.0
    pp_read_bytes_per_token: float = 0.0  # the same during prompt processing, per prompt token
    pp_major_faults_per_token: float = 0.0
    file_bytes_per_token: float = 0.0  # the file tier's reads during generation, per token
    file_read_s_per_token: float = 0.0  # the time its steps waited on those reads, per token (native's clock)
    hit_rate: float | None = None
    resident_share: float | None = None  # the RAM tier's share of the expert bytes
    peak: int = 0  # the cgroup's peak (bytes)
    oom_kills: int = 0
    tier: str = ""
    slots: list[list] = field(default_factory=list)  # spark: [il, n_slots, pinned] per layer
    trace: list[list] = field(default_factory=list)  # base: [il, phase, ids] of each step (the prompts' too)
    predicted_tg_tok_s: float | None = None  # spark: the cost model's, from the base run and the disk
    predicted_read_s_per_token: float | None = None  # spark: of which the wait on the file's reads
    replayed_bytes_per_token: float | None = None  # spark: the base run's routing replayed through its slots
    ahead_min_prob: int = 0  # spark-ahead: the gate (core/prefetch.break_even's, from the base run and the disk)
    ahead_reads_per_token: float | None = None  # spark-ahead: experts read ahead per generated token
    ahead_recall: float | None = None  # spark-ahead: share of the misses that were read ahead
    ahead_precision: float | None = None  # spark-ahead: share of the reads ahead that a step used
    rss_peak: int = 0  # the process's peak resident set (bytes)
    rss_runtime: int = 0  # base: its resident set after a dry run, before the model loads (the runtime)
    host_bill: dict = field(default_factory=dict)  # base: the dry run's host bill (model, context, compute, total)


def run_context(n_ctx: int, n_prompt: int, n_gen: int) -> int:
    """The context a run opens: -c, or the workload's tokens and a margin where that is more."""
    return max(n_ctx, n_prompt + n_gen + 64)


@dataclass(frozen=True)
class DeviceShape:
    """Three tiers: every run on this RPC device (its server outside the cgroups) with stock's
    --n-cpu-moe N for the device budget; Spark's RAM tier holds those N host layers' experts."""

    rpc: str  # HOST:PORT
    n_cpu_moe: int


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process runs (its argv, as JSON)."""

    model: str
    config: str
    n_prompt: int
    n_gen: int
    threads: int | None
    n_ctx: int
    device: DeviceShape | None = None
    ahead_min_prob: int = 0  # spark-ahead's gate

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "WorkerSpec":
        d = json.loads(text)
        dev = d.pop("device")
        return cls(**d, device=DeviceShape(**dev) if dev else None)


def worker(spec: WorkerSpec) -> dict:
    """One run in this process (inside the cgroup): prompt processing, then greedy generation."""
    model, config, n_prompt, n_gen = Path(spec.model), spec.config, spec.n_prompt, spec.n_gen
    threads, n_ctx, device = spec.threads, spec.n_ctx, spec.device
    from ..core.options import LoadFlags
    from ..files.corpus import bundled_corpus, read_corpus
    from ..native.expert_cache import CacheLayer
    from . import dry_run, session

    geometry = session.open_geometry(model)
    n_ctx = run_context(n_ctx, n_prompt, n_gen)
    flags = LoadFlags(device=None if device else "none", rpc=device.rpc if device else None, threads=threads,
                      repack=False, ctx_size=n_ctx)
    out = RamRun(config, True)
    opts = session.engine_options(model, geometry, None, flags, n_ctx=n_ctx, learn=False)
    host = [il for il in geometry.moe_layers if device and il < device.n_cpu_moe]
    if device:
        opts = dataclasses.replace(opts, host_layers=host)
    if config in SPARK:
        info = session.load_profile(model, geometry)
        if device:
            bill = dry_run.measure(dataclasses.replace(opts, dry_run=True)).host()
            tier = session.host_ram_tier(geometry, info, flags, host, bill)
        else:
            tier = session.resolve_ram_tier(model, geometry, info, flags, n_ctx)
        forced = read_ahead.AheadDecision(1, spec.ahead_min_prob, "spark-ahead") if config == "spark-ahead" else None
        opts = session.with_ram_tier(opts, tier, geometry, forced)  # NOTE: bench compares; chat decides
        if forced is not None:
            out.ahead_min_prob = spec.ahead_min_prob
        out.tier = tier.line() if tier is not None else "the weights fit: no RAM tier"
        out.resident_share = tier.resident_share if tier is not None else 1.0
        out.slots = [[l.il, l.n_slots, list(l.pinned)] for l in tier.layers] if tier is not None else []
    elif config == BASE:  # NOTE: every expert in RAM, the routing traced: the prediction's inputs
        import psutil

        out.host_bill = dry_run.measure(dataclasses.replace(opts, dry_run=True)).host()
        opts = dataclasses.replace(opts, trace=True)
        if device:  # NOTE: Spark's shape, every host expert in RAM slots: only its stops, traced where they are
            whole = [CacheLayer(il, geometry.n_expert, (), in_ram=True) for il in host]
            opts = dataclasses.replace(opts, cache_layers=whole, file_tier=True, trace_uncached=False)
        out.rss_runtime = int(psutil.Process().memory_info().rss)
    from ..native.engine import Engine
    from .bench import cache_total, make_workload

    with Engine(opts) as eng:
        work = make_workload(eng, read_corpus(bundled_corpus()).documents, n_prompt)
        r0 = disk_costs.process_io()
        t0 = time.perf_counter()
        eng.eval(work.pp_tokens, logits="last")
        t1 = time.perf_counter()
        r1 = disk_costs.process_io()
        out.pp_tok_s = len(work.pp_tokens) / (t1 - t0)
        out.prompt_tokens = len(work.pp_tokens)
        out.pp_read_bytes_per_token = (r1[0] - r0[0]) / len(work.pp_tokens)
        out.pp_major_faults_per_token = (r1[1] - r0[1]) / len(work.pp_tokens)
        eng.reset()
        logits = eng.eval(work.gen_prompt, logits="last")
        c0 = cache_total(eng) if opts.cache_layers else None
        r1 = disk_costs.process_io()
        t1 = time.perf_counter()
        for _ in range(n_gen):
            t = int(np.argmax(logits))
            out.tokens.append(t)
            logits = eng.eval([t])
        t2 = time.perf_counter()
        r2 = disk_costs.process_io()
        out.tg_tok_s = n_gen / (t2 - t1)
        out.read_bytes_per_token = (r2[0] - r1[0]) / n_gen
        out.major_faults_per_token = (r2[1] - r1[1]) / n_gen
        if c0 is not None:
            d = cache_total(eng) - c0
            out.file_bytes_per_token = (d.bytes_uploaded + d.ahead_bytes) / n_gen
            out.file_read_s_per_token = d.upload_us / 1e6 / n_gen
            out.hit_rate = d.hit_rate
            if config == "spark-ahead":
                out.ahead_reads_per_token = d.ahead_reads / n_gen
                out.ahead_recall = d.ahead_used / d.misses if d.misses else None
                out.ahead_precision = d.ahead_used / d.ahead_reads if d.ahead_reads else None
        if config == BASE:
            out.trace = [[r.il, int(r.phase), r.ids.reshape(-1).tolist()] for r in eng.cache.trace_records()]
    out.rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return asdict(out)


@dataclass
class RamBench:
    cap: int
    runs: list[RamRun]
    base: RamRun | None = None  # the uncapped run
    disk: "DiskCosts | None" = None
    faults: "DiskCosts | None" = None  # the same reads faulted in through a mapping (stock's misses)
    stock_base: RamRun | None = None  # stock with no cap: the uncapped speed stock's prediction starts from

    def of(self, config: str) -> list[RamRun]:
        return [r for r in self.runs if r.config == config and r.ok]

    def median(self, config: str, key: str) -> float | None:
        vals = [getattr(r, key) for r in self.of(config) if getattr(r, key) is not None]
        return statistics.median(vals) if vals else None

    def exact(self) -> bool | None:
        """Every run's tokens the same (None: fewer than two runs finished)."""
        seqs = [tuple(r.tokens) for r in self.runs if r.ok]
        return len(set(seqs)) == 1 if len(seqs) >= 2 else None

    def ratio(self, key: str) -> float | None:
        s, k = self.median("spark", key), self.median("stock", key)
        return s / k if s and k else None

    def to_dict(self) -> dict:
        return {"cap": self.cap, "exact": self.exact(), "tg_ratio": self.ratio("tg_tok_s"),
                "pp_ratio": self.ratio("pp_tok_s"), "runs": [asdict(r) for r in self.runs],
                "uncapped": asdict(self.base) if self.base else None,
                "uncapped_stock": asdict(self.stock_base) if self.stock_base else None,
                "disk": asdict(self.disk) if self.disk else None, "faults": asdict(self.faults) if self.faults else None}

    def exact_vs_uncapped(self) -> bool | None:
        if self.base is None or not self.base.ok or not self.of("spark"):
            return None
        return all(r.tokens == self.base.tokens for r in self.of("spark"))


def residency_cap(g, base: RamRun, share: float, device: DeviceShape | None = None) -> int:
    """--ram-residency: the cap at which Spark's RAM tier holds `share` of the experts it serves (every
    MoE layer's; with a device, the host layers') in RAM slots, by the accounting its budget uses
    (session.resolve_ram_tier): the runtime (the uncapped run's resident set after its dry run), the
    measured host KV cache and compute buffers, RAM_MARGIN, the other weights, the staging slices, and
    that share of the experts. Stock gets the same cap."""
    from .session import RAM_MARGIN

    layers = [il for il in g.moe_layers if device is None or il < device.n_cpu_moe]
    moved = ram_tier.expert_bytes(g, layers)
    h = base.host_bill
    fixed = h["context"] + h["compute"] + RAM_MARGIN + max(0, h["model"] - moved)
    return int(base.rss_runtime + fixed + ram_tier.stage_bytes(g, layers) + share * moved)


def total_runs(reps: int, configs: Sequence[str]) -> int:
    """The runs a bench makes: Spark's uncapped base, stock's (when stock is compared), then each
    configuration `reps` times."""
    return 1 + ("stock" in configs) + reps * len(configs)


def run(model: Path, cap: int | None, *, reps: int = 2, n_prompt: int = 512, n_gen: int = 48,
        threads: int | None = None, n_ctx: int = 512, configs: Sequence[str] = CONFIGS,
        device: DeviceShape | None = None, residency: float | None = None,
        on_run: Callable[[int, int, RamRun], None] | None = None) -> RamBench:
    """Every configuration `reps` times, interleaved, each in a fresh cgroup capped at `cap` bytes (or,
    with `residency`, residency_cap's from the uncapped run) with the model's page cache dropped first
    (`device`: three tiers, on an RPC device). CgroupError before any run where none can be made."""
    memcg.make(cap or 256 << 20, "spark-bench-check").remove()  # NOTE: refuse before the long work
    runs: list[RamRun] = []
    total = total_runs(reps, configs)
    geometry = load_geometry(model)
    # NOTE: measured each time (and kept for chat and serve): the disk's speed drifts on a shared machine
    disk = disk_costs.remeasure(model, disk_costs.read_size(geometry), disk_costs.READERS, spark_home())
    faults = disk_costs.remeasure(model, disk_costs.read_size(geometry), threads or os.cpu_count() or 1, spark_home(),
                                  faults=True) if "stock" in configs else None
    spec = WorkerSpec(str(model), BASE, n_prompt, n_gen, threads, n_ctx, device)
    base = _spawn(None, spec)
    if on_run:
        on_run(1, total, base)
    # NOTE: stock's own uncapped speed prices stock (Spark's traced base pays a stop per layer that stock does not)
    stock_base = _spawn(None, dataclasses.replace(spec, config="stock")) if "stock" in configs else None
    if on_run and stock_base is not None:
        on_run(2, total, stock_base)
    if device is None and base.ok and base.tg_tok_s:  # NOTE: chat and serve decide read-ahead and the mapping with them
        read_ahead.keep_uncapped(spark_home(), geometry.fingerprint, threads or os.cpu_count() or 1, base.tg_tok_s,
                                 stock_base.tg_tok_s if stock_base is not None and stock_base.ok else None)
    if residency is not None:
        if not base.ok or not base.host_bill:
            raise SparkError(f"--ram-residency: the uncapped run failed ({base.error or 'no dry run'})")
        cap = residency_cap(geometry, base, residency, device)
    assert cap is not None
    gate = ahead_gate(geometry, base, disk, device)
    # NOTE: stock's prediction depends on the uncapped run and the cap only: replayed once, not per rep
    stock_tg = (predict_stock_tg(model, geometry, base, stock_base.tg_tok_s, cap, faults, device)
                if base.ok and stock_base is not None and stock_base.ok and faults is not None else None)
    for i in range(reps):
        for config in configs:
            with memcg.make(cap, f"spark-bench-{config}") as cg:
                r = _spawn(cg, dataclasses.replace(spec, config=config, ahead_min_prob=gate))
            if config in SPARK and r.ok and base.ok:
                r.replayed_bytes_per_token = replayed_bytes(geometry, base, r)
                r.predicted_tg_tok_s = predict_tg(geometry, base, r, disk)
                if r.predicted_tg_tok_s and base.tg_tok_s:
                    r.predicted_read_s_per_token = 1.0 / r.predicted_tg_tok_s - 1.0 / base.tg_tok_s
            elif config == "stock" and r.ok:
                r.predicted_tg_tok_s = stock_tg
            runs.append(r)
            if on_run:
                on_run(len(runs) + 1 + (stock_base is not None), total, r)
    return RamBench(cap, runs, base, disk, faults, stock_base)


def _spawn(cg: "memcg.MemoryCgroup | None", spec: WorkerSpec) -> RamRun:
    """One worker process (inside `cg` when given), the model's page cache dropped first."""
    memcg.drop_page_cache(Path(spec.model))
    argv = [sys.executable, "-m", "spark_cli.runs.ram_bench", spec.to_json()]
    p = (cg.run if cg is not None else subprocess.run)(argv, capture_output=True, text=True, timeout=1800)
    r = _parse(spec.config, p)
    if cg is not None:
        r.peak, r.oom_kills = cg.peak(), cg.oom_kills()
    return r


def _base_trace(g, base: RamRun):
    """The uncapped run's routing as a RoutingTrace: its prompts' steps and its decode steps (a run kept
    before the prompts were traced has [il, ids] of decode steps only)."""
    records = [TopkRecord(r[0], DECODE if len(r) == 2 else r[1],
                          np.asarray(r[-1], dtype=np.int32).reshape(-1, g.n_expert_used)) for r in base.trace]
    return records_to_trace(records, g.n_layer, g.n_expert, g.fingerprint)


def replayed_misses(g, base: RamRun, spark: RamRun) -> tuple[ram_tier.DecodeMisses, float]:
    """(misses per decode token, mean expert bytes) of the spark run's tier: the uncapped run's routing
    replayed through the tier's slots and policy, as native runs it."""
    slots = {il: n for il, n, _ in spark.slots}
    misses = ram_tier.decode_misses(slots, {il: tuple(p) for il, _, p in spark.slots}, _base_trace(g, base))
    return misses or ram_tier.DecodeMisses(0.0, 0.0), sum(g.layers[il].expert_bytes_per_expert for il in slots) / len(slots)


def _ahead_replay(g, base: RamRun, spark: RamRun):
    """spark-ahead's tier and gate replayed on the uncapped run's routing (core/prefetch.replay)."""
    from ..core import prefetch

    slots = {il: n for il, n, _ in spark.slots}
    return prefetch.replay(_base_trace(g, base), slots, {il: tuple(p) for il, _, p in spark.slots},
                           {il: g.layers[il].expert_bytes_per_expert for il in slots},
                           prefetch.AheadParams(1, spark.ahead_min_prob))


def replayed_bytes(g, base: RamRun, spark: RamRun) -> float | None:
    """Bytes per decode token the spark run's tier should read from the file: its replayed misses (and,
    for spark-ahead, the misses not read ahead plus every read ahead)."""
    if not spark.slots:
        return None
    if spark.config == "spark-ahead":
        return _ahead_replay(g, base, spark).bytes_per_token
    misses, eb = replayed_misses(g, base, spark)
    return misses.per_token * eb


def ahead_gate(g, base: RamRun, disk: "DiskCosts", device: DeviceShape | None) -> int:
    """spark-ahead's min_prob: the chance at which one expert read ahead pays by the cost model
    (prefetch.break_even), a layer's compute being the uncapped token's share of one MoE layer."""
    from ..core import prefetch

    layers = [il for il in g.moe_layers if device is None or il < device.n_cpu_moe]
    if not base.ok or not base.tg_tok_s or not layers:
        return prefetch.ONE
    eb = sum(g.layers[il].expert_bytes_per_expert for il in layers) / len(layers)
    return prefetch.break_even(eb, disk, 1.0 / base.tg_tok_s / len(g.moe_layers))


def predict_tg(g, base: RamRun, spark: RamRun, disk: "DiskCosts") -> float | None:
    """The cost model's tg for the spark run's tier: the uncapped token, plus its replayed misses
    (replayed_misses) read at the disk's measured rate, each step with a miss waiting a read's latency;
    with read-ahead (spark-ahead), the replayed reads ahead and the misses they cover priced by
    prefetch.predicted_tg."""
    from ..core import prefetch

    if not spark.slots:
        return base.tg_tok_s
    if spark.config != "spark-ahead":
        misses, eb = replayed_misses(g, base, spark)
        return 1.0 / file_tier_tg(1.0 / base.tg_tok_s, misses.per_token, eb, disk, miss_steps_per_token=misses.steps_per_token)
    return 1.0 / prefetch.predicted_tg(_ahead_replay(g, base, spark), 1.0 / base.tg_tok_s, disk, len(g.moe_layers))


def page_cache_bytes(g, base: RamRun, cap: int, device: DeviceShape | None = None) -> int:
    """What stock's page cache can hold of the experts under `cap`: the cap less the runtime (the
    uncapped run's resident set before loading), the measured KV cache and compute buffers and the
    weights that are not the page-cached experts (every MoE layer's; with a device, the host layers')."""
    layers = [il for il in g.moe_layers if device is None or il < device.n_cpu_moe]
    if not layers or not base.host_bill:
        return 0
    h = base.host_bill
    moved = ram_tier.expert_bytes(g, layers)
    return max(0, cap - base.rss_runtime - h["context"] - h["compute"] - max(0, h["model"] - moved))


def stock_bytes_per_token(model: Path, g, base: RamRun, cap: int, device: DeviceShape | None = None) -> float | None:
    """The bytes stock reads from the file per decode token under `cap`: the uncapped run's routing
    replayed through the page cache with the disk's read-around window (page_cache_choice)."""
    layers = [il for il in g.moe_layers if device is None or il < device.n_cpu_moe]
    if not layers or not base.trace:
        return None
    return page_cache_choice.page_cache_bytes_per_token(model, g, layers, _base_trace(g, base),
                                                        page_cache_bytes(g, base, cap, device))


def predict_stock_tg(model: Path, g, base: RamRun, stock_tg: float, cap: int, faults: "DiskCosts",
                     device: DeviceShape | None = None) -> float | None:
    """The cost model's tg for stock under `cap`: stock's uncapped token (`stock_tg`), plus
    stock_bytes_per_token (the base run's routing) read at the rate measured faulting through a
    mapping (disk_costs, faults: read-around included)."""
    if not stock_tg:
        return None
    read = stock_bytes_per_token(model, g, base, cap, device)
    return None if read is None else page_cache_choice.page_cache_tg(stock_tg, read, faults)


def _parse(config: str, p: subprocess.CompletedProcess) -> RamRun:
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        if p.returncode in (-9, 137):
            why = "killed (out of memory in the cgroup)"
        return RamRun(config, False, error=why[:300])
    d = json.loads(lines[-1])
    return RamRun(**d)


def main(argv: Sequence[str]) -> int:
    try:
        d = worker(WorkerSpec.from_json(argv[0]))
    except Exception as e:  # NOTE: the parent reports the one line
        from ..errors import SparkError

        print(e.one_line() if isinstance(e, SparkError) else f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
