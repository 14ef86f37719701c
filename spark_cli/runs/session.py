"""From (model, plan or budget, profile) to a running engine, and back: self-tuning.

Shared by chat, bench and demo: pick the placement, open the engine with it, and fold the
run's decode routing counts into the model's profile when it ends.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from typing import Callable

from ..native import devices
from . import dry_run, host_ram
from ..core import planner, profile_store, units, vram
from ..files.atomic import lock_timeout_default
from ..core.trace import DECODE
from ..native.engine import CacheLayer, Engine, EngineOptions
from ..errors import PlanError, ProfileError
from ..core.gguf_info import ModelGeometry, load_geometry
from ..core.options import DEFAULT_UBATCH, LoadFlags, context_size
from ..core.placement import parse_override_tensor
from ..core.profile import RoutingProfile, profile_path_for
from ..native.rpc import parse_endpoints


@dataclass
class ProfileInfo:
    path: Path
    profile: RoutingProfile | None
    problem: str | None = None  # why the profile beside the model was not used (corrupt, newer, ...)

    def warning(self) -> str | None:
        """One line for a profile that could not be used, or None."""
        if self.problem is None:
            return None
        return (f"{self.problem}; running without it (the file is left as it is; "
                f"spark profile MODEL --reset moves it aside)")

    def summary(self) -> str:
        p = self.profile
        if p is None and self.problem is not None:
            return f"profile {self.path.name} unusable: uniform placement"
        if p is None:
            return "no profile yet: uniform placement, learning from this session"
        age = ""
        try:
            then = _dt.datetime.fromisoformat(p.updated)
            hours = (_dt.datetime.now(_dt.timezone.utc) - then.astimezone(_dt.timezone.utc)).total_seconds() / 3600
            age = f", updated {hours:.1f} h ago" if hours < 48 else f", updated {hours / 24:.0f} days ago"
        except (TypeError, ValueError):
            pass
        return f"profile {self.path.name}: {p.tokens_decode:,.0f} decode + {p.tokens_prefill:,.0f} prefill tokens{age}"


def load_profile(model: Path, geometry: ModelGeometry, path: Path | None = None) -> ProfileInfo:
    """The profile at `path` (an unusable one is an error), or the one beside the model
    (an unusable one, corrupt, newer or of another model, never blocks a run: see `problem`)."""
    p = Path(path) if path else profile_path_for(model)
    if not p.exists():
        if path:
            raise ProfileError(f"--profile {p}: no such file", hint="run spark profile first, or drop --profile")
        return ProfileInfo(p, None)
    try:
        return ProfileInfo(p, RoutingProfile.load(p, expect=geometry.identity()))
    except ProfileError as e:
        if path:
            raise
        return ProfileInfo(p, None, problem=e.message)


def profile_counts(info: ProfileInfo) -> np.ndarray | None:
    """Decode counts of the profile, or all its counts when it has no decode tokens."""
    counts = info.profile.decode if info.profile is not None and info.profile.tokens_decode > 0 else None
    if counts is None and info.profile is not None:
        counts = info.profile.prefill + info.profile.decode
    return counts


def kv_settings(flags: LoadFlags) -> dict:
    """-ctk/-ctv/-ub/-np/--kv-unified as a placement is priced for them (the engine runs the same:
    engine_options)."""
    return {"type_k": flags.type_k or "f16", "type_v": flags.type_v or "f16", "n_ubatch": ubatch_size(flags),
            "n_parallel": n_parallel(flags), "kv_unified": kv_unified(flags)}


def n_parallel(flags: LoadFlags, plan: planner.Plan | None = None) -> int:
    """-np if given, else the plan's, else 1."""
    return flags.parallel or (plan.n_parallel if plan is not None else 1)


def kv_unified(flags: LoadFlags, plan: planner.Plan | None = None) -> bool:
    """--kv-unified/--no-kv-unified if given, else the plan's, else off."""
    if flags.kv_unified is not None:
        return flags.kv_unified
    return plan.kv_unified if plan is not None else False


def plan_request(info: ProfileInfo, budget: int, n_ctx: int, *, type_k: str = "f16", type_v: str = "f16",
                 n_ubatch: int = DEFAULT_UBATCH, n_parallel: int = 1, kv_unified: bool = False, trace=None,
                 policy: str | None = None, miss_path: str | None = None) -> planner.PlanRequest:
    """What a placing command asks planner.plan_for: the profile's counts, and to replay
    `trace` (a --trace) or else the profile's ring of recent decode steps."""
    if trace is None and info.profile is not None:
        trace = info.profile.recent_trace()
    return planner.PlanRequest(budget, n_ctx, type_k, type_v, n_ubatch, profile_counts(info), trace,
                               policy or planner.AUTO_POLICY, miss_path or "auto", n_parallel=n_parallel,
                               kv_unified=kv_unified)


def engine_options(model: Path, geometry: ModelGeometry, plan: planner.Plan | None, flags: LoadFlags, *,
                   n_ctx: int, learn: bool = True) -> EngineOptions:
    """Engine options that realise a plan (cached layers get banks; resident ones stay whole)
    with llama.cpp's flags; -ctk/-ctv, -ub, -np and --kv-unified default to the plan's."""
    cache = []
    if plan is not None:
        cache = [CacheLayer(l.index, l.slots, tuple(l.pinned), policy=plan.policy)
                 for l in plan.layers if l.mode == "cached"]
    return EngineOptions(
        model, n_ctx=n_ctx, n_batch=flags.batch_size, n_ubatch=ubatch_size(flags, plan), n_threads=flags.threads,
        n_threads_batch=flags.threads_batch,
        device=flags.device, rpc=parse_endpoints(flags.rpc), cache_layers=cache,
        stage_slices=plan.stage_slices if plan is not None else 0,
        host_layers=[l.index for l in plan.layers if l.mode == "host"] if plan is not None else [],
        expert_overrides=plan.overrides if plan is not None else None,
        tensor_overrides=parse_override_tensor(flags.override_tensor, geometry), count_experts=learn,
        type_k=flags.type_k or (plan.type_k if plan else "f16"), type_v=flags.type_v or (plan.type_v if plan else "f16"),
        flash_attn=flags.flash_attn, use_mmap=flags.mmap, use_mlock=flags.mlock, repack=flags.repack,
        n_seq=n_parallel(flags, plan), kv_unified=kv_unified(flags, plan))


def ubatch_size(flags: LoadFlags, plan: planner.Plan | None = None) -> int:
    return flags.ubatch_size or (plan.n_ubatch if plan is not None else DEFAULT_UBATCH)


def decode_counts(engine: Engine) -> np.ndarray | None:
    if not engine.cache_enabled:
        return None
    return engine.routing_counts(DECODE).astype(np.float64)


def decode_tokens(geometry: ModelGeometry, counts: np.ndarray) -> float:
    """Tokens a [n_layer, n_expert] count array stands for: each routes k experts in every MoE layer."""
    return float(counts.sum()) / (geometry.n_expert_used * max(1, len(geometry.moe_layers)))


def fold_into_profile(model: Path, geometry: ModelGeometry, counts: np.ndarray | None, source: str,
                      path: Path | None = None, timeout: float | None = None,
                      on_wait: Callable[[str], None] | None = None) -> RoutingProfile | None:
    """Add a run's decode counts to the model's profile (locked, atomic): chat, serve and bench
    fold through here, `spark profile` (prefill and the step ring too) through profile_store.fold
    directly. Returns the new profile; a failed save keeps the counts in a pending side file and
    raises SaveError naming it."""
    if counts is None or counts.sum() <= 0:
        return None
    if counts.shape != (geometry.n_layer, geometry.n_expert):
        raise ProfileError(f"routing counts of shape {counts.shape} do not match the model")
    tokens = decode_tokens(geometry, counts)
    d = profile_store.delta(geometry.identity(), None, counts, 0.0, tokens, source)
    return profile_store.fold(path or profile_path_for(model), geometry.identity(), d,
                              timeout=lock_timeout_default() if timeout is None else timeout,
                              on_wait=on_wait).profile


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # where it came from, for messages
    free: int | None = None  # the device's free memory, when it was read


def resolve_budget(vram_text: str | None, devs: list) -> Budget:
    """--vram, else the first selected device's free memory less devices.BUDGET_MARGIN."""
    free = total = None
    if devs:
        free, total = devices.free_memory(devs[0])
        if not total:
            free = None
    if vram_text:
        return Budget(units.parse_size(vram_text, flag="--vram"), f"--vram {vram_text}", free)
    if not devs:
        raise PlanError("no GPU-type device: --vram is required for a dry run",
                        hint="e.g. --vram 16GiB, or pick a device with -dev/--rpc")
    if free is None:
        raise PlanError(f"{devs[0].name} did not report its free memory", hint="pass --vram, e.g. --vram 16GiB")
    budget = devices.budget_from_free(free)
    if budget <= 0:
        raise PlanError(f"{devs[0].name} has only {units.fmt_bytes(free)} free, less than the "
                        f"{units.fmt_bytes(devices.BUDGET_MARGIN)} margin", hint="free the device or pass --vram")
    return Budget(budget, f"{devs[0].name} free {units.fmt_bytes(free)} minus a {units.fmt_bytes(devices.BUDGET_MARGIN)} margin",
                  free)


@dataclass
class Placement:
    """What a model-loading command runs on: devices, the plan (None: stock CPU path), context."""

    devices: list
    plan: planner.Plan | None
    n_ctx: int
    budget_source: str = ""
    cpu_reason: str | None = None
    warnings: list[str] = field(default_factory=list)


def load_plan_file(plan_path: Path, geometry: ModelGeometry) -> planner.Plan:
    if not Path(plan_path).is_file():
        raise PlanError(f"--plan {plan_path}: no such file", hint="write one with spark plan -o FILE")
    plan = planner.Plan.load(plan_path, expect_identity=geometry.identity())
    planner.check_plan(plan, geometry, f"--plan {plan_path}")
    return plan


def resolve_placement(model: Path, geometry: ModelGeometry, info: ProfileInfo, flags: LoadFlags, *,
                      plan_path: Path | None, vram_text: str | None, miss_path: str | None = None) -> Placement:
    """The devices -dev/--rpc select, and a plan: the --plan file, or one made now from --vram
    (or the device's free memory) as `spark plan` makes it (planner.plan_for; `miss_path`:
    --miss-path, priced and recorded). No GPU-type device: the stock CPU path, without a plan."""
    file_plan = load_plan_file(plan_path, geometry) if plan_path is not None else None  # checked even if unused
    sel = devices.parse(flags.device, flags.rpc)
    devs = devices.select(sel)
    if not devs:
        reason = "-dev none" if sel.cpu_only else "no GPU found"
        warnings = [f"{reason}: --plan/--vram ignored"] if plan_path is not None or vram_text else []
        return Placement([], None, context_size(flags.ctx_size, geometry.context_length), "", reason, warnings)
    if file_plan is not None:
        out = Placement(devs, file_plan, context_size(flags.ctx_size, geometry.context_length, file_plan.n_ctx),
                        f"plan {Path(plan_path).name}")
        if out.n_ctx > file_plan.n_ctx:
            out.warnings.append(f"--ctx-size {out.n_ctx} is above the plan's {file_plan.n_ctx}: "
                                "the KV cache takes more VRAM than planned")
        seq_warning = _sequences_warning(geometry, file_plan, flags)
        if seq_warning:
            out.warnings.append(seq_warning)
        # NOTE: measured now, with this run's flags and context: a stale plan (another context size,
        # another device, less free memory) is refused here, before anything loads
        bill = dry_run.measure(model, geometry, file_plan, flags, out.n_ctx)
        dry_run.check_fits(bill, devs, f"--plan {plan_path}")
        out.plan = dataclasses.replace(file_plan, measured=bill.to_dict(), measured_device_bytes=bill.device_bytes())
    else:
        n_ctx = context_size(flags.ctx_size, geometry.context_length)
        budget = resolve_budget(vram_text, devs)
        req = plan_request(info, budget.bytes, n_ctx, miss_path=miss_path, **kv_settings(flags))
        plan = planner.plan_for(geometry, req, dry_run.measurer(model, geometry, flags, n_ctx)).plan
        out = Placement(devs, plan, n_ctx, budget.source)
    if not any(l.mode in ("resident", "cached", "host") for l in out.plan.layers):
        raise PlanError("the plan places no MoE layer", hint="write it again with spark plan")
    ram_warning = host_ram.check(out.plan, flags)
    if ram_warning:
        out.warnings.append(ram_warning)
    return out


def _sequences_warning(geometry: ModelGeometry, plan: planner.Plan, flags: LoadFlags) -> str | None:
    """A warning when this run's -np/--kv-unified need more KV cache or state than the plan priced."""
    n, unified = n_parallel(flags, plan), kv_unified(flags, plan)
    if (n, unified) == (plan.n_parallel, plan.kv_unified):
        return None
    args = (plan.n_ctx, plan.type_k, plan.type_v, plan.n_ubatch)
    if vram.kv_cache_bytes(geometry, *args, n, unified) <= vram.kv_cache_bytes(geometry, *args, plan.n_parallel,
                                                                             plan.kv_unified):
        return None
    def show(n: int, u: bool) -> str:
        return f"-np {n}" + (" --kv-unified" if u else "")
    return (f"{show(n, unified)} needs more KV cache than the plan's {show(plan.n_parallel, plan.kv_unified)}: "
            "it takes more VRAM than planned")


def open_geometry(model: Path) -> ModelGeometry:
    return load_geometry(model, require_moe=True)
