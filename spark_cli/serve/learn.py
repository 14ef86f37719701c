"""Self-tuning while serving: decode routing counts gathered per request, folded into the
model's profile every `interval` seconds and at exit (through `session.fold_into_profile`:
locked, atomic, aged)."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runs import session
from ..errors import SparkError

LOCK_TIMEOUT = 10.0  # seconds to wait for the profile's lock; then the counts go to the side file


@dataclass
class Learner:
    model: Path
    geometry: object
    interval: float = 300.0
    enabled: bool = True
    folded_tokens: float = 0.0  # decode tokens written to the profile so far
    _counts: np.ndarray | None = field(default=None, repr=False)
    _tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _fold_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def add(self, counts: np.ndarray | None, tokens: int) -> None:
        if not self.enabled or counts is None:
            return
        with self._lock:
            self._counts = counts.copy() if self._counts is None else self._counts + counts
            self._tokens += tokens

    def fold(self) -> float:
        """Fold what is pending; returns the decode tokens folded. A failed save leaves them in
        the profile's pending side file (session.fold_into_profile), which the next fold merges."""
        with self._fold_lock:
            with self._lock:
                counts, self._counts, self._tokens = self._counts, None, 0
            if counts is None or counts.sum() <= 0:
                return 0.0
            try:
                session.fold_into_profile(self.model, self.geometry, counts, source="spark serve",
                                          timeout=LOCK_TIMEOUT)
            except (SparkError, OSError) as e:
                msg = e.one_line() if isinstance(e, SparkError) else str(e)
                print(f"warning: routing counts not folded: {msg}", file=sys.stderr)
                return 0.0
            n = session.decode_tokens(self.geometry, counts)
            self.folded_tokens += n
            return n

    def start(self) -> None:
        if self.enabled and self.interval > 0:
            self._thread = threading.Thread(target=self._loop, name="spark-learn", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.fold()

    def close(self) -> float:
        """Stop the timer and fold the rest."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.fold() if self.enabled else 0.0
