"""The expert cache of a loaded engine, as its callers see it: counters, routing counts, slots, the
trace, miss paths and costs, the banks' bytes (`Engine.cache`)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..core.bill import MeasuredBill
from ..core.capture import TopkRecord
from ..core.simulator import MissCosts, MissPath
from ..errors import NativeError
from .expert_cache import CacheLayer, CacheStats, ExpertCache, Phase


class CacheControl:
    """Reads and switches of the native expert cache; `native` is None on a build without the patch
    and after the engine closed."""

    def __init__(self, native: ExpertCache | None, n_layer: int, n_expert: Callable[[], int],
                 cache_layers: Sequence[CacheLayer]):
        self.native = native
        self.n_layer = n_layer
        self._n_expert = n_expert  # read on first use (the GGUF's geometry)
        self.cache_layers = cache_layers

    @property
    def enabled(self) -> bool:
        return bool(self.native is not None and self.native.enabled())

    def close(self) -> None:
        if self.native is not None:
            self.native.free()
            self.native = None

    def memory_breakdown(self) -> MeasuredBill:
        """What the engine allocated (a dry run: would allocate) per buffer type, banks included."""
        if self.native is None:
            raise NativeError("this llama.cpp build has no memory breakdown (native/ patch missing)",
                              hint="rebuild with scripts/bootstrap.sh")
        return self.native.memory_breakdown()

    def stats(self) -> dict[int, CacheStats]:
        """Counters of every MoE layer the native side tracks (zeros for one not cached)."""
        out: dict[int, CacheStats] = {}
        if not self.enabled:
            return out
        for il in range(self.n_layer):
            s = self.native.get_stats(il)
            if s is not None:
                out[il] = s
        return out

    def set_miss_path(self, path: MissPath | dict[int, MissPath]) -> None:
        """Switch the miss path of every cached layer (or per layer: {il: path}); the graph stays."""
        per_layer = path if isinstance(path, dict) else {c.il: path for c in self.cache_layers}
        for il, p in per_layer.items():
            self.native.set_miss_path(il, p)

    def set_miss_costs(self, costs: dict[int, MissCosts]) -> None:
        """The auto path's costs per cached layer (simulator.MissCosts; `concurrent` is native's)."""
        for il, c in costs.items():
            self.native.set_miss_costs(il, c)

    def miss_paths(self) -> dict[int, MissPath | None]:
        return {c.il: self.native.get_miss_path(c.il) for c in self.cache_layers}

    def routing_counts(self, phase: int) -> np.ndarray:
        """[n_layer, n_expert] routed occurrences in one phase (zeros for dense layers)."""
        n_exp = max(self._n_expert(), 1)
        out = np.zeros((self.n_layer, n_exp), np.int64)
        if not self.enabled:
            return np.zeros((self.n_layer, 0), np.int64)
        for il in range(self.n_layer):
            row = self.native.get_counts(il, Phase(phase), n_exp)
            if row is not None:
                out[il, :len(row)] = row
        return out

    def slots(self, il: int) -> list[int]:
        return self.native.get_slots(il, max(self._n_expert(), 1)) if self.enabled else []

    def trace_records(self) -> list[TopkRecord]:
        if not self.enabled:
            return []
        a = self.native.get_trace()
        out, i, n = [], 0, len(a)
        while i < n:
            il, n_tok, k, phase = (int(x) for x in a[i:i + 4])
            out.append(TopkRecord(il, phase, a[i + 4:i + 4 + n_tok * k].reshape(n_tok, k).copy()))
            i += 4 + n_tok * k
        return out

    def trace_dropped(self) -> int:
        """Steps the native trace could not hold since the last reset (the counters still have them)."""
        return self.native.get_trace_dropped() if self.enabled else 0

    def reset_stats(self) -> None:
        if self.enabled:
            self.native.reset_stats()

    def bank_bytes(self) -> int:
        return self.native.device_bytes() if self.enabled else 0
