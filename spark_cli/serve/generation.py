"""One request's generation on the server's engine, through `spark chat`'s answer loop.

`RequestSession` is a `ChatSession` whose prompt is the request's own (every message, or a
raw completion prompt) instead of the session history, so KV prefix reuse, the decode loop,
cache figures and decode-count harvesting are the ones `spark chat` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..runs.chat_session import Answer, ChatSession, Sampling, _Learned
from ..errors import SparkError


class ContextError(SparkError):
    """The prompt does not fit the context."""


class RequestSession(ChatSession):
    """A ChatSession over a fixed prompt; `kv` is the server's record of the KV cache."""

    def __init__(self, engine, sampling: Sampling, kv: list[int], cached_layers: set[int]):
        super().__init__(engine, sampling, cached_layers=cached_layers)
        self._kv = list(kv)
        self._prompt: list[int] = []

    def set_messages(self, messages: list[dict[str, str]]) -> int:
        self._prompt = self._tokens(messages)
        return len(self._prompt)

    def set_text(self, text: str) -> int:
        self._prompt = self.engine.tokenize(text, add_special=True, parse_special=True)
        return len(self._prompt)

    def _fit(self, user: str) -> tuple[list[int], int]:
        n_ctx = self.engine.n_ctx
        if len(self._prompt) >= n_ctx:
            raise ContextError(f"the request needs {len(self._prompt)} prompt tokens but the context holds {n_ctx}",
                               hint="shorten the messages or start spark serve with a larger -c")
        return list(self._prompt), 0

    def run(self, on_text: Callable[[str], None], should_stop: Callable[[], bool]) -> Answer:
        self.learned = _Learned()  # this request's decode counts only
        return self.answer("", on_text=on_text, should_stop=should_stop)

    @property
    def kv(self) -> list[int]:
        return self._kv


@dataclass
class StopFilter:
    """Holds back text that may begin a stop sequence; `hit` once one appears (it is cut)."""

    stops: list[str]
    pending: str = ""
    hit: bool = False

    def feed(self, piece: str) -> str:
        if self.hit:
            return ""
        if not self.stops:
            return piece
        self.pending += piece
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = max(len(s) for s in self.stops) - 1
        # NOTE: keep only a tail that is a prefix of some stop sequence
        hold = 0
        for n in range(min(keep, len(self.pending)), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                hold = n
                break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.hit else self.pending), ""
        return out
