"""The plan file: a Plan as JSON (`spark plan -o`, `--plan`), read back with every field checked.

A plan file is hand-editable: `from_json` names the field and the problem of anything out of shape
(PlanError `source: field: problem`), and `check_plan` refuses a plan that does not fit the model it
is loaded for. Fields added after version 2 are optional, so older plans still read.

The format:
  {"version": 2,
   "policy": "lru" | "lfu-aged" | "slru" | "tinylfu"   # optional (default simulator.DEFAULT_POLICY)
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
   "stage_slices": int,   # optional (default 0): staging slices per expert shape
   "n_parallel": int,     # optional (default 1): -np, the sequences the KV cache and state are priced for
   "kv_unified": bool,    # optional (default false): --kv-unified, one KV stream for all of them
   "layers": [{"index", "mode", "pinned", "slots", "device_bytes", "host_bytes"}, ...]}
mode: resident | cached | host (experts in host RAM, no bank) | dense | skipped (an MTP
block llama.cpp does not load).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ..errors import PlanError
from ..files.atomic import atomic_write_text
from ..files.regular import read_regular_text
from .bill import MeasuredBill
from .gguf_info import ModelGeometry
from .placement import TensorOverride
from .planner import (BREAKDOWN_KEYS, MAX_PARALLEL, MODES, DevicePlan, LayerPlan, Plan, StockBaseline,
                      measured_total)
from .simulator import DEFAULT_POLICY, ONLINE_POLICIES, MissPath
from .split import SPLIT_MODES

PLAN_VERSION = 2
INT32_MAX = (1 << 31) - 1  # what the C API's int fields hold
INT64_MAX = (1 << 63) - 1
_MISSING = object()


class _Fields:
    """Typed reads of a hand-editable JSON object; PlanError `source: field: problem`."""

    def __init__(self, source: str):
        self.source = source

    def _get(self, d: Any, key: Any, where: str, default: Any) -> Any:
        name = f"{where}.{key}" if where else str(key)
        if not isinstance(d, (dict, list)):
            raise PlanError(f"{self.source}: {where or 'plan'}: expected an object, got {type(d).__name__}")
        try:
            v = d[key]
        except (KeyError, IndexError):
            if default is not _MISSING:
                return name, default
            raise PlanError(f"{self.source}: {name}: missing", hint="make the plan again with `spark plan`") from None
        return name, v

    def _bad(self, name: str, v: Any, want: str) -> PlanError:
        return PlanError(f"{self.source}: {name}: expected {want}, got {json.dumps(v)[:40]}")

    def int(self, d: Any, key: Any, where: str, lo: int, hi: int) -> int:
        name, v = self._get(d, key, where, _MISSING)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(name, v, "an integer")
        if not lo <= v <= hi:
            raise PlanError(f"{self.source}: {name}: {v} is outside [{lo}, {hi}]")
        return v

    def int_list(self, d: Any, key: Any, where: str, lo: int, hi: int) -> list[int]:
        name, v = self._get(d, key, where, _MISSING)
        if not isinstance(v, list):
            raise self._bad(name, v, "a list of integers")
        return [self.int(v, i, name, lo, hi) for i in range(len(v))]

    def float(self, d: Any, key: Any, where: str, optional: bool = False, default: Any = _MISSING) -> float | None:
        name, v = self._get(d, key, where, default)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise self._bad(name, v, "a number")
        return float(v)

    def str(self, d: Any, key: Any, where: str, default: Any = _MISSING) -> str:
        name, v = self._get(d, key, where, default)
        if not isinstance(v, str):
            raise self._bad(name, v, "a string")
        return v

    def bool(self, d: Any, key: Any, where: str) -> bool:
        name, v = self._get(d, key, where, _MISSING)
        if not isinstance(v, bool):
            raise self._bad(name, v, "true or false")
        return v

    def list(self, d: Any, key: Any, where: str) -> list:
        name, v = self._get(d, key, where, _MISSING)
        if not isinstance(v, list):
            raise self._bad(name, v, "a list")
        return v

    def dict(self, d: Any, key: Any, where: str) -> dict:
        name, v = self._get(d, key, where, _MISSING)
        if not isinstance(v, dict):
            raise self._bad(name, v, "an object")
        return v


def check_plan(plan: Plan, g: ModelGeometry, source: str = "plan") -> None:
    """PlanError when a (hand-edited) plan does not fit the model: layers and expert ids out of
    range, or tensor overrides that keep a resident layer's experts in host RAM."""
    n_expert = max((l.n_expert for l in g.layers), default=0)
    rxs = [(n, re.compile(o.pattern)) for n, o in enumerate(plan.overrides)]
    for n, l in enumerate(plan.layers):
        if l.index >= len(g.layers):
            raise PlanError(f"{source}: layers[{n}].index: layer {l.index}, the model has {len(g.layers)}")
        if l.pinned and max(l.pinned) >= n_expert:
            raise PlanError(f"{source}: layers[{n}].pinned: expert {max(l.pinned)}, the model has {n_expert} per layer")
        if l.mode == "cached" and l.slots > n_expert:
            raise PlanError(f"{source}: layers[{n}].slots: {l.slots} slots, the layer has {n_expert} experts")
        if l.mode == "resident":
            for t in g.layers[l.index].experts:
                hit = next((k for k, rx in rxs if rx.search(t.name)), None)
                if hit is not None:
                    raise PlanError(f"{source}: layers[{n}]: layer {l.index} is resident, but overrides[{hit}] "
                                    f"keeps its expert tensor {t.name} in host RAM",
                                    hint="make the plan again with `spark plan` (a layer's mode and the "
                                         "overrides must agree)")


def to_json(plan: Plan) -> str:
    """Indented JSON with one line per layer."""
    d = {"version": PLAN_VERSION, **asdict(plan)}
    layers = d.pop("layers")
    head = json.dumps(d, indent=1)
    body = ",\n  ".join(json.dumps(l) for l in layers)
    return head[:-2] + ',\n "layers": [\n  ' + body + "\n ]\n}"

def from_json(text: str, source: str = "plan") -> Plan:
    """A plan from its JSON; PlanError `source: field: problem` for anything out of shape."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{source}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(d, dict) or d.get("version") != PLAN_VERSION:
        got = d.get("version") if isinstance(d, dict) else None
        raise PlanError(f"{source}: version: expected {PLAN_VERSION}, got {got!r}",
                        hint="make the plan again with `spark plan`")
    f = _Fields(source)
    layers = tuple(LayerPlan(index=f.int(l, "index", f"layers[{n}]", 0, INT32_MAX),
                             mode=f.str(l, "mode", f"layers[{n}]"),
                             pinned=tuple(f.int_list(l, "pinned", f"layers[{n}]", 0, INT32_MAX)),
                             slots=f.int(l, "slots", f"layers[{n}]", 0, INT32_MAX),
                             device_bytes=f.int(l, "device_bytes", f"layers[{n}]", 0, INT64_MAX),
                             host_bytes=f.int(l, "host_bytes", f"layers[{n}]", 0, INT64_MAX),
                             device=f.int(l, "device", f"layers[{n}]", 0, INT32_MAX) if "device" in l else 0)
                   for n, l in enumerate(f.list(d, "layers", "")))
    s = f.dict(d, "stock", "")
    stock = StockBaseline(f.int(s, "n_cpu_moe", "stock", 0, INT32_MAX), f.bool(s, "fits", "stock"),
                          f.int(s, "device_bytes", "stock", 0, INT64_MAX),
                          tuple(f.str(s["override_patterns"], i, "stock.override_patterns")
                                for i in range(len(f.list(s, "override_patterns", "stock")))),
                          f.int(s, "cpu_moe_device_bytes", "stock", 0, INT64_MAX), f.bool(s, "cpu_moe_fits", "stock"))
    bd = f.dict(d, "breakdown", "")
    overrides = []
    for n, o in enumerate(f.list(d, "overrides", "")):
        pat = f.str(o, "pattern", f"overrides[{n}]")
        try:
            re.compile(pat)
        except re.error as e:
            raise PlanError(f"{source}: overrides[{n}].pattern: invalid regex {pat!r} ({e})",
                            hint="make the plan again with `spark plan`") from None
        overrides.append(TensorOverride(pat, f.str(o, "target", f"overrides[{n}]")))
    plan = Plan(model=dict(f.dict(d, "model", "")), budget_bytes=f.int(d, "budget_bytes", "", 0, INT64_MAX),
               n_ctx=f.int(d, "n_ctx", "", 1, INT32_MAX), type_k=f.str(d, "type_k", ""),
               type_v=f.str(d, "type_v", ""), n_ubatch=f.int(d, "n_ubatch", "", 1, INT32_MAX),
               layers=layers, breakdown={k: f.int(bd, k, "breakdown", 0, INT64_MAX) for k in BREAKDOWN_KEYS},
               predicted_cold_hit=f.float(d, "predicted_cold_hit", "", optional=True), stock=stock,
               policy=f.str(d, "policy", "", default=DEFAULT_POLICY),
               predicted_miss=f.float(d, "predicted_miss", "", optional=True, default=None),
               miss_path=f.str(d, "miss_path", "", default="auto"),
               stage_slices=f.int(d, "stage_slices", "", 0, INT32_MAX) if "stage_slices" in d else 0,
               # NOTE: plans from before -np priced one sequence and one stream
               n_parallel=f.int(d, "n_parallel", "", 1, MAX_PARALLEL) if "n_parallel" in d else 1,
               kv_unified=f.bool(d, "kv_unified", "") if "kv_unified" in d else False,
               overrides=tuple(overrides), predicted=_predicted_field(f, d),
               **_measured_fields(f, d), **_device_fields(f, d))
    seen: set[int] = set()
    for n, l in enumerate(plan.layers):
        if l.index in seen:
            raise PlanError(f"{source}: layers[{n}].index: layer {l.index} appears twice")
        seen.add(l.index)
        if len(l.pinned) > l.slots and l.mode == "cached":
            raise PlanError(f"{source}: layers[{n}].pinned: {len(l.pinned)} pinned experts in {l.slots} slots")
    for l in plan.layers:
        if l.mode not in MODES:
            raise PlanError(f"{source}: layers[{l.index}].mode: unknown mode {l.mode!r}")
        if l.device >= len(plan.per_device):
            raise PlanError(f"{source}: layers[{l.index}].device: device {l.device}, the plan has "
                            f"{len(plan.per_device)}")
    if plan.output_device >= len(plan.per_device):
        raise PlanError(f"{source}: output_device: device {plan.output_device}, the plan has {len(plan.per_device)}")
    if plan.measured is not None:
        plan = replace(plan, measured_device_bytes=measured_total(plan, plan.measured_bill()))
    if plan.policy not in ONLINE_POLICIES and plan.policy != "lru-pinned":
        raise PlanError(f"{source}: policy: unknown cache policy {plan.policy!r}",
                        hint=f"use one of {', '.join(ONLINE_POLICIES)}")
    if plan.miss_path not in tuple(MissPath):
        raise PlanError(f"{source}: miss_path: unknown miss path {plan.miss_path!r}", hint="use " + ", ".join(MissPath))
    return plan

def save(plan: Plan, path: str | Path, flag: str | None = None) -> Path:
    """Write the plan's JSON atomically; `flag` names the option the path came from in errors."""
    return atomic_write_text(path, to_json(plan) + "\n", flag)

def load(path: str | Path, expect_identity: dict[str, Any] | None = None) -> Plan:
    """Read a plan; refuse one made for another model (PlanError, one line)."""
    try:
        text = read_regular_text(path)
    except OSError as e:
        raise PlanError(f"{path}: cannot read plan ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise PlanError(f"{path}: not a plan (byte {e.start} is not UTF-8)",
                        hint="give a plan JSON written by spark plan -o") from None
    plan = from_json(text, str(path))
    if expect_identity is not None:
        for k, want in expect_identity.items():
            got = plan.model.get(k)
            if got != want:
                show = (lambda v: str(v)[:12]) if k in ("fingerprint", "tensor_layout_hash") else str
                raise PlanError(f"{path}: plan is for another model ({k} {show(got)} != {show(want)})",
                                hint="make a plan for this model with `spark plan`")
    return plan


def _predicted_field(f: _Fields, d: dict) -> dict[str, Any] | None:
    """The plan's predicted figures (optional: plans from before the cost model have none)."""
    if d.get("predicted") is None:
        return None
    p = f.dict(d, "predicted", "")
    alts = f.list(p, "alternatives", "predicted") if "alternatives" in p else []
    return {"tg_tok_s": f.float(p, "tg_tok_s", "predicted", optional=True),
            "pp_tok_s": f.float(p, "pp_tok_s", "predicted", optional=True),
            "stops": f.int(p, "stops", "predicted", 0, INT32_MAX), "objective": f.str(p, "objective", "predicted"),
            "costs": f.str(p, "costs", "predicted"),
            "measured": f.bool(p, "measured", "predicted") if "measured" in p else True,
            "alternatives": [f.dict(alts, i, "predicted.alternatives") for i in range(len(alts))]}


def _measured_fields(f: _Fields, d: dict) -> dict[str, Any]:
    """The optional fields of a plan file that issue 26 added (the dry run's bill, --policy auto's
    figures), checked."""
    out: dict[str, Any] = {}
    replay = d.get("policy_replay")
    if replay is not None:
        if not (isinstance(replay, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in replay.values())):
            raise PlanError(f"{f.source}: policy_replay: expected an object of numbers")
        out["policy_replay"] = {str(k): float(v) for k, v in replay.items()}
    if d.get("measured") is None:
        return out
    try:
        bill = MeasuredBill.from_dict(d["measured"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise PlanError(f"{f.source}: measured: not a measured bill",
                        hint="make the plan again with `spark plan`") from None
    return {**out, "measured": bill.to_dict(), "measured_device_bytes": bill.device_bytes(),
            "fit_rounds": f.int(d, "fit_rounds", "", 0, INT32_MAX)}


def _device_fields(f: _Fields, d: dict) -> dict[str, Any]:
    """The optional fields of a plan over several devices (split.py), checked."""
    out: dict[str, Any] = {}
    if "devices" in d:
        devs = []
        for n, e in enumerate(f.list(d, "devices", "")):
            where = f"devices[{n}]"
            bd = f.dict(e, "breakdown", where)
            m = e.get("measured") if isinstance(e, dict) else None
            if m is not None and not (isinstance(m, dict) and all(isinstance(v, int) and not isinstance(v, bool)
                                                                    and v >= 0 for v in m.values())):
                raise PlanError(f"{f.source}: {where}.measured: expected an object of byte counts")
            devs.append(DevicePlan(f.str(e, "name", where), f.int(e, "budget_bytes", where, 0, INT64_MAX),
                                   {k: f.int(bd, k, f"{where}.breakdown", 0, INT64_MAX) for k in BREAKDOWN_KEYS},
                                   dict(m) if m is not None else None))
        if not devs:
            raise PlanError(f"{f.source}: devices: empty", hint="make the plan again with `spark plan`")
        out["devices"] = tuple(devs)
    if "tensor_split" in d:
        ts = f.list(d, "tensor_split", "")
        out["tensor_split"] = tuple(f.float(ts, i, "tensor_split") for i in range(len(ts)))
        if any(v < 0 for v in out["tensor_split"]):
            raise PlanError(f"{f.source}: tensor_split: proportions must be >= 0")
    if "split_mode" in d:
        mode = f.str(d, "split_mode", "")
        if mode not in SPLIT_MODES:
            raise PlanError(f"{f.source}: split_mode: expected none or layer, got {mode!r}")
        out["split_mode"] = mode
    if "main_gpu" in d:
        out["main_gpu"] = f.int(d, "main_gpu", "", 0, INT32_MAX)
    if "output_device" in d:
        out["output_device"] = f.int(d, "output_device", "", 0, INT32_MAX)
    return out
