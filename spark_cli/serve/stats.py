"""Server figures for /metrics: llama-server's request and token counters, and the expert
cache's totals read from the engine after each request (never while it decodes).

As llama-server's: prompt tokens reused from the KV cache are counted apart (they cost no
decode), and the throughput gauges are averaged over the window since the last scrape of
/metrics (take_rates). Spark decodes every generated token, the last one included, so a
generation's rate is its n tokens over its n decode steps (llama-server's leaves the last one
undecoded and counts n - 1 steps). While the engine sleeps (--sleep-idle-seconds) /metrics shows
the snapshot taken as it fell asleep, as llama-server's; the expert cache's counters go on from
one engine to the next."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from ..native.expert_cache import CacheStats


@dataclass
class Snapshot:
    prompt_tokens: int = 0       # evaluated (not reused from the KV cache)
    prompt_cached: int = 0       # reused from the KV cache
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
    n_tokens_max: int = 0        # the longest sequence served (prompt + generation)
    window_prompt: tuple[int, float] = (0, 0.0)   # (tokens, seconds) since the last scrape
    window_predict: tuple[int, float] = (0, 0.0)  # (generated tokens, seconds) since the last scrape
    cache: CacheStats = field(default_factory=CacheStats)  # cached layers since the engine started
    device_bytes: int = 0        # held by the expert banks
    planned_bytes: int = 0       # the plan's device total

    @property
    def busy_slots_per_decode(self) -> float:
        return self.busy_slot_decodes / self.decodes if self.decodes else 0.0

    @property
    def prompt_tokens_seconds(self) -> float:
        n, t = self.window_prompt
        return n / t if t > 0 else 0.0

    @property
    def predicted_tokens_seconds(self) -> float:
        n, t = self.window_predict
        return n / t if t > 0 else 0.0

    @property
    def hit_ratio(self) -> float:
        return self.cache.hit_rate or 0.0


@dataclass
class ServerStats:
    cached_layers: set[int] = field(default_factory=set)
    planned_bytes: int = 0
    _s: Snapshot = field(default_factory=Snapshot)
    _asleep: Snapshot | None = None  # what /metrics shows while the engine sleeps
    _cache_before: CacheStats = field(default_factory=CacheStats)  # the engines freed by a sleep
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return replace(self._asleep or self._s)

    def add_request(self, fig) -> None:
        """Add one answer's figures (chat_session.AnswerFigures)."""
        with self._lock:
            s = self._s
            s.requests += 1
            s.prompt_tokens += fig.prompt_tokens
            s.prompt_cached += fig.reused_tokens
            s.prompt_seconds += fig.prompt_seconds
            s.predicted_tokens += fig.generated_tokens
            s.predicted_seconds += fig.gen_seconds
            s.n_tokens_max = max(s.n_tokens_max, fig.reused_tokens + fig.prompt_tokens + fig.generated_tokens)
            n, t = s.window_prompt
            s.window_prompt = (n + fig.prompt_tokens, t + fig.prompt_seconds)
            n, t = s.window_predict
            s.window_predict = (n + fig.generated_tokens, t + fig.gen_seconds)

    def take_rates(self) -> Snapshot:
        """A snapshot for a scrape of /metrics; the throughput window starts again."""
        with self._lock:
            out = replace(self._asleep or self._s)
            # NOTE: asleep, both: nothing ran since the snapshot, so waking must not report the window again
            for s in (self._s, self._asleep):
                if s is not None:
                    s.window_prompt, s.window_predict = (0, 0.0), (0, 0.0)
            return out

    def _engine_cache(self, engine) -> CacheStats:
        return CacheStats.total(s for il, s in engine.cache.stats().items() if il in self.cached_layers)

    def set_cache(self, engine) -> None:
        """Totals over the cached layers since the server started (pinned uploads included)."""
        tot = self._engine_cache(engine)
        dev = engine.cache.bank_bytes()
        with self._lock:
            self._s.cache = self._cache_before + tot
            self._s.device_bytes = dev
            self._s.planned_bytes = self.planned_bytes

    def sleep(self, engine) -> None:
        """The engine is about to be freed: /metrics shows the figures as they are now until wake()."""
        tot = self._engine_cache(engine)
        with self._lock:
            self._asleep = replace(self._s)
            self._cache_before = self._cache_before + tot
            self._s.cache, self._s.device_bytes = self._cache_before, 0

    def wake(self) -> None:
        with self._lock:
            self._asleep = None

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
