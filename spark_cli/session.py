"""From (model, plan or budget, profile) to a running engine, and back: self-tuning.

Shared by chat, bench and demo: pick the placement, open the engine with it, and fold the
run's decode routing counts into the model's profile when it ends.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from typing import Callable

from . import planner, profile_store, vram
from .atomic import lock_timeout_default
from .engine import PHASE_DECODE, CacheLayer, Engine, EngineOptions
from .errors import PlanError, ProfileError
from .gguf_info import ModelGeometry, load_geometry
from .profile import RoutingProfile, profile_path_for

BUDGET_MARGIN = 512 << 20  # left free on the device when the budget comes from its free memory


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


def device_budget(free_bytes: int) -> int:
    return max(0, free_bytes - BUDGET_MARGIN)


def gpu_free_bytes() -> int | None:
    """Free memory of the first NVIDIA GPU (pynvml), or None without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return int(pynvml.nvmlDeviceGetMemoryInfo(h).free)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def profile_counts(info: ProfileInfo) -> np.ndarray | None:
    """Decode counts of the profile, or all its counts when it has no decode tokens."""
    counts = info.profile.decode if info.profile is not None and info.profile.tokens_decode > 0 else None
    if counts is None and info.profile is not None:
        counts = info.profile.prefill + info.profile.decode
    return counts


def make_plan_for(model: Path, geometry: ModelGeometry, budget: int, n_ctx: int, info: ProfileInfo,
                  type_k: str = "f16", type_v: str = "f16", trace=None) -> planner.Plan:
    counts = profile_counts(info)
    miss_ratio = None
    if trace is not None:
        from .simulator import miss_ratio_curve

        k, E = geometry.n_expert_used, geometry.n_expert
        curves: dict[int, list[float]] = {}

        def miss_ratio(layer: int, slots: int) -> float:
            if layer not in curves:
                curves[layer] = miss_ratio_curve(trace, layer, list(range(k, E)), "lru")
            return curves[layer][min(max(slots, k), E - 1) - k]
    return planner.make_plan(geometry, budget, n_ctx, profile_counts=counts, type_k=type_k, type_v=type_v,
                             miss_ratio=miss_ratio)


def engine_options(model: Path, plan: planner.Plan | None, *, n_ctx: int, rpc: list[str], device: str = "auto",
                   n_batch: int = 512, n_ubatch: int = 512, type_k: str = "f16", type_v: str = "f16",
                   learn: bool = True) -> EngineOptions:
    """Engine options that realise a plan (cached layers get banks; resident ones stay whole)."""
    cache = []
    if plan is not None:
        cache = [CacheLayer(l.index, l.slots, tuple(l.pinned), policy=plan.policy) for l in plan.layers if l.mode == "cached"]
    host = [l.index for l in plan.layers if l.mode == "host"] if plan is not None else []
    return EngineOptions(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, rpc=rpc, device=device,
                         cache_layers=cache, host_layers=host, count_experts=learn, type_k=type_k, type_v=type_v)


def decode_counts(engine: Engine) -> np.ndarray | None:
    if not engine.cache_enabled:
        return None
    return engine.routing_counts(PHASE_DECODE).astype(np.float64)


def fold_into_profile(model: Path, geometry: ModelGeometry, counts: np.ndarray | None, source: str,
                      path: Path | None = None, timeout: float | None = None,
                      on_wait: Callable[[str], None] | None = None) -> RoutingProfile | None:
    """Add a run's decode counts to the model's profile (locked, atomic). Returns the new profile.

    A failed save keeps the counts in a pending side file and raises SaveError naming it."""
    if counts is None or counts.sum() <= 0:
        return None
    if counts.shape != (geometry.n_layer, geometry.n_expert):
        raise ProfileError(f"routing counts of shape {counts.shape} do not match the model")
    n_moe = max(1, len(geometry.moe_layers))
    tokens = float(counts.sum()) / (geometry.n_expert_used * n_moe)
    d = profile_store.delta(geometry.identity(), None, counts, 0.0, tokens, source)
    return profile_store.fold(path or profile_path_for(model), geometry.identity(), d,
                              timeout=lock_timeout_default() if timeout is None else timeout,
                              on_wait=on_wait).profile


def resolve_plan(model: Path, geometry: ModelGeometry, *, plan_path: Path | None, vram_text: str | None,
                 n_ctx: int, info: ProfileInfo, have_gpu: bool, free_bytes: int | None,
                 type_k: str = "f16", type_v: str = "f16") -> planner.Plan | None:
    """A plan file, or a plan made now from --vram (or the device's free memory); None = stock CPU run."""
    if plan_path is not None:
        if not Path(plan_path).is_file():
            raise PlanError(f"--plan {plan_path}: no such file", hint="write one with spark plan -o FILE")
        return planner.Plan.load(plan_path, expect_identity=geometry.identity())
    if not have_gpu:
        return None
    if vram_text:
        budget = vram.parse_size(vram_text, flag="--vram")
    elif free_bytes is not None:
        budget = device_budget(free_bytes)
    else:
        raise PlanError("no budget: the device did not report its free memory", hint="pass --vram, e.g. --vram 16GiB")
    return make_plan_for(model, geometry, budget, n_ctx, info, type_k, type_v)


def open_geometry(model: Path) -> ModelGeometry:
    return load_geometry(model, require_moe=True)
