"""--sleep-idle-seconds, llama-server's sleeping on idle: after that many seconds with no job and no
reader of the engine, the worker frees the model and its expert cache; the next job, or a reader
that needs the model (/tokenize, /infill ...), loads it again the way the server started. /health,
/props, /models and /metrics answer while it sleeps without waking it nor resetting the idle
time (what they report was kept when it fell asleep), as llama-server's."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from typing import AsyncIterator

WAKE = object()  # put in the worker's queue to wake a sleeping engine for a reader
POLL = 0.05  # seconds between checks while a reader keeps the engine awake


class IdleSleep:
    """When the engine may sleep, and who keeps it awake; `seconds` None: never (the default)."""

    def __init__(self, seconds: float | None, jobs: queue.Queue):
        self.seconds = seconds
        self.jobs = jobs
        self.asleep = False
        self._users = 0  # readers of the engine outside the engine thread
        self._since = time.monotonic()  # idle since
        self._waking = False
        self._lock = threading.Lock()

    def acquire(self, wake: bool = True) -> bool:
        """A reader outside the engine thread begins: the engine stays loaded until release().
        A sleeping engine is woken (wait with `asleep`), or with wake=False left asleep (False)."""
        with self._lock:
            if self.asleep and not wake:
                return False
            self._users += 1
            if self.asleep and not self._waking:
                self._waking = True
                with contextlib.suppress(queue.Full):  # NOTE: full: a job there wakes it
                    self.jobs.put_nowait(WAKE)
            return True

    def release(self, touch: bool = True) -> None:
        """The reader is done; `touch`: its request counts as work (the idle time starts again)."""
        with self._lock:
            self._users -= 1
            if touch:
                self._since = time.monotonic()

    def touch(self) -> None:
        with self._lock:
            self._since = time.monotonic()

    def left(self) -> float | None:
        """Seconds to wait before asking again whether the engine may sleep (None: never)."""
        if self.seconds is None:
            return None
        with self._lock:
            return max(POLL, self._since + self.seconds - time.monotonic())

    def fall_asleep(self) -> bool:
        """Asleep now, when it has been idle long enough with no reader and no job waiting."""
        with self._lock:
            if (self.seconds is None or self._users or not self.jobs.empty()
                    or time.monotonic() - self._since < self.seconds):
                return False
            self.asleep, self._waking = True, False
            return True

    def woke(self) -> None:
        with self._lock:
            self.asleep, self._waking = False, False
            self._since = time.monotonic()


@contextlib.asynccontextmanager
async def awake(idle: IdleSleep, failed=lambda: False, wake: bool = True) -> AsyncIterator[bool]:
    """Keep the engine loaded for a block of a request handler (a sleeping one is woken, and
    awaited while `failed()` is false); with wake=False a sleeping engine stays asleep and the
    block gets False (answer from what was kept)."""
    if not idle.acquire(wake):
        yield False
        return
    try:
        while idle.asleep and not failed():
            await asyncio.sleep(0.01)
        yield True
    finally:
        idle.release(touch=wake)
