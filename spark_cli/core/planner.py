"""Geometry + routing + VRAM budget -> a Plan of resident, cached and pinned experts.

One entry point: `plan_for(geometry, PlanRequest) -> PlanResult`. Every command that
places a model (plan, chat, serve, bench, demo through plan and bench) builds a
PlanRequest (runs/session.plan_request): the budget, n_ctx, the KV types and ubatch
(-ctk/-ctv/-ub), the profile's routing counts, a trace to replay (`--trace`, else the
profile's ring of recent decode steps), the cache policy, the miss path and max_admit.
The same request gives the same plan whichever command asks. The rest of this module
(_make_plan, _plan_by_replay, _LayerReplay) is its machinery.

Every MoE layer is either *resident* (all experts on the device) or *cached*: experts
stay in host RAM and a device bank of S slots holds P pinned hot experts plus S - P
policy slots, with S - P >= k (n_expert_used) so one decode step fits, and one guard
slice: bank bytes = (S + 1) * bytes_per_expert. On the auto and upload miss paths the
cached layers of one expert shape also share G staging slices (`stage_slices`), where a
step's misses are uploaded for that step only: G * bytes_per_expert per shape, in
expert_banks, a fixed cost once any layer is cached.

Placement is one greedy sequence of actions, independent of the budget: each action
pins the next-hottest expert of a layer or adds a policy slot to a layer, whichever
removes the most predicted miss mass per byte. A budget takes the longest prefix of
that sequence that fits, so a larger budget never loses a pinned, resident or policy
slot (the hot set grows monotonically). Predicted miss share of a cached layer with
P pins (the P hottest) and L policy slots:
  without a trace:  u(P), the layer's routing mass outside its pins (slots are credited
                    nothing, so they stay at the floor k): "pins+k";
  with a trace:     miss(layer, P, L), the trace's decode steps replayed through the
                    policy that will run (simulator.LayerTrace) with the P hottest pinned
                    and L policy slots. plan_for then keeps the best of three plans by
                    their replayed miss share (ties: this order): "replay" (that greedy),
                    "pins+k" (counts alone) and "all-slots" (the greedy without pins).
The replay runs the request's miss path: "cpu" and "auto" (whose admissions are the cpu path's;
its per-expert split changes no slot) replay the cpu path, "upload" and "layer" (the per-layer
rule, chosen on the machine after planning) the upload path.
A layer whose pins, policy slots and guard would reach n_expert becomes resident.
Below the cache floor (fixed costs + k slots and a guard in every MoE layer), layers keep
their experts wholly in host RAM, as stock `--n-cpu-moe N` does: the lowest-numbered MoE
layers first, their expert biases on the host too, until the rest fits ("host" layers,
predicted cold-hit 1). A plan is refused only where stock `--cpu-moe` does not fit.
Priced in time (the request carries the device's costs, cost_model.DeviceCosts: measured by
`spark bench` and kept, or a card's published figures): every MoE layer is resident, cached or
host, and the plan is the shape with the least predicted time per token (decode, or prompt with
objective "prompt") among: c cached layers for every c (the c best to cache by replayed misses;
the rest resident, the lowest-numbered of those host below the floor, plus one more host layer
for more slots), and stock's own --n-cpu-moe N for every N that fits (c = 0), so a plan is never
predicted slower than stock on the same budget. A cached layer costs a stop and its misses; a
host layer, stock's stop and its k experts on the CPU (cost_model.py). The shape's pins and slots
are the greedy's below, and the fastest of its three candidates is kept. Without costs the plan
is placed by hits alone, as before (every layer the floor allows is cached).
Layer mass is equal (every token passes every MoE layer); the profile is normalized
per layer. The prefix stops at the first action that does not fit, so up to one
action's bytes (one expert, or a whole-layer jump under max_slots_per_layer) may stay
unspent. The fixed costs (`fixed_costs`: weights, KV cache, compute buffer, overhead)
are the one non-expert bill: bench sizes stock offload and --residency with it too.

The plan file (JSON) is read and written by plan_file.py.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from . import ram_tier, units, vram
from ..errors import PlanError
from .bill import MeasuredBill
from .cost_model import OBJECTIVES, DeviceCosts, LayerLoad, Prediction, predict
from .gguf_info import ModelGeometry
from .options import DEFAULT_UBATCH
from .placement import TensorOverride, cached_expert_overrides, stock_overrides, stock_patterns
from .simulator import DEFAULT_POLICY, ONLINE_POLICIES, LayerTrace, MissPath, canonical_policy
from .split import Split, single

MAX_PARALLEL = 256  # llama.cpp's LLAMA_MAX_SEQ: -np at most
MODES = ("resident", "cached", "host", "dense", "skipped")
BREAKDOWN_KEYS = ("weights_global", "weights_layers_nonexpert", "experts_resident", "expert_banks",
                  "kv_cache", "compute", "overhead", "total")



STAGE_STEPS = 4  # staging slices per shape: the experts of this many decode steps (a prefill step's heaviest misses)


def replay_path(miss_path: str) -> str:
    """The simulator's miss path that replays a plan's: auto admits as the cpu path does (its
    per-expert split changes no slot); layer (the per-layer rule) replays the upload path."""
    return "cpu" if miss_path in ("cpu", "auto") else "upload"


def stage_slices(n_expert: int, k: int, miss_path: str) -> int:
    """Staging slices per expert shape on the paths that stage misses (auto: by cost in every
    step; upload: steps too large for the slots); none on the cpu path and the per-layer rule.
    A plan holds at most n_expert - (fewest slots of a cached layer): no step misses more."""
    return 0 if miss_path in ("cpu", "layer") else min(n_expert, STAGE_STEPS * k)


def staging_bytes(g: ModelGeometry, slices: int, layers: list | None = None) -> int:
    """Device bytes of `slices` staging slices for each distinct expert shape of the MoE layers
    (the native cache shares them among the cached layers of one shape on one device; `layers`:
    those of one device, default all)."""
    shapes = {tuple((t.kind, t.ggml_type, t.bytes_per_expert) for t in l.experts): l.expert_bytes_per_expert
              for l in (g.layers if layers is None else layers) if l.is_moe and not l.is_nextn}
    return slices * sum(shapes.values())
MissFn = Callable[[int, int, int], float]  # (layer, pins, policy slots) -> miss share


@dataclass(frozen=True)
class LayerPlan:
    index: int
    mode: str  # resident | cached | host | dense | skipped (MTP block llama.cpp does not load)
    pinned: tuple[int, ...]  # cached: expert ids in slots 0..P-1, hottest first
    slots: int  # cached: S = P pinned + S - P LRU slots (guard slice not counted)
    device_bytes: int  # layer weights + experts or bank on the device
    host_bytes: int  # expert weights kept in host RAM
    device: int = 0  # index into Plan.devices: the device llama.cpp's layer split puts it on

    @property
    def lru_slots(self) -> int:
        return self.slots - len(self.pinned)


@dataclass(frozen=True)
class DevicePlan:
    """One device of a plan: its budget, its planned bill and what a dry run measured on it."""

    name: str  # ggml's device name (CUDA0, RPC0, ...); "" where planned without the device
    budget_bytes: int
    breakdown: dict[str, int]  # BREAKDOWN_KEYS: the part of the plan's bill on this device
    measured: dict[str, int] | None = None  # bill.MeasuredBill.device: model, context, compute, banks, total


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
    policy: str = DEFAULT_POLICY  # the cache policy of the cached layers (simulator.POLICIES)
    predicted_miss: float | None = None  # replayed miss share on the planning trace
    miss_path: str = "auto"  # auto | cpu | upload (miss_path.py); --miss-path overrides it
    stage_slices: int = 0  # staging slices per expert shape (stage_slices); their bytes are in expert_banks
    overrides: tuple[TensorOverride, ...] = ()  # expert weights of cached layers -> host RAM (placement.py)
    measured: dict[str, Any] | None = None  # the dry run's bill (bill.MeasuredBill.to_dict); None: not measured
    measured_device_bytes: int | None = None  # its total on the first device (banks included)
    fit_rounds: int = 0  # dry runs the fit loop took (0: not measured)
    policy_replay: dict[str, float] | None = None  # --policy auto: each policy's share of experts on the device
    n_parallel: int = 1  # -np: sequences the KV cache and recurrent state are priced for (vram.kv_cache_bytes)
    kv_unified: bool = False  # --kv-unified: one KV stream shared by them (else n_ctx / n_parallel each)
    devices: tuple[DevicePlan, ...] = ()  # per device, -dev order (empty: one device, budget_bytes and breakdown)
    tensor_split: tuple[float, ...] = ()  # the proportions llama.cpp splits the layers by (split.py); () one device
    split_mode: str = "layer"  # -sm: layer, or none (the whole model on the main_gpu device)
    main_gpu: int = 0  # -mg: the device -sm none keeps, among the run's selected devices
    output_device: int = 0  # index into devices: where the output layer (norm, matrix) lands
    predicted: dict[str, Any] | None = None  # the cost model's figures: tg_tok_s, pp_tok_s, stops, objective, costs

    @property
    def per_device(self) -> tuple[DevicePlan, ...]:
        """Every device of the plan (a plan without `devices`: one, with the plan's budget and bill)."""
        if self.devices:
            return self.devices
        bill = self.measured_bill()
        names = bill.device_names() if bill is not None else []
        return (DevicePlan(names[0] if names else "", self.budget_bytes, dict(self.breakdown),
                           bill.device(names[0]) if names else None),)

    def split(self) -> Split:
        """The Split the engine realises this plan with (split.py)."""
        devs = self.per_device
        return Split(tuple(d.budget_bytes for d in devs), tuple(d.name for d in devs), tuple(self.tensor_split),
                     self.split_mode, self.main_gpu)

    def measured_bill(self) -> MeasuredBill | None:
        return MeasuredBill.from_dict(self.measured) if self.measured is not None else None

    def hot_set(self) -> dict[int, frozenset[int]]:
        """Experts on the device without an upload: pinned, or all of a resident layer."""
        n = int(self.model["n_expert"])
        return {l.index: frozenset(range(n)) if l.mode == "resident" else frozenset(l.pinned)
                for l in self.layers if l.mode in ("resident", "cached", "host")}


def bill_device_name(bill: MeasuredBill, names: list[str] | tuple[str, ...], d: int) -> str | None:
    """The device of `bill` that is the plan's device `d`: by its name, else (planned without the
    device, or another run numbered it otherwise) the d-th device llama.cpp reported; None: none."""
    seen = bill.device_names()
    name = names[d] if d < len(names) else ""
    if name in seen:
        return name
    return seen[d] if d < len(seen) else None


def device_bill(bill: MeasuredBill, names: list[str] | tuple[str, ...], d: int) -> dict[str, int]:
    """What `bill` measured on the plan's device `d` (bill_device_name; zeros where none)."""
    name = bill_device_name(bill, names, d)
    if name is None:
        return {"model": 0, "context": 0, "compute": 0, "banks": 0, "total": 0}
    return bill.device(name)


def measured_total(plan: "Plan", bill: MeasuredBill | None) -> int | None:
    """The measured device bytes of the plan: its device's total, or the sum over its devices."""
    if bill is None:
        return None
    names = [x.name for x in plan.per_device]
    return sum(device_bill(bill, names, d)["total"] for d in range(len(names)))


def with_measured(plan: "Plan", bill: MeasuredBill, fit_rounds: int | None = None) -> "Plan":
    """The plan with a dry run's bill: in total and on each of its devices."""
    names = [x.name for x in plan.per_device]
    devs = tuple(replace(x, name=x.name or bill_device_name(bill, names, d) or "", measured=device_bill(bill, names, d))
                 for d, x in enumerate(plan.per_device)) if plan.devices else ()
    out = replace(plan, measured=bill.to_dict(), devices=devs,
                  fit_rounds=plan.fit_rounds if fit_rounds is None else fit_rounds)
    return replace(out, measured_device_bytes=measured_total(out, bill))


def unmeasured_overhead() -> int:
    """Device bytes a dry run cannot see (CUDA context, cuBLAS workspace, pools): the estimate's."""
    return vram.DEVICE_OVERHEAD_BYTES


def fixed_costs(g: ModelGeometry, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
                n_ubatch: int = DEFAULT_UBATCH, compute: int | None = None, n_parallel: int = 1,
                kv_unified: bool = False) -> dict[str, int]:
    """The device bill of everything but the routed experts, by item: the plan's and bench's.
    `compute`: the measured compute buffers (a dry run's), else vram's estimate. The KV cache and
    recurrent state are those of `n_parallel` sequences (-np, --kv-unified), as llama.cpp allocates."""
    return {
        "weights_global": g.device_global_bytes,
        "weights_layers_nonexpert": sum(l.nonexpert_bytes for l in g.layers if not l.is_nextn),
        "kv_cache": vram.kv_cache_bytes(g, n_ctx, type_k, type_v, n_ubatch, n_parallel, kv_unified),
        "compute": vram.compute_buffer_bytes(g, n_ctx, n_ubatch, n_parallel, kv_unified) if compute is None
        else compute,
        "overhead": vram.DEVICE_OVERHEAD_BYTES,
    }


def device_fixed_costs(g: ModelGeometry, layer_dev: tuple[int, ...], n_dev: int, n_ctx: int, type_k: str = "f16",
                       type_v: str = "f16", n_ubatch: int = DEFAULT_UBATCH,
                       compute: int | tuple[int, ...] | None = None, n_parallel: int = 1,
                       kv_unified: bool = False) -> list[dict[str, int]]:
    """fixed_costs per device of a layer split (`layer_dev`: split.layer_devices, the output layer
    last): each layer's non-expert weights, KV cache and recurrent state on its device, the global
    weights on the output layer's, a compute buffer and the overhead on every device that holds a
    layer. The compute estimate counts the logits on the output device only; `compute`: the
    measured compute buffers, one per device. One device: fixed_costs."""
    if n_dev == 1:
        c = compute[0] if isinstance(compute, tuple) else compute
        return [fixed_costs(g, n_ctx, type_k, type_v, n_ubatch, c, n_parallel, kv_unified)]
    out = [{"weights_global": 0, "weights_layers_nonexpert": 0, "kv_cache": 0, "compute": 0, "overhead": 0}
           for _ in range(n_dev)]
    out[layer_dev[g.n_layer]]["weights_global"] = g.device_global_bytes
    kv = vram.kv_layer_bytes(g, n_ctx, type_k, type_v, n_ubatch, n_parallel, kv_unified)
    for l in g.layers:
        if not l.is_nextn:
            out[layer_dev[l.index]]["weights_layers_nonexpert"] += l.nonexpert_bytes
        out[layer_dev[l.index]]["kv_cache"] += kv[l.index]
    used = set(layer_dev)
    for d in range(n_dev):
        if d not in used:
            continue
        out[d]["overhead"] = vram.DEVICE_OVERHEAD_BYTES
        if isinstance(compute, tuple):
            out[d]["compute"] = compute[d]
        else:
            out[d]["compute"] = vram.compute_buffer_bytes(g, n_ctx, n_ubatch, n_parallel, kv_unified,
                                                          logits=d == layer_dev[g.n_layer])
    return out


def fixed_bytes(g: ModelGeometry, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
                n_ubatch: int = DEFAULT_UBATCH, n_parallel: int = 1, kv_unified: bool = False) -> int:
    """Device bytes of everything but the routed experts (weights, KV cache, compute, overhead)."""
    return sum(fixed_costs(g, n_ctx, type_k, type_v, n_ubatch, n_parallel=n_parallel,
                           kv_unified=kv_unified).values())


def stock_baseline(g: ModelGeometry, budget_bytes: int, fixed_bytes: int) -> StockBaseline:
    """Smallest N for llama.cpp's `--n-cpu-moe N` (expert tensors, biases included, of
    layers 0..N-1 on the CPU) whose device bytes fit, and `--cpu-moe` (all of them)."""
    return stock_baseline_split(g, (budget_bytes,), (fixed_bytes,), (0,) * (g.n_layer + 1))


def stock_baseline_split(g: ModelGeometry, budgets: tuple[int, ...], fixed: tuple[int, ...],
                         layer_dev: tuple[int, ...]) -> StockBaseline:
    """stock_baseline over a layer split: N fits when every device fits its own budget; the
    device bytes are the sum over the devices."""
    loaded = [l for l in g.layers if not l.is_nextn]

    def device(n: int) -> list[int]:
        out = list(fixed)
        for l in loaded:
            out[layer_dev[l.index]] += l.expert_bytes if l.index >= n else -l.expert_bias_bytes
        return out

    def fits(n: int) -> bool:
        return all(u <= b for u, b in zip(device(n), budgets))

    n_max = 1 + max((l.index for l in loaded if l.is_moe), default=-1)
    n = next((i for i in range(n_max + 1) if fits(i)), n_max)
    pats = stock_patterns(range(n))
    return StockBaseline(n, fits(n), sum(device(n)), pats, sum(device(n_max)), fits(n_max))


def hottest_first(row: np.ndarray) -> list[int]:
    """Expert ids by routing count, highest first; ties: lower id first."""
    row = np.asarray(row, dtype=np.float64)
    return [int(e) for e in np.lexsort((np.arange(row.size), -row))]


class _Layer:
    """Greedy state of one MoE layer."""

    def __init__(self, index: int, n_expert: int, k: int, bpe: int, freq: np.ndarray,
                 mass: float, max_slots: int | None, miss_fn: Callable[[int, int], float] | None = None,
                 allow_pins: bool = True):
        self.index, self.n, self.k, self.bpe, self.mass = index, n_expert, k, bpe, mass
        self.order = hottest_first(freq)
        self.unpinned = 1.0 - np.concatenate([[0.0], np.cumsum(freq[self.order])])  # u(P)
        self.max_slots, self.miss_fn = max_slots, miss_fn
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
        return max(float(self.unpinned[pins]), 0.0)

    def actions(self) -> list[tuple[float, int, str, int]]:
        """(gain per byte, kind rank, kind, cost) of each next action."""
        if self.resident:
            return []
        now = self.miss(self.pins, self.lru)
        if self.max_slots is not None and self.pins + self.lru >= self.max_slots:
            cost = self.n * self.bpe - self.cost()
            return [(self.mass * now / cost, 2, "resident", cost)]
        # On a tie a policy slot wins: it adapts to the traffic, a pin is a bet on the profile.
        out = []
        if self.allow_pins:
            out.append((self.mass * (now - self.miss(self.pins + 1, self.lru)) / self.bpe, 1, "pin", self.bpe))
        if self.miss_fn is not None:
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


def _make_plan(geometry: ModelGeometry, budget_bytes: int, n_ctx: int,
               profile_counts: np.ndarray | None = None, type_k: str = "f16", type_v: str = "f16",
               max_slots_per_layer: int | None = None, n_ubatch: int = DEFAULT_UBATCH, *,
               miss_fn: MissFn | None = None, allow_pins: bool = True, policy: str = DEFAULT_POLICY,
               miss_path: str = "auto", compute_bytes: int | tuple[int, ...] | None = None, n_parallel: int = 1,
               kv_unified: bool = False, split: Split | None = None, stage: int | None = None,
               shape: "Shape | None" = None) -> Plan:
    """The greedy for `budget_bytes` of device memory (see the module docstring); plan_for's.

    profile_counts: [n_layer, n_expert] decode routing counts; None = uniform prior.
    miss_fn(layer, pins, slots): replayed miss share, called at most once per triple; None:
    pins only, k policy slots per layer. allow_pins=False: policy slots only.
    `policy` and `miss_path` are recorded in the plan, and so are `n_parallel` and `kv_unified`
    (-np, --kv-unified: the sequences the KV cache is priced for).
    `split`: several devices (split.py): each layer is billed to the device llama.cpp's layer
    split puts it on, and each device spends its own budget (split.budgets; budget_bytes unused)
    on the layers it holds: the greedy sequence restricted to a device's layers is that device's
    prefix, so every device keeps the monotone hot set. `compute_bytes`: one per device then.
    `shape` (the time search): layers forced resident or host; the greedy spends the rest on the
    others' slots, and below the floor makes the lowest forced-resident layers host first.
    """
    g = geometry
    sp = split if split is not None else single(budget_bytes)
    n_dev, budgets = sp.n_devices, sp.budgets
    ldev = sp.layer_devices(g.n_layer)
    fixed = device_fixed_costs(g, ldev, n_dev, n_ctx, type_k, type_v, n_ubatch, compute_bytes, n_parallel,
                               kv_unified)
    fixed_total = [sum(f.values()) for f in fixed]
    moe = [l for l in g.layers if l.is_moe and not l.is_nextn]
    on = [[l for l in moe if ldev[l.index] == d] for d in range(n_dev)]
    bias = [sum(l.expert_bias_bytes for l in on[d]) for d in range(n_dev)]
    for d in range(n_dev):
        _check_fixed_fits(fixed[d], budgets[d], n_ctx, bias[d], n_parallel, sp.names[d] if n_dev > 1 else "")
    counts = _checked_counts(g, profile_counts)
    states = _layer_states(g, moe, counts, max_slots_per_layer, miss_fn, allow_pins)
    forced_host, prefer_host = (shape.host, shape.resident) if shape is not None else (frozenset(), frozenset())
    for il in prefer_host:
        if il in states:
            states[il].resident = True
    dev_states = [{l.index: states[l.index] for l in on[d]} for d in range(n_dev)]
    trim = stage is None  # the default count is trimmed below; a given one is kept
    stage = stage_slices(g.n_expert, g.n_expert_used, miss_path) if stage is None else stage
    # NOTE: the staging slices are part of the cache floor: a device that caches a layer holds them
    # (the native cache gives every device's arena of a shape the same n_stage slices)
    staged = [staging_bytes(g, stage, on[d]) for d in range(n_dev)]
    every_resident = [fixed_total[d] + sum(l.n_expert * l.expert_bytes_per_expert for l in on[d])
                      for d in range(n_dev)]
    if any(fixed_total[d] + staged[d] - bias[d] > budgets[d] for d in range(n_dev)):
        stage, staged = 0, [0] * n_dev
    staged = [0 if every_resident[d] <= budgets[d] else staged[d] for d in range(n_dev)]
    hosts = [_host_layers(on[d], dev_states[d], fixed_total[d] + staged[d], budgets[d], forced_host, prefer_host)
             for d in range(n_dev)]
    if any(staged[d] and len(hosts[d][0]) == len(on[d]) for d in range(n_dev)):
        stage, staged = 0, [0] * n_dev  # a device caches no layer: staging would take the floor of the rest
        hosts = [_host_layers(on[d], dev_states[d], fixed_total[d], budgets[d], forced_host, prefer_host)
                 for d in range(n_dev)]
    for d in range(n_dev):
        _spend(dev_states[d], hosts[d][0], budgets[d] - hosts[d][1])
        if n_dev > 1 and staged[d]:
            _spend_staging_left(g, stage, on[d], dev_states[d], hosts[d][0], fixed_total[d], budgets[d])
    host = set().union(*(h for h, _ in hosts))
    layers, cold, spent = _layer_plans(g, states, host, ldev, n_dev)
    cached_on = [any(l.mode == "cached" and l.device == d for l in layers) for d in range(n_dev)]
    staged = [staged[d] if cached_on[d] else 0 for d in range(n_dev)]
    if n_dev > 1:  # NOTE: the native arenas: one per device and shape of its cached layers, each with the slices
        staged = [staging_bytes(g, stage, [g.layers[l.index] for l in layers if l.mode == "cached" and l.device == d])
                  for d in range(n_dev)]
    if not any(cached_on):
        stage = 0  # every layer became resident
    need = _stage_needed(g, layers)
    if trim and 0 < need < stage:  # NOTE: fewer slices buy slots: the next plan needs at most as many
        return _make_plan(geometry, budget_bytes, n_ctx, profile_counts, type_k, type_v, max_slots_per_layer,
                          n_ubatch, miss_fn=miss_fn, allow_pins=allow_pins, policy=policy, miss_path=miss_path,
                          compute_bytes=compute_bytes, n_parallel=n_parallel, kv_unified=kv_unified, split=split,
                          stage=need, shape=shape)
    devs = []
    for d in range(n_dev):
        bd = {"weights_global": fixed[d]["weights_global"],
              "weights_layers_nonexpert": fixed[d]["weights_layers_nonexpert"] - spent[d]["host_bias"],
              "experts_resident": spent[d]["resident"], "expert_banks": spent[d]["banks"] + staged[d],
              "kv_cache": fixed[d]["kv_cache"], "compute": fixed[d]["compute"], "overhead": fixed[d]["overhead"]}
        bd["total"] = sum(bd.values())
        assert bd["total"] <= budgets[d], "planner overspent its budget"
        devs.append(DevicePlan(sp.names[d], budgets[d], bd))
    breakdown = {k: sum(x.breakdown[k] for x in devs) for k in BREAKDOWN_KEYS}
    stock = stock_baseline(g, budgets[0], fixed_total[0]) if n_dev == 1 else \
        stock_baseline_split(g, budgets, tuple(fixed_total), ldev)
    return Plan(model=g.identity(), budget_bytes=sum(budgets), n_ctx=n_ctx, type_k=type_k, type_v=type_v,
                n_ubatch=n_ubatch, layers=tuple(layers), breakdown=breakdown,
                predicted_cold_hit=(sum(cold) / len(cold) if cold else 0.0) if counts is not None else None,
                stock=stock, policy=policy, miss_path=miss_path,
                stage_slices=stage, n_parallel=n_parallel, kv_unified=kv_unified,
                overrides=cached_expert_overrides(g, [l.index for l in layers if l.mode == "cached"])
                + stock_overrides(l.index for l in layers if l.mode == "host"),
                devices=tuple(devs), tensor_split=sp.tensor_split if n_dev > 1 else (), split_mode=sp.mode,
                main_gpu=sp.main_gpu, output_device=ldev[g.n_layer])


def _stage_needed(g: ModelGeometry, layers) -> int:
    """The most misses a step can have in a cached layer (its experts outside its slots): staging
    slices beyond that are never filled (0: no cached layer)."""
    return max((g.n_expert - l.slots for l in layers if l.mode == "cached"), default=0)


def _check_fixed_fits(fixed: dict[str, int], budget_bytes: int, n_ctx: int, all_bias: int,
                      n_parallel: int = 1, device: str = "") -> None:
    """PlanError when not even stock --cpu-moe fits: the model without experts is over the budget
    (`device`: of that device, for a layer split)."""
    need = sum(fixed.values()) - all_bias
    if need > budget_bytes:
        parts = ", ".join(f"{k} {units.gib(v)}" for k, v in fixed.items())
        seqs = f", -np {n_parallel}" if n_parallel > 1 else ""
        on = f" on {device}" if device else ""
        raise PlanError(
            f"--vram {units.gib(budget_bytes)}{on}: the model without experts needs {units.gib(need)}{on} "
            f"({parts}; n_ctx {n_ctx}{seqs}); over by {units.shortfall(need - budget_bytes)}",
            hint=f"lower --ctx-size{' or -np' if seqs else ''}, quantize the KV cache (-ctk q8_0) or raise --vram")


def _checked_counts(g: ModelGeometry, profile_counts: np.ndarray | None) -> np.ndarray | None:
    """The profile's counts as float64 [n_layer, n_expert], checked; None for none or all zero."""
    if profile_counts is None:
        return None
    counts = np.asarray(profile_counts, dtype=np.float64)
    if counts.shape != (g.n_layer, g.n_expert):
        raise PlanError(f"profile: shape {counts.shape} does not match the model ({g.n_layer}, {g.n_expert})")
    if (counts < 0).any() or not np.isfinite(counts).all():
        raise PlanError("profile: routing counts must be finite and >= 0")
    return counts if counts.sum() > 0 else None


def _layer_states(g: ModelGeometry, moe: list, counts: np.ndarray | None, max_slots_per_layer: int | None,
                  miss_fn: MissFn | None, allow_pins: bool) -> dict[int, "_Layer"]:
    """Each MoE layer's greedy state; miss_fn's answers memoised per (layer, pins, slots)."""
    cache: dict[tuple[int, int, int], float] = {}

    def mf(layer: int) -> Callable[[int, int], float]:
        def f(pins: int, lru: int) -> float:
            if (layer, pins, lru) not in cache:
                cache[(layer, pins, lru)] = float(miss_fn(layer, pins, lru))  # type: ignore[misc]
            return cache[(layer, pins, lru)]
        return f

    states: dict[int, _Layer] = {}
    for l in moe:
        row = counts[l.index] if counts is not None else np.zeros(l.n_expert)
        freq = row / row.sum() if row.sum() > 0 else np.full(l.n_expert, 1.0 / l.n_expert)
        states[l.index] = _Layer(l.index, l.n_expert, g.n_expert_used, l.expert_bytes_per_expert, freq,
                                 1.0 / len(moe), max_slots_per_layer, mf(l.index) if miss_fn else None,
                                 allow_pins)
    return states


def _host_layers(moe: list, states: dict[int, "_Layer"], fixed_total: int, budget_bytes: int,
                 forced: frozenset[int] = frozenset(), prefer: frozenset[int] = frozenset()) -> tuple[set[int], int]:
    """Below the cache floor: the lowest-numbered MoE layers keep their experts (and expert
    biases) in host RAM, as stock --n-cpu-moe does, until the rest fits. (host layers, bytes needed)
    `moe` and `states`: the layers of one device. `forced`: host whatever the budget; `prefer`:
    these go first (the time search's resident layers: a whole layer frees the most)."""
    host = {l.index for l in moe if l.index in forced}
    need = fixed_total + sum(s.cost() for i, s in states.items() if i not in host) \
        - sum(l.expert_bias_bytes for l in moe if l.index in host)
    for l in sorted(moe, key=lambda l: (l.index not in prefer, l.index)):
        if need <= budget_bytes:
            break
        if l.index in host:
            continue
        need -= states[l.index].cost() + l.expert_bias_bytes
        host.add(l.index)
    assert need <= budget_bytes, "stock --cpu-moe fits, so the all-host plan fits"
    return host, need


def _spend(states: dict[int, "_Layer"], host: set[int], left: int) -> None:
    """Walk the budget-independent greedy sequence until the next action does not fit."""
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


def _spend_staging_left(g: ModelGeometry, stage: int, moe: list, states: dict[int, "_Layer"], host: set[int],
                        fixed_total: int, budget: int) -> None:
    """Over several devices a device's staging slices are those of its cached layers' shapes (the
    native arenas), which the greedy reserved for every shape of its layers: it goes on with what
    that leaves (the same prefix, longer; a cached layer can only become resident, so the shapes
    and the staging only shrink)."""
    for _ in range(len(moe) + 1):
        cached = [l for l in moe if l.index not in host and not states[l.index].resident]
        used = (fixed_total + staging_bytes(g, stage, cached) - sum(l.expert_bias_bytes for l in moe if l.index in host)
                + sum(states[l.index].cost() for l in moe if l.index not in host))
        before = [(s.pins, s.lru, s.resident) for s in states.values()]
        _spend({i: s for i, s in states.items() if i not in host}, host, budget - used)
        if [(s.pins, s.lru, s.resident) for s in states.values()] == before:
            return


def _layer_plans(g: ModelGeometry, states: dict[int, "_Layer"], host: set[int], layer_dev: tuple[int, ...],
                 n_dev: int = 1) -> tuple[list[LayerPlan], list[float], list[dict[str, int]]]:
    """Every layer's LayerPlan, the predicted cold share per MoE layer, and the bytes spent per
    device (banks, resident experts, expert biases left on the host)."""
    layers: list[LayerPlan] = []
    spent = [{"banks": 0, "resident": 0, "host_bias": 0} for _ in range(n_dev)]
    cold: list[float] = []
    for l in g.layers:
        d = layer_dev[l.index]
        if l.is_nextn:
            layers.append(LayerPlan(l.index, "skipped", (), 0, 0, 0, d))
        elif not l.is_moe:
            layers.append(LayerPlan(l.index, "dense", (), 0, l.nonexpert_bytes, 0, d))
        elif l.index in host:
            spent[d]["host_bias"] += l.expert_bias_bytes
            cold.append(1.0)
            layers.append(LayerPlan(l.index, "host", (), 0, l.nonexpert_bytes - l.expert_bias_bytes,
                                    l.expert_bytes + l.expert_bias_bytes, d))
        elif states[l.index].resident:
            s = states[l.index]
            spent[d]["resident"] += s.cost()
            cold.append(0.0)
            layers.append(LayerPlan(l.index, "resident", (), 0, l.nonexpert_bytes + s.cost(), 0, d))
        else:
            s = states[l.index]
            spent[d]["banks"] += s.cost()
            cold.append(float(max(s.unpinned[s.pins], 0.0)))
            layers.append(LayerPlan(l.index, "cached", tuple(s.order[: s.pins]), s.pins + s.lru,
                                    l.nonexpert_bytes + s.cost(), l.expert_bytes, d))
    return layers, cold, spent


# ---------------------------------------------------------------- the one entry point


@dataclass(frozen=True)
class PlanRequest:
    """Everything a placement depends on; every placing command builds one (runs/session.py)."""

    budget_bytes: int
    n_ctx: int
    type_k: str = "f16"  # -ctk
    type_v: str = "f16"  # -ctv
    n_ubatch: int = DEFAULT_UBATCH  # -ub
    profile_counts: np.ndarray | None = field(default=None, compare=False)  # [n_layer, n_expert]; None: uniform
    trace: Any = field(default=None, compare=False)  # RoutingTrace to replay: --trace, else the profile's ring
    policy: str = DEFAULT_POLICY  # simulator.ONLINE_POLICIES
    miss_path: MissPath = MissPath.AUTO  # recorded in the plan; cpu and auto replay the cpu path, upload and layer the upload path
    max_admit: int | None = None  # cpu path admissions per decode step (None: k)
    compute_bytes: int | tuple[int, ...] | None = None  # measured compute buffers per device (the fit loop's); None: estimate
    n_parallel: int = 1  # -np: sequences the KV cache and recurrent state hold
    kv_unified: bool = False  # --kv-unified: one KV stream for all of them
    split: Split | None = None  # several devices (split.py): their budgets (which budget_bytes sums) and layer split
    costs: DeviceCosts | None = field(default=None, compare=False)  # the device's time figures: plans priced in time
    objective: str = "decode"  # with costs: the time a plan minimises (cost_model.OBJECTIVES)
    assumed_cold_hit: float | None = None  # without a trace: a cached layer's miss share at k slots (--cold-hit)
    # three tiers (--vram with --ram): the RAM the host weights may take. A cached layer keeps its experts
    # whole in RAM (its device misses' source); a host layer needs only its RAM tier's k slots, the rest
    # read from the file. Cached layers beyond what fits become host layers (ram_fit).
    ram_bytes: int | None = None
    ram_source: str = "--ram"  # where ram_bytes came from, for ram_fit's error
    ram_strict: bool = True  # False (a bound read from the machine, not asked for): where no placement fits
                             # it, ram_fit keeps the unbounded one (the mapping pages the rest in)
    forced_host: frozenset[int] = frozenset()  # MoE layers placed on the host whatever the budget (ram_fit's)

    @property
    def replay_path(self) -> str:
        return replay_path(self.miss_path)

    def devices(self) -> Split:
        """The devices planned for: the split, or one device of budget_bytes."""
        return self.split if self.split is not None else single(self.budget_bytes)


@dataclass(frozen=True)
class Candidate:
    """A plan made one way, and its miss share replayed on the planning trace."""

    name: str  # "replay" (pins and slots priced by replay), "pins+k", "all-slots"
    plan: Plan
    miss: float


@dataclass(frozen=True)
class Alternative:
    """A placement for the same budget, priced by the same cost model (what `spark plan` compares)."""

    name: str  # spark | cpu-moe | n-cpu-moe | resident
    label: str  # "Spark", "stock --n-cpu-moe 12", ...
    prediction: Prediction | None  # None: does not fit the budget
    device_bytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "label": self.label, "fits": self.prediction is not None,
                "device_bytes": self.device_bytes, **(self.prediction.to_dict() if self.prediction else {})}


@dataclass(frozen=True)
class PlanResult:
    """The plan, and how it was chosen (what `spark plan` prints)."""

    plan: Plan
    candidates: tuple[Candidate, ...] = ()  # with a trace: every plan tried, replayed on it
    replay_steps: int = 0  # decode steps replayed (0: planned from the counts alone)
    chosen: str = "pins+k"  # the candidate kept
    alternatives: tuple["Alternative", ...] = ()  # priced in time: the plan beside stock's placements

    def candidate(self, name: str) -> Plan:
        """The candidate plan `name`; without a trace the plan itself is the pins+k plan."""
        if not self.candidates and name == "pins+k":
            return self.plan
        for c in self.candidates:
            if c.name == name:
                return c.plan
        raise KeyError(name)


Measure = Callable[[Plan], MeasuredBill]  # a dry run of a plan (runs/session.measurer)
MAX_FIT_ROUNDS = 5


def plan_for(geometry: ModelGeometry, request: PlanRequest, measure: Measure | None = None) -> PlanResult:
    """The placement for `request`: replay pricing when its trace has decode steps, else the
    profile's counts alone (pins and k policy slots per layer). PlanError when the budget
    cannot hold even stock --cpu-moe, or for a policy or miss path a cache cannot run.

    With `measure` (a dry run), the fit loop: the estimate (vram.py) places the first guess;
    each round measures it and moves the budget the greedy spends by what the measurement found
    over or under (over: it gives up the last slots and pins it bought, layer by layer; under:
    it buys more), until the measured bill plus the unmeasured overhead fits the budget and the
    rest is less than one expert, or MAX_FIT_ROUNDS. The plan kept is the fullest that fit,
    with its measured bill; PlanError when none fits."""
    auto = request.policy == AUTO_POLICY
    r = replace(request, policy=DEFAULT_POLICY) if auto else request
    res = _plan_once(geometry, r) if measure is None else _fit(geometry, r, measure)
    res = _choose_policy(res, r) if auto else res
    if res.alternatives:  # NOTE: priced again with the policy chosen
        alts = alternatives(geometry, r, res.plan)
        res = replace(res, plan=with_prediction(res.plan, alts, r), alternatives=alts)
    return res


AUTO_POLICY = "auto"  # --policy auto: the native policy that replays best with the plan's slots


def _choose_policy(res: PlanResult, request: PlanRequest) -> PlanResult:
    """--policy auto: replay the request's trace (the profile's ring, or --trace) through each
    native policy with the plan's pins, slots and miss path; keep the one that finds the most
    routed experts on the device (ties: the default policy, then ONLINE_POLICIES order). No
    decode steps to replay, or no cached layer: simulator.DEFAULT_POLICY, with no figures."""
    plan, trace = res.plan, request.trace
    if trace is None or not trace.n_decode or not any(l.mode == "cached" for l in plan.layers):
        return res
    hit = {p: 1.0 - replayed_miss(replace(plan, policy=p), trace, request.replay_path, request.max_admit)
           for p in ONLINE_POLICIES}
    best = max(ONLINE_POLICIES, key=lambda p: (hit[p], p == DEFAULT_POLICY, -ONLINE_POLICIES.index(p)))
    return replace(res, plan=replace(plan, policy=best, policy_replay=hit, predicted_miss=1.0 - hit[best]))


def _fit(geometry: ModelGeometry, request: PlanRequest, measure: Measure) -> PlanResult:
    sp = request.devices()
    n, budgets = sp.n_devices, sp.budgets
    target = [b - unmeasured_overhead() for b in budgets]  # what the measured bill may take, per device
    step = min((l.expert_bytes_per_expert for l in geometry.layers if l.is_moe and l.expert_bytes_per_expert),
               default=1)
    spend, compute, margin, best, seen = budgets, None, [0] * n, None, {}
    names = list(sp.names)
    for rnd in range(1, MAX_FIT_ROUNDS + 1):
        try:
            res = _plan_once(geometry, replace(request, budget_bytes=sum(spend), compute_bytes=compute,
                                               split=replace(sp, budgets=tuple(spend))))
        except PlanError:
            if best is None and rnd == 1:
                raise
            break  # the correction asked for less than the model without experts
        key = (res.plan.layers, compute)
        bill = seen[key] if key in seen else measure(res.plan)
        seen[key] = bill
        measured = [device_bill(bill, names, d) for d in range(n)]
        used = [m["total"] for m in measured]
        if compute is not None:  # planned with measured compute buffers: the plan's sums are the bill
            if all(u <= t for u, t in zip(used, target)) and (best is None or sum(used) > sum(best[3])):
                best = (res, bill, rnd, used)
            for d in range(n):
                if used[d] > target[d]:
                    margin[d] += used[d] - target[d]  # the compute buffers grew with the placement: give up more
        if best is not None and best[2] == rnd and all(t - u < step for u, t in zip(used, target)):
            break
        # NOTE: the next round plans with the measured compute buffers, and takes what the rest of the
        # bill measured over (or under) the plan's own sums off (or onto) the budget each device spends
        nxt_spend = []
        for d, dp in enumerate(res.plan.per_device):
            planned = dp.breakdown
            rest = (used[d] - measured[d]["compute"]) - (planned["total"] - planned["overhead"] - planned["compute"])
            nxt_spend.append(budgets[d] - rest - margin[d])
        nxt = (tuple(nxt_spend), tuple(m["compute"] for m in measured) if n > 1 else measured[0]["compute"])
        if nxt == (tuple(spend), compute):
            break
        spend, compute = nxt
    if best is None:
        d = next((i for i in range(n) if used[i] > target[i]), 0)
        seen_names = bill.device_names()
        name = names[d] or (seen_names[d] if d < len(seen_names) else "the device")
        raise PlanError(f"--vram {units.gib(budgets[d])}: measured by a dry run, the placement needs "
                        f"{units.gib(used[d])} on {name} plus {units.fmt_bytes(unmeasured_overhead())} overhead: "
                        f"over by {units.shortfall(used[d] - target[d])}",
                        hint="lower --ctx-size or -ub, quantize the KV cache (-ctk q8_0) or raise --vram")
    res, bill, rnd, _ = best
    # NOTE: the plan was made with the previous round's compute buffers; its own measurement replaces
    # them (the buffers move a little with the placement: the cached layers' stop nodes)
    computes = [device_bill(bill, names, d)["compute"] for d in range(n)]
    devs = tuple(replace(x, budget_bytes=budgets[d], breakdown=_with_compute(x.breakdown, computes[d]))
                 for d, x in enumerate(res.plan.per_device))
    plan = replace(res.plan, budget_bytes=request.budget_bytes, devices=devs,
                   breakdown=_with_compute(res.plan.breakdown, sum(computes)))
    return replace(res, plan=with_measured(plan, bill, rnd))


def _with_compute(breakdown: dict[str, int], compute: int) -> dict[str, int]:
    """A bill with its compute buffer replaced and its total summed again."""
    out = {**breakdown, "compute": compute}
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def _plan_once(geometry: ModelGeometry, request: PlanRequest) -> PlanResult:
    """One placement for the request; with ram_bytes, the RAM fit (ram_fit) on top."""
    res = _plan_device(geometry, request)
    return res if request.ram_bytes is None else ram_fit(geometry, request, res)


MAX_RAM_ROUNDS = 8


def ram_fit(geometry: ModelGeometry, request: PlanRequest, res: PlanResult) -> PlanResult:
    """Three tiers: while the plan's host weights (the cached layers' experts whole, k RAM slots a host
    layer, the input embeddings) do not fit request.ram_bytes, the lowest-numbered cached layers go to
    the host (as stock's --n-cpu-moe orders them), enough to cover what is over, and the device budget
    is spent again on the rest. PlanError (one line) when no cached layer is left to move."""
    forced, first = set(request.forced_host), res
    for _ in range(MAX_RAM_ROUNDS):
        cached = [l.index for l in res.plan.layers if l.mode == "cached"]
        host = [l.index for l in res.plan.layers if l.mode == "host"]
        over = ram_tier.three_tier_need(geometry, cached, host) - request.ram_bytes
        if over <= 0:
            return res
        if not cached:
            break
        for il in cached:
            forced.add(il)
            over -= ram_tier.expert_bytes(geometry, [il]) - ram_tier.slot_floor(geometry, il)
            if over <= 0:
                break
        res = _plan_device(geometry, replace(request, forced_host=frozenset(forced)))
    need = ram_tier.three_tier_need(geometry, [l.index for l in res.plan.layers if l.mode == "cached"],
                                    [l.index for l in res.plan.layers if l.mode == "host"])
    if need <= request.ram_bytes:  # NOTE: the last round's placement, not checked in the loop
        return res
    if not request.ram_strict:
        return first
    raise PlanError(f"{request.ram_source} {units.fmt_bytes(request.ram_bytes)}: the placement's host weights need "
                    f"{units.fmt_bytes(need)} at least (the cached layers' experts, {geometry.n_expert_used} RAM slots "
                    "per host layer, the staging slices)", hint="give the run more RAM (--ram) or more --vram")


def _plan_device(geometry: ModelGeometry, request: PlanRequest) -> PlanResult:
    r = request
    policy = canonical_policy(r.policy)  # NOTE: plan_for resolved "auto"
    if policy not in ONLINE_POLICIES:
        raise PlanError(f"policy {r.policy!r}: a cache cannot run it", hint=f"use one of {', '.join(ONLINE_POLICIES)}")
    if r.objective not in OBJECTIVES:
        raise PlanError(f"objective {r.objective!r}: unknown", hint="use " + ", ".join(OBJECTIVES))
    kw = dict(type_k=r.type_k, type_v=r.type_v, n_ubatch=r.n_ubatch, policy=policy, miss_path=r.miss_path,
              compute_bytes=r.compute_bytes, n_parallel=r.n_parallel, kv_unified=r.kv_unified, split=r.split)
    trace = r.trace if r.trace is not None and r.trace.n_decode else None
    if trace is not None and (trace.n_layer, trace.n_expert) != (geometry.n_layer, geometry.n_expert):
        raise PlanError(f"trace: {trace.n_layer} layers x {trace.n_expert} experts; the model has "
                        f"{geometry.n_layer} x {geometry.n_expert}")
    if r.costs is not None and r.devices().n_devices == 1:
        return _plan_in_time(geometry, r, trace, kw)
    if r.forced_host:
        kw["shape"] = Shape(frozenset(), r.forced_host)
    if trace is None:
        return PlanResult(_make_plan(geometry, r.budget_bytes, r.n_ctx, r.profile_counts, **kw))
    plan, cands = _plan_by_replay(geometry, r.budget_bytes, r.n_ctx, trace, r.profile_counts,
                                  replay_path=r.replay_path, max_admit=r.max_admit, **kw)
    chosen = next(c.name for c in cands if c.plan.layers == plan.layers)
    return PlanResult(plan, tuple(cands), trace.n_decode, chosen)


def replayed_miss(plan: Plan, trace: Any, miss_path: str = "upload", max_admit: int | None = None) -> float:
    """Share of routed decode experts of `trace` not on the device when needed, with the plan's
    pins, slots and policy (resident layers 0, host layers 1; mean over the MoE layers)."""
    return _LayerReplay(trace, None, canonical_policy(plan.policy), miss_path, max_admit).plan_miss(plan)


# ---------------------------------------------------------------- planning by replay (internal)


def _policy_for(policy: str, pins: int) -> str:
    return "lru-pinned" if policy == "lru" and pins else policy


class _LayerReplay:
    """Replays one trace's decode steps, layer by layer, through `policy` with the P
    hottest experts (by `counts`) pinned and L policy slots: miss(layer, P, L) in [0, 1]."""

    def __init__(self, trace: Any, counts: np.ndarray | None, policy: str, miss_path: str = "upload",
                 max_admit: int | None = None):
        self.trace, self.policy, self.miss_path, self.max_admit = trace, policy, miss_path, max_admit
        self._layers: dict[int, LayerTrace] = {}
        self._memo: dict[tuple[int, tuple[int, ...], int], float] = {}
        self._admits: dict[tuple[int, tuple[int, ...], int], float] = {}
        n = trace.n_expert
        self.order = {l: hottest_first(counts[l] if counts is not None else np.zeros(n)) for l in trace.moe_layers()}

    def miss(self, layer: int, pins: int, lru: int, pinned: tuple[int, ...] | None = None) -> float:
        if layer not in self.order:
            return 0.0  # the trace never routes this layer: nothing to miss
        if layer not in self._layers:
            self._layers[layer] = LayerTrace(self.trace, layer, ("decode",))
        pin = pinned if pinned is not None else tuple(self.order[layer][:pins])
        key = (layer, pin, lru)
        if key in self._memo:
            return self._memo[key]
        st = self._layers[layer].replay(len(pin) + lru, pin, _policy_for(self.policy, len(pin)), self.miss_path,
                                        self.max_admit)
        n = st.hits_decode + st.misses_decode + st.stock_accesses_decode
        self._memo[key] = 1.0 - st.hits_decode / n if n else 0.0
        self._admits[key] = st.admissions_decode / n if n else 0.0
        return self._memo[key]

    def traffic(self, layer: int, pins: int, lru: int, pinned: tuple[int, ...] | None = None) -> tuple[float, float]:
        """(miss share, admissions per routed expert) of the layer's decode steps with this placement."""
        share = self.miss(layer, pins, lru, pinned)
        pin = pinned if pinned is not None else tuple(self.order.get(layer, [])[:pins])
        return share, self._admits.get((layer, pin, lru), 0.0)

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


def _plan_by_replay(geometry: ModelGeometry, budget_bytes: int, n_ctx: int, trace: Any,
                    profile_counts: np.ndarray | None = None, policy: str = DEFAULT_POLICY, type_k: str = "f16",
                    type_v: str = "f16", n_ubatch: int = DEFAULT_UBATCH, replay_path: str = "upload",
                    max_admit: int | None = None, miss_path: str = "auto",
                    compute_bytes: int | tuple[int, ...] | None = None, n_parallel: int = 1,
                    kv_unified: bool = False, split: Split | None = None,
                    shape: "Shape | None" = None) -> tuple[Plan, list[Candidate]]:
    """Price pins against policy slots per layer by replaying `trace` (decode steps)
    through the policy that will run, and keep the best of three plans for the budget:

    - "replay": the greedy of _make_plan with miss_fn = the replayed miss share with the
      P hottest pinned (by `profile_counts`, else the trace's decode counts) and L slots;
    - "pins+k": _make_plan from the counts alone (pins, k policy slots per layer);
    - "all-slots": _make_plan with slots only (no pins), priced by replay.

    The chosen plan has the smallest replayed miss share on `trace` (ties: that order),
    so on its own trace it is never worse than pins+k or all-slots. Returns (plan with
    predicted_miss set, every candidate).
    """
    policy = canonical_policy(policy)
    counts = profile_counts
    if counts is None or np.asarray(counts).sum() <= 0:
        counts = trace.counts("decode") if trace.n_decode else None
    rp = _LayerReplay(trace, None if counts is None else np.asarray(counts, dtype=np.float64), policy,
                      replay_path, max_admit)
    common = dict(profile_counts=counts, type_k=type_k, type_v=type_v, n_ubatch=n_ubatch, policy=policy,
                  miss_path=miss_path, compute_bytes=compute_bytes, n_parallel=n_parallel, kv_unified=kv_unified,
                  split=split, shape=shape)
    plans = [
        ("replay", _make_plan(geometry, budget_bytes, n_ctx, miss_fn=rp.miss, **common)),
        ("pins+k", _make_plan(geometry, budget_bytes, n_ctx, **common)),
        ("all-slots", _make_plan(geometry, budget_bytes, n_ctx, miss_fn=rp.miss, allow_pins=False, **common)),
    ]
    cands = [Candidate(name, p, rp.plan_miss(p)) for name, p in plans]
    best = min(range(len(cands)), key=lambda i: (cands[i].miss, i))
    return replace(cands[best].plan, predicted_miss=cands[best].miss), cands


# ---------------------------------------------------------------- planning in time (cost_model.py)


@dataclass(frozen=True)
class Shape:
    """The time search's layer shape: MoE layers forced resident, and forced host (stock's)."""

    resident: frozenset[int]
    host: frozenset[int] = frozenset()


def _planning_counts(request: PlanRequest, trace: Any) -> np.ndarray | None:
    """The counts that pick pins: the profile's, else the trace's decode counts."""
    counts = request.profile_counts
    if counts is None or np.asarray(counts).sum() <= 0:
        counts = trace.counts("decode") if trace is not None and trace.n_decode else None
    return None if counts is None else np.asarray(counts, dtype=np.float64)


def _off_mass(counts: np.ndarray | None, layer: int, pinned: tuple[int, ...], n_expert: int) -> float:
    """Share of a layer's routed entries outside its pinned experts (uniform without counts)."""
    row = counts[layer] if counts is not None else None
    if row is None or row.sum() <= 0:
        return 1.0 - len(pinned) / max(n_expert, 1)
    return float(1.0 - row[list(pinned)].sum() / row.sum()) if pinned else 1.0


def layer_loads(g: ModelGeometry, plan: Plan | None, host_layers: Any = (),
                replay: "_LayerReplay | _AssumedMiss | None" = None,
                counts: np.ndarray | None = None) -> list[LayerLoad]:
    """The MoE layers of a placement as the cost model reads them: a plan's modes (misses and
    admissions of its cached layers replayed on `replay`'s trace, else the counts' unpinned mass
    with every miss admitted), or stock's: `host_layers` on the CPU, the rest resident."""
    k, out = g.n_expert_used, []
    if plan is None:
        host = set(host_layers)
        return [LayerLoad("host" if l.index in host else "resident")
                for l in g.layers if l.is_moe and not l.is_nextn]
    for l in plan.layers:
        if l.mode in ("resident", "host"):
            out.append(LayerLoad(l.mode))
        elif l.mode == "cached":
            off = _off_mass(counts, l.index, tuple(l.pinned), g.n_expert)
            if replay is not None:
                miss, admits = replay.traffic(l.index, len(l.pinned), l.lru_slots, tuple(l.pinned))
            else:
                miss, admits = off, off
            out.append(LayerLoad("cached", miss * k, admits * k, off))
    return out


def price(g: ModelGeometry, request: PlanRequest, plan: Plan | None = None, host_layers: Any = ()) -> Prediction | None:
    """The cost model's prediction for a plan, or for stock's placement with `host_layers` on the
    CPU, with the request's device costs, trace and counts (None: no costs)."""
    if request.costs is None:
        return None
    trace = request.trace if request.trace is not None and request.trace.n_decode else None
    counts = _planning_counts(request, trace)
    policy = canonical_policy(plan.policy if plan is not None else DEFAULT_POLICY)
    rp = _replay_for(g, request, trace, counts, policy)
    miss_path = plan.miss_path if plan is not None else request.miss_path
    return predict(layer_loads(g, plan, host_layers, rp, counts), request.costs, miss_path)


class _AssumedMiss:
    """Without a trace, --cold-hit: a cached layer misses `rate` of its routed experts with k
    policy slots and none with a slot for every expert, linearly between; every miss is admitted."""

    def __init__(self, rate: float, n_expert: int, k: int):
        self.rate, self.n, self.k = rate, n_expert, k

    def miss(self, layer: int, pins: int, lru: int, pinned: tuple[int, ...] | None = None) -> float:
        return self.rate * max(self.n - pins - lru, 0) / max(self.n - self.k, 1)

    def traffic(self, layer: int, pins: int, lru: int, pinned: tuple[int, ...] | None = None) -> tuple[float, float]:
        m = self.miss(layer, pins, lru)
        return m, m

    def plan_miss(self, plan: Plan) -> float:
        out = [0.0 if l.mode == "resident" else 1.0 if l.mode == "host" else self.miss(l.index, len(l.pinned), l.lru_slots)
               for l in plan.layers if l.mode in ("resident", "host", "cached")]
        return sum(out) / len(out) if out else 0.0


def _replay_for(g: ModelGeometry, r: PlanRequest, trace: Any, counts: np.ndarray | None,
                policy: str) -> "_LayerReplay | _AssumedMiss | None":
    """What prices a cached layer's misses: the trace replayed, else the assumed cold-hit rate."""
    if trace is not None:
        return _LayerReplay(trace, counts, policy, r.replay_path, r.max_admit)
    if r.assumed_cold_hit is not None:
        return _AssumedMiss(r.assumed_cold_hit, g.n_expert, g.n_expert_used)
    return None


def _caching_order(g: ModelGeometry, moe: list, rp: "_LayerReplay | _AssumedMiss | None",
                   counts: np.ndarray | None) -> list[int]:
    """MoE layers, the best to cache first: the fewest misses with k policy slots (replayed), else
    the most routing mass on its k hottest experts; ties: the highest layer (stock hosts the lowest)."""
    k = g.n_expert_used

    def miss(il: int) -> float:
        if rp is not None:
            return rp.miss(il, 0, k)
        row = counts[il] if counts is not None else None
        if row is None or row.sum() <= 0:
            return 1.0
        return float(1.0 - np.sort(row)[::-1][:k].sum() / row.sum())

    return sorted((l.index for l in moe), key=lambda il: (miss(il), -il))


def _plan_in_time(g: ModelGeometry, r: PlanRequest, trace: Any, kw: dict) -> PlanResult:
    """The placement with the least predicted time per token (r.objective) on r.costs' device:
    every count c of cached layers (the c best to cache; the rest resident, and below the floor
    the lowest-numbered of those host, as stock does; and with one layer more on the host, for
    more slots), c = 0 being stock's own placements (--n-cpu-moe N for every N that fits, up to
    --cpu-moe). Ties: fewer stops, then fewer
    cached layers. The shape chosen, its pins and slots are then priced by replay as _plan_by_replay
    does (replay, pins+k, all-slots) and the fastest kept."""
    counts = _planning_counts(r, trace)
    rp = _replay_for(g, r, trace, counts, kw["policy"])
    moe = [l for l in g.layers if l.is_moe and not l.is_nextn]
    order = _caching_order(g, moe, rp, counts)
    base = dict(profile_counts=counts, **kw)

    def make(shape: Shape, candidate: str = "replay") -> Plan:
        shape = Shape(shape.resident - r.forced_host, shape.host | r.forced_host)  # NOTE: ram_fit's host layers
        stage = None if set(order) - shape.resident - shape.host else 0
        miss_fn = rp.miss if rp is not None and candidate != "pins+k" else None
        return _make_plan(g, r.budget_bytes, r.n_ctx, shape=shape, stage=stage, miss_fn=miss_fn,
                          allow_pins=candidate != "all-slots", **base)

    def cost(plan: Plan) -> tuple[float, int, int]:
        p = predict(layer_loads(g, plan, (), rp, counts), r.costs, plan.miss_path)  # type: ignore[arg-type]
        return p.time_us(r.objective), p.stops, sum(1 for l in plan.layers if l.mode == "cached")

    seen: dict[tuple, tuple[tuple[float, int, int], Plan, Shape]] = {}
    for c in range(len(order) + 1):
        shape = Shape(frozenset(order[c:]))
        plan = make(shape)
        host = frozenset(l.index for l in plan.layers if l.mode == "host")
        tries = [(shape, plan)]
        more = [l.index for l in moe if l.index not in host and l.index in shape.resident]
        for n in range(1, len(more) + 1 if c == 0 else min(len(more), 1) + 1):  # stock: every --n-cpu-moe N
            wider = Shape(shape.resident, host | frozenset(more[:n]))
            tries.append((wider, make(wider)))
        for sh, p in tries:
            if p.layers not in seen:
                seen[p.layers] = (cost(p), p, sh)
    _, plan, shape = min(seen.values(), key=lambda v: v[0])
    cands, priced = [], []
    for name in ("replay", "pins+k", "all-slots") if rp is not None else ("pins+k",):
        p = plan if name == "replay" or rp is None else make(shape, name)
        cands.append(Candidate(name, p, rp.plan_miss(p) if rp is not None else 1.0))
        priced.append(cost(p))
    best = min(range(len(cands)), key=lambda i: (priced[i], i))
    plan = cands[best].plan
    if trace is not None:
        plan = replace(plan, predicted_miss=cands[best].miss)
    alts = alternatives(g, r, plan)
    plan = with_prediction(plan, alts, r)
    if trace is None:
        return PlanResult(plan, (), 0, "pins+k", alts)
    return PlanResult(plan, tuple(cands), trace.n_decode, cands[best].name, alts)


def with_prediction(plan: Plan, alts: tuple[Alternative, ...], r: PlanRequest) -> Plan:
    """The plan with the cost model's figures recorded: its own, and its alternatives' (none
    without costs)."""
    p = alts[0].prediction if alts else None
    if p is None or r.costs is None:
        return plan
    return replace(plan, predicted={**p.to_dict(), "objective": r.objective, "costs": r.costs.describe(),
                                    "measured": not r.costs.predicted,
                                    "alternatives": [a.to_dict() for a in alts]})


def alternatives(g: ModelGeometry, r: PlanRequest, plan: Plan) -> tuple[Alternative, ...]:
    """The plan and stock's placements for the same budget, priced alike: Spark, --n-cpu-moe N
    (the smallest N that fits), --cpu-moe, and all resident where it fits."""
    stock, bd = plan.stock, plan.breakdown
    all_moe = [l.index for l in g.layers if l.is_moe and not l.is_nextn]
    host_bias = sum(g.layers[l.index].expert_bias_bytes for l in plan.layers if l.mode == "host")
    fixed = sum(bd[k] for k in ("weights_global", "weights_layers_nonexpert", "kv_cache", "compute", "overhead")) \
        + host_bias
    resident_bytes = stock_baseline(g, 1 << 62, fixed).device_bytes
    out = [Alternative("spark", "Spark", price(g, r, plan), plan.breakdown["total"]),
           Alternative("n-cpu-moe", f"stock --n-cpu-moe {stock.n_cpu_moe}",
                       price(g, r, None, [i for i in all_moe if i < stock.n_cpu_moe]) if stock.fits else None,
                       stock.device_bytes),
           Alternative("cpu-moe", "stock --cpu-moe", price(g, r, None, all_moe) if stock.cpu_moe_fits else None,
                       stock.cpu_moe_device_bytes),
           Alternative("resident", "all resident",
                       price(g, r, None, ()) if resident_bytes <= plan.budget_bytes else None, resident_bytes)]
    return tuple(out)


@dataclass(frozen=True)
class HeldOutCheck:
    """Plan on the first part of a trace's decode steps, then replay the rest."""

    train_steps: int
    test_steps: int
    predicted: float  # the train plan's miss share replayed on the train part (what it predicts)
    measured: float  # the train plan replayed on the held-out part
    oracle: float  # a plan made from the held-out part itself, replayed on it
    belady: float  # the train plan's pins and slots on the held-out part, Belady evicting


def held_out_check(geometry: ModelGeometry, request: PlanRequest, train_frac: float = 0.7) -> HeldOutCheck | None:
    """Plan as `request` asks on the first `train_frac` of its trace's decode steps (their
    counts pick the pins), predict the rest; None when either part has no decode step."""
    if request.trace is None:
        return None
    train, test = request.trace.decode_steps().split(train_frac)
    if not train.n_rows or not test.n_rows:
        return None
    p_train = plan_for(geometry, replace(request, trace=train, profile_counts=train.counts("decode"))).plan
    p_test = plan_for(geometry, replace(request, trace=test, profile_counts=test.counts("decode"))).plan
    path, policy = request.replay_path, canonical_policy(request.policy)
    measured = _LayerReplay(test, None, policy, path, request.max_admit).plan_miss(p_train)
    belady = _LayerReplay(test, None, "belady", path, request.max_admit).plan_miss(p_train)
    return HeldOutCheck(train.n_rows, test.n_rows, float(p_train.predicted_miss or 0.0), measured,
                        float(p_test.predicted_miss or 0.0), belady)
