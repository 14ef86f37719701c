"""How fast this CPU streams experts of each ggml type, timed on ggml's own CPU kernels (the
mul_mat_id a host layer's experts run through at decode: one token, k experts drawn from a pool
larger than a last-level cache). A kept CPU calibration is measured on one model's experts;
runs/host_calibration.py scales it by these rates to price a model whose experts are of other
types (IQ3_XXS streams at a quarter of Q4_K's bytes a second on an AVX-512 core)."""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import NativeError
from .llama_lib import load

POOL_BYTES = 256 * 2**20  # the experts one measurement draws from: more than a CPU's cache
MAX_EXPERTS = 512  # experts one weight tensor holds: a mul_mat_id's bookkeeping grows with them
GRAPH_BYTES = 64 * 2**20  # expert bytes one timed graph reads
ROW = 2048  # a row's length: a multiple of every block size, as a model's hidden size is
QUANT_ROWS = 64  # rows quantized; the rest of an expert repeats them at other addresses
K = 8  # experts a token reads, as Qwen3's and gpt-oss's routers pick (4 to 8)
OPS = 16  # at most this many mul_mat_id nodes in one graph: one thread pool start spread over them
REPS = 9  # graphs timed; the fastest is kept (another process's work only ever slows one down)
WORK_BYTES = 16 * 2**20  # the context's room for tensors, the graph and each run's work buffer
# the types ggml_quantize_chunk makes without an importance matrix (gguf's names); others are not timed
QUANTIZABLE = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q2_K", "Q3_K",
                         "Q4_K", "Q5_K", "Q6_K", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"})


class InitParams(ctypes.Structure):
    """`struct ggml_init_params`."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@dataclass(frozen=True)
class TypeRate:
    """One measurement: experts of `ggml_type`, `expert_bytes` each, on `threads` threads."""

    ggml_type: str
    expert_bytes: int
    threads: int
    gb_s: float  # bytes of the experts read a microsecond, / 1e3


RateFn = Callable[[str, int, int], "TypeRate | None"]


@functools.lru_cache(maxsize=1)
def _api() -> dict:
    try:
        return _bind(load())
    except (OSError, AttributeError) as e:  # a build without these symbols, or split CPU libraries
        raise NativeError(f"ggml's CPU functions are not loadable ({e.__class__.__name__}: {e})",
                          hint="rerun scripts/bootstrap.sh to install the native build") from None


def _bind(lib) -> dict:
    base, cpu = lib.base_lib, lib.cpu_lib
    vp, i64, sz, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_int

    def fn(l, name, res, args):
        f = getattr(l, name)
        f.restype, f.argtypes = res, args
        return f

    api = {
        "init": fn(base, "ggml_init", vp, [InitParams]),
        "free": fn(base, "ggml_free", None, [vp]),
        "type_name": fn(base, "ggml_type_name", ctypes.c_char_p, [c_int]),
        "row_size": fn(base, "ggml_row_size", sz, [c_int, i64]),
        "needs_imatrix": fn(base, "ggml_quantize_requires_imatrix", ctypes.c_bool, [c_int]),
        "quantize": fn(base, "ggml_quantize_chunk", sz, [c_int, vp, vp, i64, i64, i64, vp]),
        "tensor_3d": fn(base, "ggml_new_tensor_3d", vp, [vp, c_int, i64, i64, i64]),
        "tensor_2d": fn(base, "ggml_new_tensor_2d", vp, [vp, c_int, i64, i64]),
        "mul_mat_id": fn(base, "ggml_mul_mat_id", vp, [vp, vp, vp, vp]),
        "new_graph": fn(base, "ggml_new_graph", vp, [vp]),
        "expand": fn(base, "ggml_build_forward_expand", None, [vp, vp]),
        "data": fn(base, "ggml_get_data", vp, [vp]),
        "compute": fn(cpu, "ggml_graph_compute_with_ctx", c_int, [vp, vp, c_int]),
    }
    fn(cpu, "ggml_cpu_init", None, [])()
    return api


def type_id(name: str) -> int:
    """ggml's enum value of a type name as gguf spells it ('Q4_K'), checked against the library."""
    from gguf import GGMLQuantizationType

    try:
        tid = int(GGMLQuantizationType[name])
    except KeyError:
        raise NativeError(f"ggml type {name!r} is not one gguf knows",
                          hint="rerun scripts/bootstrap.sh: the model's types are newer than this install") from None
    got = (_api()["type_name"](tid) or b"").decode()
    if got.upper() != name.upper():
        raise NativeError(f"ggml type {name}: the library calls type {tid} {got!r}",
                          hint="rerun scripts/bootstrap.sh: gguf and the native build disagree")
    return tid


@dataclass(frozen=True)
class _Shape:
    """How one measurement lays its experts out: `per` bytes each (`rows` rows of ROW weights),
    `n_exp` to a weight tensor, `n_tensors` tensors, `ops` mul_mat_id nodes a graph."""

    rows: int
    per: int
    n_exp: int
    n_tensors: int
    ops: int

    @classmethod
    def of(cls, row_bytes: int, expert_bytes: int) -> "_Shape":
        rows = max(1, round(expert_bytes / row_bytes))
        per = rows * row_bytes
        n_exp = min(MAX_EXPERTS, max(2 * K, POOL_BYTES // per))
        return cls(rows, per, n_exp, max(1, min(OPS, POOL_BYTES // (n_exp * per))),
                   max(1, min(OPS, GRAPH_BYTES // (K * per))))


@functools.lru_cache(maxsize=64)
def expert_rate(ggml_type: str, expert_bytes: int, threads: int) -> TypeRate | None:
    """GB/s at which one token's K experts of `ggml_type` (about `expert_bytes` each) stream through
    the CPU's mul_mat_id on `threads` threads (None: a type ggml cannot quantize without an
    importance matrix, or at all)."""
    if ggml_type.upper() not in QUANTIZABLE:
        return None
    api = _api()
    tid = type_id(ggml_type)
    if api["needs_imatrix"](tid):
        return None
    s = _Shape.of(api["row_size"](tid, ROW), expert_bytes)
    ctx = api["init"](InitParams(s.n_tensors * s.n_exp * s.per + WORK_BYTES, None, False))
    try:
        return TypeRate(ggml_type, s.per, threads, _timed(api, ctx, tid, s, threads))
    finally:
        api["free"](ctx)


def _weights(api, ctx, tid: int, s: _Shape, rng: np.random.Generator) -> list:
    """The pool: `n_tensors` weight tensors of `n_exp` experts, all holding one expert's bytes."""
    ws = [api["tensor_3d"](ctx, tid, ROW, s.rows, s.n_exp) for _ in range(s.n_tensors)]
    first = api["data"](ws[0])
    rows = min(s.rows, QUANT_ROWS)
    src = rng.standard_normal(ROW * rows, dtype=np.float32)
    api["quantize"](tid, src.ctypes.data, first, 0, rows, ROW, None)
    done = api["row_size"](tid, ROW) * rows
    while done < s.per:  # the expert's other rows repeat the quantized ones
        n = min(done, s.per - done)
        ctypes.memmove(first + done, first, n)
        done += n
    for w in ws:
        for e in range(s.n_exp):
            if w != ws[0] or e:
                ctypes.memmove(api["data"](w) + e * s.per, first, s.per)
    return ws


def _timed(api, ctx, tid: int, s: _Shape, threads: int) -> float:
    rng = np.random.default_rng(0)
    ws = _weights(api, ctx, tid, s, rng)
    x = api["tensor_3d"](ctx, 0, ROW, 1, 1)  # GGML_TYPE_F32
    xs = rng.standard_normal(ROW, dtype=np.float32)
    ctypes.memmove(api["data"](x), xs.ctypes.data, xs.nbytes)
    graph = api["new_graph"](ctx)
    ids = []
    for i in range(s.ops):
        t = api["tensor_2d"](ctx, 26, K, 1)  # GGML_TYPE_I32
        ids.append(ctypes.cast(api["data"](t), ctypes.POINTER(ctypes.c_int32)))
        api["expand"](graph, api["mul_mat_id"](ctx, ws[i % len(ws)], x, t))
    times = []
    for rep in range(REPS + 1):  # the first run warms the pool and the pages
        for p in ids:
            for j, e in enumerate(rng.choice(s.n_exp, K, replace=False)):
                p[j] = int(e)
        t0 = time.perf_counter()
        if api["compute"](ctx, graph, threads) != 0:
            raise NativeError("ggml_graph_compute_with_ctx failed timing the CPU's experts",
                              hint="rerun; if it persists, rerun scripts/bootstrap.sh")
        if rep:
            times.append(time.perf_counter() - t0)
    return s.ops * K * s.per / (min(times) * 1e6) / 1e3


def mix_rate(mix: dict[str, float], threads: int, rate: RateFn = expert_rate) -> float | None:
    """GB/s of a model's experts whose bytes per expert by type are `mix` (a Q4_K_M layer holds
    Q4_K and Q6_K tensors): their bytes over the time each type's take (None: a type not timed)."""
    seconds = 0.0
    for t, nbytes in mix.items():
        r = rate(t, int(nbytes), threads)
        if r is None:
            return None
        seconds += nbytes / r.gb_s
    return sum(mix.values()) / seconds if seconds > 0 else None
