"""Typed ctypes binding of the expert-cache C API, native/include/llama-expert-cache-api.h.

The structs mirror the header field for field; `ExpertCacheAPI.bind` refuses a library of
another API version (LLAMA_EXPERT_CACHE_API_VERSION) so a stale build fails at load, not
with garbage in a struct. `ExpertCache` wraps one llama_context; its methods are named
after the C functions (llama_expert_cache_<name>).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Sequence

import numpy as np

from ..core import simulator, trace
from ..core.bill import BufferBill, MeasuredBill
from ..core.simulator import DEFAULT_POLICY, MissPath
from ..errors import NativeError

API_VERSION = 8  # LLAMA_EXPERT_CACHE_API_VERSION this binding matches
REBUILD_HINT = "rerun scripts/bootstrap.sh to install the native build of this checkout"


class Status(IntEnum):
    """enum llama_expert_cache_status."""

    OK = 0
    ERR_ARG = -1
    ERR_NOT_MOE = -2
    ERR_SLOTS = -3
    ERR_EXPERT_ID = -4
    ERR_NO_MEMORY = -5
    ERR_PLACEMENT = -6
    ERR_LAYER = -7
    ERR_INTERNAL = -8
    ERR_VERSION = -9


class Phase(IntEnum):
    """enum llama_expert_cache_phase."""

    PREFILL = trace.PREFILL
    DECODE = trace.DECODE


class NativeMissPath(IntEnum):
    """enum llama_expert_cache_miss_path: a layer's MissPath (LAYER_MISS_PATHS) by the same name."""

    UPLOAD = 0
    CPU = 1
    AUTO = 2


HINTS: dict[Status, str] = {
    Status.ERR_ARG: "a bug in Spark's call (see SPARK_VERBOSE=1)",
    Status.ERR_NOT_MOE: "cache only MoE layers",
    Status.ERR_SLOTS: "give each cached layer at least as many LRU slots as experts used per token",
    Status.ERR_EXPERT_ID: "pinned expert ids must be distinct and below the expert count",
    Status.ERR_NO_MEMORY: "lower the slot counts or raise the device budget",
    Status.ERR_PLACEMENT: "cached layers must run on a GPU-type device with their experts in host RAM, "
                          "or on the CPU with the file tier (--ram) reading a one-file GGUF",
    Status.ERR_LAYER: "list each layer once, within the model's layer count",
    Status.ERR_INTERNAL: "see SPARK_VERBOSE=1 for llama.cpp's log",
    Status.ERR_VERSION: REBUILD_HINT,
}


class LayerParams(ctypes.Structure):
    """struct llama_expert_cache_layer_params."""

    _fields_ = [
        ("il", ctypes.c_int32),
        ("n_slots", ctypes.c_int32),
        ("n_pinned", ctypes.c_int32),
        ("pinned", ctypes.POINTER(ctypes.c_int32)),
        ("miss_path", ctypes.c_int32),
        ("max_admit", ctypes.c_int32),
        ("policy", ctypes.c_int32),
        ("in_ram", ctypes.c_int32),
    ]


class Params(ctypes.Structure):
    """struct llama_expert_cache_params (start from ExpertCacheAPI.default_params)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("layers", ctypes.POINTER(LayerParams)),
        ("n_layers", ctypes.c_int32),
        ("device_budget", ctypes.c_size_t),
        ("device_margin", ctypes.c_size_t),
        ("trace", ctypes.c_bool),
        ("trace_max", ctypes.c_int64),
        ("n_threads", ctypes.c_int32),
        ("policy_window", ctypes.c_int32),
        ("slru_protected_num", ctypes.c_int32),
        ("slru_protected_den", ctypes.c_int32),
        ("n_stage", ctypes.c_int32),
        ("count_uncached", ctypes.c_bool),
        ("file_path", ctypes.c_char_p),
        ("n_readers", ctypes.c_int32),
        ("host_budget", ctypes.c_size_t),
        ("ahead", ctypes.c_int32),
        ("ahead_min_prob", ctypes.c_int32),
    ]


class Stats(ctypes.Structure):
    """struct llama_expert_cache_stats."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "hits", "misses", "uploads", "bytes_uploaded", "upload_us", "steps_cached", "steps_stock",
        "syncs", "blocking_upload_bytes", "async_uploads", "async_upload_bytes", "cpu_experts",
        "cpu_expert_bytes", "cpu_us", "cpu_entries", "admit_skipped", "staged_uploads", "staged_upload_bytes",
        "stop_reads", "stop_writes", "blocking_calls", "ahead_reads", "ahead_used", "ahead_bytes")]


class MemEntry(ctypes.Structure):
    """struct llama_expert_cache_mem_entry."""

    _fields_ = [
        ("buft", ctypes.c_char * 64),
        ("device", ctypes.c_char * 64),
        ("is_host", ctypes.c_int32),
        ("model", ctypes.c_uint64),
        ("context", ctypes.c_uint64),
        ("compute", ctypes.c_uint64),
        ("banks", ctypes.c_uint64),
    ]

    def bill(self) -> BufferBill:
        return BufferBill(self.buft.decode(errors="replace"), self.device.decode(errors="replace"),
                          bool(self.is_host), int(self.model), int(self.context), int(self.compute), int(self.banks))


@dataclass(frozen=True)
class CacheStats:
    """Counters of one cached layer (or a sum of layers); see the header for each field."""

    hits: int = 0
    misses: int = 0
    uploads: int = 0
    bytes_uploaded: int = 0
    upload_us: int = 0
    steps_cached: int = 0
    steps_stock: int = 0
    syncs: int = 0
    blocking_upload_bytes: int = 0
    async_uploads: int = 0
    async_upload_bytes: int = 0
    cpu_experts: int = 0
    cpu_expert_bytes: int = 0
    cpu_us: int = 0
    cpu_entries: int = 0
    admit_skipped: int = 0
    staged_uploads: int = 0
    staged_upload_bytes: int = 0
    stop_reads: int = 0
    stop_writes: int = 0
    blocking_calls: int = 0
    ahead_reads: int = 0
    ahead_used: int = 0
    ahead_bytes: int = 0

    @classmethod
    def from_struct(cls, s: Stats) -> "CacheStats":
        return cls(**{f.name: int(getattr(s, f.name)) for f in fields(cls)})

    def __add__(self, other: "CacheStats") -> "CacheStats":
        return CacheStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "CacheStats") -> "CacheStats":
        return CacheStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @classmethod
    def total(cls, items) -> "CacheStats":
        out = cls()
        for s in items:
            out = out + s
        return out

    @property
    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None


assert [f.name for f in fields(CacheStats)] == [n for n, _ in Stats._fields_], "CacheStats must mirror Stats"


@dataclass(frozen=True)
class CacheLayer:
    """One cached MoE layer: `n_slots` device slots, the first `len(pinned)` pinned."""

    il: int
    n_slots: int
    pinned: tuple[int, ...] = ()
    miss_path: MissPath = MissPath.UPLOAD  # one of LAYER_MISS_PATHS
    max_admit: int = -1  # CPU miss path: admissions per decode step (<0: experts used per token)
    policy: str = DEFAULT_POLICY  # a native policy (simulator.NATIVE_POLICY_IDS)
    in_ram: bool = False  # the file tier: slots in RAM, misses read from the model file (a device's layer too)


class ExpertCacheAPI:
    """The C functions of one loaded library, with their ctypes signatures."""

    def __init__(self, lib: ctypes.CDLL):
        vp, sz, i32, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int64

        def fn(name: str, restype, argtypes):
            f = getattr(lib, f"llama_expert_cache_{name}")
            f.restype, f.argtypes = restype, argtypes
            return f

        self.api_version = fn("api_version", i32, [])
        self.default_params = fn("default_params", Params, [])
        self.init = fn("init", i32, [vp, ctypes.POINTER(Params), ctypes.c_char_p, sz])
        self.free = fn("free", None, [vp])
        self.enabled = fn("enabled", ctypes.c_bool, [vp])
        self.set_miss_path = fn("set_miss_path", i32, [vp, i32, i32])
        self.get_miss_path = fn("get_miss_path", i32, [vp, i32])
        self.set_miss_costs = fn("set_miss_costs", i32, [vp, i32, i64, i64, i64])
        self.get_stats = fn("get_stats", i32, [vp, i32, ctypes.POINTER(Stats)])
        self.get_counts = fn("get_counts", i32, [vp, i32, i32, ctypes.POINTER(ctypes.c_uint64), i32])
        self.get_slots = fn("get_slots", i32, [vp, i32, ctypes.POINTER(ctypes.c_int32), i32])
        self.get_trace = fn("get_trace", i64, [vp, ctypes.POINTER(ctypes.c_int32), i64])
        self.get_trace_dropped = fn("get_trace_dropped", i64, [vp])
        self.reset_stats = fn("reset_stats", None, [vp])
        self.device_bytes = fn("device_bytes", sz, [vp])
        self.memory_breakdown = fn("memory_breakdown", i32, [vp, ctypes.POINTER(MemEntry), i32])

    @classmethod
    def bind(cls, lib: ctypes.CDLL) -> "ExpertCacheAPI | None":
        """The API of `lib`; None for a library without the expert cache (stock llama.cpp).
        NativeError (one line) for a library of another API version."""
        if not hasattr(lib, "llama_expert_cache_init"):
            return None
        if not hasattr(lib, "llama_expert_cache_api_version"):
            raise NativeError(f"the installed llama.cpp has expert cache API v1, Spark needs v{API_VERSION}",
                              hint=REBUILD_HINT)
        version = lib.llama_expert_cache_api_version
        version.restype, version.argtypes = ctypes.c_int32, []
        got = int(version())  # NOTE: before binding the rest: an older API lacks newer functions
        if got != API_VERSION:
            raise NativeError(f"the installed llama.cpp has expert cache API v{got}, Spark needs v{API_VERSION}",
                              hint=REBUILD_HINT)
        api = cls(lib)
        size = ctypes.sizeof(Params)
        if api.default_params().size != size:
            raise NativeError(f"the installed llama.cpp's expert cache params are {api.default_params().size} bytes, "
                              f"this binding's {size}", hint=REBUILD_HINT)
        return api


def native_policy_id(policy: str) -> int:
    """enum llama_expert_cache_policy of a simulator policy name (belady has none)."""
    from ..core.simulator import NATIVE_POLICY_IDS, canonical_policy

    p = canonical_policy(policy)
    if p not in NATIVE_POLICY_IDS:
        raise NativeError(f"expert cache: policy {policy!r} cannot run in the native cache",
                          hint="use one of " + ", ".join(NATIVE_POLICY_IDS))
    return NATIVE_POLICY_IDS[p]


class ExpertCache:
    """The expert cache of one llama_context: methods named after the C functions."""

    def __init__(self, api: ExpertCacheAPI, ctx: int):
        self.api, self.ctx = api, ctx
        self._keep: list[object] = []  # arrays the params point into, alive while the cache is

    def default_params(self) -> Params:
        return self.api.default_params()

    def init(self, layers: Sequence[CacheLayer], *, device_budget: int = 0, device_margin: int | None = None,
             trace: bool = False, trace_max: int | None = None, n_threads: int | None = None,
             policy_params: simulator.PolicyParams = simulator.PolicyParams(), n_stage: int = 0,
             count_uncached: bool = True, file_path: str | None = None, n_readers: int | None = None,
             host_budget: int = 0, ahead: int = 0, ahead_min_prob: int = 0) -> None:
        """Attach a cache (n_layers 0: counting only). NativeError with the library's reason.
        The policies' tunables come from the simulator, their specification. n_stage: staging
        slices, shared by the layers of one expert shape (misses uploaded for one step).
        count_uncached: the layers not cached count their routing too, at a device stop each per step.
        file_path: the file tier: cached layers on the CPU keep their slots in RAM and read misses from
        this model file, n_readers reads in flight; host_budget: bytes those RAM banks may take (0: any);
        ahead: experts of the next file-tier layer read ahead per decode step at most, at a predicted chance
        of at least ahead_min_prob (fixed point, 1 << 16 = 1; core/prefetch.py replays the predictor)."""
        p = self.default_params()
        p.n_stage = n_stage
        p.count_uncached = count_uncached
        p.policy_window = policy_params.window
        p.slru_protected_num, p.slru_protected_den = policy_params.protected_num, policy_params.protected_den
        arr = (LayerParams * max(1, len(layers)))()
        keep: list[object] = [arr]
        for i, c in enumerate(layers):
            pinned = (ctypes.c_int32 * max(1, len(c.pinned)))(*c.pinned)
            keep.append(pinned)
            arr[i] = LayerParams(c.il, c.n_slots, len(c.pinned), ctypes.cast(pinned, ctypes.POINTER(ctypes.c_int32)),
                                 NativeMissPath[MissPath(c.miss_path).name], c.max_admit, native_policy_id(c.policy),
                                 int(c.in_ram))
        p.layers = ctypes.cast(arr, ctypes.POINTER(LayerParams))
        p.n_layers = len(layers)
        p.device_budget = device_budget
        if device_margin is not None:
            p.device_margin = device_margin
        p.trace = trace
        if trace_max is not None:
            p.trace_max = trace_max
        if n_threads is not None:
            p.n_threads = n_threads
        if file_path is not None:
            path = os.fsencode(file_path)
            keep.append(path)
            p.file_path = path
        if n_readers is not None:
            p.n_readers = n_readers
        p.host_budget = host_budget
        p.ahead, p.ahead_min_prob = ahead, ahead_min_prob
        err = ctypes.create_string_buffer(512)
        rc = self.api.init(self.ctx, ctypes.byref(p), err, len(err))
        if rc != Status.OK:
            status = _status(rc)
            msg = err.value.decode(errors="replace") or (status.name if status else f"status {rc}")
            raise NativeError(f"expert cache: {msg}", hint=HINTS.get(status) if status else None)
        self._keep = keep

    def free(self) -> None:
        self.api.free(self.ctx)
        self._keep = []

    def enabled(self) -> bool:
        return bool(self.api.enabled(self.ctx))

    def set_miss_path(self, il: int, miss_path: MissPath) -> None:
        rc = self.api.set_miss_path(self.ctx, il, NativeMissPath[MissPath(miss_path).name])
        if rc != Status.OK:
            status = _status(rc)
            raise NativeError(f"expert cache: layer {il}: cannot set miss path {miss_path} "
                              f"({status.name if status else rc})", hint=HINTS.get(status) if status else None)

    def set_miss_costs(self, il: int, costs: "simulator.MissCosts") -> None:
        """The auto path's costs of layer il (ns): a missed expert on the CPU (cpu_expert_ns plus
        cpu_ns per entry), one expert's upload into a staging slice (upload_ns)."""
        rc = self.api.set_miss_costs(self.ctx, il, int(costs.cpu_expert_ns), int(costs.cpu_ns), int(costs.upload_ns))
        if rc != Status.OK:
            status = _status(rc)
            raise NativeError(f"expert cache: layer {il}: cannot set miss costs ({status.name if status else rc})",
                              hint=HINTS.get(status) if status else None)

    def get_miss_path(self, il: int) -> MissPath | None:
        """The layer's miss path, or None for a layer that is not cached."""
        rc = self.api.get_miss_path(self.ctx, il)
        return MissPath[NativeMissPath(rc).name] if rc >= 0 else None

    def get_stats(self, il: int) -> CacheStats | None:
        s = Stats()
        return CacheStats.from_struct(s) if self.api.get_stats(self.ctx, il, ctypes.byref(s)) == Status.OK else None

    def get_counts(self, il: int, phase: Phase, n_expert: int) -> np.ndarray | None:
        """[n_expert] routed occurrences of layer il in one phase; None for a dense layer."""
        buf = (ctypes.c_uint64 * max(1, n_expert))()
        n = self.api.get_counts(self.ctx, il, int(phase), buf, n_expert)
        return np.array(buf[:n], dtype=np.int64) if n > 0 else None

    def get_slots(self, il: int, n_slots: int) -> list[int]:
        """Expert per slot (-1 free, -2 - e: admission of e in flight); [] for a layer not cached."""
        buf = (ctypes.c_int32 * max(1, n_slots))()
        n = self.api.get_slots(self.ctx, il, buf, n_slots)
        return list(buf[:min(n, n_slots)]) if n > 0 else []

    def get_trace(self) -> np.ndarray:
        """The raw trace: records [il, n_tokens, k, phase, ids...] as int32."""
        n = int(self.api.get_trace(self.ctx, None, 0))
        if n <= 0:
            return np.zeros(0, np.int32)
        buf = (ctypes.c_int32 * n)()
        self.api.get_trace(self.ctx, buf, n)
        return np.frombuffer(buf, dtype=np.int32).copy()

    def get_trace_dropped(self) -> int:
        return int(self.api.get_trace_dropped(self.ctx))

    def reset_stats(self) -> None:
        self.api.reset_stats(self.ctx)

    def device_bytes(self) -> int:
        return int(self.api.device_bytes(self.ctx))

    def memory_breakdown(self) -> MeasuredBill:
        """llama.cpp's memory per buffer type, with the banks (reserves a changed graph first)."""
        n = 16
        while True:
            buf = (MemEntry * n)()
            got = int(self.api.memory_breakdown(self.ctx, buf, n))
            if got < 0:
                status = _status(got)
                raise NativeError(f"expert cache: memory breakdown failed ({status.name if status else got})",
                                  hint=HINTS.get(status) if status else None)
            if got <= n:
                return MeasuredBill(tuple(buf[i].bill() for i in range(got)))
            n = got


def _status(rc: int) -> Status | None:
    try:
        return Status(rc)
    except ValueError:
        return None
