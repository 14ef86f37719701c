"""The patched llama.cpp libraries, loaded once: llama_cpp's ctypes module plus the ggml
functions (devices, buffer types, RPC) that it does not bind. The expert-cache C API is
bound in expert_cache.py."""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ..errors import NativeError
from .expert_cache import ExpertCacheAPI

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64

DEV_TYPE_NAMES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL", 4: "META"}


class GGMLTensor(ctypes.Structure):
    """`struct ggml_tensor` of the vendored ggml (read-only use: shape, strides, name)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class BuftOverride(ctypes.Structure):
    """`struct llama_model_tensor_buft_override`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    description: str
    type: str
    free: int
    total: int
    handle: int

    @property
    def is_gpu(self) -> bool:
        return self.type in ("GPU", "IGPU")


def _soname(libdir: Path, name: str) -> Path:
    """The file libllama's dependencies load (`name.so.0`): the wheel holds copies, not links,
    and loading `name.so` too would give a second instance with its own registries and RPC
    connections."""
    so0 = libdir / f"{name}.so.0"
    return so0 if so0.exists() else libdir / f"{name}.so"


def _fn(lib: ctypes.CDLL, name: str, restype, argtypes) -> object:
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = argtypes
    return f


@functools.lru_cache(maxsize=1)
def load() -> SimpleNamespace:
    """Import llama_cpp (the build from scripts/build_native.py) and bind what Spark needs."""
    try:
        import llama_cpp  # noqa: F401
        import llama_cpp.llama_cpp as lc
    except Exception as e:  # ImportError, or OSError from a broken shared library
        raise NativeError(
            f"llama_cpp is not importable ({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})",
            hint="run scripts/bootstrap.sh to build the patched llama-cpp-python",
        ) from None
    libdir = Path(lc.__file__).parent / "lib"
    mode = getattr(os, "RTLD_GLOBAL", 0)
    base = ctypes.CDLL(str(_soname(libdir, "libggml-base")), mode=mode)
    ggml = ctypes.CDLL(str(_soname(libdir, "libggml")), mode=mode)
    cpu = ctypes.CDLL(str(_soname(libdir, "libggml-cpu")), mode=mode)
    rpc_path = _soname(libdir, "libggml-rpc")
    rpc = ctypes.CDLL(str(rpc_path), mode=mode) if rpc_path.exists() else None
    llama = lc._lib

    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    ns = SimpleNamespace(lc=lc, libdir=libdir, llama=llama, base_lib=base, cpu_lib=cpu, rpc_available=rpc is not None)
    ns.dev_count = _fn(ggml, "ggml_backend_dev_count", sz, [])
    ns.dev_get = _fn(ggml, "ggml_backend_dev_get", vp, [sz])
    ns.dev_by_name = _fn(ggml, "ggml_backend_dev_by_name", vp, [ctypes.c_char_p])
    ns.dev_name = _fn(base, "ggml_backend_dev_name", ctypes.c_char_p, [vp])
    ns.dev_description = _fn(base, "ggml_backend_dev_description", ctypes.c_char_p, [vp])
    ns.dev_type = _fn(base, "ggml_backend_dev_type", ctypes.c_int, [vp])
    ns.dev_memory = _fn(base, "ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])
    ns.dev_buffer_type = _fn(base, "ggml_backend_dev_buffer_type", vp, [vp])
    ns.dev_host_buffer_type = _fn(base, "ggml_backend_dev_host_buffer_type", vp, [vp])
    ns.buft_name = _fn(base, "ggml_backend_buft_name", ctypes.c_char_p, [vp])
    ns.cpu_buffer_type = _fn(cpu, "ggml_backend_cpu_buffer_type", vp, [])
    ns.register = _fn(ggml, "ggml_backend_register", None, [vp])
    ns.reg_count = _fn(ggml, "ggml_backend_reg_count", sz, [])
    ns.reg_get = _fn(ggml, "ggml_backend_reg_get", vp, [sz])
    ns.reg_name = _fn(base, "ggml_backend_reg_name", ctypes.c_char_p, [vp])
    ns.reg_dev_count = _fn(base, "ggml_backend_reg_dev_count", sz, [vp])
    ns.tensor_get = _fn(base, "ggml_backend_tensor_get", None, [vp, vp, sz, sz])
    ns.nbytes = _fn(base, "ggml_nbytes", sz, [vp])
    if rpc is not None:
        ns.rpc_add_server = _fn(rpc, "ggml_backend_rpc_add_server", vp, [ctypes.c_char_p])
        ns.rpc_start_server = _fn(rpc, "ggml_backend_rpc_start_server", None,
                                  [ctypes.c_char_p, ctypes.c_char_p, sz, sz, ctypes.POINTER(vp)])
    ns.expert_cache = ExpertCacheAPI.bind(llama)  # None: a build without native/
    ns.has_expert_cache = ns.expert_cache is not None
    lc.llama_backend_init()
    return ns


def header_check(path: Path) -> str | None:
    """llama.cpp's loader on a GGUF's header alone (`no_alloc`, load mode none: every tensor's shape
    is checked against the hyperparameters, no weight is read or allocated); None when it loads."""
    lc = load().lc
    p = lc.llama_model_default_params()
    p.n_gpu_layers = 0
    p.no_alloc = True
    p.load_mode = 0  # LLAMA_LOAD_MODE_NONE: no_alloc maps nothing
    model = lc.llama_model_load_from_file(os.fsencode(path), p)
    if not model:
        return "llama_model_load_from_file returned NULL"
    lc.llama_model_free(model)
    return None


def devices() -> list[Device]:
    """Registered ggml devices (free and total 0: devices.free_memory reads a device's, asking an
    RPC server)."""
    lib = load()
    out = []
    for i in range(lib.dev_count()):
        h = lib.dev_get(i)
        out.append(Device(
            index=i,
            name=lib.dev_name(h).decode(),
            description=(lib.dev_description(h) or b"").decode(errors="replace"),
            type=DEV_TYPE_NAMES.get(lib.dev_type(h), "?"),
            free=0,
            total=0,
            handle=h,
        ))
    return out


def idle_backends() -> list[str]:
    """Backends of this build that found no device (a CUDA build on a machine without the NVIDIA
    driver or a GPU): every registered backend but the CPU's and RPC's (whose devices are servers)."""
    lib = load()
    names = [(lib.reg_name(lib.reg_get(i)) or b"?").decode() for i in range(lib.reg_count())]
    return [n for i, n in enumerate(names) if n not in ("CPU", "RPC") and lib.reg_dev_count(lib.reg_get(i)) == 0]


def gpu_devices() -> list[Device]:
    return [d for d in devices() if d.is_gpu]
