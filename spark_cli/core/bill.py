"""A measured memory bill: what llama.cpp allocates per buffer type for a placement.

The dry run (runs/dry_run.py) loads the model with `no_alloc` on the plan's devices and tensor
overrides, with the run's context parameters, attaches the expert cache without allocating, and
reads `llama_expert_cache_memory_breakdown`: per buffer type the weights (`model`), the KV cache
and recurrent state (`context`), the compute buffers (`compute`) and the cache's `banks`. This
module holds that result (pure data: no llama.cpp here) and the sums the planner and the
commands read. Host entries (the CPU's buffers and a device's pinned host memory) are the host
RAM the placement needs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("model", "context", "compute", "banks")


@dataclass(frozen=True)
class BufferBill:
    """Bytes of one buffer type."""

    buft: str  # ggml's buffer type name (CUDA0, CUDA_Host, CPU, RPC0[...])
    device: str  # its device ("" for the CPU's own buffers)
    is_host: bool
    model: int = 0
    context: int = 0
    compute: int = 0
    banks: int = 0

    @property
    def total(self) -> int:
        return self.model + self.context + self.compute + self.banks


@dataclass(frozen=True)
class MeasuredBill:
    """Every buffer type of a dry run (or of a loaded engine)."""

    entries: tuple[BufferBill, ...]

    def device_names(self) -> list[str]:
        """Devices with device memory, in the order llama.cpp reported them."""
        out: list[str] = []
        for e in self.entries:
            if not e.is_host and e.device and e.device not in out:
                out.append(e.device)
        return out

    def device(self, name: str) -> dict[str, int]:
        """Device memory of `name` by kind, plus `total`."""
        return _sum(e for e in self.entries if not e.is_host and e.device == name)

    def device_bytes(self, name: str | None = None) -> int:
        """Device memory of `name` (None: the first device)."""
        names = self.device_names()
        if name is None:
            name = names[0] if names else ""
        return self.device(name)["total"]

    def host(self) -> dict[str, int]:
        """Host memory (the CPU's buffers and pinned host memory) by kind, plus `total`."""
        return _sum(e for e in self.entries if e.is_host)

    def to_dict(self) -> dict[str, Any]:
        """What a plan file records: per device by kind, host, and the raw entries."""
        return {"devices": {n: self.device(n) for n in self.device_names()}, "host": self.host(),
                "entries": [asdict(e) for e in self.entries]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MeasuredBill":
        """The inverse of to_dict (reads `entries`); KeyError/TypeError/ValueError on a bad one."""
        out = []
        for e in d["entries"]:
            vals = {k: int(e[k]) for k in KINDS}
            if any(v < 0 for v in vals.values()):
                raise ValueError("negative bytes")
            out.append(BufferBill(str(e["buft"]), str(e["device"]), bool(e["is_host"]), **vals))
        return cls(tuple(out))


def _sum(entries) -> dict[str, int]:
    out = {k: 0 for k in KINDS}
    for e in entries:
        for k in KINDS:
            out[k] += getattr(e, k)
    out["total"] = sum(out[k] for k in KINDS)
    return out
