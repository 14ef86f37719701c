"""The server's slots (llama-server's -np): one KV sequence each, with the tokens it holds, and
the decode routing counts of the steps that only decode (what the profile learns from)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..core.context_shift import after_shifts
from ..core.trace import DECODE, PREFILL
from ..native.generate import StepShape
from ..runs.chat_session import common_prefix


@dataclass
class Slot:
    id: int  # its sequence id in the KV cache
    kv: list[int] = field(default_factory=list)  # the tokens its sequence holds, in order
    job: Any = None  # the job it serves (worker.Job), None: idle
    prompt: list[int] = field(default_factory=list)  # the running job's prompt
    reused: int = 0  # prompt tokens kept from the KV cache
    generated: list[int] = field(default_factory=list)
    sent: int = 0  # generated tokens handed out with a text (worker.Text)
    sampler: Any = None
    probs: Any = None
    n_task: int = 0  # jobs served so far
    last_used: float = 0.0

    def common(self, prompt: Sequence[int]) -> int:
        return common_prefix(self.kv, list(prompt))

    def begin(self, job: Any, prompt: list[int], kept: int) -> None:
        self.job, self.prompt, self.reused, self.generated, self.sent = job, prompt, kept, [], 0
        self.kv = self.kv[:kept]
        self.n_task += 1

    def end(self, n_pos: int, shifts: Sequence[tuple[int, int]] = ()) -> None:
        """The job is over; its sequence holds n_pos positions of prompt + generated tokens, less
        the spans its context shifts dropped ((n_keep, n_discard), in order)."""
        self.kv = after_shifts(self.prompt + self.generated, list(shifts))[:n_pos]
        self.job, self.last_used = None, time.monotonic()
        self.close()

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None

    def info(self, n_ctx: int) -> dict:
        """llama-server's /slots entry (the fields Spark has)."""
        job = self.job
        n_predict = job.sampling.n_predict if job is not None else -1
        n_decoded = len(self.generated) if job is not None else 0
        return {"id": self.id, "id_task": self.n_task - 1 if self.n_task else -1, "n_ctx": n_ctx,
                "is_processing": job is not None, "n_prompt_tokens": len(self.prompt) if job is not None else 0,
                "n_cached_tokens": len(self.kv),
                "next_token": [{"has_next_token": job is not None, "n_decoded": n_decoded,
                                "n_remain": n_predict - n_decoded if n_predict >= 0 else -1}]}


def pick_slot(slots: list[Slot], prompt: Sequence[int], wanted: int = -1) -> Slot:
    """Slot `wanted` (a request's id_slot, idle), or else the idle slot whose cached tokens share
    the longest prefix with `prompt`; with none shared, the one idle longest (llama-server's choice)."""
    if wanted >= 0:
        assert slots[wanted].job is None, "a request's slot is busy"
        return slots[wanted]
    idle = [s for s in slots if s.job is None]
    best = max(idle, key=lambda s: (s.common(prompt), -s.last_used))
    if best.common(prompt) == 0:
        best = min(idle, key=lambda s: s.last_used)
    return best


class DecodeCounts:
    """Routing counts of the steps that only decode (one token per busy slot), handed to the
    learner, read around each run of such steps (both phases: native counts a step of one token
    per sequence as decode, a step with a prompt chunk as prefill); a step with prompt tokens ends
    the run, uncounted."""

    def __init__(self, engine, learner):
        self.engine, self.learner = engine, learner
        self.mark: np.ndarray | None = None
        self.tokens = 0

    def _now(self) -> np.ndarray | None:
        if not self.engine.cache.enabled:
            return None
        return (self.engine.cache.routing_counts(DECODE) + self.engine.cache.routing_counts(PREFILL)).astype(np.float64)

    def before(self, shape: StepShape) -> None:
        """A step is about to be decoded: one with prompt tokens ends the run (uncounted)."""
        if shape.prompt_tokens:
            self.flush()
        elif self.mark is None:
            self.mark = self._now()

    def after(self, shape: StepShape) -> None:
        """The step was decoded."""
        if not shape.prompt_tokens:
            self.tokens += shape.decode_tokens

    def flush(self) -> None:
        """Hand the run so far to the learner."""
        if self.mark is not None:
            now = self._now()
            if now is not None:
                self.learner.add(now - self.mark, self.tokens)
        self.mark, self.tokens = None, 0
