"""CPU time the machine lost to other guests while something ran: the hypervisor's "steal" (Linux,
psutil.cpu_times), as a share of all CPU time. Bench reports it beside its figures: on a shared
virtual machine its medians, and predicted over measured, move with it."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

NOTICEABLE = 0.05  # a share of stolen CPU time that bench names in its notes


@dataclass(frozen=True)
class CpuClock:
    """The machine's CPU seconds so far: stolen, and in all."""

    steal: float
    total: float

    @classmethod
    def now(cls) -> "CpuClock | None":
        """None where the system does not count steal (not Linux)."""
        t = psutil.cpu_times()
        steal = getattr(t, "steal", None)
        if steal is None:
            return None
        d = t._asdict()
        # guest time is counted inside user (and guest_nice inside nice) as well
        total = sum(v for k, v in d.items() if k not in ("guest", "guest_nice"))
        return cls(float(steal), float(total))


def steal_share(start: CpuClock | None, end: CpuClock | None) -> float | None:
    """The share of the CPU time between two readings that was stolen (None: not counted)."""
    if start is None or end is None or end.total <= start.total:
        return None
    return min(max(end.steal - start.steal, 0.0) / (end.total - start.total), 1.0)


def steal_note(share: float | None) -> str | None:
    """A line for bench's notes when the share is noticeable."""
    if share is None or share < NOTICEABLE:
        return None
    return (f"the hypervisor gave {share:.0%} of this machine's CPU time to other guests while measuring "
            "(steal): the medians, and predicted over measured, move with it; measure again when it is quieter")
