"""Safe writes: check an output path, write temp file + fsync + rename, and an advisory lock.

Every file Spark writes goes through here, so that:
- only a regular file or a new path is replaced; a device, FIFO, socket or folder is refused;
- a symlink is followed and its target rewritten (the link stays);
- a new file follows the umask, a rewritten file keeps its mode (and, where allowed, owner);
- a temp file left by a killed writer is removed at the next write of the same file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..errors import LockTimeout, OutputError, SaveError

STALE_TMP_SECONDS = 600  # a temp file without a live writer's pid in its name, older than this, is a leftover


def _label(path: Path, flag: str | None) -> str:
    return f"{flag} {path}" if flag else str(path)


def kind_of(mode: int) -> str | None:
    """What a non-regular file is, for messages; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _same_file(a: os.stat_result, path: Path | str) -> bool:
    try:
        b = os.stat(path)
    except (OSError, ValueError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_output(path: Path | str, flag: str | None = None, make_parent: bool = False,
                 inputs: "Iterable[tuple[str, Path | str | None]]" = ()) -> Path:
    """The file a write to `path` will replace (a symlink's target), or OutputError in one line.

    Refuses a device, FIFO, socket or folder, a path under a file, a missing folder (unless
    `make_parent`), a folder this process cannot write, and a file that is one of `inputs`
    ((what, path) pairs: the model, the plan...; by device and inode, so a relative path,
    a symlink or a hard link is caught too). Call it before long work starts.
    """
    path = Path(path).expanduser()
    label = _label(path, flag)
    target = Path(os.path.realpath(path))
    try:
        st = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):  # a new path (under a file: found below)
        st = None
    except OSError as e:
        raise OutputError(f"{label}: {e.strerror or e}", hint="give a plain file path") from None
    if st is not None and (kind := kind_of(st.st_mode)) is not None:
        raise OutputError(f"{label}: is {kind}; Spark replaces only regular files",
                          hint="give a file path, e.g. a name ending in .json")
    if st is not None:
        for what, other in inputs:
            if other is not None and _same_file(st, Path(other).expanduser()):
                raise OutputError(f"{label}: is the {what} this run reads ({other}); Spark would overwrite it",
                                  hint="write the output to another file")
    folder = target.parent
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"{label}: {existing} is a file, not a folder", hint="give a path in a folder")
    if existing != folder and not make_parent:
        raise OutputError(f"{label}: folder {folder} does not exist", hint="create it first")
    _writable_folder(folder, label)
    return target


def _writable_folder(folder: Path, label: str) -> None:
    """Create `folder` if missing; OutputError when it cannot be made or written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{label}: cannot create folder {folder} ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{label}: folder {folder} is not writable", hint="give a folder you can write")


def check_folder(path: Path | str, flag: str | None = None) -> Path:
    """An output folder, created if missing; a file in its place, or one that cannot be made, is one line."""
    path = Path(path).expanduser()
    label = _label(path, flag)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{label}: is a file, not a folder", hint="give a folder")
    _writable_folder(path, label)
    return path


def write_failure(e: OSError) -> str:
    """Why a write failed, for a message."""
    return "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(target: Path) -> int:
    """Delete temp files of `target` whose writer is gone; returns how many went."""
    removed = 0
    now = time.time()
    for p in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        middle = p.name[len(target.name) + 2:-len(".tmp")]
        pid_text = middle.split(".", 1)[0]
        try:
            if pid_text.isdigit():
                if _pid_alive(int(pid_text)):
                    continue
            elif now - p.lstat().st_mtime < STALE_TMP_SECONDS:
                continue
            p.unlink()
            removed += 1
        except OSError:
            continue
    return removed


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write_with(path: Path | str, writer: Callable[[object], object], flag: str | None = None,
                      make_parent: bool = True) -> Path:
    """Call `writer(fileobj)` on a temp file beside the target, then rename it over the target.

    A reader sees the old file or the new one, never a half-written one. Raises OutputError
    for a path Spark must not replace and SaveError (naming the path) when the write fails.
    Returns the file written (a symlink's target).
    """
    path = Path(path).expanduser()
    target = check_output(path, flag, make_parent)
    label = _label(path, flag)
    remove_leftovers(target)
    try:
        old = os.stat(target)
    except OSError:
        old = None
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        if old is not None:
            os.chmod(tmp, stat.S_IMODE(old.st_mode))
            with contextlib.suppress(OSError):
                os.chown(tmp, old.st_uid, old.st_gid)
        else:
            os.chmod(tmp, _new_file_mode())
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise SaveError(f"{label}: cannot write ({write_failure(e)})") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return target


def atomic_write_bytes(path: Path | str, data: bytes, flag: str | None = None, make_parent: bool = True) -> Path:
    return atomic_write_with(path, lambda f: f.write(data), flag, make_parent)


def atomic_write_text(path: Path | str, text: str, flag: str | None = None, make_parent: bool = True) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), flag, make_parent)


def lock_timeout_default() -> float:
    """Seconds a fold waits for a profile lock (SPARK_LOCK_TIMEOUT, default 30)."""
    try:
        return max(0.0, float(os.environ.get("SPARK_LOCK_TIMEOUT", "30")))
    except ValueError:
        return 30.0


def _open_lock(lock_path: Path):
    try:
        return open(lock_path, "a+")
    except FileNotFoundError:
        raise
    except PermissionError:
        pass  # another user's lock file: flock works on a read-only descriptor too
    return open(lock_path, "r")


@contextlib.contextmanager
def file_lock(path: Path | str, timeout: float | None = None,
              on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Exclusive advisory lock on `path + '.lock'` for read-modify-write cycles.

    `timeout` None waits for ever; otherwise LockTimeout after that many seconds. `on_wait`
    gets one message when the lock is busy. A lock that cannot be opened is a SaveError.
    """
    lock_path = Path(str(path) + ".lock")
    try:
        f = _open_lock(lock_path)
    except OSError as e:
        raise SaveError(f"lock {lock_path}: cannot open ({e.strerror or e})") from None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                wait = "" if timeout is None else f" (up to {timeout:.0f} s)"
                on_wait(f"waiting for {lock_path}: another Spark process holds it{wait}")
            if timeout is None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            else:
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise LockTimeout(f"lock {lock_path}: still held by another process after "
                                              f"{timeout:.0f} s") from None
                        time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
