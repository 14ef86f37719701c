"""A Linux memory cgroup to run a command under a RAM cap, and the page cache of a file dropped.

cgroup v1 (the memory controller's hierarchy) or v2 (the unified one, where this process's cgroup
must let its children have the memory controller: root, or a delegated subtree). The cgroup is a
child of this process's own, made for one run and removed after it; the child process joins it
before it runs anything (so its whole life counts), and its peak, OOM kills and limit are read back.
Where none can be made, CgroupError says how to get one.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import SparkError

ROOT = Path("/sys/fs/cgroup")


class CgroupError(SparkError):
    """No memory cgroup could be made here."""


HOW = ("run as root on a machine with the cgroup memory controller, or inside a delegated scope "
       "(systemd-run --user --scope -p MemoryMax=SIZE spark ...: Spark reads the scope's limit itself)")


@dataclass
class MemoryCgroup:
    path: Path
    v2: bool
    limit: int

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def peak(self) -> int:
        """The most memory the cgroup's processes held at once (page cache included)."""
        return int(self._read("memory.peak" if self.v2 else "memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        text = self._read("memory.events" if self.v2 else "memory.oom_control")
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def run(self, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run argv inside the cgroup (the child joins before it execs)."""
        procs = str(self.path / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.run(list(argv), preexec_fn=join, **kw)

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def own(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = ROOT) -> tuple[Path, Path, bool] | None:
    """This process's memory cgroup: (its directory, the hierarchy's root, whether it is v2); the
    v1 memory controller's where both are mounted. None where neither is."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            return root / "memory" / rel.lstrip("/"), root / "memory", False
    for line in lines:
        if line.startswith("0::") and (root / "cgroup.controllers").exists():
            return root / line[3:].lstrip("/"), root, True
    return None


def make(limit: int, name: str) -> MemoryCgroup:
    """A fresh child cgroup capped at `limit` bytes (swap too, where v1 counts it). CgroupError, one
    line with what to do, where none can be made."""
    mine = own()
    if mine is None:
        raise CgroupError("no memory cgroup controller is mounted here", hint=HOW)
    base, _, v2 = mine
    path = base / f"{name}-{os.getpid()}"
    try:
        if v2 and "memory" not in (base / "cgroup.subtree_control").read_text().split():
            (base / "cgroup.subtree_control").write_text("+memory")
        path.mkdir(exist_ok=True)
        if v2:
            (path / "memory.max").write_text(str(limit))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            try:  # NOTE: no swap either, where the kernel accounts it: the cap is the RAM's
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            except OSError:
                pass
    except OSError as e:
        try:
            path.rmdir()
        except OSError:
            pass
        raise CgroupError(f"cannot make a memory cgroup under {base} ({e.strerror or e})", hint=HOW) from None
    return MemoryCgroup(path, v2, limit)


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to drop the file's cached pages (those no process maps)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
