"""Geometry + routing profile + VRAM budget -> a Plan of resident, cached and pinned experts.

Every MoE layer is either *resident* (all experts on the device) or *cached*: experts
stay in host RAM and a device bank of S slots holds P pinned hot experts plus S - P
LRU slots, with S - P >= k (n_expert_used) so one decode step fits, and one guard
slice: bank bytes = (S + 1) * bytes_per_expert.

Placement is one greedy sequence of actions, independent of the budget: each action
pins the next-hottest expert of a layer or adds an LRU slot to a layer, whichever
removes the most predicted miss mass per byte. A budget takes the longest prefix of
that sequence that fits, so a larger budget never loses a pinned, resident or LRU
slot (the hot set grows monotonically). Predicted miss share of a cached layer with
P pins (the P hottest) and L LRU slots:
  without miss_ratio:  u(P), the layer's routing mass outside its pins (LRU slots
                       are credited nothing, so they stay at the floor k);
  with miss_ratio:     min(u(P), miss_ratio(layer, P + L)), where miss_ratio is the
                       miss ratio of plain LRU with that many slots on the layer's
                       decode traffic (pinning the hottest P and keeping L LRU slots is
                       assumed no worse than LRU of P + L slots).
  with miss_fn:        miss_fn(layer, P, L), the replayed miss share of the policy that
                       will run (simulator.py) with the P hottest pinned and L policy slots.
A layer whose pins, LRU slots and guard would reach n_expert becomes resident.
Below the cache floor (fixed costs + k slots and a guard in every MoE layer), layers keep
their experts wholly in host RAM, as stock `--n-cpu-moe N` does: the lowest-numbered MoE
layers first, their expert biases on the host too, until the rest fits ("host" layers,
predicted cold-hit 1). A plan is refused only where stock `--cpu-moe` does not fit.
Layer mass is equal (every token passes every MoE layer); the profile is normalized
per layer. The prefix stops at the first action that does not fit, so up to one
action's bytes (one expert, or a whole-layer jump under max_slots_per_layer) may stay
unspent.

Plan file (`spark plan -o`, read by `--plan`), JSON:
  {"version": 2,
   "policy": "lru" | "lfu-aged" | "slru" | "tinylfu"   # optional (default "lru")
   "miss_path": "auto" | "cpu" | "upload"              # optional (default "auto")
   "predicted_miss": float | null,  # optional: replayed miss share on the planning trace
   "model": {arch, n_layer, n_expert, n_expert_used, fingerprint, tensor_layout_hash},
   "budget_bytes", "n_ctx", "type_k", "type_v", "n_ubatch",
   "breakdown": {weights_global, weights_layers_nonexpert, experts_resident,
                 expert_banks, kv_cache, compute, overhead, total},   # bytes
   "predicted_cold_hit": float | null,
   "stock": {n_cpu_moe, fits, device_bytes, override_patterns, cpu_moe_device_bytes,
             cpu_moe_fits},
   "overrides": [{"pattern", "target"}, ...],   # tensor overrides the engine applies (placement.py)
   "layers": [{"index", "mode", "pinned", "slots", "device_bytes", "host_bytes"}, ...]}
mode: resident | cached | host (experts in host RAM, no bank) | dense | skipped (an MTP
block llama.cpp does not load).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import units, vram
from ..files.atomic import atomic_write_text
from ..errors import PlanError
from .gguf_info import ModelGeometry
from .placement import TensorOverride, cached_expert_overrides, stock_overrides, stock_patterns

PLAN_VERSION = 2
MODES = ("resident", "cached", "host", "dense", "skipped")
BREAKDOWN_KEYS = ("weights_global", "weights_layers_nonexpert", "experts_resident", "expert_banks",
                  "kv_cache", "compute", "overhead", "total")

MissRatio = Callable[[int, int], float]
MissFn = Callable[[int, int, int], float]  # (layer, pins, policy slots) -> miss share


@dataclass(frozen=True)
class LayerPlan:
    index: int
    mode: str  # resident | cached | host | dense | skipped (MTP block llama.cpp does not load)
    pinned: tuple[int, ...]  # cached: expert ids in slots 0..P-1, hottest first
    slots: int  # cached: S = P pinned + S - P LRU slots (guard slice not counted)
    device_bytes: int  # layer weights + experts or bank on the device
    host_bytes: int  # expert weights kept in host RAM

    @property
    def lru_slots(self) -> int:
        return self.slots - len(self.pinned)


@dataclass(frozen=True)
class StockBaseline:
    """Stock llama.cpp: the smallest --n-cpu-moe N that fits, and --cpu-moe."""

    n_cpu_moe: int
    fits: bool
    device_bytes: int
    override_patterns: tuple[str, ...]  # what --n-cpu-moe N adds, each `=CPU`
    cpu_moe_device_bytes: int
    cpu_moe_fits: bool


@dataclass(frozen=True)
class Plan:
    model: dict[str, Any]  # ModelGeometry.identity()
    budget_bytes: int
    n_ctx: int
    type_k: str
    type_v: str
    n_ubatch: int
    layers: tuple[LayerPlan, ...]
    breakdown: dict[str, int]
    predicted_cold_hit: float | None
    stock: StockBaseline
    policy: str = "lru"  # the cache policy of the cached layers (simulator.POLICIES)
    predicted_miss: float | None = None  # replayed miss share on the planning trace
    miss_path: str = "auto"  # auto | cpu | upload (miss_path.py); --miss-path overrides it
    overrides: tuple[TensorOverride, ...] = ()  # expert weights of cached layers -> host RAM (placement.py)

    def hot_set(self) -> dict[int, frozenset[int]]:
        """Experts on the device without an upload: pinned, or all of a resident layer."""
        n = int(self.model["n_expert"])
        return {l.index: frozenset(range(n)) if l.mode == "resident" else frozenset(l.pinned)
                for l in self.layers if l.mode in ("resident", "cached", "host")}

    def to_json(self) -> str:
        """Indented JSON with one line per layer."""
        d = {"version": PLAN_VERSION, **asdict(self)}
        layers = d.pop("layers")
        head = json.dumps(d, indent=1)
        body = ",\n  ".join(json.dumps(l) for l in layers)
        return head[:-2] + ',\n "layers": [\n  ' + body + "\n ]\n}"

    @classmethod
    def from_json(cls, text: str, source: str = "plan") -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{source}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(d, dict) or d.get("version") != PLAN_VERSION:
            got = d.get("version") if isinstance(d, dict) else None
            raise PlanError(f"{source}: version: expected {PLAN_VERSION}, got {got!r}",
                            hint="make the plan again with `spark plan`")
        try:
            layers = tuple(LayerPlan(index=int(l["index"]), mode=str(l["mode"]),
                                     pinned=tuple(int(e) for e in l["pinned"]), slots=int(l["slots"]),
                                     device_bytes=int(l["device_bytes"]), host_bytes=int(l["host_bytes"]))
                           for l in d["layers"])
            s = d["stock"]
            stock = StockBaseline(int(s["n_cpu_moe"]), bool(s["fits"]), int(s["device_bytes"]),
                                  tuple(str(p) for p in s["override_patterns"]),
                                  int(s["cpu_moe_device_bytes"]), bool(s["cpu_moe_fits"]))
            cold, miss = d["predicted_cold_hit"], d.get("predicted_miss")
            plan = cls(model=dict(d["model"]), budget_bytes=int(d["budget_bytes"]), n_ctx=int(d["n_ctx"]),
                       type_k=str(d["type_k"]), type_v=str(d["type_v"]), n_ubatch=int(d["n_ubatch"]),
                       layers=layers, breakdown={k: int(d["breakdown"][k]) for k in BREAKDOWN_KEYS},
                       predicted_cold_hit=None if cold is None else float(cold), stock=stock,
                       policy=str(d.get("policy", "lru")),
                       predicted_miss=None if miss is None else float(miss),
                       miss_path=str(d.get("miss_path", "auto")),

overrides=tuple(TensorOverride(str(o["pattern"]), str(o["target"])) for o in d["overrides"]))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{source}: {type(e).__name__}: {e} (missing or malformed field)") from None
        for l in plan.layers:
            if l.mode not in MODES:
                raise PlanError(f"{source}: layers[{l.index}].mode: unknown mode {l.mode!r}")
        from .simulator import ONLINE_POLICIES

        if plan.policy not in ONLINE_POLICIES and plan.policy != "lru-pinned":
            raise PlanError(f"{source}: policy: unknown cache policy {plan.policy!r}",
                            hint=f"use one of {', '.join(ONLINE_POLICIES)}")
        if plan.miss_path not in ("auto", "cpu", "upload"):
            raise PlanError(f"{source}: miss_path: unknown miss path {plan.miss_path!r}", hint="use auto, cpu or upload")
        return plan

    def save(self, path: str | Path, flag: str | None = None) -> Path:
        return atomic_write_text(path, self.to_json() + "\n", flag)

    @classmethod
    def load(cls, path: str | Path, expect_identity: dict[str, Any] | None = None) -> "Plan":
        """Read a plan; refuse one made for another model (PlanError, one line)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise PlanError(f"{path}: cannot read plan ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise PlanError(f"{path}: not a plan (byte {e.start} is not UTF-8)",
                            hint="give a plan JSON written by spark plan -o") from None
        plan = cls.from_json(text, str(path))
        if expect_identity is not None:
            for k, want in expect_identity.items():
                got = plan.model.get(k)
                if got != want:
                    show = (lambda v: str(v)[:12]) if k in ("fingerprint", "tensor_layout_hash") else str
                    raise PlanError(f"{path}: plan is for another model ({k} {show(got)} != {show(want)})",
                                    hint="make a plan for this model with `spark plan`")
        return plan


def _fixed_costs(g: ModelGeometry, n_ctx: int, type_k: str, type_v: str, n_ubatch: int) -> dict[str, int]:
    return {
        "weights_global": g.device_global_bytes,
        "weights_layers_nonexpert": sum(l.nonexpert_bytes for l in g.layers if not l.is_nextn),
        "kv_cache": vram.kv_cache_bytes(g, n_ctx, type_k, type_v, n_ubatch),
        "compute": vram.compute_buffer_bytes(g, n_ctx, n_ubatch),
        "overhead": vram.DEVICE_OVERHEAD_BYTES,
    }


def stock_baseline(g: ModelGeometry, budget_bytes: int, fixed_bytes: int) -> StockBaseline:
    """Smallest N for llama.cpp's `--n-cpu-moe N` (expert tensors, biases included, of
    layers 0..N-1 on the CPU) whose device bytes fit, and `--cpu-moe` (all of them)."""
    loaded = [l for l in g.layers if not l.is_nextn]

    def device(n: int) -> int:
        return fixed_bytes + sum(l.expert_bytes if l.index >= n else -l.expert_bias_bytes for l in loaded)

    n_max = 1 + max((l.index for l in loaded if l.is_moe), default=-1)
    n = next((i for i in range(n_max + 1) if device(i) <= budget_bytes), n_max)
    pats = stock_patterns(range(n))
    all_cpu = device(n_max)
    return StockBaseline(n, device(n) <= budget_bytes, device(n), pats, all_cpu, all_cpu <= budget_bytes)


def hottest_first(row: np.ndarray) -> list[int]:
    """Expert ids by routing count, highest first; ties: lower id first."""
    row = np.asarray(row, dtype=np.float64)
    return [int(e) for e in np.lexsort((np.arange(row.size), -row))]


class _Layer:
    """Greedy state of one MoE layer."""

    def __init__(self, index: int, n_expert: int, k: int, bpe: int, freq: np.ndarray,
                 mass: float, max_slots: int | None, miss_ratio: Callable[[int, int], float] | None,
                 miss_fn: Callable[[int, int], float] | None = None, allow_pins: bool = True):
        self.index, self.n, self.k, self.bpe, self.mass = index, n_expert, k, bpe, mass
        self.order = hottest_first(freq)
        self.unpinned = 1.0 - np.concatenate([[0.0], np.cumsum(freq[self.order])])  # u(P)
        self.max_slots, self.miss_ratio, self.miss_fn = max_slots, miss_ratio, miss_fn
        self.allow_pins = allow_pins
        self.pins, self.lru, self.resident = 0, k, False
        if k + 1 >= n_expert or bpe <= 0 or (max_slots is not None and max_slots < k):
            self.resident = True
        self.version = 0

    def cost(self) -> int:
        return self.n * self.bpe if self.resident else (self.pins + self.lru + 1) * self.bpe

    def miss(self, pins: int, lru: int) -> float:
        if self.miss_fn is not None:
            return min(max(self.miss_fn(pins, lru), 0.0), 1.0)
        u = max(float(self.unpinned[pins]), 0.0)
        if self.miss_ratio is None:
            return u
        return min(u, min(max(self.miss_ratio(self.index, pins + lru), 0.0), 1.0))

    def actions(self) -> list[tuple[float, int, str, int]]:
        """(gain per byte, kind rank, kind, cost) of each next action."""
        if self.resident:
            return []
        now = self.miss(self.pins, self.lru)
        if self.max_slots is not None and self.pins + self.lru >= self.max_slots:
            cost = self.n * self.bpe - self.cost()
            return [(self.mass * now / cost, 2, "resident", cost)]
        # On a tie an LRU slot wins: it adapts to the traffic, a pin is a bet on the profile.
        out = []
        if self.allow_pins:
            out.append((self.mass * (now - self.miss(self.pins + 1, self.lru)) / self.bpe, 1, "pin", self.bpe))
        if self.miss_ratio is not None or self.miss_fn is not None:
            out.append((self.mass * (now - self.miss(self.pins, self.lru + 1)) / self.bpe, 0, "slot", self.bpe))
        return out

    def apply(self, kind: str) -> None:
        if kind == "pin":
            self.pins += 1
        elif kind == "slot":
            self.lru += 1
        if kind == "resident" or self.pins + self.lru + 1 >= self.n:
            self.resident = True
        self.version += 1


def make_plan(geometry: ModelGeometry, budget_bytes: int, n_ctx: int,
              profile_counts: np.ndarray | None = None, type_k: str = "f16", type_v: str = "f16",
              miss_ratio: MissRatio | None = None, max_slots_per_layer: int | None = None,
              n_ubatch: int = 512, *, miss_fn: MissFn | None = None, allow_pins: bool = True,
              policy: str = "lru") -> Plan:
    """Place experts for `budget_bytes` of device memory (see the module docstring).

    profile_counts: [n_layer, n_expert] decode routing counts; None = uniform prior.
    miss_ratio(layer, slots): plain-LRU miss ratio, called at most once per pair.
    miss_fn(layer, pins, slots): replayed miss share (overrides miss_ratio), called at most
    once per triple. allow_pins=False: policy slots only. `policy` is recorded in the plan.
    """
    g = geometry
    fixed = _fixed_costs(g, n_ctx, type_k, type_v, n_ubatch)
    fixed_total = sum(fixed.values())
    moe = [l for l in g.layers if l.is_moe and not l.is_nextn]
    all_bias = sum(l.expert_bias_bytes for l in moe)
    if fixed_total - all_bias > budget_bytes:  # not even stock --cpu-moe fits
        parts = ", ".join(f"{k} {units.gib(v)}" for k, v in fixed.items())
        need = fixed_total - all_bias
        raise PlanError(
            f"--vram {units.gib(budget_bytes)}: the model without experts needs {units.gib(need)} "
            f"({parts}; n_ctx {n_ctx}); over by {units.shortfall(need - budget_bytes)}",
            hint="lower --ctx-size, quantize the KV cache (-ctk q8_0) or raise --vram")

    counts = None
    if profile_counts is not None:
        counts = np.asarray(profile_counts, dtype=np.float64)
        if counts.shape != (g.n_layer, g.n_expert):
            raise PlanError(f"profile: shape {counts.shape} does not match the model ({g.n_layer}, {g.n_expert})")
        if (counts < 0).any() or not np.isfinite(counts).all():
            raise PlanError("profile: routing counts must be finite and >= 0")
        if counts.sum() <= 0:
            counts = None
    cache: dict[tuple[int, int, int], float] = {}

    def mr(layer: int, slots: int) -> float:
        if (layer, -1, slots) not in cache:
            cache[(layer, -1, slots)] = float(miss_ratio(layer, slots))  # type: ignore[misc]
        return cache[(layer, -1, slots)]

    def mf(layer: int) -> Callable[[int, int], float]:
        def f(pins: int, lru: int) -> float:
            if (layer, pins, lru) not in cache:
                cache[(layer, pins, lru)] = float(miss_fn(layer, pins, lru))  # type: ignore[misc]
            return cache[(layer, pins, lru)]
        return f

    k = g.n_expert_used
    states: dict[int, _Layer] = {}
    for l in moe:
        row = counts[l.index] if counts is not None else np.zeros(l.n_expert)
        freq = row / row.sum() if row.sum() > 0 else np.full(l.n_expert, 1.0 / l.n_expert)
        states[l.index] = _Layer(l.index, l.n_expert, k, l.expert_bytes_per_expert, freq,
                                 1.0 / len(moe), max_slots_per_layer, mr if miss_ratio else None,
                                 mf(l.index) if miss_fn else None, allow_pins)

    # Below the cache floor: the lowest-numbered MoE layers keep their experts (and expert
    # biases) in host RAM, as stock --n-cpu-moe does, until the rest fits.
    host: set[int] = set()
    need = fixed_total + sum(s.cost() for s in states.values())
    for l in moe:
        if need <= budget_bytes:
            break
        need -= states[l.index].cost() + l.expert_bias_bytes
        host.add(l.index)
    assert need <= budget_bytes, "stock --cpu-moe fits, so the all-host plan fits"

    # Walk the budget-independent greedy sequence until the next action does not fit.
    left = budget_bytes - need
    heap: list[tuple[float, int, int, int, str, int]] = []

    def push(s: _Layer) -> None:
        for gain, rank, kind, cost in s.actions():
            heapq.heappush(heap, (-gain, rank, s.index, s.version, kind, cost))

    for s in states.values():
        if s.index not in host:
            push(s)
    while heap:
        _, _, il, version, kind, _ = heapq.heappop(heap)
        s = states[il]
        if version != s.version:
            continue
        before = s.cost()
        s.apply(kind)
        if s.cost() - before > left:  # undo and stop: a prefix keeps plans monotone in the budget
            s.pins, s.lru, s.resident = (s.pins - (kind == "pin"), s.lru - (kind == "slot"), False)
            break
        left -= s.cost() - before
        push(s)

    layers: list[LayerPlan] = []
    banks = resident = host_bias = 0
    cold: list[float] = []
    for l in g.layers:
        if l.is_nextn:
            layers.append(LayerPlan(l.index, "skipped", (), 0, 0, 0))
        elif not l.is_moe:
            layers.append(LayerPlan(l.index, "dense", (), 0, l.nonexpert_bytes, 0))
        elif l.index in host:
            host_bias += l.expert_bias_bytes
            cold.append(1.0)
            layers.append(LayerPlan(l.index, "host", (), 0, l.nonexpert_bytes - l.expert_bias_bytes,
                                    l.expert_bytes + l.expert_bias_bytes))
        elif states[l.index].resident:
            s = states[l.index]
            resident += s.cost()
            cold.append(0.0)
            layers.append(LayerPlan(l.index, "resident", (), 0, l.nonexpert_bytes + s.cost(), 0))
        else:
            s = states[l.index]
            banks += s.cost()
            cold.append(float(max(s.unpinned[s.pins], 0.0)))
            layers.append(LayerPlan(l.index, "cached", tuple(s.order[: s.pins]), s.pins + s.lru,
                                    l.nonexpert_bytes + s.cost(), l.expert_bytes))
    breakdown = {"weights_global": fixed["weights_global"],
                 "weights_layers_nonexpert": fixed["weights_layers_nonexpert"] - host_bias,
                 "experts_resident": resident, "expert_banks": banks, "kv_cache": fixed["kv_cache"],
                 "compute": fixed["compute"], "overhead": fixed["overhead"]}
    breakdown["total"] = sum(breakdown.values())
    assert breakdown["total"] <= budget_bytes, "planner overspent its budget"
    return Plan(model=g.identity(), budget_bytes=budget_bytes, n_ctx=n_ctx, type_k=type_k, type_v=type_v,
                n_ubatch=n_ubatch, layers=tuple(layers), breakdown=breakdown,
                predicted_cold_hit=(sum(cold) / len(cold) if cold else 0.0) if counts is not None else None,
                stock=stock_baseline(g, budget_bytes, fixed_total), policy=policy,
                overrides=cached_expert_overrides(g, [l.index for l in layers if l.mode == "cached"])
                + stock_overrides(l.index for l in layers if l.mode == "host"))



# ---------------------------------------------------------------- planning by replay


@dataclass(frozen=True)
class Candidate:
    """A plan made one way, and its miss share replayed on the planning trace."""

    name: str  # "replay" (pins and slots priced by replay), "pins+k", "all-slots"
    plan: Plan
    miss: float


def _policy_for(policy: str, pins: int) -> str:
    return "lru-pinned" if policy == "lru" and pins else policy


class LayerReplay:
    """Replays one trace's decode steps, layer by layer, through `policy` with the P
    hottest experts (by `counts`) pinned and L policy slots: miss(layer, P, L) in [0, 1]."""

    def __init__(self, trace: Any, counts: np.ndarray | None, policy: str, miss_path: str = "upload",
                 max_admit: int | None = None):
        from .simulator import _layer_steps, _phase_mask

        self.trace, self.policy, self.miss_path, self.max_admit = trace, policy, miss_path, max_admit
        keep, _ = _phase_mask(trace, ("decode",))
        self._keep, self._layer_steps = keep, _layer_steps
        self._steps: dict[int, Any] = {}
        self._memo: dict[tuple[int, tuple[int, ...], int], float] = {}
        n = trace.n_expert
        self.order = {l: hottest_first(counts[l] if counts is not None else np.zeros(n)) for l in trace.moe_layers()}

    def miss(self, layer: int, pins: int, lru: int, pinned: tuple[int, ...] | None = None) -> float:
        from .simulator import _replay

        if layer not in self.order:
            return 0.0  # the trace never routes this layer: nothing to miss
        if layer not in self._steps:
            self._steps[layer] = self._layer_steps(self.trace, layer, self._keep)
        pin = pinned if pinned is not None else tuple(self.order[layer][:pins])
        key = (layer, pin, lru)
        if key in self._memo:
            return self._memo[key]
        st = _replay(self._steps[layer], self.trace.k, self.trace.n_expert, layer, len(pin) + lru, pin,
                     _policy_for(self.policy, len(pin)), self.miss_path, self.max_admit)
        n = st.hits_decode + st.misses_decode + st.stock_accesses_decode
        self._memo[key] = 1.0 - st.hits_decode / n if n else 0.0
        return self._memo[key]

    def plan_miss(self, plan: Plan) -> float:
        """Mean over the plan's MoE layers: resident 0, host 1, cached the replayed miss share."""
        out = []
        for l in plan.layers:
            if l.mode == "resident":
                out.append(0.0)
            elif l.mode == "host":
                out.append(1.0)
            elif l.mode == "cached":
                out.append(self.miss(l.index, len(l.pinned), l.lru_slots, tuple(l.pinned)))
        return sum(out) / len(out) if out else 0.0


def plan_by_replay(geometry: ModelGeometry, budget_bytes: int, n_ctx: int, trace: Any,
                   profile_counts: np.ndarray | None = None, policy: str = "lru", type_k: str = "f16",
                   type_v: str = "f16", n_ubatch: int = 512, miss_path: str = "upload",
                   max_admit: int | None = None) -> tuple[Plan, list[Candidate]]:
    """Price pins against policy slots per layer by replaying `trace` (decode steps)
    through the policy that will run, and keep the best of three plans for the budget:

    - "replay": the greedy of make_plan with miss_fn = the replayed miss share with the
      P hottest pinned (by `profile_counts`, else the trace's decode counts) and L slots;
    - "pins+k": make_plan from the counts alone (pins, k policy slots per layer);
    - "all-slots": make_plan with slots only (no pins), priced by replay.

    The chosen plan has the smallest replayed miss share on `trace` (ties: that order),
    so on its own trace it is never worse than pins+k or all-slots. Returns (plan with
    predicted_miss set, every candidate).
    """
    from .simulator import canonical_policy

    policy = canonical_policy(policy)
    counts = profile_counts
    if counts is None or np.asarray(counts).sum() <= 0:
        counts = trace.counts("decode") if trace.n_decode else None
    rp = LayerReplay(trace, None if counts is None else np.asarray(counts, dtype=np.float64), policy,
                     miss_path, max_admit)
    common = dict(profile_counts=counts, type_k=type_k, type_v=type_v, n_ubatch=n_ubatch, policy=policy)
    plans = [
        ("replay", make_plan(geometry, budget_bytes, n_ctx, miss_fn=rp.miss, **common)),
        ("pins+k", make_plan(geometry, budget_bytes, n_ctx, **common)),
        ("all-slots", make_plan(geometry, budget_bytes, n_ctx, miss_fn=rp.miss, allow_pins=False, **common)),
    ]
    cands = [Candidate(name, p, rp.plan_miss(p)) for name, p in plans]
    best = min(range(len(cands)), key=lambda i: (cands[i].miss, i))
    return replace(cands[best].plan, predicted_miss=cands[best].miss), cands


@dataclass(frozen=True)
class HeldOutCheck:
    """Plan on the first part of a trace's decode steps, then replay the rest."""

    train_steps: int
    test_steps: int
    predicted: float  # the train plan's miss share replayed on the train part (what it predicts)
    measured: float  # the train plan replayed on the held-out part
    oracle: float  # a plan made from the held-out part itself, replayed on it
    belady: float  # the train plan's pins and slots on the held-out part, Belady evicting


def held_out_check(geometry: ModelGeometry, budget_bytes: int, n_ctx: int, trace: Any, train_frac: float = 0.7,
                   policy: str = "lru", type_k: str = "f16", type_v: str = "f16", n_ubatch: int = 512,
                   miss_path: str = "upload", max_admit: int | None = None) -> HeldOutCheck | None:
    """Train on the first `train_frac` of the decode steps (their counts pick the pins),
    predict the rest; None when either part has no decode step."""
    train, test = trace.decode_steps().split(train_frac)
    if not train.n_rows or not test.n_rows:
        return None
    kw = dict(policy=policy, type_k=type_k, type_v=type_v, n_ubatch=n_ubatch, miss_path=miss_path,
              max_admit=max_admit)
    p_train, _ = plan_by_replay(geometry, budget_bytes, n_ctx, train, train.counts("decode"), **kw)
    p_test, _ = plan_by_replay(geometry, budget_bytes, n_ctx, test, test.counts("decode"), **kw)
    measured = LayerReplay(test, None, policy, miss_path, max_admit).plan_miss(p_train)
    belady = LayerReplay(test, None, "belady", miss_path, max_admit).plan_miss(p_train)
    return HeldOutCheck(train.n_rows, test.n_rows, float(p_train.predicted_miss or 0.0), measured,
                        float(p_test.predicted_miss or 0.0), belady)
