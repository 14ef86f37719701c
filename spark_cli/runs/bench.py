"""`spark bench`, engine side: configurations within one VRAM budget, timed runs on corpus
text, medians and spreads, the figures that do not depend on the hardware, the report.

Configurations (every one sized for the same budget):
  resident    all experts on the device: the ceiling (run beyond the budget only on request)
  cpu-moe     stock llama.cpp --cpu-moe: every expert tensor in host RAM, computed on the CPU
  n-cpu-moe   stock llama.cpp --n-cpu-moe N, N the fewest expert layers on the CPU that fit
  spark-step  Spark placement without a cache to speak of: the budget spent on pinned hot
              experts, k policy slots per layer (one step): the planner's "pins+k" candidate
  spark       Spark placement with the planned cache: planner.plan_for, as chat and plan place
              (pins against slots priced by replaying the profile's ring, calibration included)
  cpu         everything on the CPU: the only configuration without a GPU-type device

Every configuration is sized with the run's -ctk/-ctv/-ub/-np/--kv-unified (planner.fixed_bytes), as the plans are.

When every configuration fits the device at once (an RPC stand-in, a large card) they are all
opened first and take turns, one repetition each (take_turns): a machine whose speed drifts
during the bench drifts for all of them alike, so their ratios hold. Otherwise one after another.

Each run: prompt processing of `n_prompt` corpus tokens, then greedy generation of `n_gen`
tokens after a corpus prompt (end-of-generation tokens are skipped so every configuration
decodes the same number of tokens). Cache figures: the decode steps (per generated token) and
the prompt-processing evals (per prompt token), apart; the generation prompt's own prefill is in
neither.

With --infill each configuration also times /infill as an editor plugin sends it on every
keystroke, -r times after its runs: the time to the first token of the FIM prompt serve builds
(core/fim.py) for a 2048-token prefix of the bundled code corpus and a short suffix. A model
without FIM tokens gets a note naming them instead.

With -np N > 1 every configuration is opened with N sequences (and sized for them), and after
the single-sequence runs each repetition also decodes N distinct corpus prompts through one
BatchLoop (`measure_parallel`): first one after another, each alone in the loop ("serial"),
then all N together. Both count only the all-decode steps (no prompt token in the step; the
prompts are cut to fit one step together): tokens decoded in them over their wall time.

Pure of rich and typer: the command renders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ..core import planner, settle, units, vram
from ..core.simulator import MissPath
from ..core.trace import DECODE
from ..native.engine import CacheLayer, Engine, EngineOptions
from ..native.expert_cache import CacheStats
from ..native.generate import BatchLoop, Decoding, GenerationStep, Greedy, StepShape, StopRules
from ..native.rpc_traffic import Traffic
from ..native import rpc_traffic
from ..errors import PlanError, ProfileError, SparkError, UsageError
from ..core.gguf_info import ModelGeometry
from ..core.options import DEFAULT_UBATCH
from ..core.cost_model import Prediction
from ..files.paths import spark_home
from . import device_costs, session
from .cpu_steal import CpuClock, steal_note, steal_share
from .miss_path import initial_path

REPORT_VERSION = 1
CONFIG_NAMES = ("resident", "cpu-moe", "n-cpu-moe", "spark-step", "spark", "spark-layer")
DEFAULT_CONFIGS = CONFIG_NAMES[:5]  # spark-layer: the per-layer miss rule before issue 25, on request
CPU_CONFIG = "cpu"
TARGET_VS_CEILING = 0.6  # Spark generation against the all-resident ceiling
TARGET_VS_STOCK = 1.0  # Spark against the best stock offload, generation and prompt: never slower
WARMUP_PROMPT = 32
WARMUP_DECODE = 4
CALIB_DECODE = 48  # decode tokens after each calibration prompt
CALIB_PROMPTS = 6
CALIB_PROMPT_TOKENS = 256
INFILL_PREFIX = 2048  # tokens of code before the cursor (--infill)
INFILL_SUFFIX = 64  # and after it

Progress = Callable[[str, int, int], None]  # (configuration, tokens done, tokens in all)


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread | None":
        return cls(statistics.median(values), min(values), max(values)) if values else None


@dataclass(frozen=True)
class Run:
    pp_tokens: int
    pp_seconds: float
    tg_tokens: int
    tg_seconds: float
    started: float = 0.0  # seconds from the start of the bench's measurements (measuring's `clock`) to this run

    @property
    def pp_tok_s(self) -> float:
        return self.pp_tokens / self.pp_seconds if self.pp_seconds > 0 else 0.0

    @property
    def tg_tok_s(self) -> float:
        return self.tg_tokens / self.tg_seconds if self.tg_seconds > 0 else 0.0


# ---------------------------------------------------------------- configurations


@dataclass
class Config:
    name: str
    label: str
    kind: str  # ceiling | stock | spark | cpu
    status: str = "ready"  # ready | does not fit
    note: str = ""
    device: str | None = None  # -dev (devices.py): None = the run's selection, "none" = the CPU
    host_layers: tuple[int, ...] = ()
    cache_layers: tuple[CacheLayer, ...] = ()
    expert_overrides: tuple = ()  # a Spark plan's tensor overrides (placement.py); stock: from host_layers
    planned_bytes: int = 0
    over_budget: bool = False  # the ceiling, run beyond the budget as a reference
    plan: planner.Plan | None = field(default=None, repr=False)
    miss_path: MissPath = MissPath.AUTO  # spark: auto | cpu | upload (see miss_path.py)
    predicted: Prediction | None = None  # the cost model's, with the device's costs (None: no costs)

    def key(self) -> tuple:
        return self.device, self.host_layers, self.cache_layers, self.miss_path if self.cache_layers else None

    def summary(self, g: ModelGeometry) -> dict:
        """Where the experts are: layers on the CPU, cached layers, pins, LRU slots, residency."""
        exp = max(g.total_expert_bytes, 1)
        out: dict = {"host_layers": list(self.host_layers), "cached_layers": len(self.cache_layers)}
        if self.plan is not None:
            b = self.plan.breakdown
            out["pinned"] = sum(len(c.pinned) for c in self.cache_layers)
            out["lru_slots"] = sum(c.n_slots - len(c.pinned) for c in self.cache_layers)
            out["policy"] = self.plan.policy
            out["expert_residency"] = (b["experts_resident"] + b["expert_banks"]) / exp
        elif self.kind in ("ceiling", "stock"):
            on_cpu = sum(l.expert_bytes for l in g.layers if l.index in set(self.host_layers))
            out["expert_residency"] = 1.0 - on_cpu / exp
        return out


def residency_budget(g: ModelGeometry, n_ctx: int, share: float, type_k: str = "f16", type_v: str = "f16",
                     n_ubatch: int = DEFAULT_UBATCH, n_parallel: int = 1, kv_unified: bool = False) -> int:
    """A budget that holds `share` of the expert bytes beside everything else (planner.fixed_bytes
    with the run's KV types, ubatch and sequences)."""
    return (planner.fixed_bytes(g, n_ctx, type_k, type_v, n_ubatch, n_parallel, kv_unified)
            + int(share * g.total_expert_bytes))


def make_configs(g: ModelGeometry, budget: int, n_ctx: int, names: Sequence[str],
                 plan_step: planner.Plan | PlanError | None, plan_cache: planner.Plan | PlanError | None,
                 ceiling: bool = False, *, type_k: str = "f16", type_v: str = "f16",
                 n_ubatch: int = DEFAULT_UBATCH, plan_layer: planner.Plan | PlanError | None = None,
                 n_parallel: int = 1, kv_unified: bool = False) -> list[Config]:
    """The configurations asked for, each ready or marked "does not fit" (with why); stock ones
    sized with the KV types, ubatch and sequences (-np, --kv-unified) the plans were made for."""
    fixed = planner.fixed_bytes(g, n_ctx, type_k, type_v, n_ubatch, n_parallel, kv_unified)
    stock = planner.stock_baseline(g, budget, fixed)
    moe = g.moe_layers
    out = []
    for name in names:
        if name == "resident":
            need = planner.stock_baseline(g, 1 << 62, fixed).device_bytes
            c = Config(name, "all resident", "ceiling", planned_bytes=need)
            if need > budget:
                if ceiling:
                    c.over_budget, c.label = True, "all resident (over budget)"
                    c.note = f"reference beyond the budget: needs {units.gib(need)} > {units.gib(budget)}"
                else:
                    c.status, c.note = "does not fit", f"needs {units.gib(need)} > budget {units.gib(budget)}"
        elif name == "cpu-moe":
            c = Config(name, "stock --cpu-moe", "stock", host_layers=tuple(moe),
                       planned_bytes=stock.cpu_moe_device_bytes)
            if not stock.cpu_moe_fits:
                c.status, c.note = "does not fit", f"needs {units.gib(stock.cpu_moe_device_bytes)} > budget {units.gib(budget)}"
        elif name == "n-cpu-moe":
            n = stock.n_cpu_moe
            c = Config(name, f"stock --n-cpu-moe {n}", "stock",
                       host_layers=tuple(i for i in moe if i < n), planned_bytes=stock.device_bytes)
            if not stock.fits:
                c.status, c.note = "does not fit", f"needs {units.gib(stock.device_bytes)} > budget {units.gib(budget)}"
        elif name in ("spark-step", "spark", "spark-layer"):
            plan = {"spark-step": plan_step, "spark": plan_cache, "spark-layer": plan_layer}[name]
            label = {"spark-step": "Spark, step slots", "spark": "Spark + cache",
                     "spark-layer": "Spark, per-layer misses"}[name]
            c = Config(name, label, "spark", miss_path=MissPath.LAYER if name == "spark-layer" else MissPath.AUTO)
            if isinstance(plan, planner.Plan):
                c.plan, c.planned_bytes = plan, plan.breakdown["total"]
                c.cache_layers = tuple(CacheLayer(l.index, l.slots, tuple(l.pinned), policy=plan.policy)
                                       for l in plan.layers if l.mode == "cached")
                c.host_layers = tuple(l.index for l in plan.layers if l.mode == "host")  # below the cache floor
                c.expert_overrides = plan.overrides
            else:
                c.status, c.note = "does not fit", (plan.one_line() if plan is not None else "no plan")
        else:
            raise UsageError(f"--configs: unknown configuration {name!r}", hint="use " + ", ".join(CONFIG_NAMES))
        out.append(c)
    return out


def predict_config(g: ModelGeometry, req: planner.PlanRequest, c: Config) -> Prediction | None:
    """The cost model's time per token of a configuration that fits (stock's: its host layers)."""
    if c.status != "ready" or c.kind == "cpu" or req.costs is None:
        return None
    return planner.price(g, req, c.plan if c.kind == "spark" else None, c.host_layers)


def cpu_config() -> Config:
    return Config(CPU_CONFIG, "CPU only (no device)", "cpu", device="none")


def parse_config_names(text: str | None) -> list[str]:
    if not text:
        return list(DEFAULT_CONFIGS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIG_NAMES]
    if bad or not names:
        raise UsageError(f"--configs: unknown configuration {', '.join(bad) or repr(text)}",
                         hint="a comma-separated list of " + ", ".join(CONFIG_NAMES))
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------- workload


@dataclass
class Workload:
    pp_tokens: list[int]  # prompt-processing text
    gen_prompt: list[int]  # generation starts after this
    calibration: list[list[int]]  # prompts for the routing trace (other documents than gen_prompt)
    note: str = ""
    prompts: list[list[int]] = field(default_factory=list)  # every document's prompt, gen_prompt first (-np)
    infill: list[int] = field(default_factory=list)  # --infill: the /infill prompt (InfillPrompt)

    def parallel_prompts(self, n_seq: int, max_len: int) -> list[list[int]]:
        """N distinct prompts of at most max_len tokens: the documents' prompts in turn (gen_prompt
        first); past the last, again with one more token cut from the end each round."""
        pool = [p for p in (self.prompts or [self.gen_prompt]) if len(p) >= 2] or [self.gen_prompt]
        out = []
        for i in range(n_seq):
            p = pool[i % len(pool)][:max(max_len, 2)]
            out.append(p[:max(len(p) - i // len(pool), 1)])
        return out


def _first_turn(messages: list[dict]) -> list[dict]:
    """The messages up to the first assistant turn: what the model answers."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and any(x["role"] == "user" for x in out):
            break
        out.append(m)
    return out


def make_workload(engine: Engine, documents: Sequence, n_prompt: int) -> Workload:
    """Token sequences from corpus documents (corpus.Document): chats through the model's template."""
    rendered, prompts = [], []
    for d in documents:
        if d.is_chat:
            rendered.append(engine.vocab.chat_prompt(d.messages, add_generation_prompt=False))
            prompts.append(engine.vocab.tokenize(engine.vocab.chat_prompt(_first_turn(d.messages)), add_special=True))
        else:
            rendered.append(d.text or "")
            prompts.append(engine.vocab.tokenize(d.text or "", add_special=True)[:CALIB_PROMPT_TOKENS])
    prefix = engine.vocab.tokenize("", add_special=True)  # BOS, where the model has one
    body = engine.vocab.tokenize("\n\n".join(rendered), add_special=False)
    if len(body) < 2:
        raise ProfileError("--corpus: the text tokenizes to nothing", hint="give a corpus with text")
    text = prefix + body
    note = ""
    if len(text) < n_prompt:
        note = f"corpus has {len(text)} tokens: repeated to {n_prompt} for prompt processing"
        while len(text) < n_prompt:
            text += body
    # generation follows the first chat's first user turn; the other documents calibrate (held out)
    usable = [i for i, p in enumerate(prompts) if len(p) >= 2]
    gi = next((i for i in usable if documents[i].is_chat), usable[0] if usable else None)
    gen = text[:64] if gi is None else prompts[gi] if documents[gi].is_chat else prompts[gi][:64]
    calib = [p[:CALIB_PROMPT_TOKENS] for i, p in enumerate(prompts) if i != gi and len(p) >= 2][:CALIB_PROMPTS]
    calib = calib or [text[:CALIB_PROMPT_TOKENS]]
    pool = [gen] + [p[:CALIB_PROMPT_TOKENS] for i, p in enumerate(prompts) if i != gi and len(p) >= 2]
    return Workload(text[:n_prompt], gen, calib, note, pool)


@dataclass(frozen=True)
class InfillPrompt:
    """--infill: the /infill prompt for a code prefix and suffix (empty: the model has no FIM tokens)."""

    tokens: list[int]
    prefix_tokens: int  # of the code before the cursor, as given (the prompt keeps 3/4 of a batch of them)
    suffix_tokens: int
    n_batch: int
    missing: tuple[str, ...] = ()  # the FIM tokens the model lacks (core.fim.FimTokens.missing)

    def note(self) -> str:
        from ..core.fim import NoFim

        return f"infill: not measured: {NoFim(list(self.missing))}" if self.missing else ""

    def to_dict(self) -> dict:
        return {"prompt_tokens": len(self.tokens) or None, "prefix_tokens": self.prefix_tokens,
                "suffix_tokens": self.suffix_tokens, "n_batch": self.n_batch, "missing": list(self.missing) or None,
                "note": self.note() or None}


def infill_prompt(engine: Engine, n_prefix: int = INFILL_PREFIX, n_suffix: int = INFILL_SUFFIX) -> InfillPrompt:
    """The prompt spark serve's /infill builds (serve/infill.py, core/fim.py) on `engine` for the
    first n_prefix tokens of the bundled code corpus (repeated to length) and the n_suffix after them."""
    from ..core.fim import infill_tokens
    from ..files.corpus import bundled_corpus

    vocab = engine.vocab
    fim = vocab.fim_tokens()
    if fim.missing():
        return InfillPrompt([], n_prefix, n_suffix, engine.n_batch, tuple(fim.missing()))
    body = vocab.tokenize((bundled_corpus() / "code.md").read_text(encoding="utf-8"), add_special=False,
                          parse_special=False)
    code = list(body)
    while len(code) < n_prefix + n_suffix:
        code += body
    prefix, suffix = vocab.detokenize(code[:n_prefix]), vocab.detokenize(code[n_prefix:n_prefix + n_suffix])
    tokens = infill_tokens(fim, lambda text, special: vocab.tokenize(text, add_special=False, parse_special=special),
                           prefix, suffix, n_batch=engine.n_batch, n_predict=-1, n_ctx=engine.n_ctx)
    return InfillPrompt(tokens, n_prefix, n_suffix, engine.n_batch)


# ---------------------------------------------------------------- measurement


GREEDY = Greedy(skip_eog=True)  # every run decodes its full length
NO_EOG = StopRules(eog=False)


def decode(engine: Engine, prompt: Sequence[int], n: int, on_prompt: Callable | None = None,
           on_token: Callable[[int], None] | None = None) -> GenerationStep:
    """Greedy decode of n tokens after `prompt` through the generation loop; its last step."""
    for step in engine.stream_generate(list(prompt), sampler=GREEDY, max_tokens=n, stop=NO_EOG, on_prompt=on_prompt):
        if step.token is not None and on_token:
            on_token(step.token)
    return step


def calibrate(engine: Engine, g: ModelGeometry, prompts: Sequence[Sequence[int]], n_decode: int = CALIB_DECODE,
              progress: Progress | None = None):
    """A routing trace of the calibration prompts, each followed by greedy decode.
    `engine` must have been opened with trace=True (any placement: the routing is the same)."""
    from ..core.capture import records_to_trace

    total = sum(len(p) + n_decode for p in prompts)
    done = 0
    engine.reset_stats()
    for p in prompts:
        engine.reset()
        decode(engine, p, n_decode)  # the prompt's last layer routes the output row only
        done += len(p) + n_decode
        if progress:
            progress("calibration", done, total)
    records = engine.cache.trace_records()
    engine.reset_stats()
    return records_to_trace(records, g.n_layer, g.n_expert, g.fingerprint)


@dataclass
class Result:
    config: Config
    status: str = "pending"  # ok | does not fit | failed | interrupted | pending
    reason: str = ""
    runs: list[Run] = field(default_factory=list)
    decode_tokens: int = 0  # decode steps the cache figures cover
    cache: CacheStats = field(default_factory=CacheStats)  # summed over the decode steps of every run
    prompt_cache: CacheStats = field(default_factory=CacheStats)  # summed over the prompt evals of every run
    miss_path: str = ""  # what ran: cpu, upload, or a per-layer mix (spark)
    miss_path_why: str = ""
    bank_bytes: int = 0
    device_name: str = ""
    device_used_bytes: int | None = None  # free before load - free after warm-up (measured)
    tokens_digest: str = ""  # of the generated tokens of the first run
    same_as: str = ""  # identical placement measured under another name
    counts: np.ndarray | None = field(default=None, repr=False)  # decode routing counts
    ratios: dict[str, float | None] = field(default_factory=dict)
    parallel: "ParallelResult | None" = None  # -np N > 1: N sequences together and one after another
    traffic: Traffic | None = None  # with the RPC servers (rpc_traffic), summed over the decode steps of every run
    prompt_traffic: Traffic | None = None  # the same over the prompt evals of every run
    counted_uncached: bool = False  # the layers a Spark plan does not cache counted their routing (a stop each)
    infill: list[float] = field(default_factory=list)  # --infill: seconds to the first token, one per repetition

    @property
    def prompt_tokens(self) -> int:
        """Prompt-processing tokens `prompt_cache` covers (one logits read-back per run)."""
        return sum(x.pp_tokens for x in self.runs)

    @property
    def pp(self) -> Spread | None:
        return Spread.of([r.pp_tok_s for r in self.runs])

    @property
    def tg(self) -> Spread | None:
        return Spread.of([r.tg_tok_s for r in self.runs])

    @property
    def infill_ms(self) -> Spread | None:
        return Spread.of([1000 * s for s in self.infill])


@dataclass(frozen=True)
class BatchRun:
    """One pass of the N sequences through the batch loop (together, or one after another): the
    all-decode steps (no prompt token in them), their decoded tokens, wall time and cache counters."""

    tokens: int
    seconds: float
    steps: int
    cache: CacheStats = field(default_factory=CacheStats)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ParallelResult:
    """-np N: each repetition's N sequences decoded one after another (serial) and together."""

    n_seq: int
    prompt_lengths: list[int] = field(default_factory=list)
    serial: list[BatchRun] = field(default_factory=list)
    together: list[BatchRun] = field(default_factory=list)
    tokens_match: bool | None = None  # each sequence's greedy tokens together == alone, every repetition
    serial_digest: str = ""  # of every sequence's tokens, in order (first repetition)
    together_digest: str = ""

    @staticmethod
    def spread(runs: list[BatchRun]) -> Spread | None:
        return Spread.of([r.tok_s for r in runs])

    @property
    def ratio(self) -> float | None:
        """Median aggregate tok/s together over the median one after another."""
        a, b = self.spread(self.together), self.spread(self.serial)
        return a.median / b.median if a is not None and b is not None and b.median > 0 else None

    def phase(self, runs: list[BatchRun], cached: bool) -> dict:
        c = CacheStats.total(r.cache for r in runs)
        n = sum(r.tokens for r in runs)
        return {"runs": [{"tokens": r.tokens, "seconds": r.seconds, "steps": r.steps, "tok_s": r.tok_s}
                         for r in runs],
                "tok_s": _spread(self.spread(runs)), "decode_tokens": n,
                "hits": c.hits, "misses": c.misses, "uploads": c.uploads, "bytes_uploaded": c.bytes_uploaded,
                "staged_uploads": c.staged_uploads, "staged_upload_bytes": c.staged_upload_bytes,
                "cpu_experts": c.cpu_experts,
                # as the single-sequence figures: hits / (hits + misses), admissions (uploads) per token
                "hit_rate": c.hit_rate if cached else None,
                "uploads_per_token": (c.uploads / n if n else None) if cached else 0.0}

    def to_dict(self, cached: bool) -> dict:
        return {"n_seq": self.n_seq, "prompt_lengths": list(self.prompt_lengths),
                "serial": self.phase(self.serial, cached), "together": self.phase(self.together, cached),
                "ratio": self.ratio, "tokens_match": self.tokens_match,
                "serial_digest": self.serial_digest or None, "together_digest": self.together_digest or None}


def cold_figures(r: Result, g: ModelGeometry) -> dict[str, float | None]:
    """Cold-hit rate (routed decode experts not on the device when needed), uploads and bytes
    per decode token. Stock layers on the CPU are cold for every routed expert, and never upload."""
    if not r.runs:
        return {"cold_hit": None, "uploads_per_token": None, "bytes_per_token": None}
    moe = max(len(g.moe_layers), 1)
    if r.config.kind in ("stock", "ceiling", "cpu"):
        cold = 1.0 if r.config.kind == "cpu" else len(r.config.host_layers) / moe
        return {"cold_hit": cold, "uploads_per_token": 0.0, "bytes_per_token": 0.0}
    n, c = max(r.decode_tokens, 1), r.cache
    return {"cold_hit": c.misses / (n * g.n_expert_used * moe), "uploads_per_token": c.uploads / n,
            "bytes_per_token": c.bytes_uploaded / n}


# counters reported per token, in each phase: "<name>_per_token" (decode), "<name>_per_prompt_token"
ACCOUNTING = ("syncs", "blocking_upload_bytes", "async_upload_bytes", "cpu_expert_bytes",
              "staged_uploads", "staged_upload_bytes", "blocking_calls")
PROMPT_ACCOUNTING = ("uploads",) + ACCOUNTING  # decode uploads per token: cold_figures


def per_token(c: CacheStats, names: Sequence[str], n_tokens: int, readbacks: int, suffix: str) -> dict[str, float]:
    """Measured counters over `n_tokens`; `readbacks` device -> host stops outside the cache's own
    (the logits read-backs) join the syncs."""
    n = max(n_tokens, 1)
    return {f"{name}{suffix}": (getattr(c, name) + (readbacks if name == "syncs" else 0)) / n for name in names}


def host_layers(r: Result, g: ModelGeometry) -> set[int]:
    """MoE layers whose experts a stock or CPU configuration keeps (and computes) on the host."""
    return set(g.moe_layers) if r.config.kind == "cpu" else set(r.config.host_layers)


def stock_decode(r: Result, g: ModelGeometry) -> dict[str, float]:
    """A stock or CPU configuration per decode token: each host layer stops the device once (it
    hands the routed ids and activations over) and reads k experts; nothing is uploaded."""
    host = host_layers(r, g)
    cpu_bytes = sum(g.n_expert_used * l.expert_bytes / max(g.n_expert, 1) for l in g.layers if l.index in host)
    out = {f"{name}_per_token": 0.0 for name in ACCOUNTING}
    out["syncs_per_token"] = 0.0 if r.config.kind == "cpu" else float(len(host) + 1)
    out["cpu_expert_bytes_per_token"] = cpu_bytes
    return out


def stock_prompt(r: Result, g: ModelGeometry) -> dict[str, float | None]:
    """A stock or CPU configuration per prompt token. All experts on the device: one logits
    read-back per prompt, nothing uploaded or computed on the host. Experts on the host: not
    modelled (None) but for what stock never does (async or staged uploads): llama.cpp may run a
    prompt batch's host expert matmuls on the device, copying the weights, or on the CPU."""
    out: dict[str, float | None] = {f"{name}_per_prompt_token": 0.0 for name in PROMPT_ACCOUNTING}
    if r.config.kind == "cpu":
        out["cpu_expert_bytes_per_prompt_token"] = None
    elif host_layers(r, g):
        for name in ("syncs", "uploads", "blocking_upload_bytes", "cpu_expert_bytes"):
            out[f"{name}_per_prompt_token"] = None
    else:
        out["syncs_per_prompt_token"] = len(r.runs) / max(r.prompt_tokens, 1)
    return out


def accounting(r: Result, g: ModelGeometry) -> dict[str, float | str | None]:
    """Hardware-independent figures per decode token: device -> host stops on the critical path
    (the logits read-back included), bytes uploaded while the step waited, bytes uploaded in the
    background, host expert bytes the CPU computed with, staged uploads and their bytes."""
    keys = tuple(f"{name}_per_token" for name in ACCOUNTING) + ("cpu_us_per_expert",)
    if not r.runs:
        return {"miss_path": r.miss_path or None, **{k: None for k in keys}}
    if r.config.kind in ("stock", "ceiling", "cpu"):
        return {"miss_path": None, **stock_decode(r, g), "cpu_us_per_expert": None}
    c = r.cache
    n = r.decode_tokens  # one logits read-back per decode step
    return {"miss_path": r.miss_path or None, **per_token(c, ACCOUNTING, n, n, "_per_token"),
            # wall time of the CPU miss path per CPU-computed expert (decode steps, at cpu_threads)
            "cpu_us_per_expert": c.cpu_us / c.cpu_experts if c.cpu_experts else None}


def prompt_accounting(r: Result, g: ModelGeometry) -> dict[str, float | None]:
    """The same figures per prompt-processing token (plus uploads), from the prompt evals; one
    logits read-back per eval."""
    if not r.runs:
        return {f"{name}_per_prompt_token": None for name in PROMPT_ACCOUNTING}
    if r.config.kind in ("stock", "ceiling", "cpu"):
        return stock_prompt(r, g)
    return per_token(r.prompt_cache, PROMPT_ACCOUNTING, r.prompt_tokens, len(r.runs), "_per_prompt_token")


TRAFFIC = ("segs_out", "segs_in", "bytes_out", "bytes_in")  # rpc_traffic.Traffic's counters


def traffic_per_token(t: Traffic | None, n_tokens: int, suffix: str) -> dict[str, float | None]:
    """RPC traffic over `n_tokens` as "rpc_<counter><suffix>" (None: not on RPC, or not measured)."""
    n = max(n_tokens, 1)
    return {f"rpc_{name}{suffix}": (getattr(t, name) / n if t is not None else None) for name in TRAFFIC}


def stops_per_token(r: Result, g: ModelGeometry) -> float | None:
    """Times a decode token stops the device for the host (the logits read-back not counted): a
    configuration's host layers (cpu: none, no device), plus a Spark configuration's host nodes
    that waited for the device (measured; when the layers it does not cache counted their routing,
    its host layers' stops are among them)."""
    if not r.runs:
        return None
    if r.config.kind == "cpu":
        return 0.0
    host = float(len(host_layers(r, g)))
    if r.config.kind != "spark":
        return host
    return r.cache.syncs / max(r.decode_tokens, 1) + (0.0 if r.counted_uncached else host)


def round_trips(report: "Report", r: Result) -> dict[str, float | None]:
    """A decode token's stops and what each costs in device round trips. Measured on RPC, for
    every configuration alike: what the stops add to the all-resident run of the same bench in data
    segments the client sent (commands: id, size and payload, one segment each) and received
    (replies: size and payload), and replies (received segments / 2: a stop's replies are small);
    None without an all-resident run, RPC traffic or a stop. Counted by the cache (Spark, any
    device): the copies down (reads) and up (writes) per stop, from the graph the scheduler ran."""
    g = report.geometry
    ref = next((x for x in report.results if x.config.kind == "ceiling" and x.runs and x.traffic is not None), None)
    stops = stops_per_token(r, g)
    c, cached = r.cache, r.config.kind == "spark" and r.runs
    out: dict[str, float | None] = {
        "stops_per_token": stops, "rpc_segs_out_per_stop": None, "rpc_segs_in_per_stop": None,
        "rpc_replies_per_stop": None,
        "stop_reads_per_stop": c.stop_reads / c.syncs if cached and c.syncs else None,
        "stop_writes_per_stop": c.stop_writes / c.syncs if cached and c.syncs else None}
    if ref is None or r.traffic is None or not stops:
        return out
    mine, base = traffic_per_token(r.traffic, r.decode_tokens, ""), traffic_per_token(ref.traffic, ref.decode_tokens, "")
    extra = {k: (mine[f"rpc_{k}"] - base[f"rpc_{k}"]) / stops for k in ("segs_out", "segs_in")}
    out.update({"rpc_segs_out_per_stop": extra["segs_out"], "rpc_segs_in_per_stop": extra["segs_in"],
                "rpc_replies_per_stop": extra["segs_in"] / 2})
    return out


def describe_paths(picks: dict[int, str]) -> str:
    kinds = sorted(set(picks.values()))
    if len(kinds) == 1:
        return kinds[0]
    return ", ".join(f"{p} {sum(1 for v in picks.values() if v == p)}" for p in kinds)


def device_memory(opts: EngineOptions) -> tuple[str, int, int] | None:
    """(name, free, total) of the first device an engine with these options would use, read now."""
    from ..native import devices

    devs = devices.select(devices.parse(opts.device, opts.rpc))
    return (devs[0].name, *devices.free_memory(devs[0])) if devs else None


def geometry_fingerprint(opts: EngineOptions) -> str:
    from ..core.gguf_info import load_geometry

    return load_geometry(opts.model_path, require_moe=False).fingerprint


def cache_total(eng: Engine) -> CacheStats:
    """The counters of every cached layer, summed (zeros without a cache)."""
    return CacheStats.total(eng.cache.stats().values())


def _digest(tokens: Sequence[int]) -> str:
    return hashlib.sha1(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:12]


def _drive(eng: Engine, loop: BatchLoop, on_step: Callable[[StepShape], None] | None = None) -> BatchRun:
    """Step the loop until every sequence has ended. Timed and counted: the all-decode steps
    (one token per decoding sequence, no prompt token), from the first such step's start to the
    end of the last step of its run of them (cache counters read outside the timing)."""
    tokens = steps = 0
    seconds = 0.0
    cache = CacheStats()
    block: tuple[CacheStats, float] | None = None  # (counters, start) of the all-decode steps under way

    def close() -> None:
        nonlocal block, seconds, cache
        if block is not None:
            t = time.perf_counter()
            seconds += t - block[1]
            cache += cache_total(eng) - block[0]
            block = None

    def before(shape: StepShape) -> None:
        nonlocal block
        if shape.prompt_tokens:
            close()
        elif block is None:
            s0 = cache_total(eng)
            block = (s0, time.perf_counter())

    while loop.busy:
        shape = loop.step(before)
        if shape.decode_tokens and not shape.prompt_tokens:
            tokens += shape.decode_tokens
            steps += 1
        if on_step:
            on_step(shape)
    close()
    return BatchRun(tokens, seconds, steps, cache)


def decode_parallel(eng: Engine, prompts: Sequence[Sequence[int]], n_gen: int, together: bool,
                    on_step: Callable[[StepShape], None] | None = None) -> tuple[BatchRun, list[list[int]]]:
    """Greedy decode of n_gen tokens after each prompt, prompt i in sequence i (every sequence
    cleared first): all added to one BatchLoop (together), or each alone in it, one after another
    (each cleared when it ends).
    The run's all-decode steps (_drive), and each sequence's tokens."""
    eng.reset()
    loop = BatchLoop(eng)
    toks: list[list[int]] = [[] for _ in prompts]
    runs: list[BatchRun] = []

    def add(i: int) -> None:
        def emit(step: GenerationStep, i: int = i) -> None:
            if step.token is not None:
                toks[i].append(step.token)

        loop.add(Decoding(eng, i, n_prompt=len(prompts[i]), sampler=GREEDY, max_tokens=n_gen, stop=NO_EOG), emit,
                 prompt=list(prompts[i]))

    for i in range(len(prompts)):
        add(i)
        if not together:
            runs.append(_drive(eng, loop, on_step))
            eng.seq_clear(i)  # alone: no other sequence's cells in a unified KV cache either
    if together:
        runs.append(_drive(eng, loop, on_step))
    return BatchRun(sum(r.tokens for r in runs), sum(r.seconds for r in runs), sum(r.steps for r in runs),
                    CacheStats.total(r.cache for r in runs)), toks


def parallel_prompt_length(eng: Engine, n_seq: int, n_gen: int) -> int:
    """The longest prompt N sequences can each take: all N prompts in one step (n_batch), and
    prompt + n_gen in each sequence's context (with --kv-unified: in the one they share)."""
    per_seq = min(eng.n_ctx, eng.n_ctx_total // max(n_seq, 1)) - n_gen - 1
    return max(1, min(CALIB_PROMPT_TOKENS, eng.n_batch // max(n_seq, 1), per_seq))


def measure_parallel(eng: Engine, work: Workload, n_gen: int, par: ParallelResult,
                     on_step: Callable[[StepShape], None] | None = None) -> None:
    """One repetition of the -np measurement: N distinct prompts, decoded one after another (serial),
    then together; appends to `par` and checks each sequence's tokens together against alone."""
    prompts = work.parallel_prompts(par.n_seq, parallel_prompt_length(eng, par.n_seq, n_gen))
    par.prompt_lengths = [len(p) for p in prompts]
    serial, alone = decode_parallel(eng, prompts, n_gen, together=False, on_step=on_step)
    par.serial.append(serial)
    together, batched = decode_parallel(eng, prompts, n_gen, together=True, on_step=on_step)
    par.together.append(together)
    same = batched == alone
    par.tokens_match = same if par.tokens_match is None else par.tokens_match and same
    if not par.serial_digest:
        par.serial_digest = _digest([t for seq in alone for t in seq])
        par.together_digest = _digest([t for seq in batched for t in seq])


MORE = 2  # runs per configuration: at most this many times -r, while timings spread wide (Turns)


@dataclass
class Turns:
    """How many runs the configurations in `jobs` take: -r at least, then while any one's
    generation timings spread wider than a quarter of their median (core/settle.py), one more
    each, up to MORE times -r. Each configuration asks before its next run with the number it has
    run, and only that many runs of each are looked at, so every configuration of an interleaved
    bench decides alike in a round, whichever goes first."""

    least: int
    jobs: list[Result]

    def more(self, n_runs: int) -> bool:
        if n_runs < self.least:
            return True
        if n_runs >= MORE * self.least:
            return False
        return any(not settle.settled([r.tg_seconds / r.tg_tokens for r in j.runs[:n_runs]], self.least,
                                      MORE * self.least)
                   for j in self.jobs if len(j.runs) >= n_runs)


def measuring(cfg: Config, base: EngineOptions, work: Workload, repetitions: int, n_gen: int,
              result: Result, progress: Progress | None = None, learn: bool = True,
              home: Path | None = None, fingerprint: str = "", clock: float | None = None,
              more: Callable[[int], bool] | None = None) -> Iterator[None]:
    """Load the configuration and warm up (then yield), then runs of prompt processing and
    generation (a yield after each) while `more(runs so far)` (default: `repetitions` runs), so
    that several open configurations can take turns (run: take_turns). Fills `result` as it goes:
    an interrupted bench keeps the finished runs. Closing it early closes the engine. `clock`:
    the perf_counter value Run.started counts from."""
    clock = time.perf_counter() if clock is None else clock
    more = more or (lambda n: n < repetitions)
    spark = cfg.kind == "spark"
    first_path = initial_path(cfg.miss_path)
    cpu = cfg.device == "none"
    opts = dataclasses.replace(base, device=cfg.device or base.device, rpc=[] if cpu else base.rpc,
                               host_layers=list(cfg.host_layers),
                               cache_layers=[replace(c, miss_path=first_path) for c in cfg.cache_layers],
                               stage_slices=cfg.plan.stage_slices if spark and cfg.plan is not None else 0,
                               expert_overrides=cfg.expert_overrides if spark else None,
                               count_experts=spark and session.counts_every_layer(cfg.plan, learn), trace=False,
                               capture_topk=False)
    n_seq = max(1, opts.n_seq)
    per_run, parallel = len(work.pp_tokens) + n_gen, repetitions * 2 * n_seq * n_gen if n_seq > 1 else 0
    parallel += repetitions * (len(work.infill) + 1) if work.infill else 0  # --infill's runs come after too
    total = repetitions * per_run + parallel
    done = 0
    result.status = "running"
    try:
        from .run import open_engine

        mem = device_memory(opts)
        why: list[str] = []
        fingerprint = fingerprint or (geometry_fingerprint(opts) if opts.cache_layers else "")
        with open_engine(opts, cfg.miss_path, fingerprint, home=home,
                         on_why=why.append) as eng:
            result.device_name = eng.devices[0].name if eng.devices else "CPU"
            if opts.cache_layers:
                result.miss_path_why, result.miss_path = "".join(why), describe_paths(eng.cache.miss_paths())
            result.counted_uncached = opts.count_experts
            eng.reset()
            decode(eng, work.pp_tokens[:WARMUP_PROMPT], WARMUP_DECODE)
            after = device_memory(opts)
            if mem is not None and after is not None and mem[1] > after[1]:
                result.device_used_bytes = mem[1] - after[1]
            yield
            while more(len(result.runs)):
                total = max(repetitions, len(result.runs) + 1) * per_run + parallel
                eng.reset()
                s0 = cache_total(eng)
                n0 = rpc_traffic.read(opts.rpc)
                t0 = time.perf_counter()
                eng.eval(work.pp_tokens, logits="last")
                pp_s = time.perf_counter() - t0
                pp_cache = cache_total(eng) - s0
                result.prompt_traffic = _add_traffic(result.prompt_traffic, n0, rpc_traffic.read(opts.rpc))
                done += len(work.pp_tokens)
                if progress:
                    progress(cfg.name, done, total)

                eng.reset()
                toks: list[int] = []

                def on_token(tok: int, base: int = done) -> None:
                    toks.append(tok)
                    if progress and (len(toks) % 8 == 0 or len(toks) == n_gen):
                        progress(cfg.name, base + len(toks), total)

                n0 = None

                def on_prompt(_) -> None:
                    nonlocal n0
                    eng.reset_stats()
                    n0 = rpc_traffic.read(opts.rpc)

                last = decode(eng, work.gen_prompt, n_gen, on_prompt=on_prompt, on_token=on_token)
                tg_s = last.gen_seconds
                result.traffic = _add_traffic(result.traffic, n0, rpc_traffic.read(opts.rpc))
                done += n_gen
                if not result.runs:
                    result.tokens_digest = _digest(toks)
                if spark:
                    result.cache += last.cache
                    result.prompt_cache += pp_cache
                    if learn:
                        c = eng.cache.routing_counts(DECODE).astype(np.float64)
                        if c.size:
                            result.counts = c if result.counts is None else result.counts + c
                result.decode_tokens += n_gen
                result.runs.append(Run(len(work.pp_tokens), pp_s, n_gen, tg_s, started=t0 - clock))
                yield
            for _ in range(repetitions if work.infill else 0):  # NOTE: after the runs whose routing is folded
                eng.reset()
                t0 = time.perf_counter()
                decode(eng, work.infill, 1)  # as /infill's first token: the prompt's eval and one sample
                result.infill.append(time.perf_counter() - t0)
                done += len(work.infill) + 1
                if progress:
                    progress(cfg.name, done, total)
            if eng.n_seq > 1:
                # NOTE: after the single-sequence runs, whose routing counts are folded: these are not
                result.parallel = ParallelResult(eng.n_seq)

                def on_step(shape: StepShape) -> None:
                    nonlocal done
                    done += shape.decode_tokens
                    if progress:
                        progress(cfg.name, done, total)

                for _ in range(repetitions):
                    measure_parallel(eng, work, n_gen, result.parallel, on_step)
            result.bank_bytes = eng.cache.bank_bytes()
        result.status = "ok"
    except KeyboardInterrupt:
        result.status, result.reason = "interrupted", f"after {len(result.runs)} of {repetitions} runs"
        raise
    except SparkError as e:
        result.status, result.reason = "failed", e.one_line()
    return result


def _add_traffic(total: Traffic | None, before: Traffic | None, after: Traffic | None) -> Traffic | None:
    """`total` plus the traffic between two readings (None when either could not be read)."""
    if before is None or after is None:
        return total
    return after - before if total is None else total + (after - before)


def copy_result(cfg: Config, other: Result) -> Result:
    """A configuration whose placement equals one already measured: same numbers."""
    return replace(other, config=cfg, runs=list(other.runs), counts=None, ratios={}, same_as=other.config.name)


# ---------------------------------------------------------------- a whole bench


def run(report: "Report", base: EngineOptions, documents: Sequence, names: Sequence[str], *, ceiling: bool = False,
        learn: bool = True, progress: Progress | None = None, status: Callable[[str], None] | None = None,
        miss_path: MissPath = MissPath.AUTO, say: Callable[[str], None] | None = None, infill: bool = False) -> None:
    """Tokenize the corpus and trace routing on held-out prompts (CPU), plan the Spark
    configurations from the profile plus that trace (one planner.plan_for call: "spark" is its
    plan, "spark-step" its pins+k candidate), then measure every configuration; `infill`: /infill's
    time to first token too (report.infill).
    Fills `report` as it goes: on KeyboardInterrupt it holds what was measured."""
    from ..core.profile import RoutingProfile

    g, path, ctx = report.geometry, report.model, report.n_ctx
    kv = dict(type_k=base.type_k, type_v=base.type_v, n_ubatch=base.n_ubatch, n_parallel=base.n_seq,
              kv_unified=base.kv_unified)
    status = status or (lambda text: None)
    spark = any(n.startswith("spark") for n in names)
    plan_step = plan_cache = plan_layer = None
    status("reading the corpus")
    # NOTE: one CPU engine tokenizes the corpus and traces routing on held-out prompts
    cpu = dataclasses.replace(base, device="none", rpc=[], repack=False, trace=True, tensor_overrides=())
    with Engine(cpu) as eng:
        work = make_workload(eng, documents, report.n_prompt)
        if infill:
            report.infill = infill_prompt(eng)
            work.infill = list(report.infill.tokens)
        need = max(len(work.pp_tokens), len(work.gen_prompt) + report.n_gen + 1,
                   max(len(p) + CALIB_DECODE + 1 for p in work.calibration), len(work.infill) + 1)
        seq_ctx = min(ctx, vram.kv_ctx_seq(ctx, base.n_seq, base.kv_unified))  # one sequence's: -c / -np
        if need > seq_ctx:
            per = f" ({seq_ctx} per sequence of -np {base.n_seq})" if seq_ctx < ctx else ""
            c = need * base.n_seq if per else need
            raise UsageError(f"--ctx-size {ctx}{per}: the runs need {need} tokens of context", hint=f"use -c {c}")
        if spark:
            status("calibration (routing trace, CPU)")
            trace = calibrate(eng, g, work.calibration, progress=progress)
    if work.note:
        report.notes.append(work.note)
    if spark:
        info = session.load_profile(path, g)
        if info.profile is None:
            report.notes.append("no profile: placement from the calibration trace (held-out prompts)")
            prof = RoutingProfile.empty(g.identity())
        else:
            report.notes.append(info.summary() + " + the calibration trace (held-out prompts)")
            prof = info.profile.copy()
        # NOTE: planned from everything known; the calibration counts are not saved
        info = session.ProfileInfo(info.path, prof.add_trace(trace, "bench calibration"))
    else:
        info = session.ProfileInfo(path, None)
    costs = None
    if spark:  # NOTE: measured for a Spark plan; stock configurations alone are priced with kept costs only
        status("device costs")
        costs, why = device_costs.ensure(base, g, work.pp_tokens, spark_home(), progress,
                                         max(report.n_gen, device_costs.DECODE_TOKENS))
        report.notes.append(why)
    elif list(names) != [CPU_CONFIG]:
        costs = device_costs.for_run(base, g.fingerprint, spark_home())
    req = session.plan_request(info, report.budget_bytes, ctx, miss_path=miss_path, costs=costs, **kv)
    if spark:
        try:
            placed = planner.plan_for(g, req)
            plan_step, plan_cache = placed.candidate("pins+k"), placed.plan
            if "spark-layer" in names:  # the same request under the per-layer rule (no staging slices)
                plan_layer = planner.plan_for(g, dataclasses.replace(req, miss_path=MissPath.LAYER)).plan
        except PlanError as e:
            plan_step = plan_cache = plan_layer = e
    status("measuring")
    cfgs = [cpu_config()] if list(names) == [CPU_CONFIG] else \
        make_configs(g, report.budget_bytes, ctx, names, plan_step, plan_cache, ceiling=ceiling, plan_layer=plan_layer,
                     **kv)
    for c in cfgs:
        c.predicted = predict_config(g, req, c)
    if not any(c.status == "ready" for c in cfgs):
        raise PlanError(f"budget {units.gib(report.budget_bytes)}: no configuration fits ("
                        + "; ".join(f"{c.name}: {c.note}" for c in cfgs) + ")",
                        hint="raise --vram or --residency, or lower --ctx-size")
    for c in cfgs:
        if c.name != "spark-layer":
            c.miss_path = miss_path
    seen: dict[tuple, Result] = {}
    copies: list[tuple[int, Config, Result]] = []  # (position, configuration, the result it equals)
    for c in cfgs:
        if c.status != "ready":
            report.results.append(Result(c, status=c.status, reason=c.note))
        elif c.key() in seen:
            copies.append((len(report.results), c, seen[c.key()]))
            report.results.append(Result(c))
        else:
            seen[c.key()] = Result(c)
            report.results.append(seen[c.key()])
    jobs = list(seen.values())
    report.interleaved, why = take_turns(jobs, base)
    report.notes.append(why)
    clock = time.perf_counter()
    turns = [Turns(report.repetitions, jobs if report.interleaved else [r]) for r in jobs]
    steps = [measuring(r.config, base, work, report.repetitions, report.n_gen, r, learn=learn,
                       progress=(lambda _n, d, t, c=r.config: progress(c.label, d, t)) if progress else None,
                       fingerprint=g.fingerprint, clock=clock, more=t.more) for r, t in zip(jobs, turns)]
    cpu_clock = CpuClock.now()
    try:
        if progress:
            for r in jobs:
                progress(r.config.label, 0, report.repetitions * (len(work.pp_tokens) + report.n_gen))
        drive(steps, jobs, report.interleaved, report.repetitions, say)
    finally:
        for i, c, r in copies:
            report.results[i] = copy_result(c, r)
        report.cpu_steal = steal_share(cpu_clock, CpuClock.now())
        for note in (steal_note(report.cpu_steal), more_runs_note(jobs, report.repetitions)):
            if note:
                report.notes.append(note)


def more_runs_note(jobs: Sequence[Result], repetitions: int) -> str:
    """The configurations that ran more than -r times (Turns), in one line; "" when none did."""
    extra = [f"{r.config.label} {len(r.runs)}" for r in jobs if len(r.runs) > repetitions]
    if not extra:
        return ""
    return (f"runs added while generation timings spread wider than {settle.SPREAD:.0%} of their median "
            f"(at most {MORE}x -r {repetitions}): " + ", ".join(extra))


def run_counts(report: "Report") -> str:
    """How many runs each median is of: "5", or "5-10" where Turns added some."""
    n = sorted({len(r.runs) for r in report.results if r.runs} or {report.repetitions})
    return str(n[0]) if n[0] == n[-1] else f"{n[0]}-{n[-1]}"


def drive(steps: list[Iterator[None]], jobs: list[Result], interleaved: bool, repetitions: int,
          say: Callable[[str], None] | None = None) -> None:
    """The measuring() steps of `jobs`, in turns or one configuration after another. However it
    ends (an interrupt included) every engine is closed, and a configuration stopped in the
    middle is marked interrupted."""
    try:
        if interleaved:
            _in_turns(steps, jobs, say)
        else:
            for step, r in zip(steps, jobs):
                _in_turns([step], [r], say)
    finally:
        for step, r in zip(steps, jobs):
            step.close()  # NOTE: an interrupt in another configuration's turn leaves this one running
            if r.status == "running":
                r.status, r.reason = "interrupted", f"after {len(r.runs)} of {repetitions} runs"


def _in_turns(steps: list[Iterator[None]], jobs: list[Result], say: Callable[[str], None] | None) -> None:
    """Drive measuring() steps round-robin until each has finished: all open and warm first (each
    says its miss path as it opens), then one repetition of each in turn."""
    live = []
    for step, r in zip(steps, jobs):
        if next(step, StopIteration) is not StopIteration:
            live.append(step)
        if r.miss_path_why and say:
            say(f"{r.config.label}: {r.miss_path_why}")
    while live:
        live = [step for step in live if next(step, StopIteration) is not StopIteration]


INTERLEAVE_MARGIN = 1 << 30  # device memory left free when every configuration is open at once


def take_turns(jobs: list[Result], base: EngineOptions) -> tuple[bool, str]:
    """Whether the configurations run interleaved (every one open at once, one repetition of each
    in turn, so a machine whose speed drifts during the bench drifts for all of them alike), and
    the note that says so. Only when their planned device bytes fit one device's free memory
    together (an RPC stand-in, a large card); else one after another, as llama-bench runs."""
    if len(jobs) < 2:
        return False, "configurations measured one after another"
    mem = device_memory(base) if base.device != "none" and len(base.rpc) <= 1 else None
    need = sum(r.config.planned_bytes for r in jobs) + INTERLEAVE_MARGIN
    if mem is None or any(r.config.device == "none" for r in jobs) or need > mem[1]:
        have = f"{units.gib(mem[1])} free on {mem[0]}" if mem else "not one device to hold them all"
        return False, (f"configurations measured one after another (together they need {units.gib(need)}, "
                       f"{have})")
    return True, (f"configurations interleaved: all {len(jobs)} open on {mem[0]}, one repetition of each in turn "
                  f"({units.gib(need)} of {units.gib(mem[1])} free)")


def fold(report: "Report") -> "Result | None":
    """Self-tuning: the decode routing of the Spark run joins the model's profile. Returns
    the result whose counts were folded, or None."""
    src = next((r for r in (report.result("spark"), report.result("spark-step"))
                if r is not None and r.counts is not None), None)
    if src is None:
        return None
    prof = session.fold_into_profile(report.model, report.geometry, src.counts, "spark bench")
    return src if prof is not None else None


# ---------------------------------------------------------------- report


@dataclass
class Report:
    model: Path
    geometry: ModelGeometry
    budget_bytes: int
    budget_source: str
    n_ctx: int
    n_prompt: int
    n_gen: int
    repetitions: int
    device: str  # CUDA0, RPC[...] or CPU
    corpus: str
    results: list[Result] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    baseline: str | None = None  # best stock configuration by generation median
    cpu_threads: tuple[int, int] | None = None  # (-t, -tb) of every configuration's engine
    ceiling: str | None = None
    n_parallel: int = 1  # -np: sequences every configuration is opened with (> 1: Result.parallel)
    interleaved: bool = False  # every configuration open at once, one repetition of each in turn (take_turns)
    cpu_steal: float | None = None  # share of the machine's CPU time stolen while measuring (cpu_steal.py)
    infill: InfillPrompt | None = None  # --infill: the /infill prompt every configuration timed

    def result(self, name: str) -> Result | None:
        return next((r for r in self.results if r.config.name == name), None)

    def finalize(self) -> None:
        """Ratios from the medians: against the best stock configuration and the ceiling."""
        measured = [r for r in self.results if r.runs]
        stock = [r for r in measured if r.config.kind == "stock"]
        best = max(stock, key=lambda r: r.tg.median) if stock else None
        ceil = next((r for r in measured if r.config.kind == "ceiling"), None)
        self.baseline = best.config.name if best else None
        self.ceiling = ceil.config.name if ceil else None
        for r in self.results:
            r.ratios = {}
            for what in ("pp", "tg"):
                mine = getattr(r, what)
                for ref_name, ref in (("stock", best), ("ceiling", ceil)):
                    theirs = getattr(ref, what) if ref is not None else None
                    ok = mine is not None and theirs is not None and theirs.median > 0
                    r.ratios[f"{what}_vs_{ref_name}"] = mine.median / theirs.median if ok else None

    def targets(self) -> dict[str, dict]:
        spark = self.result("spark")
        out = {}
        for key, target in (("tg_vs_ceiling", TARGET_VS_CEILING), ("tg_vs_stock", TARGET_VS_STOCK),
                            ("pp_vs_stock", TARGET_VS_STOCK)):
            v = spark.ratios.get(key) if spark is not None else None
            out[key] = {"target": target, "value": v, "met": None if v is None else bool(v >= target)}
        return out

    def to_dict(self) -> dict:
        g = self.geometry
        configs = []
        for r in self.results:
            c = r.config
            configs.append({
                "name": c.name, "label": c.label, "kind": c.kind, "status": r.status,
                "reason": r.reason or c.note, "same_as": r.same_as or None, "over_budget": c.over_budget,
                "placement": c.summary(g),
                "vram_planned_bytes": c.planned_bytes, "bank_bytes": r.bank_bytes,
                "device_used_bytes": r.device_used_bytes, "device": r.device_name or None,
                "runs": [{"pp_tokens": x.pp_tokens, "pp_seconds": x.pp_seconds, "pp_tok_s": x.pp_tok_s,
                          "tg_tokens": x.tg_tokens, "tg_seconds": x.tg_seconds, "tg_tok_s": x.tg_tok_s,
                          "started": x.started}
                         for x in r.runs],
                "pp_tok_s": _spread(r.pp), "tg_tok_s": _spread(r.tg),
                **cold_figures(r, g),
                **accounting(r, g),
                **prompt_accounting(r, g),
                **traffic_per_token(r.traffic, r.decode_tokens, "_per_token"),
                **traffic_per_token(r.prompt_traffic, r.prompt_tokens, "_per_prompt_token"),
                **round_trips(self, r),
                "miss_path_why": r.miss_path_why or None,
                "decode_tokens": r.decode_tokens, "hits": r.cache.hits, "misses": r.cache.misses,
                "uploads": r.cache.uploads, "bytes_uploaded": r.cache.bytes_uploaded,
                "staged_uploads": r.cache.staged_uploads, "staged_upload_bytes": r.cache.staged_upload_bytes,
                "prompt_tokens": r.prompt_tokens,
                "prompt_cache": dataclasses.asdict(r.prompt_cache) if c.kind == "spark" and r.runs else None,
                "upload_seconds": r.cache.upload_us / 1e6,
                "tokens_digest": r.tokens_digest or None,
                "ratios": dict(r.ratios),
                "predicted": c.predicted.to_dict() if c.predicted is not None else None,
                "predicted_over_measured": predicted_over_measured(r),
                "parallel": r.parallel.to_dict(c.kind == "spark") if r.parallel is not None else None,
                "infill_ttft_ms": _spread(r.infill_ms),
                "infill_seconds": list(r.infill) if self.infill is not None else None,
            })
        return {
            "version": REPORT_VERSION,
            "model": {"path": str(self.model), "name": self.model.name, **g.identity(),
                      "n_moe_layers": len(g.moe_layers), "expert_bytes": g.total_expert_bytes},
            "device": self.device, "budget_bytes": self.budget_bytes, "budget_source": self.budget_source,
            "n_ctx": self.n_ctx, "n_prompt": self.n_prompt, "n_gen": self.n_gen, "n_parallel": self.n_parallel,
            "repetitions": self.repetitions, "corpus": self.corpus,
            "cpu_threads": self.cpu_threads[0] if self.cpu_threads else None,
            "cpu_threads_batch": self.cpu_threads[1] if self.cpu_threads else None,
            "baseline": self.baseline, "ceiling": self.ceiling,
            "targets": self.targets(), "notes": list(self.notes), "interrupted": self.interrupted,
            "interleaved": self.interleaved, "cpu_steal": self.cpu_steal,
            "infill": self.infill.to_dict() if self.infill is not None else None,
            "configs": configs,
        }


def _spread(s: Spread | None) -> dict | None:
    return None if s is None else {"median": s.median, "min": s.min, "max": s.max}


def fmt_rate(s: Spread | None) -> str:
    if s is None:
        return "-"
    return f"{s.median:.1f} ({s.min:.1f}-{s.max:.1f})" if s.max > s.min else f"{s.median:.1f}"


def fmt_ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _mib(v: float | None) -> str:
    if v is None:
        return "-"
    x = v / (1 << 20)
    return f"{x:.2f}" if x == 0 or x >= 0.1 else f"{x:.3f}"


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2g}" if 0 < v < 0.1 else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def speed_rows(report: Report) -> list[dict[str, str]]:
    """Speeds and ratios: one row of display strings per configuration (the rich and markdown
    tables); a configuration that did not run shows its status in the pp column (reasons: `footnotes`)."""
    out = []
    for r in report.results:
        c = r.config
        row = {"configuration": c.label, "VRAM": units.gib(c.planned_bytes) if c.planned_bytes else "-",
               "pp tok/s": fmt_rate(r.pp), "tg tok/s": fmt_rate(r.tg)}
        for ref in ("stock", "ceiling"):
            for what in ("pp", "tg"):
                row[f"{what}/{ref}"] = fmt_ratio(r.ratios.get(f"{what}_vs_{ref}"))
        if not r.runs:
            row["pp tok/s"] = r.status
        elif r.status != "ok":
            row["configuration"] += f" ({r.status})"
        out.append(row)
    return out


def predicted_over_measured(r: Result) -> dict[str, float | None] | None:
    """The cost model's tok/s over the measured median, per phase (None: no prediction or run)."""
    p = r.config.predicted
    if p is None or not r.runs:
        return None
    out: dict[str, float | None] = {}
    for what, pred in (("pp", p.pp_tok_s), ("tg", p.tg_tok_s)):
        m = getattr(r, what)
        out[what] = pred / m.median if m is not None and m.median > 0 else None
    return out


def prediction_rows(report: Report) -> list[dict[str, str]]:
    """Predicted (the cost model, with the device's costs) beside measured tok/s, one row per
    configuration that has a prediction."""
    out = []
    for r in report.results:
        p = r.config.predicted
        if p is None:
            continue
        ratio = predicted_over_measured(r) or {}
        out.append({"configuration": r.config.label, "stops/tok": str(p.stops),
                    "pp predicted": _rate(p.pp_tok_s), "pp measured": _rate(r.pp.median if r.pp else None),
                    "pp pred/meas": fmt_ratio(ratio.get("pp")),
                    "tg predicted": _rate(p.tg_tok_s), "tg measured": _rate(r.tg.median if r.tg else None),
                    "tg pred/meas": fmt_ratio(ratio.get("tg"))})
    return out


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def parallel_rows(report: Report) -> list[dict[str, str]]:
    """-np N: aggregate generation tok/s of N sequences together and one after another (medians),
    their ratio, and the cache's hit rate and uploads per decoded token in each; one row per
    configuration that measured them."""
    n = report.n_parallel
    out = []
    for r in report.results:
        p = r.parallel
        if p is None or not (p.serial or p.together):
            continue
        cached = r.config.kind == "spark"
        one, many = p.phase(p.serial, cached), p.phase(p.together, cached)
        tg = {k: (s.median if (s := p.spread(runs)) else None) for k, runs in (("1", p.serial), ("n", p.together))}
        out.append({"configuration": r.config.label, "tg together": _rate(tg["n"]), "tg serial": _rate(tg["1"]),
                    "ratio": fmt_ratio(p.ratio), "hit rate 1 seq": _pct(one["hit_rate"]),
                    f"hit rate {n} seq": _pct(many["hit_rate"]), "uploads/tok 1": _num(one["uploads_per_token"]),
                    f"uploads/tok {n}": _num(many["uploads_per_token"])})
    return out


def _accounting_row(label: str, phase: str, figs: dict, suffix: str, cold_hit: str) -> dict[str, str]:
    """One phase's per-token figures as display strings (figs: accounting's keys ending in suffix)."""
    return {"configuration": label, "phase": phase, "cold-hit": cold_hit,
            "uploads": _num(figs[f"uploads{suffix}"]), "syncs": _num(figs[f"syncs{suffix}"]),
            "blocking MiB": _mib(figs[f"blocking_upload_bytes{suffix}"]),
            "async MiB": _mib(figs[f"async_upload_bytes{suffix}"]),
            "staged": _num(figs[f"staged_uploads{suffix}"]), "staged MiB": _mib(figs[f"staged_upload_bytes{suffix}"]),
            "CPU MiB": _mib(figs[f"cpu_expert_bytes{suffix}"])}


def accounting_rows(report: Report) -> list[dict[str, str]]:
    """The per-token accounting: two rows per measured configuration, phase "tg" per generated
    token (decode) then "pp" per prompt token (prompt processing); the tg row carries the
    cold-hit rate, a decode figure (the miss path: `footnotes`)."""
    out = []
    g = report.geometry
    for r in (x for x in report.results if x.runs):
        cold = cold_figures(r, g)
        decode_figs = {**cold, **accounting(r, g)}
        out.append(_accounting_row(r.config.label, "tg", decode_figs, "_per_token", _pct(cold["cold_hit"])))
        out.append(_accounting_row("", "pp", prompt_accounting(r, g), "_per_prompt_token", ""))
    return out


def stop_rows(report: Report) -> list[dict[str, str]]:
    """A decode token's stops and their round trips (round_trips), the cache's own blocking calls and
    the bytes exchanged with an RPC server: one row per measured configuration."""
    out = []
    g = report.geometry
    for r in (x for x in report.results if x.runs):
        st = round_trips(report, r)
        rpc = traffic_per_token(r.traffic, r.decode_tokens, "")
        out.append({"configuration": r.config.label, "stops": _num(st["stops_per_token"]),
                    "replies": _num(st["rpc_replies_per_stop"]), "segs out": _num(st["rpc_segs_out_per_stop"]),
                    "reads": _num(st["stop_reads_per_stop"]), "writes": _num(st["stop_writes_per_stop"]),
                    "blocking": _num(accounting(r, g)["blocking_calls_per_token"]),
                    "MiB in": _mib(rpc["rpc_bytes_in"]), "MiB out": _mib(rpc["rpc_bytes_out"])})
    return out


def footnotes(report: Report) -> list[str]:
    """Which miss path Spark ran, why a configuration did not run, was cut short, or repeats another."""
    out = []
    threads = report.cpu_threads
    for r in report.results:
        acc = accounting(r, report.geometry)
        if acc["miss_path"] and r.runs and not r.same_as:
            out.append(f"{r.config.label}: miss path {acc['miss_path']}")
        per = acc.get("cpu_us_per_expert")
        if per is not None and threads:
            out.append(f"{r.config.label}: CPU miss path {per:.0f} us per expert on {threads[0]} "
                       f"thread{'s' if threads[0] != 1 else ''} (-t; -tb {threads[1]})")
    for r in report.results:
        why = r.reason or r.config.note
        if r.same_as:
            out.append(f"{r.config.label}: same placement as {r.same_as}, measured once")
        elif why:
            out.append(f"{r.config.label}: {r.status}: {why}" if r.status not in ("ok",) else f"{r.config.label}: {why}")
    return out


def infill_line(report: Report) -> str:
    """--infill: each configuration's /infill time to first token in one line ("" without --infill; a
    model without FIM tokens: its note, which names them)."""
    p = report.infill
    if p is None or p.missing:
        return p.note() if p is not None else ""
    timed = [f"{r.config.label} {fmt_rate(r.infill_ms)} ms" for r in report.results if r.infill]
    kept = min(p.prefix_tokens, 3 * (p.n_batch // 4))
    return (f"infill: time to first token of /infill's {len(p.tokens)}-token prompt (the last {kept} tokens of a "
            f"{p.prefix_tokens}-token code prefix: 3/4 of -b {p.n_batch}; a {p.suffix_tokens}-token suffix), "
            "median (min-max): "
            + (", ".join(timed) or "no configuration measured it"))


def markdown_table(table: list[dict[str, str]]) -> str:
    if not table:
        return ""
    cols = list(table[0])
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---" if c == "configuration" else "---:" for c in cols) + "|"]
    for r in table:
        lines.append("| " + " | ".join(r[c].replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines)


def to_markdown(report: Report) -> str:
    """The speeds table, then (after a blank line) the predictions, the per-token accounting and
    the stops where something ran, then the -np table where N sequences were measured."""
    return "\n\n".join(t for t in (markdown_table(speed_rows(report)), markdown_table(prediction_rows(report)),
                                   markdown_table(accounting_rows(report)), markdown_table(stop_rows(report)),
                                   markdown_table(parallel_rows(report)))
                       if t)
