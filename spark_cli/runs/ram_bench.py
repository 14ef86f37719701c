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
from . import disk_costs, memcg

CONFIGS = ("stock", "spark")
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
    hit_rate: float | None = None
    resident_share: float | None = None  # the RAM tier's share of the expert bytes
    peak: int = 0  # the cgroup's peak (bytes)
    oom_kills: int = 0
    tier: str = ""
    slots: list[list] = field(default_factory=list)  # spark: [il, n_slots, pinned] per layer
    trace: list[list] = field(default_factory=list)  # base: [il, ids] of each decode step
    predicted_tg_tok_s: float | None = None  # spark: the cost model's, from the base run and the disk


def _io() -> tuple[int, int]:
    """(bytes this process read from storage, its major faults) so far."""
    rb = 0
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                rb = int(line.split()[1])
    return rb, resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def worker(model: Path, config: str, n_prompt: int, n_gen: int, threads: int | None, n_ctx: int) -> dict:
    """One run in this process (inside the cgroup): prompt processing, then greedy generation."""
    from ..core.options import LoadFlags
    from ..files.corpus import bundled_corpus, read_corpus
    from . import session

    geometry = session.open_geometry(model)
    n_ctx = max(n_ctx, n_prompt + n_gen + 64)
    flags = LoadFlags(device="none", threads=threads, repack=False, ctx_size=n_ctx)
    out = RamRun(config, True)
    opts = session.engine_options(model, geometry, None, flags, n_ctx=n_ctx, learn=False)
    if config == "spark":
        info = session.load_profile(model, geometry)
        tier = session.resolve_ram_tier(model, geometry, info, flags, n_ctx)
        opts = session.with_ram_tier(opts, tier, geometry)
        out.tier = tier.line() if tier is not None else "the weights fit: no RAM tier"
        out.resident_share = tier.resident_share if tier is not None else 1.0
        out.slots = [[l.il, l.n_slots, list(l.pinned)] for l in tier.layers] if tier is not None else []
    elif config == BASE:  # NOTE: every expert in RAM, the routing traced: the prediction's inputs
        opts = dataclasses.replace(opts, trace=True)
    from ..native.engine import Engine
    from .bench import cache_total, make_workload

    with Engine(opts) as eng:
        work = make_workload(eng, read_corpus(bundled_corpus()).documents, n_prompt)
        r0 = _io()
        t0 = time.perf_counter()
        eng.eval(work.pp_tokens, logits="last")
        t1 = time.perf_counter()
        r1 = _io()
        out.pp_tok_s = len(work.pp_tokens) / (t1 - t0)
        out.prompt_tokens = len(work.pp_tokens)
        out.pp_read_bytes_per_token = (r1[0] - r0[0]) / len(work.pp_tokens)
        out.pp_major_faults_per_token = (r1[1] - r0[1]) / len(work.pp_tokens)
        eng.reset()
        logits = eng.eval(work.gen_prompt, logits="last")
        c0 = cache_total(eng) if opts.cache_layers else None
        r1 = _io()
        t1 = time.perf_counter()
        for _ in range(n_gen):
            t = int(np.argmax(logits))
            out.tokens.append(t)
            logits = eng.eval([t])
        t2 = time.perf_counter()
        r2 = _io()
        out.tg_tok_s = n_gen / (t2 - t1)
        out.read_bytes_per_token = (r2[0] - r1[0]) / n_gen
        out.major_faults_per_token = (r2[1] - r1[1]) / n_gen
        if c0 is not None:
            d = cache_total(eng) - c0
            out.file_bytes_per_token = d.bytes_uploaded / n_gen
            out.hit_rate = d.hit_rate
        if config == BASE:
            out.trace = [[r.il, r.ids.reshape(-1).tolist()] for r in eng.cache.trace_records() if r.phase == DECODE]
    return asdict(out)


@dataclass
class RamBench:
    cap: int
    runs: list[RamRun]
    base: RamRun | None = None  # the uncapped run
    disk: "DiskCosts | None" = None

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
                "uncapped": {"tg_tok_s": self.base.tg_tok_s, "pp_tok_s": self.base.pp_tok_s} if self.base else None,
                "disk": asdict(self.disk) if self.disk else None}

    def exact_vs_uncapped(self) -> bool | None:
        if self.base is None or not self.base.ok or not self.of("spark"):
            return None
        return all(r.tokens == self.base.tokens for r in self.of("spark"))


def run(model: Path, cap: int, *, reps: int = 2, n_prompt: int = 512, n_gen: int = 48, threads: int | None = None,
        n_ctx: int = 512, configs: Sequence[str] = CONFIGS,
        on_run: Callable[[int, int, RamRun], None] | None = None) -> RamBench:
    """Every configuration `reps` times, interleaved, each in a fresh cgroup capped at `cap` bytes
    with the model's page cache dropped first. CgroupError before any run where none can be made."""
    memcg.make(cap, "spark-bench-check").remove()  # NOTE: refuse before the long work
    runs: list[RamRun] = []
    total = reps * len(configs) + 1
    geometry = load_geometry(model)
    disk = disk_costs.ensure(model, disk_costs.read_size(geometry), READERS, spark_home())
    base = _spawn(None, model, BASE, n_prompt, n_gen, threads, n_ctx)
    if on_run:
        on_run(1, total, base)
    for i in range(reps):
        for config in configs:
            with memcg.make(cap, f"spark-bench-{config}") as cg:
                r = _spawn(cg, model, config, n_prompt, n_gen, threads, n_ctx)
            if config == "spark" and r.ok and base.ok:
                r.predicted_tg_tok_s = predict_tg(geometry, base, r, disk)
            runs.append(r)
            if on_run:
                on_run(len(runs) + 1, total, r)
    return RamBench(cap, runs, base, disk)


READERS = 4  # the file tier's reads in flight (EngineOptions.file_readers)


def _spawn(cg: "memcg.MemoryCgroup | None", model: Path, config: str, n_prompt: int, n_gen: int,
           threads: int | None, n_ctx: int) -> RamRun:
    """One worker process (inside `cg` when given), the model's page cache dropped first."""
    memcg.drop_page_cache(model)
    argv = [sys.executable, "-m", "spark_cli.runs.ram_bench", str(model), config, str(n_prompt),
            str(n_gen), str(threads or 0), str(n_ctx)]
    p = (cg.run if cg is not None else subprocess.run)(argv, capture_output=True, text=True, timeout=1800)
    r = _parse(config, p)
    if cg is not None:
        r.peak, r.oom_kills = cg.peak(), cg.oom_kills()
    return r


def predict_tg(g, base: RamRun, spark: RamRun, disk: "DiskCosts") -> float | None:
    """The cost model's tg for the spark run's tier: the uncapped token, plus its misses (the uncapped
    run's routing replayed through the tier's slots and policy, as native runs it) read at the disk's
    measured rate."""
    if not spark.slots:
        return base.tg_tok_s
    records = [TopkRecord(il, DECODE, np.asarray(ids, dtype=np.int32).reshape(-1, g.n_expert_used))
               for il, ids in base.trace]
    trace = records_to_trace(records, g.n_layer, g.n_expert, g.fingerprint)
    slots = {il: n for il, n, _ in spark.slots}
    misses = ram_tier.misses_per_token(slots, {il: tuple(p) for il, _, p in spark.slots}, trace) or 0.0
    eb = sum(g.layers[il].expert_bytes_per_expert for il in slots) / len(slots)
    return 1.0 / file_tier_tg(1.0 / base.tg_tok_s, misses, eb, disk)


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
    model, config, n_prompt, n_gen, threads, n_ctx = argv
    try:
        d = worker(Path(model), config, int(n_prompt), int(n_gen), int(threads) or None, int(n_ctx))
    except Exception as e:  # NOTE: the parent reports the one line
        from ..errors import SparkError

        print(e.one_line() if isinstance(e, SparkError) else f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(d))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
