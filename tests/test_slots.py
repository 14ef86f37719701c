"""The server's slots without a model: which slot a request takes, what the profile learns from
batched steps, and a unified KV cache that runs out of room (a fake engine with a cell limit)."""

from __future__ import annotations

import numpy as np

from test_serve_parity import _Engine
from _serve_client import fake_client

from spark_cli.native.engine import KVFullError
from spark_cli.native.generate import StepShape
from spark_cli.serve.slots import DecodeCounts, Slot, pick_slot


def test_a_request_takes_the_slot_that_holds_most_of_its_prompt():
    a, b, c = Slot(0, kv=[1, 2, 3, 4], last_used=3.0), Slot(1, kv=[1, 2, 9], last_used=1.0), Slot(2, last_used=2.0)
    assert pick_slot([a, b, c], [1, 2, 3, 7]) is a
    assert pick_slot([a, b, c], [1, 2, 9, 9]) is b
    assert pick_slot([a, b, c], [5, 5]) is b  # nothing shared: the one idle longest
    a.job = object()
    assert pick_slot([a, b, c], [1, 2, 3, 7]) is b  # busy slots are not taken


class _Counting:
    enabled = True

    @property
    def cache(self) -> "_Counting":
        return self

    def __init__(self):
        self.now = np.zeros((2, 4))

    def routing_counts(self, phase):
        return self.now / 2  # both phases read: half each here


class _Learner:
    def __init__(self):
        self.got: list[tuple[np.ndarray, int]] = []

    def add(self, counts, tokens):
        self.got.append((counts, tokens))


def test_only_steps_that_only_decode_are_learned():
    eng, learner = _Counting(), _Learner()
    dc = DecodeCounts(eng, learner)
    def step(shape: StepShape, decoded: bool = True) -> None:
        dc.before(shape)
        if decoded:
            eng.now += shape.decode_tokens + shape.prompt_tokens
            dc.after(shape)

    step(StepShape(0, 30, 1))  # a prompt: not learned
    step(StepShape(3, 0, 3))  # three slots decode
    step(StepShape(3, 0, 3), decoded=False)  # no room in the KV cache: nothing evaluated
    step(StepShape(3, 0, 3))
    step(StepShape(2, 10, 3))  # a prompt chunk joins: the run ends, this step uncounted
    dc.flush()
    assert len(learner.got) == 1 and learner.got[0][1] == 6 and learner.got[0][0].sum() == 6 * 8


class _Cells(_Engine):
    """A unified KV cache of `cells` cells shared by every sequence."""

    def __init__(self, cells: int):
        super().__init__(n_ctx=256, n_seq=2)
        self.cells = cells

    def decode(self, entries):
        if sum(self.pos) + len(entries) > self.cells:
            raise KVFullError("the KV cache has no room for this batch")
        super().decode(entries)


def _ask(tc, words: str, max_tokens: int = 8):
    r = tc.post("/v1/completions", json={"prompt": words, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_full_unified_cache_first_forgets_idle_slots_then_ends_the_longest():
    prompt_a = " ".join(f"a{i}" for i in range(20))
    prompt_b = " ".join(f"b{i}" for i in range(20))
    with fake_client(lambda: _Cells(cells=45)) as tc:
        a = _ask(tc, prompt_a)
        assert a["usage"]["completion_tokens"] == 3 and a["choices"][0]["finish_reason"] == "stop"
        slots = tc.get("/slots").json()
        assert [s["n_cached_tokens"] for s in slots] == [23, 0]
        b = _ask(tc, prompt_b)  # 23 more cells do not fit beside slot 0's: slot 0 forgets them
        assert b["usage"]["completion_tokens"] == 3 and b["choices"][0]["finish_reason"] == "stop"
        assert [s["n_cached_tokens"] for s in tc.get("/slots").json()] == [0, 23]
    with fake_client(lambda: _Cells(cells=22)) as tc:
        r = _ask(tc, prompt_a)  # room for the prompt and two tokens: it ends there
        assert r["usage"]["completion_tokens"] == 2 and r["choices"][0]["finish_reason"] == "length"
        assert tc.get("/health").status_code == 200
