"""From (model, plan or budget, profile) to a running engine, and back: self-tuning.

Shared by chat, bench and demo: pick the placement, open the engine with it, and fold the
run's decode routing counts into the model's profile when it ends.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from typing import Callable

from ..native import devices
from . import device_costs, dry_run, host_ram, page_cache_choice, read_ahead, self_check
from .miss_path import device_key
from ..files.paths import spark_home
from ..core import plan_file, planner, profile_store, ram_tier, split as split_mod, units, vram
from ..files.atomic import lock_timeout_default
from ..files.regular import not_a_file
from ..core.simulator import MissPath
from ..core.trace import DECODE
from ..native.engine import CacheLayer, Engine, EngineOptions
from ..errors import PlanError, ProfileError, UsageError
from ..core.gguf_info import ModelGeometry, load_geometry
from ..core.options import DEFAULT_UBATCH, LoadFlags, context_size
from ..core.placement import parse_override_tensor
from ..core.profile import RoutingProfile, profile_path_for
from ..core.cost_model import DeviceCosts
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
                 policy: str | None = None, miss_path: MissPath | None = None,
                 split: split_mod.Split | None = None, costs: DeviceCosts | None = None,
                 objective: str = "decode") -> planner.PlanRequest:
    """What a placing command asks planner.plan_for: the profile's counts, and to replay
    `trace` (a --trace) or else the profile's ring of recent decode steps. `split`: several
    devices (resolve_split), whose budgets `budget` sums. `costs`: the device's time figures
    (device_costs.py, device_table.py): the plan is priced in time, for `objective`."""
    if trace is None and info.profile is not None:
        trace = info.profile.recent_trace()
    return planner.PlanRequest(budget, n_ctx, type_k, type_v, n_ubatch, profile_counts(info), trace,
                               policy or planner.AUTO_POLICY, miss_path or MissPath.AUTO, n_parallel=n_parallel,
                               kv_unified=kv_unified, split=split, costs=costs, objective=objective)


def engine_options(model: Path, geometry: ModelGeometry, plan: planner.Plan | None, flags: LoadFlags, *,
                   n_ctx: int, learn: bool = True) -> EngineOptions:
    """Engine options that realise a plan (cached layers get banks; resident ones stay whole)
    with llama.cpp's flags; -ctk/-ctv, -ub, -np and --kv-unified default to the plan's."""
    cache = []
    if plan is not None:
        cache = [CacheLayer(l.index, l.slots, tuple(l.pinned), policy=plan.policy)
                 for l in plan.layers if l.mode == "cached"]
    # NOTE: a plan's layer split is the one llama.cpp makes: it gets the plan's proportions
    if plan is not None:
        ts, mode, mg = plan.tensor_split or None, plan.split_mode, plan.main_gpu
    else:
        ts, mode, mg = flags.tensor_split, flags.split_mode or "layer", flags.main_gpu or 0
    return EngineOptions(
        model, n_ctx=n_ctx, n_batch=flags.batch_size, n_ubatch=ubatch_size(flags, plan), n_threads=flags.threads,
        n_threads_batch=flags.threads_batch,
        device=flags.device, rpc=parse_endpoints(flags.rpc), cache_layers=cache,
        tensor_split=tuple(ts) if ts else None, split_mode=mode, main_gpu=mg,
        stage_slices=plan.stage_slices if plan is not None else 0,
        host_layers=[l.index for l in plan.layers if l.mode == "host"] if plan is not None else [],
        expert_overrides=plan.overrides if plan is not None else None,
        tensor_overrides=parse_override_tensor(flags.override_tensor, geometry),
        count_experts=counts_every_layer(plan, learn),
        type_k=flags.type_k or (plan.type_k if plan else "f16"), type_v=flags.type_v or (plan.type_v if plan else "f16"),
        flash_attn=flags.flash_attn, use_mmap=flags.mmap, use_mlock=flags.mlock, repack=flags.repack,
        n_seq=n_parallel(flags, plan), kv_unified=kv_unified(flags, plan))


def measurer(model: Path, geometry: ModelGeometry, flags: LoadFlags, n_ctx: int) -> planner.Measure:
    """planner.plan_for's `measure` for this model and these flags: a plan's dry run (dry_run.measure)."""
    return lambda plan: dry_run.measure(engine_options(model, geometry, plan, flags, n_ctx=n_ctx, learn=False))


def counts_every_layer(plan: planner.Plan | None, learn: bool) -> bool:
    """Whether learning counts the routing of every MoE layer: counting a layer that does not stop
    (resident, host) costs a device stop a token, so a plan priced in time, which chose its stops,
    learns from its cached layers alone; a plan placed by hits, or none (the CPU path), counts all."""
    return learn and (plan is None or plan.predicted is None)


def ubatch_size(flags: LoadFlags, plan: planner.Plan | None = None) -> int:
    return flags.ubatch_size or (plan.n_ubatch if plan is not None else DEFAULT_UBATCH)


def decode_counts(engine: Engine) -> np.ndarray | None:
    if not engine.cache.enabled:
        return None
    return engine.cache.routing_counts(DECODE).astype(np.float64)


def decode_tokens(geometry: ModelGeometry, counts: np.ndarray) -> float:
    """Tokens a [n_layer, n_expert] count array stands for: each routes k experts in every MoE layer
    that counted (a plan priced in time counts its cached layers alone: counts_every_layer)."""
    counted = int(np.count_nonzero(np.asarray(counts).sum(axis=1))) if np.asarray(counts).ndim == 2 else 0
    return float(counts.sum()) / (geometry.n_expert_used * max(1, counted or len(geometry.moe_layers)))


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
    bytes: int  # over every device (one device: its budget)
    source: str  # where it came from, for messages
    free: int | None = None  # the first device's free memory, when it was read
    per_device: tuple[int, ...] = ()  # one per device, -dev order
    names: tuple[str, ...] = ()  # their names ("" where planned without the device)


def resolve_budget(vram_text: str | None, devs: list, names: tuple[str, ...] = ()) -> Budget:
    """--vram (one size per device in -dev order, or one for each), else each selected device's
    free memory less devices.BUDGET_MARGIN. Without a device (planning without measuring), the
    devices are `names` (-dev's) if given, else one per --vram size."""
    frees = []
    for d in devs:
        free, total = devices.free_memory(d)
        frees.append(free if total else None)
    if vram_text:
        sizes = units.parse_sizes(vram_text, len(devs) or len(names) or None, flag="--vram")
        names = tuple(d.name for d in devs) or tuple(names) or ("",) * len(sizes)
        return Budget(sum(sizes), f"--vram {vram_text}", frees[0] if frees else None, sizes, names)
    if not devs:
        raise PlanError("no GPU-type device: --vram is required for a dry run",
                        hint="e.g. --vram 16GiB, or pick a device with -dev/--rpc")
    sizes, sources = [], []
    for d, free in zip(devs, frees):
        if free is None:
            raise PlanError(f"{d.name} did not report its free memory", hint="pass --vram, e.g. --vram 16GiB")
        budget = devices.budget_from_free(free)
        if budget <= 0:
            raise PlanError(f"{d.name} has only {units.fmt_bytes(free)} free, less than the "
                            f"{units.fmt_bytes(devices.BUDGET_MARGIN)} margin", hint="free the device or pass --vram")
        sizes.append(budget)
        sources.append(f"{d.name} free {units.fmt_bytes(free)}")
    return Budget(sum(sizes), f"{', '.join(sources)} minus a {units.fmt_bytes(devices.BUDGET_MARGIN)} margin"
                  + (" each" if len(devs) > 1 else ""), frees[0], tuple(sizes), tuple(d.name for d in devs))


def resolve_split(flags: LoadFlags, budget: Budget) -> split_mod.Split | None:
    """The devices a plan spreads over (-sm, -ts, -mg with the budgets); None: one device."""
    sp = split_mod.make_split(budget.per_device or (budget.bytes,), budget.names or ("",),
                              flags.tensor_split, flags.split_mode or "layer", flags.main_gpu or 0)
    return sp if sp.n_devices > 1 or sp.mode == "none" else None


def used_devices(devs: list, plan: planner.Plan | None) -> list:
    """The selected devices a plan runs on (-sm none: the main device alone)."""
    if plan is not None and plan.split_mode == "none" and devs:
        return [devs[min(plan.main_gpu, len(devs) - 1)]]
    return devs


def _check_plan_devices(plan: planner.Plan, devs: list, flags: LoadFlags, source: str) -> None:
    """PlanError when a plan file was made for other devices than this run selects, or -sm/-ts/-mg
    ask for another split than the plan's (its layers and bills are per device)."""
    names = [d.name for d in plan.per_device]
    if plan.split_mode == "none":
        if plan.main_gpu >= len(devs):
            raise PlanError(f"{source}: made for -sm none -mg {plan.main_gpu}; this run selects {len(devs)} "
                            f"device{'s' * (len(devs) != 1)}", hint="select the same devices with -dev/--rpc")
    elif len(names) != len(devs):
        raise PlanError(f"{source}: made for {len(names)} device{'s' * (len(names) != 1)} "
                        f"({', '.join(n or '?' for n in names)}); this run selects {len(devs)} "
                        f"({', '.join(d.name for d in devs)})",
                        hint="select the same devices with -dev/--rpc, or make the plan again with `spark plan`")
    asked = []
    if flags.split_mode is not None and flags.split_mode != plan.split_mode:
        asked.append(f"-sm {flags.split_mode}")
    if flags.main_gpu is not None and plan.split_mode == "none" and flags.main_gpu != plan.main_gpu:
        asked.append(f"-mg {flags.main_gpu}")
    if (flags.tensor_split is not None and len(devs) > 1 and plan.split_mode == "layer"
            and split_mod.as_float32(flags.tensor_split) != tuple(plan.tensor_split)):
        asked.append("-ts " + ",".join(f"{v:g}" for v in flags.tensor_split))
    if asked:
        raise PlanError(f"{source}: {' '.join(asked)} asks for another layer split than the plan's",
                        hint="drop the flag, or make the plan again with `spark plan` and these flags")


@dataclass
class Placement:
    """What a model-loading command runs on: devices, the plan (None: stock CPU path), context."""

    devices: list
    plan: planner.Plan | None
    n_ctx: int
    budget_source: str = ""
    cpu_reason: str | None = None
    warnings: list[str] = field(default_factory=list)
    miss_path: MissPath = MissPath.AUTO  # the effective one: --miss-path, else the plan's, else auto
    ram: ram_tier.RamTier | None = None  # the weights do not fit the run's RAM: the file tier (CPU runs)
    ahead: read_ahead.AheadDecision | None = None  # whether the RAM tier reads ahead (None: no tier)
    mapped: bool = False  # the weights do not fit the run's RAM and stock's mapping was chosen: no repacking


def load_plan_file(plan_path: Path, geometry: ModelGeometry) -> planner.Plan:
    why = not_a_file(plan_path)
    if why is not None:
        raise PlanError(f"--plan {plan_path}: {why}", hint="write one with spark plan -o FILE")
    plan = plan_file.load(plan_path, expect_identity=geometry.identity())
    plan_file.check_plan(plan, geometry, f"--plan {plan_path}")
    return plan


def resolve_placement(model: Path, geometry: ModelGeometry, info: ProfileInfo, flags: LoadFlags, *,
                      plan_path: Path | None, vram_text: str | None, miss_path: MissPath | None = None) -> Placement:
    """The devices -dev/--rpc select, and a plan: the --plan file, or one made now from --vram
    (or the device's free memory) as `spark plan` makes it (planner.plan_for; `miss_path`:
    --miss-path, priced and recorded). No GPU-type device: the stock CPU path, without a plan.
    The placement's miss path: --miss-path, else the plan's, else auto."""
    file_plan = load_plan_file(plan_path, geometry) if plan_path is not None else None  # checked even if unused
    sel = devices.parse(flags.device, flags.rpc)
    devs = devices.select(sel)
    if not devs:
        reason = "-dev none" if sel.cpu_only else devices.no_gpu_reason()
        warnings = [f"{reason}: --plan/--vram ignored"] if plan_path is not None or vram_text else []
        n_ctx = context_size(flags.ctx_size, geometry.context_length)
        tier = resolve_ram_tier(model, geometry, info, flags, n_ctx)
        choice = resolve_tier_choice(model, geometry, info, flags, tier, None)
        mapped = choice is not None and not choice.use_tier
        if choice is not None:
            warnings.append(choice.line)
            tier = None if mapped else tier
        ahead = resolve_read_ahead(model, geometry, info, flags, tier, None)
        if tier is not None:
            warnings += [tier.line(), ahead.line]
        return Placement([], None, n_ctx, "", reason, warnings, miss_path or MissPath.AUTO, tier, ahead, mapped)
    if file_plan is not None:
        out = Placement(devs, file_plan, context_size(flags.ctx_size, geometry.context_length, file_plan.n_ctx),
                        f"plan {Path(plan_path).name}")
        if out.n_ctx > file_plan.n_ctx:
            out.warnings.append(f"--ctx-size {out.n_ctx} is above the plan's {file_plan.n_ctx}: "
                                "the KV cache takes more VRAM than planned")
        seq_warning = _sequences_warning(geometry, file_plan, flags)
        if seq_warning:
            out.warnings.append(seq_warning)
        _check_plan_devices(file_plan, devs, flags, f"--plan {plan_path}")
        if file_plan.devices:  # the plan's device d is this run's d-th (an RPC server's name may differ)
            file_plan = dataclasses.replace(file_plan, devices=tuple(
                dataclasses.replace(x, name=d.name) for x, d in zip(file_plan.devices, used_devices(devs, file_plan))))
        # NOTE: measured now, with this run's flags and context: a stale plan (another context size,
        # another device, less free memory) is refused here, before anything loads
        bill = measurer(model, geometry, flags, out.n_ctx)(file_plan)
        dry_run.check_fits(bill, used_devices(devs, file_plan), f"--plan {plan_path}")
        out.plan = planner.with_measured(file_plan, bill)
    else:
        n_ctx = context_size(flags.ctx_size, geometry.context_length)
        budget = resolve_budget(vram_text, devs)
        req = plan_request(info, budget.bytes, n_ctx, miss_path=miss_path, split=resolve_split(flags, budget),
                           costs=kept_costs(devs, geometry, flags), **kv_settings(flags))
        req = dataclasses.replace(req, **plan_ram_bound(flags, geometry))
        plan = planner.plan_for(geometry, req, measurer(model, geometry, flags, n_ctx)).plan
        out = Placement(devs, plan, n_ctx, budget.source)
    if not any(l.mode in ("resident", "cached", "host") for l in out.plan.layers):
        raise PlanError("the plan places no MoE layer", hint="write it again with spark plan")
    out.ram = resolve_device_ram_tier(geometry, info, flags, out.plan)
    choice = resolve_tier_choice(model, geometry, info, flags, out.ram, out.plan)
    if choice is not None:
        out.warnings.append(choice.line)
        out.mapped = not choice.use_tier
        out.ram = None if out.mapped else out.ram
    out.ahead = resolve_read_ahead(model, geometry, info, flags, out.ram, out.plan)
    if out.ram is not None:
        out.warnings += [out.ram.line(), out.ahead.line]
    elif not out.mapped:
        ram_warning = host_ram.check(out.plan, flags)
        if ram_warning:
            out.warnings.append(ram_warning)
    out.miss_path = miss_path or MissPath(out.plan.miss_path)  # the plan file's was checked when it loaded
    self_check.guard(out, flags, used_devices(devs, out.plan), measurer(model, geometry, flags, out.n_ctx))  # unchecked: stock's
    return out


RAM_MARGIN = 64 << 20  # left free of the run's RAM: threads' stacks, allocator slack, the reads' page cache


def resolve_ram_tier(model: Path, geometry: ModelGeometry, info: ProfileInfo, flags: LoadFlags,
                     n_ctx: int) -> ram_tier.RamTier | None:
    """The file tier of a CPU run whose weights do not fit its RAM (None: they fit, nothing changes).
    The weights' budget: --ram, else the available RAM (or the memory cgroup's headroom) less what the
    run needs besides them, its KV cache and compute buffers as llama.cpp's dry run measures them, and
    RAM_MARGIN. PlanError (one line, before anything loads) when too small for the resident weights."""
    if not geometry.moe_layers:
        return None
    if flags.ram is not None:
        budget, source = flags.ram, "--ram"
    else:
        if host_ram.available()[0] >= geometry.file_size + (1 << 30):  # NOTE: plenty: no dry run for the common case
            return None
        bill = dry_run.measure(engine_options(model, geometry, None, flags, n_ctx=n_ctx, learn=False)).host()
        free, where = host_ram.available()  # NOTE: after the dry run: llama.cpp's libraries are resident now
        budget = max(0, free - bill["context"] - bill["compute"] - RAM_MARGIN)
        source = f"{where}: {units.fmt_bytes(free)} free less {units.fmt_bytes(bill['context'] + bill['compute'])} " \
                 f"of KV cache and compute buffers"
    return ram_tier.plan(geometry, budget, source, profile_counts(info),
                         flag="--ram" if flags.ram is not None else "the RAM budget")


def plan_ram_bound(flags: LoadFlags, geometry: ModelGeometry) -> dict:
    """The RAM a device plan's host weights are fitted to (planner.ram_fit), as PlanRequest fields: --ram;
    else, for a model file bigger than the available RAM, that RAM less RAM_MARGIN; none (it fits, or
    --no-mmap/--mlock: every weight resident, host_ram.check refuses what does not fit)."""
    if flags.ram is not None:
        return {"ram_bytes": flags.ram, "ram_source": "--ram"}
    if not flags.mmap or flags.mlock:
        return {}
    free, where = host_ram.available()
    return {"ram_bytes": max(0, free - RAM_MARGIN), "ram_source": f"the available RAM ({where})",
            "ram_strict": False} if free < geometry.file_size else {}


def resolve_device_ram_tier(geometry: ModelGeometry, info: ProfileInfo, flags: LoadFlags,
                            plan: planner.Plan) -> ram_tier.RamTier | None:
    """Three tiers: the RAM tier of a device plan whose host weights do not fit the run's RAM (None: they
    fit). The plan's host layers (stock's --n-cpu-moe shape: their experts on the CPU) keep RAM slots and
    read the rest from the model file; the other host weights (the cached layers' host experts, what
    llama.cpp keeps on the CPU) stay resident, as the plan's dry run measured them. The budget: --ram,
    else the available RAM (or the memory cgroup's headroom) less the measured host KV cache and compute
    buffers and RAM_MARGIN. PlanError (one line, before anything loads) when it cannot hold them."""
    if not geometry.moe_layers:
        return None
    bill = plan.measured_bill()
    host = bill.host() if bill is not None else planned_host_bill(geometry, plan)
    return host_ram_tier(geometry, info, flags, [l.index for l in plan.layers if l.mode == "host"], host)


def planned_host_bill(geometry: ModelGeometry, plan: planner.Plan) -> dict[str, int]:
    """A plan's host weights where no dry run measured them (a header-only fixture, no device): the
    expert tensors of its cached and host layers and the input embeddings llama.cpp keeps on the CPU;
    its host KV cache and compute buffers are not known (0)."""
    off = [l.index for l in plan.layers if l.mode in ("cached", "host")]
    model = geometry.token_embd_bytes + ram_tier.expert_bytes(geometry, off)
    return {"model": model, "context": 0, "compute": 0, "total": model}


def host_ram_tier(geometry: ModelGeometry, info: ProfileInfo, flags: LoadFlags, host_layers: list[int],
                  host: dict[str, int]) -> ram_tier.RamTier | None:
    """The RAM tier of a device run whose `host_layers` keep their experts on the CPU, `host` its dry
    run's host bill (model, context, compute, total): resolve_device_ram_tier's."""
    if flags.ram is None and (not host_layers or not flags.mmap or flags.mlock):
        return None  # NOTE: nothing to read from the file, or every weight resident: host_ram.check refuses or warns
    resident = max(0, host["model"] - ram_tier.expert_bytes(geometry, host_layers))
    if flags.ram is not None:
        budget, source, flag = flags.ram, "--ram", "--ram"
    else:
        free, where = host_ram.available()
        if free >= host["total"] + RAM_MARGIN:  # NOTE: the common case: every host weight fits
            return None
        budget = max(0, free - host["context"] - host["compute"] - RAM_MARGIN)
        source = f"{where}: {units.fmt_bytes(free)} free less {units.fmt_bytes(host['context'] + host['compute'])} " \
                 "of host KV cache and compute buffers"
        if budget < ram_tier.minimum(geometry, host_layers, resident):
            return None  # NOTE: not asked for: the mapping pages the rest in (host_ram.check warns)
        flag = "the RAM budget"
    return ram_tier.plan(geometry, budget, source, profile_counts(info), flag=flag, layers=host_layers,
                         resident=resident)


def with_ram_tier(opts: EngineOptions, tier: ram_tier.RamTier | None, geometry: ModelGeometry,
                  ahead: read_ahead.AheadDecision | None = None, mapped: bool = False) -> EngineOptions:
    """Engine options that realise a RAM tier: the tier's layers (every MoE layer of a CPU run; a device
    plan's host layers) cached in RAM with their slots, and a layer's worth of staging slices for prefill,
    misses read from the model file, read ahead as `ahead` decided; a device plan's cached layers keep
    their device banks. `mapped` (no tier: the weights do not fit and the page cache was chosen): the
    weights stay in the mapping, never repacked into RAM (stock's --no-repack), or the run would hold
    the whole model in memory it does not have."""
    if tier is None:
        return dataclasses.replace(opts, repack=False) if mapped else opts
    ram = [CacheLayer(l.il, l.n_slots, l.pinned, in_ram=True) for l in tier.layers]
    return dataclasses.replace(opts, cache_layers=[*opts.cache_layers, *ram], file_tier=True,
                               host_budget=tier.bank_bytes, read_ahead=ahead.ahead if ahead else 0,
                               ahead_min_prob=ahead.min_prob if ahead else 0)


def resolve_tier_choice(model: Path, geometry: ModelGeometry, info: ProfileInfo, flags: LoadFlags,
                        tier: ram_tier.RamTier | None, plan: planner.Plan | None) -> page_cache_choice.TierDecision | None:
    """A run's RAM tier (a CPU run's, or a device plan's host layers' with `plan`), or stock's mapping
    where the cost model prices the page cache faster (runs/page_cache_choice.decide; the uncapped speed:
    the plan's priced tg, or the one spark bench --ram kept for a CPU run). Not with --ram: only the tier
    keeps to a budget the kernel does not enforce. None: no RAM tier to decide on."""
    if tier is None:
        return None
    if flags.ram is not None:
        return page_cache_choice.tier("--ram: the mapping's page cache would not keep to it")
    trace = info.profile.recent_trace() if info.profile is not None else None
    base = read_ahead.uncapped_tg(spark_home(), geometry.fingerprint, plan, flags.threads)
    stock = read_ahead.uncapped_tg(spark_home(), geometry.fingerprint, plan, flags.threads, stock=True)
    return page_cache_choice.decide(model, geometry, tier, trace, base, stock, flags.threads, spark_home())


def resolve_read_ahead(model: Path, geometry: ModelGeometry, info: ProfileInfo, flags: LoadFlags,
                       tier: ram_tier.RamTier | None, plan: planner.Plan | None) -> read_ahead.AheadDecision | None:
    """Whether the RAM tier reads ahead (runs/read_ahead.decide: the profile's recent decode routing,
    the kept disk costs, the uncapped speed: a device plan's priced tg, else the one spark bench --ram
    kept for this model and -t). None: no RAM tier."""
    if tier is None:
        return None
    trace = info.profile.recent_trace() if info.profile is not None else None
    base = read_ahead.uncapped_tg(spark_home(), geometry.fingerprint, plan, flags.threads)
    return read_ahead.decide(model, geometry, tier, trace, base, spark_home())


def kept_costs(devs: list, geometry: ModelGeometry, flags: LoadFlags) -> DeviceCosts | None:
    """The device costs `spark bench` measured for the first device, this model and -t (None:
    never measured: the plan is priced by hits alone)."""
    if not devs:
        return None
    threads = flags.threads or os.cpu_count() or 1
    return device_costs.load(spark_home(), device_key(devs[0]), geometry.fingerprint, threads)


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


def open_geometry(model: Path, require_moe: bool = True) -> ModelGeometry:
    return load_geometry(model, require_moe=require_moe)
