"""Host RAM a placement needs against what the machine has: refused early, or warned.

The need is the dry run's host bill (the CPU's buffers and the device's pinned host memory: expert
tensors of cached and host layers, weights llama.cpp keeps on the CPU, pinned staging, CPU
compute buffers) when the plan was measured, else the plan's host expert bytes. Available RAM
is psutil's `available`, or SPARK_RAM_LIMIT (bytes, or a size such as 8GiB) when set.
Without mmap (--no-mmap) or with --mlock the weights must all be resident: a plan that does not
fit is refused before anything loads. With mmap the kernel pages the rest in from the model
file as it is read: a warning names how much.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..core import units
from ..core.options import LoadFlags
from ..core.planner import Plan
from ..errors import PlanError

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


def available() -> tuple[int, str]:
    """(bytes of RAM available, where that figure came from)."""
    env = os.environ.get(RAM_LIMIT_ENV)
    if env:
        return units.parse_size(env, flag=RAM_LIMIT_ENV), RAM_LIMIT_ENV
    import psutil

    return int(psutil.virtual_memory().available), "psutil"


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
