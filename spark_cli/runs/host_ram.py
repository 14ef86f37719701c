"""Host RAM a placement needs against what the machine has: refused early, or warned.

The need is the dry run's host bill (the CPU's buffers and the device's pinned host memory: expert
tensors of cached and host layers, weights llama.cpp keeps on the CPU, pinned staging, CPU
compute buffers) when the plan was measured, else the plan's host expert bytes. Available RAM
is psutil's `available`, or SPARK_RAM_LIMIT (bytes, or a size such as 8GiB) when set; inside a memory
cgroup (a container, a systemd scope; v1 or v2) the tightest limit of the cgroup and its ancestors less
their working set (usage without the inactive page cache), when that is less.
Without mmap (--no-mmap) or with --mlock the weights must all be resident: a plan that does not
fit is refused before anything loads. With mmap the kernel pages the rest in from the model
file as it is read: a warning names how much.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..core import units
from ..core.options import LoadFlags
from ..core.planner import Plan
from ..errors import PlanError
from . import memcg

RAM_LIMIT_ENV = "SPARK_RAM_LIMIT"


@dataclass(frozen=True)
class HostRam:
    need: int
    available: int
    measured: bool  # the need is the dry run's host bill
    source: str  # where `available` came from

    @property
    def short(self) -> int:
        return max(0, self.need - self.available)

    def line(self) -> str:
        how = "measured" if self.measured else "planned"
        return (f"host RAM: needs {units.fmt_bytes(self.need)} ({how}), {units.fmt_bytes(self.available)} "
                f"available ({self.source})")


CGROUP_ROOT = memcg.ROOT
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def available() -> tuple[int, str]:
    """(bytes of RAM available, where that figure came from)."""
    env = os.environ.get(RAM_LIMIT_ENV)
    if env:
        return units.parse_size(env, flag=RAM_LIMIT_ENV), RAM_LIMIT_ENV
    import psutil

    free, source = int(psutil.virtual_memory().available), "psutil"
    # NOTE: this process's resident pages (its libraries too) are in the cgroup's usage; fresh ones
    # count as inactive page cache, so the working set alone would leave them out
    cg = cgroup_free(own_rss=int(psutil.Process().memory_info().rss))
    if cg is not None and cg[0] < free:
        free, source = cg
    return free, source


def cgroup_free(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT,
                own_rss: int = 0) -> tuple[int, str] | None:
    """(limit - working set, "cgroup PATH") of the tightest memory cgroup limit over this process's
    cgroup and its ancestors, v1 or v2, the working set at least `own_rss`; None outside a limited
    one or where it cannot be read."""
    mine = memcg.own(proc_cgroup, root)
    if mine is None:
        return None
    d, base, v2 = mine
    best: tuple[int, str] | None = None
    while True:
        got = _cgroup_headroom(d, v2, own_rss)
        if got is not None and (best is None or got < best[0]):
            best = (got, f"memory cgroup {'/' + str(d.relative_to(base)).strip('.')}")
        if d == base or base not in d.parents:
            break
        d = d.parent
    return best


def _cgroup_headroom(d: Path, v2: bool, own_rss: int = 0) -> int | None:
    """limit - max(usage - inactive file pages, own_rss) of one cgroup directory; None without a limit."""
    try:
        if v2:
            text = (d / "memory.max").read_text().strip()
            if text == "max":
                return None
            limit, usage = int(text), int((d / "memory.current").read_text())
            inactive_key = "inactive_file"
        else:
            limit, usage = int((d / "memory.limit_in_bytes").read_text()), int((d / "memory.usage_in_bytes").read_text())
            inactive_key = "total_inactive_file"
        if limit >= NO_LIMIT:
            return None
        stat = dict(l.split() for l in (d / "memory.stat").read_text().splitlines() if len(l.split()) == 2)
        inactive = int(stat.get(inactive_key, 0))
    except (OSError, ValueError):
        return None
    return max(0, limit - max(usage - inactive, own_rss))


def host_ram(plan: Plan) -> HostRam:
    bill = plan.measured_bill()
    need = bill.host()["total"] if bill is not None else sum(l.host_bytes for l in plan.layers)
    avail, source = available()
    return HostRam(need, avail, bill is not None, source)


def check(plan: Plan, flags: LoadFlags) -> str | None:
    """PlanError without mmap or with --mlock when the host bill is over the available RAM;
    with mmap a warning line (None when it fits)."""
    h = host_ram(plan)
    if not h.short:
        return None
    flag = "--mlock" if flags.mlock else "--no-mmap" if not flags.mmap else None
    if flag:
        raise PlanError(f"{flag}: the plan needs {units.fmt_bytes(h.need)} of host RAM, {units.fmt_bytes(h.available)} "
                        f"is available ({h.source}): short by {units.shortfall(h.short)}",
                        hint=f"drop {flag} (mmap pages weights in as they are used), free RAM or raise --vram")
    return (f"host RAM: the plan needs {units.fmt_bytes(h.need)}, {units.fmt_bytes(h.available)} is available "
            f"({h.source}): expect about {units.shortfall(h.short)} of page-ins from the model file (mmap)")
