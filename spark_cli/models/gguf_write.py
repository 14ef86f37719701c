"""Writing GGUF files for the built models: tensors made one at a time, a temp file renamed into
place, and a cache keyed by file name (a build runs once, under a lock, and leftovers of a killed
build are removed). The demo model, the tiny models and the fixtures all write through here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from ..errors import ModelFileError, SaveError
from ..files.atomic import file_lock, write_failure

KeyValue = tuple[str, Any, GGUFValueType, Any]  # key, value, type, array element type (or None)


@dataclass
class Tensor:
    """A tensor to write: its declared shape and type, and how to make its data when written."""

    name: str
    shape: tuple[int, ...]  # numpy order (ggml reversed); last dim in bytes when quantized
    dtype: np.dtype
    raw_dtype: QT | None
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def array_tensor(name: str, arr: np.ndarray, raw_dtype: QT | None = None) -> Tensor:
    return Tensor(name, tuple(arr.shape), arr.dtype, raw_dtype, lambda: arr)


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


def write_gguf(path: Path, arch: str, kvs: Iterable[KeyValue], tensors: list[Tensor]) -> None:
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


def cached_build(path: Path, build: Callable[[Path], None]) -> Path:
    """`path`, built by `build(path)` unless it exists; one builder at a time."""
    if path.is_file():
        return path
    with file_lock(lock_path(path)):
        if not path.is_file():
            remove_leftovers(path.parent, [f".{path.name}.*.tmp"])
            build(path)
    return path


def remove_leftovers(folder: Path, patterns: list[str]) -> None:
    """Temp files and folders of a build or download that was killed (callers hold the lock)."""
    for pattern in patterns:
        for p in folder.glob(pattern):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()


def lock_path(path: Path) -> Path:
    """The lock file of a build of `path`: hidden, so that listings of the cache show only finished files."""
    return path.parent / f".{path.name}"


def read_kvs(reader: GGUFReader, keep: Callable[[str], bool]) -> list[KeyValue]:
    """The key-values of a GGUF whose key `keep` accepts, as write_gguf takes them."""
    out = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or not keep(field.name):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        out.append((field.name, field.contents(), vtype, sub))
    return out


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: not a readable GGUF ({e})",
                             hint="delete it so that it is fetched again") from None
