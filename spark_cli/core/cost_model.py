"""Time per token of a placement on one device: the one cost model the planner and bench use.

A decode token on a placement of n MoE layers (resident r, cached c, host h; r + c + h = n):

    tg = base_tg + h * host_tg + sum over cached layers of (stop + misses_l * miss)
         (+ admissions_l * upload where uploads queue behind compute: no second device queue;
          with one, the upload queue's own busy time bounds the token from below)

- base_tg: one decode token with every expert on the device (attention, router, experts, logits);
- host_tg: what a host layer (stock --n-cpu-moe's) adds: its stop (ids and activations down, the
  result up) and its k experts on the CPU, less the device's share of them;
- stop: what a cached layer adds with no miss: its stop (ids down, slot ids, mask and partial up);
- misses_l: distinct experts per decode token of cached layer l not on the device (replayed from
  the profile's trace under the plan's policy), each costing `miss`: the CPU's time for one
  expert at one token, or its upload where that is cheaper (miss path auto: per expert and step);
- admissions_l: background uploads per decode token (the policy admitting misses into slots).

A prompt token: pp = base_pp + h * host_pp + sum over cached layers of cached_pp * off_l, with
off_l the layer's routed mass not pinned on the device (a prompt step is too large for the LRU
slots: it runs read-only, its misses on the CPU or staged).

Measured, the stock part (base + h * host) is not taken as a straight line: a host layer's cost
depends on how many there are (on the stand-in the first 15 of 30 cost less each than the next
15 in most runs, more in some), so where stock placements with two or more host-layer counts
were timed, the stock part is read off those timings (`stock_points`), linearly between them and
along the nearest segment beyond; each timed placement is then predicted as it was measured.

The figures come from a measurement on the device at hand (runs/device_costs.py: a few
placements timed, `fit`), kept per device, model and thread count, or from published figures
for a card that is not at hand (core/device_table.py). Pure: no llama_cpp, rich or typer.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, fields
from typing import Sequence

import numpy as np

COSTS_VERSION = 2  # 2: median timings, stock_points
# a host layer's figures may be negative: on a device slower than the CPU (lavapipe) a layer's
# experts on the CPU take less time than on the device, stop included
SIGNED = frozenset({"host_tg_us", "host_pp_us"})
FLOOR_US = 1.0  # no placement is predicted faster than this per token
OBJECTIVES = ("decode", "prompt")  # --objective: what a plan minimises (decode: tg time per token)


@dataclass(frozen=True)
class DeviceCosts:
    """Microseconds per token (or per event) on one device, model and thread count."""

    device: str  # what they describe: the device key, or a card's name for published figures
    source: str  # "measured <UTC time>" or "published figures (...)"
    threads: int  # the CPU threads they were measured at (0: not measured)
    base_tg_us: float  # a decode token, every expert on the device
    base_pp_us: float  # a prompt token, every expert on the device
    stop_us: float  # a cached layer per decode token, no miss: its stop
    host_tg_us: float  # a host layer (stock) per decode token beyond a resident one (< 0: the CPU is faster)
    host_pp_us: float  # a host layer per prompt token beyond a resident one (< 0: the CPU is faster)
    cached_pp_us: float  # a cached layer per prompt token with none of its routed mass pinned
    miss_cpu_us: float  # a missed expert computed on the CPU for one token
    miss_upload_us: float  # a missed expert uploaded (staged) and waited for
    concurrent: bool = False  # a second device queue: uploads run beside compute
    predicted: bool = False  # from published figures, not measured
    # stock placements timed: (host layers, us per decode token, us per prompt token), by host
    # layers; with two or more, the stock part of a prediction is read off them (module docstring)
    stock_points: tuple[tuple[int, float, float], ...] = ()

    def to_dict(self) -> dict:
        return {"version": COSTS_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceCosts":
        if d.get("version") != COSTS_VERSION:
            raise ValueError("device costs version")
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["stock_points"] = _points(kw.get("stock_points", ()))
        out = cls(**kw)
        for f in fields(cls):
            v = getattr(out, f.name)
            if f.type in ("float",) and not (isinstance(v, (int, float)) and np.isfinite(v)
                                             and (v >= 0 or f.name in SIGNED)):
                raise ValueError(f"device costs: {f.name}")
        return out

    def stock_us(self, n_host: int) -> tuple[float, float]:
        """Decode and prompt time per token of stock's placement with `n_host` host layers."""
        if len(self.stock_points) < 2:
            return self.base_tg_us + n_host * self.host_tg_us, self.base_pp_us + n_host * self.host_pp_us
        return _read_off(self.stock_points, n_host)

    def miss_us(self, miss_path: str) -> float:
        """One missed expert at decode on `miss_path` (auto and layer: the cheaper side)."""
        if miss_path == "cpu":
            return self.miss_cpu_us
        if miss_path == "upload":
            return self.miss_upload_us
        return min(self.miss_cpu_us, self.miss_upload_us)

    def describe(self) -> str:
        """One line: which device and where the figures come from."""
        th = f", {self.threads} thread{'s' if self.threads != 1 else ''}" if self.threads else ""
        return f"{self.device} ({self.source}{th})"


def _read_off(pts: Sequence[tuple[int, float, float]], n_host: int) -> tuple[float, float]:
    """(tg, pp) at `n_host` host layers on two or more stock points: linear between them, along
    the nearest segment beyond."""
    i = min(max(bisect.bisect_right([p[0] for p in pts], n_host) - 1, 0), len(pts) - 2)
    (n0, tg0, pp0), (n1, tg1, pp1) = pts[i], pts[i + 1]
    w = (n_host - n0) / (n1 - n0)
    return tg0 + w * (tg1 - tg0), pp0 + w * (pp1 - pp0)


def _points(raw) -> tuple[tuple[int, float, float], ...]:
    """Stock points read from a file: host-layer counts distinct, ascending, none negative; times finite
    and positive (ValueError otherwise)."""
    out = tuple((int(n), float(tg), float(pp)) for n, tg, pp in raw)
    ns = [p[0] for p in out]
    if ns != sorted(set(ns)) or any(n < 0 for n in ns) or \
            not all(np.isfinite(v) and v > 0 for p in out for v in p[1:]):
        raise ValueError("device costs: stock_points")
    return out


@dataclass(frozen=True)
class LayerLoad:
    """One MoE layer of a placement as the cost model reads it."""

    mode: str  # resident | cached | host
    misses: float = 0.0  # cached: distinct experts per decode token not on the device
    admissions: float = 0.0  # cached: background uploads per decode token
    off_mass: float = 1.0  # cached: share of routed entries not pinned (prompt steps)


@dataclass(frozen=True)
class Prediction:
    """Predicted time per token of one placement."""

    tg_us: float
    pp_us: float
    stops: int  # device stops per decode token (each cached or host layer, and the logits read-back)

    @property
    def tg_tok_s(self) -> float:
        return 1e6 / self.tg_us if self.tg_us > 0 else float("inf")

    @property
    def pp_tok_s(self) -> float:
        return 1e6 / self.pp_us if self.pp_us > 0 else float("inf")

    def time_us(self, objective: str) -> float:
        return self.pp_us if objective == "prompt" else self.tg_us

    def to_dict(self) -> dict:
        """JSON figures; a phase with no time (prompt, for a card whose compute is not known) is null: not
        predicted."""
        return {"tg_tok_s": self.tg_tok_s if self.tg_us > 0 else None,
                "pp_tok_s": self.pp_tok_s if self.pp_us > 0 else None, "stops": self.stops}


def predict(layers: Sequence[LayerLoad], costs: DeviceCosts, miss_path: str = "auto") -> Prediction:
    """Predicted decode and prompt time per token of a placement (see the module docstring)."""
    c = costs
    miss = c.miss_us(miss_path)
    n_host = sum(1 for l in layers if l.mode == "host")
    tg, pp = c.stock_us(n_host)
    upload_queue, stops = 0.0, 1 + n_host
    for l in layers:
        if l.mode == "cached":
            tg += c.stop_us + l.misses * miss
            pp += c.cached_pp_us * min(max(l.off_mass, 0.0), 1.0)
            upload_queue += l.admissions * c.miss_upload_us
            stops += 1
    if c.concurrent:
        tg = max(tg, upload_queue)
    else:
        tg += upload_queue
    return Prediction(max(tg, FLOOR_US), max(pp, FLOOR_US) if c.base_pp_us > 0 else 0.0, stops)


# ---------------------------------------------------------------- fitting a measurement


@dataclass(frozen=True)
class Sample:
    """One placement timed on the device (runs/device_costs.py)."""

    name: str  # what was run: resident, cpu-moe, n-cpu-moe N, cached
    n_host: int
    n_cached: int
    tg_us: float  # per decode token
    pp_us: float  # per prompt token
    miss_tg_us: float = 0.0  # cached: the misses' measured time per decode token (CPU and blocking uploads)
    off_mass: float = 0.0  # cached: mean share of prompt entries not pinned (1 without pins)

    def to_dict(self) -> dict:
        return asdict(self)


def _stock_points(samples: Sequence[Sample]) -> tuple[tuple[int, float, float], ...]:
    """The stock placements among `samples` (no cached layer) as (host layers, tg, pp), by host
    layers; several timings of one count are averaged."""
    by_n: dict[int, list[Sample]] = {}
    for s in samples:
        if s.n_cached == 0:
            by_n.setdefault(s.n_host, []).append(s)
    return tuple((n, float(np.mean([s.tg_us for s in ss])), float(np.mean([s.pp_us for s in ss])))
                 for n, ss in sorted(by_n.items()))


def fit(samples: Sequence[Sample], k: int, miss_cpu_us: float, miss_upload_us: float, *, device: str,
        source: str, threads: int, concurrent: bool) -> DeviceCosts:
    """The cost model's figures from timed placements. With stock placements at two or more
    host-layer counts, those timings are the stock part (`stock_points`; base and host figures
    summarise them: the time with none on the host, the mean slope to the most), and a cached
    layer's stop (and prompt cost) is what a cached placement adds to the stock part at its host
    layers, its misses' measured time taken off. A host layer's figures keep their sign. With
    fewer, a host layer is taken as its k experts on the CPU plus one cached stop."""
    points = _stock_points(samples)
    cached = [s for s in samples if s.n_cached > 0]
    if len(points) < 2 or not cached:
        tg, pp = _fit_assuming_host(samples, k, miss_cpu_us)
        base_tg, stop, base_pp, cached_pp = (max(float(v), 0.0) for v in (tg[0], tg[2], pp[0], pp[2]))
        return DeviceCosts(device, source, threads, base_tg, base_pp, stop, float(tg[1]), float(pp[1]), cached_pp,
                           miss_cpu_us, miss_upload_us, concurrent)
    base_tg, base_pp = _read_off(points, 0)
    top, top_tg, top_pp = points[-1]  # the most host layers timed (> 0: two counts or more)
    stops, prompt = [], []
    for s in cached:
        tg_h, pp_h = _read_off(points, s.n_host)
        stops.append((s.tg_us - s.miss_tg_us - tg_h) / s.n_cached)
        if s.off_mass > 0:
            prompt.append((s.pp_us - pp_h) / (s.n_cached * s.off_mass))
    stop, cached_pp = max(float(np.mean(stops)), 0.0), max(float(np.mean(prompt)) if prompt else 0.0, 0.0)
    return DeviceCosts(device, source, threads, max(base_tg, 0.0), max(base_pp, 0.0), stop,
                       (top_tg - base_tg) / top, (top_pp - base_pp) / top,  # host figures signed (SIGNED)
                       cached_pp, miss_cpu_us, miss_upload_us, concurrent, stock_points=points)


def _solve(rows: list[list[float]], y: list[float]) -> np.ndarray | None:
    """Least squares of y = rows @ x, or None when the rows do not determine x."""
    a, b = np.asarray(rows, np.float64), np.asarray(y, np.float64)
    if np.linalg.matrix_rank(a) < a.shape[1]:
        return None
    return np.linalg.lstsq(a, b, rcond=None)[0]


def _fit_assuming_host(samples: Sequence[Sample], k: int, miss_cpu_us: float) -> tuple[np.ndarray, np.ndarray]:
    """Two unknowns per phase: a host layer's decode cost tied to a cached one's stop
    (host_tg = stop + k * miss_cpu_us), its prompt cost to a fully missing cached layer's."""
    tg = _solve([[1.0, s.n_host + s.n_cached] for s in samples],
                [s.tg_us - s.miss_tg_us - s.n_host * k * miss_cpu_us for s in samples])
    pp = _solve([[1.0, s.n_host + s.n_cached * s.off_mass] for s in samples], [s.pp_us for s in samples])
    base_tg, stop = (tg if tg is not None else np.array([min(s.tg_us for s in samples), 0.0]))
    base_pp, per = (pp if pp is not None else np.array([min(s.pp_us for s in samples), 0.0]))
    return np.array([base_tg, stop + k * miss_cpu_us, stop]), np.array([base_pp, per, per])


# ---------------------------------------------------------------- the file tier


@dataclass(frozen=True)
class DiskCosts:
    """The disk under a model file (runs/disk_costs.py): reads of `read_bytes`, `depth` in flight."""

    read_bytes: int
    depth: int
    bytes_per_s: float
    latency_s: float  # one read alone

    @property
    def step_latency_s(self) -> float:
        """What a step's reads cost beyond their bytes at the rate in flight: a step waits at least for one
        read alone, whose latency is more than its bytes at that rate."""
        return max(0.0, self.latency_s - self.read_bytes / self.bytes_per_s)


def file_tier_tg(base_s: float, misses_per_token: float, expert_bytes: float, disk: DiskCosts, *,
                 miss_steps_per_token: float) -> float:
    """Seconds per decode token of a RAM-tier run: the token with every expert in RAM (`base_s`)
    plus the reads of its misses, which each layer's step with a miss waits for (all of a step's in
    flight: their bytes at the disk's rate, and the latency of the first beyond that)."""
    return base_s + misses_per_token * expert_bytes / disk.bytes_per_s + miss_steps_per_token * disk.step_latency_s


def file_tier_tg_ahead(base_s: float, uncovered_per_token: float, uncovered_steps_per_token: float,
                       ahead_steps: dict[int, float], expert_bytes: float, disk: DiskCosts, overlap_s: float) -> float:
    """file_tier_tg with read-ahead (core/prefetch.py): the token waits for the reads of its misses that
    were not read ahead, and a layer that reads q experts ahead for the next one hides them behind its
    compute (`overlap_s`) only: the next layer starts when they are in, so it waits
    max(0, q * read - overlap_s) more. `ahead_steps`: q -> layer steps per token that read q ahead
    (none, or only q = 0: no read-ahead, file_tier_tg). `uncovered_steps_per_token`: layer steps with a
    miss that was not read ahead."""
    read_s = expert_bytes / disk.bytes_per_s
    wait = sum(n * max(0.0, q * read_s - overlap_s) for q, n in ahead_steps.items())
    return file_tier_tg(base_s, uncovered_per_token, expert_bytes, disk, miss_steps_per_token=uncovered_steps_per_token) + wait
