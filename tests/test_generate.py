"""The one generation loop (native/generate.py): stop rules, limits, UTF-8 pieces, and greedy
output equal to the hand-written loops it replaced."""

from __future__ import annotations

import time

import numpy as np
import pytest

from _answers import greedy_rows, knows_paris
from spark_cli.native.generate import Forced, Greedy, StopRules, stream_generate


class _Engine:
    """A vocabulary of byte pieces; the logits make `script` the greedy continuation."""

    EOG = 0

    def __init__(self, script: list[int], pieces: dict[int, bytes], n_ctx: int = 64):
        self.script, self.pieces, self.n_ctx = script, pieces, n_ctx
        self.n_past, self.fed, self.n_batch = 0, [], 512
        self.enabled = False
        self.vocab = self.cache = self  # one fake for the engine, its vocabulary and its cache

    def _row(self) -> np.ndarray:
        row = np.zeros(max(self.pieces) + 1, np.float32)
        i = len(self.fed) - self.n_prompt
        row[self.script[i] if i < len(self.script) else self.EOG] = 1.0
        return row

    def eval(self, tokens, logits="last"):
        assert self.n_past + len(tokens) <= self.n_ctx
        if not self.fed:
            self.n_prompt = len(tokens)
        self.fed += list(tokens)
        self.n_past += len(tokens)
        return self._row() if logits == "last" else np.stack([self._row()] * len(tokens))

    def decode(self, entries):  # one sequence here: (token, 0, output)
        assert all(seq == 0 for _, seq, _ in entries)
        self.eval([t for t, _, _ in entries], logits="none")

    def logits_row(self, i):
        return self._row()

    def seq_pos(self, seq):
        return self.n_past

    def is_eog(self, t):
        return t == self.EOG

    def piece(self, t):
        return self.pieces[t]


PIECES = {0: b"", 1: b"a", 2: b"b", 3: b"<", 4: b"/s>", 5: b"\xc3", 6: b"\xa9", 7: b"x"}


def _run(eng, prompt=(7, 7), **kw):
    steps = list(stream_generate(eng, list(prompt), **kw))
    return [s.token for s in steps if s.token is not None], "".join(s.text for s in steps), steps[-1]


def test_eog_ends_and_is_never_evaluated():
    eng = _Engine([1, 2, 1], PIECES)
    toks, text, last = _run(eng)
    assert toks == [1, 2, 1] and text == "aba" and last.finish == "eog"
    assert eng.fed == [7, 7, 1, 2, 1] and last.generated_tokens == 3 and last.token is None


def test_length_and_context_limits():
    eng = _Engine([1] * 50, PIECES)
    assert _run(eng, max_tokens=5)[2].finish == "length" and eng.n_past == 7
    eng = _Engine([1] * 50, PIECES, n_ctx=10)
    toks, _, last = _run(eng)
    assert last.finish == "context" and len(toks) == 8 and eng.n_past == 10
    eng = _Engine([1] * 50, PIECES)
    assert _run(eng, max_tokens=0)[:2] == ([], "") and eng.n_past == 2


def test_stop_string_is_cut_and_held_back():
    eng = _Engine([1, 3, 4, 2], PIECES)
    seen = []
    for s in stream_generate(eng, [7], stop=StopRules(strings=("</s>",))):
        seen.append((s.token, s.text, s.finish))
    assert "".join(t for _, t, _ in seen) == "a" and seen[-1][2] == "stop"
    assert seen[1] == (3, "", None)  # "<" may begin the stop string: held back
    assert eng.fed == [7, 1, 3, 4]  # the token that completed it was evaluated, nothing after


def test_stop_token_and_interruption():
    eng = _Engine([1, 2, 1], PIECES)
    toks, _, last = _run(eng, stop=StopRules(token_ids=frozenset({2})))
    assert toks == [1] and last.finish == "stop"
    n = iter(range(100))
    toks, _, last = _run(_Engine([1] * 9, PIECES), should_stop=lambda: next(n) >= 3)
    assert toks == [1, 1, 1] and last.finish == "interrupted"


def test_utf8_across_tokens_and_skip_eog():
    eng = _Engine([5, 6, 1], PIECES)
    steps = list(stream_generate(eng, [7]))
    assert [s.text for s in steps] == ["", "é", "a", ""]
    eng = _Engine([1], PIECES)  # then only end-of-generation tokens
    toks, _, last = _run(eng, sampler=Greedy(skip_eog=True), max_tokens=3, stop=StopRules(eog=False))
    assert len(toks) == 3 and 0 not in toks and last.finish == "length"


def test_prompt_rows_and_forced_tokens():
    eng = _Engine([1, 2], PIECES)
    rows = []
    steps = list(stream_generate(eng, [7, 7, 7], sampler=Forced([2, 2]), max_tokens=2, prompt_logits="all",
                                 on_prompt=rows.append, keep_logits=True))
    assert rows[0].shape[0] == 3 and [s.token for s in steps[:-1]] == [2, 2]
    assert all(s.logits is not None for s in steps[:-1])


# ---------------------------------------------------------------- on the demo model


@pytest.mark.model
def test_greedy_equals_the_old_hand_written_loop_and_chat(small_model):
    """The loop's greedy tokens equal an eval/argmax loop (the one chat, bench and calibration ran
    before), chat's answer (llama.cpp's greedy chain) and bench's decode on the same prompt."""
    from spark_cli.native.engine import Engine, EngineOptions
    from spark_cli.runs import bench
    from spark_cli.runs.chat_session import ChatSession, Sampling

    n = 16
    with Engine(EngineOptions(small_model, n_ctx=256, device="none", repack=False)) as eng:
        prompt = eng.vocab.tokenize(eng.vocab.chat_prompt([{"role": "user", "content": "What is the capital of France?"}]))
        eng.reset()
        old, _ = greedy_rows(eng, prompt, n)
        eng.reset()
        new = [s.token for s in eng.stream_generate(prompt, max_tokens=n) if s.token is not None]
        chat = ChatSession(eng, Sampling(temp=0, n_predict=n))
        eng.reset()
        ans = chat.answer("What is the capital of France?")
        chat.close()
        assert ans.figures.to_dict()["cpu_threads"] == eng.cpu_threads > 0
        eng.reset()
        benched: list[int] = []
        bench.decode(eng, prompt, len(old), on_token=benched.append)
        assert knows_paris(eng)  # a working model: the loops below agree on real text
    assert len(old) >= 4
    assert new == old
    assert ans.text == eng_text(small_model, old) and ans.figures.generated_tokens == len(old)
    assert benched == old


def eng_text(model, tokens) -> str:
    from spark_cli.native.engine import Engine, EngineOptions

    with Engine(EngineOptions(model, n_ctx=64, device="none", repack=False)) as eng:
        return eng.vocab.detokenize(tokens)


def test_a_step_without_room_leaves_the_prompts_as_they_were():
    """llama_decode found no room (KVFullError): nothing was evaluated, so the next step feeds the
    same prompt chunk again and the sequence's tokens are those of an undisturbed run."""
    from spark_cli.native.engine import KVFullError
    from spark_cli.native.generate import BatchLoop, Decoding

    class Full(_Engine):
        refusals = 1

        def decode(self, entries):
            if self.refusals:
                self.refusals -= 1
                raise KVFullError("no room")
            super().decode(entries)

    eng, steps = Full([1, 2, 1], PIECES), []
    loop = BatchLoop(eng)
    loop.add(Decoding(eng, 0, n_prompt=3), steps.append, prompt=[7, 7, 7])
    with pytest.raises(KVFullError):
        loop.step()
    while loop.busy:
        loop.step()
    assert eng.fed == [7, 7, 7, 1, 2, 1] and [s.token for s in steps] == [1, 2, 1, None]


def test_the_prompts_time_ends_with_its_first_sample_as_llama_servers():
    """A GPU or RPC backend evaluates asynchronously: llama_decode returns at once and reading the
    logits waits. The prompt's time runs until the first token is sampled (the wait counted as
    the prompt's, as llama-server's t_prompt_processing), not until llama_decode returns."""
    from spark_cli.native.generate import BatchLoop, Decoding

    wait = 0.3

    class Async(_Engine):
        pending = False

        def decode(self, entries):
            super().decode(entries)
            self.pending = any(out for _, _, out in entries)

        def logits_row(self, i):
            if self.pending:  # the first read after a decode waits for its evaluation
                time.sleep(wait if self.n_past == 3 else 0.0)
                self.pending = False
            return super().logits_row(i)

    eng, steps = Async([1, 2], PIECES), []
    loop = BatchLoop(eng)
    loop.add(Decoding(eng, 0, n_prompt=3), steps.append, prompt=[7, 7, 7])
    while loop.busy:
        loop.step()
    last = steps[-1]
    assert last.prompt_seconds >= wait and last.gen_seconds < wait, (last.prompt_seconds, last.gen_seconds)
