"""Server figures for /metrics: llama-server's request and token counters, and the expert
cache's totals read from the engine after each request (never while it decodes)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from ..native.expert_cache import CacheStats


@dataclass
class Snapshot:
    prompt_tokens: int = 0       # evaluated (not reused from the KV cache)
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    requests: int = 0            # finished generations
    rejected: int = 0            # refused with a full queue
    processing: int = 0          # busy slots
    slots: int = 1
    decodes: int = 0             # llama_decode calls
    busy_slot_decodes: int = 0   # busy slots summed over them
    deferred: int = 0
    cache: CacheStats = field(default_factory=CacheStats)  # cached layers since the engine started
    device_bytes: int = 0        # held by the expert banks
    planned_bytes: int = 0       # the plan's device total

    @property
    def busy_slots_per_decode(self) -> float:
        return self.busy_slot_decodes / self.decodes if self.decodes else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.cache.hit_rate or 0.0


@dataclass
class ServerStats:
    cached_layers: set[int] = field(default_factory=set)
    planned_bytes: int = 0
    _s: Snapshot = field(default_factory=Snapshot)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return replace(self._s)

    def add_request(self, fig) -> None:
        """Add one answer's figures (chat_session.AnswerFigures)."""
        with self._lock:
            s = self._s
            s.requests += 1
            s.prompt_tokens += fig.prompt_tokens
            s.prompt_seconds += fig.prompt_seconds
            s.predicted_tokens += fig.generated_tokens
            s.predicted_seconds += fig.gen_seconds

    def set_cache(self, engine) -> None:
        """Totals over the cached layers since the engine started (pinned uploads included)."""
        tot = CacheStats.total(s for il, s in engine.cache_stats().items() if il in self.cached_layers)
        dev = engine.bank_bytes()
        with self._lock:
            self._s.cache = tot
            self._s.device_bytes = dev
            self._s.planned_bytes = self.planned_bytes

    def set_slots(self, n: int) -> None:
        with self._lock:
            self._s.slots = n

    def add_decode(self, busy: int) -> None:
        """One llama_decode with `busy` slots generating."""
        with self._lock:
            self._s.decodes += 1
            self._s.busy_slot_decodes += busy

    def set_processing(self, n: int) -> None:
        with self._lock:
            self._s.processing = n

    def set_deferred(self, n: int) -> None:
        with self._lock:
            self._s.deferred = n

    def rejected(self) -> None:
        with self._lock:
            self._s.rejected += 1
