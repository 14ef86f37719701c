"""Profiling runs, engine side: feed corpus chunks, harvest routing counts and traces.

The CLI (`commands/profile.py`) renders; this module imports neither typer nor rich.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import NativeError, SparkError

CAPTURE_MODES = ("auto", "native", "callback")
TRACE_MAX: int | None = None  # native trace capacity in int32 values (None: the library's default)


@dataclass
class Gathered:
    """What a profiling run recorded; counts are [n_layer, n_expert] routed occurrences."""

    prefill: np.ndarray
    decode: np.ndarray
    tokens_prefill: int = 0
    tokens_decode: int = 0
    chunks_done: int = 0
    traces: list[Any] = field(default_factory=list)  # one RoutingTrace per chunk (when kept)
    interrupted: bool = False
    seconds: float = 0.0
    trace_dropped_steps: int = 0  # steps the native trace was too small for (the counts have them)

    @property
    def tokens(self) -> int:
        return self.tokens_prefill + self.tokens_decode

    def summary(self) -> dict:
        """The run's figures for --json (counts and traces aside)."""
        return {"chunks_done": self.chunks_done, "tokens_prefill": self.tokens_prefill,
                "tokens_decode": self.tokens_decode, "seconds": self.seconds, "interrupted": self.interrupted,
                "trace_dropped_steps": self.trace_dropped_steps}


class Capture:
    """Routing since the last harvest, from the native counters or the eval callback."""

    def __init__(self, engine, mode: str, n_layer: int, n_expert: int, fingerprint: str, keep_trace: bool):
        self.engine, self.mode = engine, mode
        self.n_layer, self.n_expert, self.fingerprint = n_layer, n_expert, fingerprint
        self.keep_trace = keep_trace
        self.decode_only = False  # keep only the one-token decode steps (the profile's ring)

    def _fit(self, a: np.ndarray) -> np.ndarray:
        out = np.zeros((self.n_layer, self.n_expert), dtype=np.float64)
        rows, cols = min(self.n_layer, a.shape[0]), min(self.n_expert, a.shape[1])
        out[:rows, :cols] = a[:rows, :cols]
        return out

    def harvest(self) -> tuple[np.ndarray, np.ndarray, Any, int]:
        """(prefill counts, decode counts, trace, trace steps dropped) since the last harvest;
        native counts come from the counters, which a full trace does not stop."""
        from ..core.capture import records_to_counts, records_to_trace
        from ..core.trace import DECODE, PREFILL

        e = self.engine
        if self.mode == "native":
            pre = self._fit(e.cache.routing_counts(PREFILL))
            dec = self._fit(e.cache.routing_counts(DECODE))
            records = e.cache.trace_records() if self.keep_trace else []
            dropped = e.cache.trace_dropped() if self.keep_trace else 0
        else:
            dropped = 0
            records = list(e.records)
            pre, dec = (a.astype(np.float64) for a in records_to_counts(records, self.n_layer, self.n_expert))
        trace = records_to_trace(records, self.n_layer, self.n_expert, self.fingerprint) if self.keep_trace else None
        if trace is not None and self.decode_only:
            trace = trace.decode_steps()
        e.reset_stats()  # zeroes native counts and trace, and clears callback records
        return pre, dec, trace, dropped


class StopFlag:
    """First Ctrl-C asks the loop to stop at the next ubatch and save; a second one aborts."""

    def __init__(self) -> None:
        self.requested = False
        self._old: Any = None

    def _handler(self, signum, frame) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, self._old if callable(self._old) else signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


def _pieces(tokens: Sequence[int], n_batch: int) -> list[Sequence[int]]:
    """Even pieces of at most n_batch tokens: none of one token (that would count as decode)."""
    n = len(tokens)
    k = max(1, -(-n // n_batch))
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        size = base + (i < extra)
        out.append(tokens[start:start + size])
        start += size
    return out


def gather(engine, capture: Capture, chunks: Sequence[Any], gen: int, stop: StopFlag | None = None,
           advance: Callable[[int], None] | None = None, drop: Callable[[int], None] | None = None,
           n_batch: int = 512, into: Gathered | None = None) -> Gathered:
    """Prefill every chunk (fresh KV each), then decode `gen` greedy tokens after it.

    `advance(n)` reports evaluated tokens, `drop(n)` planned decode tokens that an
    end-of-generation token made unnecessary. Stops early, keeping what was gathered,
    when `stop.requested` turns true (checked after every ubatch). `into` (optional) is
    filled chunk by chunk, so that a caller can keep the chunks done when the device is lost.
    """
    shape = (capture.n_layer, capture.n_expert)
    g = into if into is not None else Gathered(np.zeros(shape), np.zeros(shape))
    advance = advance or (lambda n: None)
    drop = drop or (lambda n: None)
    stopped = (lambda: stop.requested) if stop is not None else (lambda: False)
    t0 = time.perf_counter()
    try:
        for chunk in chunks:
            engine.reset()
            pieces = _pieces(chunk.tokens, n_batch)
            for piece in pieces:
                # NOTE: llama.cpp runs the last layer only on tokens with outputs: ask for all
                engine.eval(piece, logits="outputs")
                g.tokens_prefill += len(piece)
                advance(len(piece))
                if stopped():
                    break
            if gen > 0 and not stopped():
                # greedy after the chunk's last output row; an end-of-generation token ends it
                for step in engine.stream_generate([], max_tokens=gen, should_stop=stopped):
                    if step.token is not None:
                        advance(1)
                g.tokens_decode += step.generated_tokens
                if not stopped():
                    drop(gen - step.generated_tokens)
            pre, dec, trace, dropped = capture.harvest()
            g.trace_dropped_steps += dropped
            g.prefill += pre
            g.decode += dec
            if trace is not None and trace.n_rows:
                g.traces.append(trace)
            g.chunks_done += 1
            if stopped():
                g.interrupted = True
                break
    finally:
        g.seconds = time.perf_counter() - t0
    return g


def resolve_capture(requested: str) -> str:
    """`auto` -> native counters when the library has the expert cache, else the callback."""
    from ..native import llama_lib

    if requested not in CAPTURE_MODES:
        raise SparkError(f"--capture {requested}: expected one of {', '.join(CAPTURE_MODES)}")
    has = llama_lib.load().has_expert_cache
    if requested == "native" and not has:
        raise NativeError("--capture native: this llama.cpp build has no expert cache",
                          hint="use --capture callback, or rebuild with scripts/bootstrap.sh")
    if requested == "auto":
        return "native" if has else "callback"
    return requested


def profiling_options(base, mode: str, keep_trace: bool):
    """`base`'s options (EngineOptions) reporting routing by `mode`, without a cache."""
    import dataclasses

    return dataclasses.replace(base, count_experts=mode == "native", trace=mode == "native" and keep_trace,
                               capture_topk=mode == "callback", cache_layers=[],
                               trace_max=TRACE_MAX if base.trace_max is None else base.trace_max)


def open_engine(base, geometry, mode: str, keep_trace: bool, note: Callable[[str], None] = lambda msg: None):
    """An engine for profiling (run.open_engine): experts fall back to host RAM if the whole
    model does not load on the device."""
    from .run import open_engine as open_run

    return open_run(profiling_options(base, mode, keep_trace), "cpu", geometry.fingerprint,
                    host_layers=list(geometry.moe_layers), on_why=note)


def _held_out_indices(n: int, frac: float) -> set[int]:
    """Chunks to hold out, spread evenly: i where floor((i + 1) * frac) > floor(i * frac)."""
    out = {i for i in range(n) if int((i + 1) * frac + 1e-9) > int(i * frac + 1e-9)}
    return out or {n - 1}


def split_held_out(traces: Sequence[Any], frac: float) -> tuple[Any, Any]:
    """(train, test) traces: whole chunks held out when there are several, else a row cut."""
    from ..core.trace import concat

    if len(traces) >= 2:
        test_idx = _held_out_indices(len(traces), frac)
        if len(test_idx) == len(traces):
            test_idx = set(list(sorted(test_idx))[1:])
        train = concat([t for i, t in enumerate(traces) if i not in test_idx])
        test = concat([t for i, t in enumerate(traces) if i in test_idx])
        return train, test
    return concat(traces).split(1.0 - frac)


def dropped_warning(g: Gathered) -> str | None:
    """One line when the native trace dropped steps (the profile's counts are still complete)."""
    n = g.trace_dropped_steps
    return (f"native trace full: {n:,} steps dropped; counts are complete, the trace is not "
            "(recent decode steps, --trace and --held-out miss them)") if n else None
