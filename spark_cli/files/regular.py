"""Reads that cannot hang or run without end: only regular files, up to a size limit.

A FIFO would block `open()` until a writer comes, a link to /dev/zero never ends; both are
refused with an OSError whose `strerror` says why (callers report it as a skipped file).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .atomic import kind_of

MAX_INPUT_BYTES = 1 << 30  # a corpus file, a profile or a plan larger than this is refused


def not_a_file(path: Path | str) -> str | None:
    """Why `path` (a symlink's target) is no file to read, for messages: "no such file", "is a
    device, not a regular file", ...; None for a regular file."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return "no such file"
    except OSError as e:
        return e.strerror or type(e).__name__
    kind = kind_of(st.st_mode)
    return f"is {kind}, not a regular file" if kind is not None else None


def read_regular(path: Path | str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of a regular file (a symlink's target) of at most `limit` bytes, else OSError."""
    # NOTE: O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"is {kind_of(st.st_mode)}, not a regular file (skipped)")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"is {st.st_size} bytes, over the {limit}-byte limit (skipped)")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(limit + 1)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"is over the {limit}-byte limit (skipped)")
    return data


def read_regular_text(path: Path | str, limit: int = MAX_INPUT_BYTES) -> str:
    return read_regular(path, limit).decode("utf-8")
