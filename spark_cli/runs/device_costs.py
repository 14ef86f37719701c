"""The cost model's figures for the device at hand (core/cost_model.py), measured once per device,
model and thread count and kept under SPARK_HOME/calibration beside the miss-path calibration.

A measurement times a few placements on the device, whatever the budget (they only need to fit
its free memory): stock --cpu-moe, stock --n-cpu-moe N (about half the MoE layers on the host),
all resident where the device holds it, and every MoE layer cached with k policy slots (the cache
floor, miss path auto: its miss costs come from the miss-path calibration it runs). Each is timed
on a short prompt and a short greedy decode, three times or, while its decode timings spread
wider than a quarter of their median, up to seven, and the median is kept (bench reports medians:
a prediction from the fastest timings overshoots a machine that other work slows now and then,
and the median of a wide spread needs more timings to settle). cost_model.fit turns them into
the stock part (the stock placements' own timings), the stop and the host-layer figures.

Kept figures are checked before a bench uses them: the kept stock placements are timed again
the same way, and where one now decodes or prompts more than DRIFT faster or slower than when
kept (the machine's speed moved: another load, a power mode, a driver), every probe is measured
again, so that the prediction beside each measured configuration comes from the machine as it
is now."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ..core import planner, settle
from ..core.cost_model import DeviceCosts, Sample, fit
from ..core.gguf_info import ModelGeometry
from ..core.placement import cached_expert_overrides
from ..core.simulator import DEFAULT_POLICY, MissPath
from ..errors import SparkError
from ..files.atomic import atomic_write_text
from ..native import devices
from ..native.engine import Engine, EngineOptions
from ..native.expert_cache import CacheLayer, CacheStats
from ..native.generate import Greedy, StopRules
from . import miss_path as mp
from .run import open_engine

PROMPT_TOKENS = 128  # at most this long a prompt step per timing
DECODE_TOKENS = 32  # decode tokens per timing, at least (bench: its own -n where longer)
REPEATS = 3  # timings of each probe at least; the median is kept
MAX_REPEATS = 7  # at most: a probe is timed again while its decode timings spread wide (core/settle.py)
FIT_MARGIN = 1 << 30  # device memory left free by the placements measured

Progress = Callable[[str, int, int], None]


def cache_file(home: Path, device: str, fingerprint: str, threads: int) -> Path:
    key = hashlib.sha1(f"{device}\n{fingerprint}\n{threads}".encode()).hexdigest()[:16]
    return home / "calibration" / f"device-costs-{key}.json"


def load(home: Path, device: str, fingerprint: str, threads: int) -> DeviceCosts | None:
    """The kept figures of this device, model and thread count; None when there are none (or
    they cannot be read: they are measured again)."""
    kept = _kept(home, device, fingerprint, threads)
    return kept[0] if kept else None


def _kept(home: Path, device: str, fingerprint: str, threads: int) -> tuple[DeviceCosts, list[Sample]] | None:
    """The kept figures and the timings they were fitted from (samples that cannot be read: none)."""
    path = cache_file(home, device, fingerprint, threads)
    try:
        d = json.loads(path.read_text())
        costs = DeviceCosts.from_dict(d["costs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (d.get("fingerprint"), costs.device, costs.threads) != (fingerprint, device, threads):
        return None
    try:
        samples = [Sample(**s) for s in d.get("samples", [])]
    except TypeError:
        samples = []
    return costs, samples


def save(home: Path, fingerprint: str, costs: DeviceCosts, samples: Sequence[Sample]) -> Path:
    path = cache_file(home, costs.device, fingerprint, costs.threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"fingerprint": fingerprint, "costs": costs.to_dict(), "samples": [s.to_dict() for s in samples]}
    return atomic_write_text(path, json.dumps(body, indent=1) + "\n")


def device_of(opts: EngineOptions):
    """The first device a run with these options uses (None: the CPU alone)."""
    devs = devices.select(devices.parse(opts.device, opts.rpc))
    return devs[0] if devs else None


def for_run(opts: EngineOptions, fingerprint: str, home: Path) -> DeviceCosts | None:
    """The kept figures for a run with these options (its first device, its threads), if any."""
    dev = device_of(opts)
    return load(home, mp.device_key(dev), fingerprint, opts.threads) if dev is not None else None


# ---------------------------------------------------------------- measuring


@dataclasses.dataclass(frozen=True)
class Probe:
    """A placement to time."""

    name: str
    host: tuple[int, ...] = ()
    cached: tuple[int, ...] = ()


def probes(g: ModelGeometry, free_bytes: int, fixed_bytes: int) -> list[Probe]:
    """What to time: --cpu-moe, --n-cpu-moe with about half the MoE layers (more where the device
    needs it), all resident where it fits, every MoE layer at the cache floor."""
    moe = [l.index for l in g.layers if l.is_moe and not l.is_nextn]
    budget = max(free_bytes - FIT_MARGIN, 0)
    stock = planner.stock_baseline(g, budget, fixed_bytes)
    n_host = max(sum(1 for i in moe if i < stock.n_cpu_moe), len(moe) // 2)
    out = [Probe("cpu-moe", tuple(moe))]
    if 0 < n_host < len(moe):
        out.append(Probe(f"n-cpu-moe {n_host}", tuple(moe[:n_host])))
    if stock.fits and stock.n_cpu_moe == 0:
        out.append(Probe("resident"))
    out.append(Probe("cached", cached=tuple(moe)))
    return out


def _options(base: EngineOptions, g: ModelGeometry, p: Probe) -> EngineOptions:
    k = g.n_expert_used
    cache = [CacheLayer(il, k, (), miss_path=mp.initial_path(MissPath.AUTO), policy=DEFAULT_POLICY) for il in p.cached]
    return dataclasses.replace(
        base, host_layers=list(p.host), cache_layers=cache,
        stage_slices=planner.stage_slices(g.n_expert, k, "auto") if p.cached else 0,
        expert_overrides=cached_expert_overrides(g, p.cached) if p.cached else None,
        count_experts=False, trace=False, capture_topk=False)


def probe_bytes(g: ModelGeometry, fixed_bytes: int, p: Probe) -> int:
    """Device bytes of a probe's placement: the fixed bill, every resident layer's experts, k
    slots a cached layer, the staging slices where a layer is cached (host layers move their
    expert biases off the device too, as --n-cpu-moe does)."""
    k, host, cached = g.n_expert_used, set(p.host), set(p.cached)
    out = fixed_bytes
    for l in g.layers:
        if l.is_nextn or not l.is_moe:
            continue
        if l.index in host:
            out -= l.expert_bias_bytes
        elif l.index in cached:
            out += k * l.expert_bytes_per_expert
        else:
            out += l.expert_bytes
    if cached:
        out += planner.staging_bytes(g, planner.stage_slices(g.n_expert, k, "auto"))
    return out


def _time(eng: Engine, prompt: Sequence[int], n_decode: int) -> tuple[float, float, CacheStats]:
    """One prompt step (us per token), one greedy decode (us per token) and its cache counters."""
    eng.reset()
    t0 = time.perf_counter()
    eng.eval(list(prompt), logits="last")
    pp = (time.perf_counter() - t0) * 1e6 / len(prompt)
    eng.reset()
    last = None
    for last in eng.stream_generate(list(prompt[:16]), sampler=Greedy(skip_eog=True), max_tokens=n_decode,
                                    stop=StopRules(eog=False), on_prompt=lambda _: eng.reset_stats()):
        pass
    assert last is not None
    return pp, last.gen_seconds * 1e6 / n_decode, last.cache


@contextlib.contextmanager
def _warm(base: EngineOptions, g: ModelGeometry, p: Probe, prompt: Sequence[int], home: Path,
          on_miss: Callable[[mp.Calibration], None]) -> Iterator[Engine]:
    """A probe's engine, open, its miss path calibrated where it caches, and warmed up."""
    with open_engine(_options(base, g, p), "auto", g.fingerprint, home=home) as eng:
        if p.cached:
            cal, _ = mp.calibration(eng, g.fingerprint, home, list(p.cached))
            on_miss(cal)
        _time(eng, prompt[:8], 2)
        yield eng


Timing = tuple[float, float, CacheStats]


def settled(tg: Sequence[float]) -> bool:
    """Whether a probe has been timed enough (core/settle.py): REPEATS decode timings within a
    quarter of their median, or MAX_REPEATS of them."""
    return settle.settled(tg, REPEATS, MAX_REPEATS)


def _timings(base: EngineOptions, g: ModelGeometry, todo: Sequence[Probe], prompt: Sequence[int], n_decode: int,
             home: Path, together: bool, on_miss: Callable[[mp.Calibration], None],
             progress: Progress | None, label: str = "device costs") -> list[list[Timing]]:
    """Each probe's timings until settled(): with every probe open at once, one of each unsettled
    probe in turn (a machine whose speed drifts drifts for all of them alike, as bench runs), else
    one probe after another."""
    out: list[list[Timing]] = [[] for _ in todo]

    def done(i: int) -> bool:
        return settled([t[1] for t in out[i]])

    def step(i: int, eng: Engine) -> None:
        out[i].append(_time(eng, prompt, n_decode))
        if progress:
            total = sum(len(o) if done(j) else max(REPEATS, len(o) + 1) for j, o in enumerate(out))
            progress(label, sum(len(o) for o in out), total)

    if together:
        with contextlib.ExitStack() as stack:
            engines = [stack.enter_context(_warm(base, g, p, prompt, home, on_miss)) for p in todo]
            while not all(done(i) for i in range(len(todo))):
                for i, eng in enumerate(engines):
                    if not done(i):
                        step(i, eng)
        return out
    for i, p in enumerate(todo):
        with _warm(base, g, p, prompt, home, on_miss) as eng:
            while not done(i):
                step(i, eng)
    return out


def _sample(p: Probe, runs: Sequence[Timing], n_decode: int) -> Sample:
    pp = statistics.median(r[0] for r in runs)
    tg = statistics.median(r[1] for r in runs)
    cache = CacheStats.total(r[2] for r in runs)
    miss_us = (cache.cpu_us + cache.upload_us) / (len(runs) * n_decode) if p.cached else 0.0
    return Sample(p.name, len(p.host), len(p.cached), tg, pp, miss_us, 1.0 if p.cached else 0.0)


def measure(base: EngineOptions, g: ModelGeometry, prompt: Sequence[int], home: Path,
            progress: Progress | None = None, n_decode: int = DECODE_TOKENS) -> tuple[DeviceCosts, list[Sample]]:
    """Time the probes on the first device of `base` and fit the cost model's figures."""
    dev = _device(base)
    free, fixed = _room(base, g)
    todo = probes(g, free, fixed)
    together = _fit_together(g, fixed, free, todo)
    miss: list[mp.Calibration] = []
    samples = _timed(base, g, todo, prompt, home, together, miss.append, progress, n_decode)
    cal = miss[0] if miss else None
    cpu_us = (cal.median("cpu_us") if cal else None) or 0.0
    upload_us = (cal.median("upload_us") if cal else None) or 0.0
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    order = "interleaved" if together else "one after another"
    costs = fit(samples, g.n_expert_used, cpu_us, upload_us, device=mp.device_key(dev),
                source=f"measured {when}, {order}", threads=base.threads, concurrent=not dev.name.startswith("RPC"))
    return costs, samples


def _device(base: EngineOptions):
    dev = device_of(base)
    if dev is None:
        raise SparkError("device costs: no device to measure", hint="give -dev or --rpc")
    return dev


def _room(base: EngineOptions, g: ModelGeometry) -> tuple[int, int]:
    """The device's free bytes, and the bytes every placement of a run with these options needs
    beside its experts (planner.fixed_bytes)."""
    free, _ = devices.free_memory(_device(base))
    return free, planner.fixed_bytes(g, base.n_ctx, base.type_k, base.type_v, base.n_ubatch, base.n_seq,
                                     base.kv_unified)


def _fit_together(g: ModelGeometry, fixed: int, free: int, todo: Sequence[Probe]) -> bool:
    """Whether the probes fit the device's free memory all at once (then they are timed in turn)."""
    return sum(probe_bytes(g, fixed, p) for p in todo) + FIT_MARGIN <= free


def _timed(base: EngineOptions, g: ModelGeometry, todo: Sequence[Probe], prompt: Sequence[int], home: Path,
           together: bool, on_miss: Callable[[mp.Calibration], None], progress: Progress | None,
           n_decode: int, label: str = "device costs") -> list[Sample]:
    """Each probe's sample: its median timings until settled()."""
    prompt = list(prompt)[:PROMPT_TOKENS]
    if progress:
        progress(label, 0, len(todo) * REPEATS)
    timings = _timings(base, g, todo, prompt, n_decode, home, together, on_miss, progress, label)
    return [_sample(p, runs, n_decode) for p, runs in zip(todo, timings)]


# ---------------------------------------------------------------- kept figures checked


DRIFT = 0.15  # a kept stock placement timed again this much faster or slower (either phase): measured again


def stock_probes(g: ModelGeometry, samples: Sequence[Sample]) -> list[Probe]:
    """The stock placements among kept samples, to time again: --n-cpu-moe N hosts the first N
    MoE layers, as probes() places them."""
    moe = [l.index for l in g.layers if l.is_moe and not l.is_nextn]
    return [Probe(s.name, tuple(moe[:s.n_host])) for s in samples if s.n_cached == 0 and s.n_host <= len(moe)]


def drift(kept: Sequence[Sample], now: Sequence[Sample]) -> str | None:
    """Why kept timings no longer hold, in a few words: the first placement (by name) whose decode
    or prompt time now differs from the kept one by more than DRIFT; None when all hold."""
    then = {s.name: s for s in kept}
    for s in now:
        old = then.get(s.name)
        if old is None:
            continue
        for what, a, b in (("decodes", old.tg_us, s.tg_us), ("prompts", old.pp_us, s.pp_us)):
            if a > 0 and b > 0 and abs(a / b - 1) > DRIFT:
                return f"{s.name} {what} {a / b:.2f}x as fast as when kept"
    return None


def check(base: EngineOptions, g: ModelGeometry, samples: Sequence[Sample], prompt: Sequence[int], home: Path,
          progress: Progress | None = None, n_decode: int = DECODE_TOKENS) -> str | None:
    """Time the kept stock placements again, as measure() times them; why the kept figures no
    longer hold (drift()), or None. Nothing to time again (no kept stock timings): None."""
    todo = stock_probes(g, samples)
    if not todo:
        return None
    free, fixed = _room(base, g)
    together = _fit_together(g, fixed, free, todo)
    now = _timed(base, g, todo, prompt, home, together, lambda _: None, progress, n_decode, "device costs (check)")
    return drift(samples, now)


def ensure(base: EngineOptions, g: ModelGeometry, prompt: Sequence[int], home: Path,
           progress: Progress | None = None, n_decode: int = DECODE_TOKENS) -> tuple[DeviceCosts | None, str]:
    """The kept figures for this device, model and threads once their stock placements, timed
    again, still hold (check()); else measured now and kept. (None, why) without a device. The
    second value says which, in one line."""
    dev = device_of(base)
    if dev is None:
        return None, "no device: plans are not priced in time"
    kept = _kept(home, mp.device_key(dev), g.fingerprint, base.threads)
    again = ""
    if kept is not None:
        costs, samples = kept
        why = check(base, g, samples, prompt, home, progress, n_decode)
        if why is None:
            timed = f", its stock placements timed again within {DRIFT:.0%}" if stock_probes(g, samples) else ""
            return costs, f"device costs: {costs.describe()}, kept{timed}"
        again = f", measured again: {why}"
    costs, samples = measure(base, g, prompt, home, progress, n_decode)
    note = ""
    try:
        save(home, g.fingerprint, costs, samples)
    except (OSError, SparkError):
        note = " (not saved)"
    return costs, f"device costs: {costs.describe()}{again}{note}"
