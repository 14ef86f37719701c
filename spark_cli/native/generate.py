"""The one generation loop, in the spirit of mlx-lm's `stream_generate`: prompt tokens in, one
`GenerationStep` per token out, then a last step that says why it ended.

Chat, serve, bench, calibration, profiling and the exactness helper all run it; they differ only
in the sampler (llama.cpp's chain, numpy greedy, or given tokens), the stop rules and what they do
between steps. Every token yielded has been evaluated, so the KV cache always holds prompt +
yielded tokens; an end-of-generation or stop token is never evaluated.
"""

from __future__ import annotations

import codecs
import ctypes
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from ..core.context_shift import ContextShift
from .expert_cache import CacheStats

FINISH_REASONS = ("eog", "stop", "length", "context", "interrupted")


class Sampler(Protocol):
    def sample(self, engine, logits: np.ndarray | None, row: int = -1) -> int:
        """The next token, from `logits` or else output row `row` of the context's last decode."""

    def prime(self, prompt: Sequence[int]) -> None:
        """Take `prompt` as the history that penalties look back on (samplers without any: nothing)."""


# llama.cpp's llama_token_data, as a numpy record (the candidate array a sampler chain works on)
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class NativeSampler:
    """A llama.cpp sampler chain (Engine.make_sampler); reads the context's last logits row.
    `penalties`: the chain's penalties sampler (None: none), whose history `prime` sets;
    `greedy`: the chain ends in llama.cpp's greedy sampler (temperature 0)."""

    def __init__(self, lc, chain, penalties=None, window: int = 0, greedy: bool = False):
        self.lc, self.chain, self.penalties, self.window, self.greedy = lc, chain, penalties, window, greedy

    def prime(self, prompt: Sequence[int]) -> None:
        """Make the prompt's last tokens the penalties' history, as llama-server does (the
        grammar, earlier in the chain, sees only generated tokens)."""
        if self.penalties is None or self.chain is None:
            return
        self.lc.llama_sampler_reset(self.penalties)
        for tok in prompt[-self.window:]:
            self.lc.llama_sampler_accept(self.penalties, tok)

    def sample(self, engine, logits: np.ndarray | None, row: int = -1) -> int:
        return int(self.lc.llama_sampler_sample(self.chain, engine.ctx, row))

    def sample_post(self, engine, logits: np.ndarray | None, row: int = -1, n: int = 0) -> tuple[int, TokenProbs]:
        """What `sample` does, step for step (llama_sampler_sample: every token's logit in id order,
        the chain applied, its selected token accepted), so the same token, and the probabilities
        the chain left on its candidates (llama-server's post_sampling_probs). A greedy chain sets
        none: its token has probability 1, as llama-server's temperature 0 reports it."""
        lc = self.lc
        z = engine.logits_row(row) if logits is None else logits
        cur = np.zeros(len(z), dtype=TOKEN_DATA)
        cur["id"], cur["logit"] = np.arange(len(z), dtype=np.int32), z
        arr = lc.llama_token_data_array(cur.ctypes.data_as(lc.llama_token_data_p), len(z), -1, False)
        lc.llama_sampler_apply(self.chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise RuntimeError(f"the sampler chain selected no token (selected {arr.selected} of {arr.size})")
        kept = cur[:arr.size]
        tok = int(kept["id"][arr.selected])
        lc.llama_sampler_accept(self.chain, tok)
        p = (kept["id"] == tok).astype(np.float32) if self.greedy else kept["p"]
        return tok, TokenProbs.after(kept["id"], p, tok, n)

    def close(self) -> None:
        if self.chain is not None:
            self.lc.llama_sampler_free(self.chain)
            self.chain = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


@dataclass
class Greedy:
    """Argmax of the logits row; skip_eog: never an end-of-generation token (bench decodes its full length)."""

    skip_eog: bool = False

    def sample(self, engine, logits: np.ndarray | None, row: int = -1) -> int:
        row = engine.logits_row(row) if logits is None else logits
        tok = int(np.argmax(row))
        if self.skip_eog and engine.vocab.is_eog(tok):
            row = row.copy()
            while engine.vocab.is_eog(tok):
                row[tok] = -np.inf
                tok = int(np.argmax(row))
        return tok

    def prime(self, prompt: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Forced:
    """Given tokens, in order (the exactness runs feed the reference's tokens)."""

    tokens: Sequence[int]
    i: int = 0

    def sample(self, engine, logits: np.ndarray | None, row: int = -1) -> int:
        tok = int(self.tokens[self.i])
        self.i += 1
        return tok

    def prime(self, prompt: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class StopRules:
    eog: bool = True                   # end at an end-of-generation token
    strings: tuple[str, ...] = ()      # end when the text contains one (it is cut, and held back until sure)
    token_ids: frozenset[int] = frozenset()  # end at one of these tokens (not evaluated)


class Rates:
    """Prompt and generation tok/s of anything with prompt/generated tokens and their seconds."""

    @property
    def prompt_tps(self) -> float | None:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else None

    @property
    def gen_tps(self) -> float | None:
        return self.generated_tokens / self.gen_seconds if self.gen_seconds > 0 else None


@dataclass(frozen=True)
class GenerationStep(Rates):
    """One evaluated token (token set), or the end (finish set, token None)."""

    token: int | None
    text: str                  # the UTF-8-safe text this step adds (after stop-string holding)
    prompt_tokens: int
    prompt_seconds: float
    generated_tokens: int      # evaluated so far
    gen_seconds: float         # since the first decode step began
    finish: str | None = None  # FINISH_REASONS, on the last step
    logits: np.ndarray | None = None  # [n_vocab] after this token (keep_logits)
    prompt_cache: CacheStats | None = None  # the prompt's cache figures (last step)
    cache: CacheStats | None = None  # the decode steps' cache figures (last step)
    stop_word: str | None = None  # the stop string that ended it (last step, finish "stop")
    probs: TokenProbs | None = None  # this token's probabilities (n_probs set)
    shifts: tuple[tuple[int, int], ...] = ()  # (n_keep, n_discard) of each context shift (last step)


@dataclass(frozen=True)
class TokenProbs:
    """A sampled token's probability and the n most probable of the distribution it was drawn
    from, as (token, prob): the softmax of the raw logits (llama-server's, before any sampler;
    `of`), or with `post` the candidates the sampler chain left, by the probabilities it gave them
    (llama-server's post_sampling_probs; `after`)."""

    token: int
    prob: float
    top: tuple[tuple[int, float], ...]
    post: bool = False

    @classmethod
    def of(cls, logits: np.ndarray, token: int, n: int) -> "TokenProbs":
        z = logits.astype(np.float64) - float(np.max(logits))
        p = np.exp(z)
        p /= p.sum()
        n = min(max(n, 0), len(p))
        best = np.argpartition(-p, n - 1)[:n] if n else np.zeros(0, dtype=np.int64)
        best = best[np.argsort(-p[best], kind="stable")]
        return cls(int(token), float(p[token]), tuple((int(t), float(p[t])) for t in best))

    @classmethod
    def after(cls, ids: np.ndarray, p: np.ndarray, token: int, n: int) -> "TokenProbs":
        """From a chain's candidates (`ids`, their probabilities `p`): the sampled token's, and the
        n most probable of those with a probability above 0 (llama-server drops the zeros)."""
        order = np.argsort(-p, kind="stable")[:max(n, 0)]
        mine = p[ids == token]
        return cls(int(token), float(mine[0]) if len(mine) else 1.0,
                   tuple((int(ids[i]), float(p[i])) for i in order if p[i] > 0), post=True)


class StopFilter:
    """Holds back text that may begin a stop sequence; `matched` is the one that appeared (it is cut)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.pending = ""
        self.matched: str | None = None

    @property
    def hit(self) -> bool:
        return self.matched is not None

    def feed(self, piece: str) -> str:
        if self.hit:
            return ""
        if not self.stops:
            return piece
        self.pending += piece
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
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


def _cache_total(engine, layers: set[int] | None) -> CacheStats:
    if not engine.cache.enabled:
        return CacheStats()
    return CacheStats.total(s for il, s in engine.cache.stats().items() if layers is None or il in layers)


class Decoding:
    """One sequence's side of the loop: sample, apply the stop rules, turn evaluated tokens into
    text (UTF-8-safe, stop strings held back). BatchLoop drives one per sequence."""

    def __init__(self, engine, seq: int = 0, *, n_prompt: int, sampler: Sampler | None = None,
                 max_tokens: int = -1, stop: StopRules = StopRules(), should_stop: Callable[[], bool] | None = None,
                 keep_logits: bool = False, special: bool = False, n_probs: int | None = None,
                 post_sampling: bool = False, shift: ContextShift | None = None):
        self.engine, self.seq = engine, seq
        self.shift = shift  # llama-server's context shift when the context fills (None: it ends, "context")
        self.shifts: list[tuple[int, int]] = []  # (n_keep, n_discard) of each shift done
        self.sampler = sampler or Greedy()
        self.max_tokens, self.stop, self.should_stop = max_tokens, stop, should_stop
        self.keep_logits, self.special, self.n_probs = keep_logits, special, n_probs
        self.post_sampling = post_sampling and n_probs is not None  # the probabilities after the sampler chain
        self.n_prompt, self.n = n_prompt, 0
        self.filt = StopFilter(stop.strings)
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.finish: str | None = None
        self.t0 = time.perf_counter()  # the prompt's start
        self.t1: float | None = None  # the first decode step's start
        self.prompt_seconds = 0.0
        self._probs: TokenProbs | None = None

    def prompt_done(self) -> None:
        """The prompt is evaluated: decoding starts now."""
        self.t1 = time.perf_counter()
        self.prompt_seconds = self.t1 - self.t0

    def interrupted(self) -> bool:
        return bool(self.should_stop and self.should_stop())

    def choose(self, logits: np.ndarray | None, row: int = -1) -> int | None:
        """The next token to evaluate, from `logits` or output row `row`; None: it ends (`finish`).
        The first choice ends the prompt's time (prompt_done), as llama-server's: reading the
        logits waits for the prompt's evaluation, which a GPU or RPC backend runs asynchronously
        (llama_decode returns before it is done)."""
        try:
            return self._choose(logits, row)
        finally:
            if self.t1 is None:
                self.prompt_done()

    def _choose(self, logits: np.ndarray | None, row: int) -> int | None:
        eng = self.engine
        if 0 <= self.max_tokens <= self.n:
            self.finish = "length"
        elif self.interrupted():
            self.finish = "interrupted"
        elif eng.seq_pos(self.seq) >= eng.n_ctx:
            self.finish = "context"
        else:
            tok = self._sample(logits, row)
            if self.stop.eog and eng.vocab.is_eog(tok):
                self.finish = "eog"
            elif tok in self.stop.token_ids:
                self.finish = "stop"
            else:
                self._shift_if_full()
                return tok
        return None

    def _shift_if_full(self) -> None:
        """Before a sampled token is evaluated into a full context: llama-server's context shift
        (pre_decode: the sequence holds n_ctx - 1 positions)."""
        eng = self.engine
        n_past = eng.seq_pos(self.seq)
        if self.shift is None or n_past + 1 < eng.n_ctx:
            return
        keep, discard = self.shift.span(n_past, eng.n_ctx)
        eng.shift(self.seq, keep, discard)
        self.shifts.append((keep, discard))

    def _sample(self, logits: np.ndarray | None, row: int) -> int:
        """The sampler's token; with n_probs, its probabilities (raw, or after the chain) kept for its step."""
        eng = self.engine
        if self.post_sampling:
            tok, self._probs = self.sampler.sample_post(eng, logits, row, self.n_probs)
            return tok
        tok = self.sampler.sample(eng, logits, row)
        if self.n_probs is not None:
            self._probs = TokenProbs.of(eng.logits_row(row) if logits is None else logits, tok, self.n_probs)
        return tok

    def evaluated(self, tok: int, row: int) -> GenerationStep:
        """The step of `tok`, now in the KV cache; its logits are output row `row`."""
        self.n += 1
        piece = self.engine.vocab.piece(tok, special=True) if self.special else self.engine.vocab.piece(tok)
        text = self.filt.feed(self.dec.decode(piece))
        if self.filt.hit:
            self.finish = "stop"
        probs, self._probs = self._probs, None
        return GenerationStep(tok, text, self.n_prompt, self.prompt_seconds, self.n, time.perf_counter() - self.t1,
                              logits=self.engine.logits_row(row) if self.keep_logits else None, probs=probs)

    def end(self) -> GenerationStep:
        """The last step: the text held back, and why it ended."""
        tail = self.filt.feed(self.dec.decode(b"", final=True)) + self.filt.flush()
        gen_seconds = time.perf_counter() - self.t1 if self.t1 is not None else 0.0
        return GenerationStep(None, tail, self.n_prompt, self.prompt_seconds, self.n, gen_seconds,
                              self.finish or "interrupted", stop_word=self.filt.matched, shifts=tuple(self.shifts))


@dataclass(frozen=True)
class PromptProgress:
    """How far a sequence's prompt is evaluated (llama-server's `prompt_progress`): reported once
    before any prompt token is evaluated (processed == cache) and after each chunk (the last:
    processed == total)."""

    total: int  # the whole prompt, the cached prefix included
    cache: int  # the prefix reused from the KV cache (not evaluated)
    processed: int  # cache + the tokens evaluated so far
    seconds: float  # the prompt's evaluation so far (0.0 before its first chunk)

    def to_dict(self) -> dict[str, int]:
        """As llama-server writes it (time_ms: whole milliseconds)."""
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": int(self.seconds * 1e3)}


@dataclass
class _Active:
    dec: Decoding
    emit: Callable[[GenerationStep], None]
    pending: list[int]  # prompt tokens not evaluated yet
    token: int | None = None  # sampled, evaluated at the next step
    on_progress: Callable[[PromptProgress], None] | None = None
    cached: int = 0  # prompt tokens already in the sequence
    total: int = 0  # cached + the prompt given

    def report(self) -> None:
        """The prompt's progress to on_progress (if any)."""
        if self.on_progress is None:
            return
        done = self.total - len(self.pending)
        seconds = time.perf_counter() - self.dec.t0 if done > self.cached else 0.0
        self.on_progress(PromptProgress(self.total, self.cached, done, seconds))


@dataclass(frozen=True)
class StepShape:
    """What one decode step held: one token per decoding sequence, and prompt tokens."""

    decode_tokens: int
    prompt_tokens: int
    sequences: int  # sequences with a token in it


class BatchLoop:
    """The generation loop: continuous batching over the engine's sequences. Each step is one
    llama_decode of the next token of every decoding sequence and, up to n_batch, chunks of the
    prompts still pending; then each sequence with an output samples its next token (Decoding).
    A sequence that ends emits its last step and leaves at once (its KV entries stay: the caller
    owns them). Every token emitted has been evaluated; an end-of-generation or stop token never is.
    A sequence added with `on_progress` reports its prompt's PromptProgress after each chunk."""

    def __init__(self, engine):
        self.engine = engine
        self.active: dict[int, _Active] = {}

    @property
    def busy(self) -> bool:
        return bool(self.active)

    def add(self, dec: Decoding, emit: Callable[[GenerationStep], None], prompt: Sequence[int] = (),
            logits: np.ndarray | None = None, *, cached: int = 0,
            on_progress: Callable[[PromptProgress], None] | None = None) -> None:
        """Start sequence dec.seq: evaluate `prompt` (from its current position), then decode. An
        empty prompt continues from `logits`, or else the context's last output row. `on_progress`
        gets the prompt's PromptProgress now and after each chunk; `cached`: the tokens before
        `prompt` already in the sequence (its cache)."""
        if dec.seq in self.active:
            raise ValueError(f"sequence {dec.seq} is already generating")
        a = _Active(dec, emit, list(prompt), on_progress=on_progress, cached=cached, total=cached + len(prompt))
        self.active[dec.seq] = a
        a.report()
        if not a.pending:
            dec.prompt_done()
            self._next(a, logits, -1)

    def step(self, before: Callable[[StepShape], None] | None = None) -> StepShape:
        """One decode step (`before` sees its shape first); the steps go to each sequence's emit."""
        for a in list(self.active.values()):
            if a.pending and a.dec.interrupted():
                a.dec.finish = "interrupted"
                self._end(a)
        entries, n_decode, chunks = self._gather()
        shape = StepShape(n_decode, len(entries) - n_decode, n_decode + len(chunks))
        if not entries:
            return shape
        if before:
            before(shape)
        self.engine.decode(entries)  # NOTE: it evaluates all or nothing: the prompts move on after it
        for a, n in chunks:
            a.pending = a.pending[n:]
            a.report()
        for i, (_, seq, out) in enumerate(entries):
            a = self.active.get(seq)
            if not out or a is None:
                continue
            if a.token is not None:
                tok, a.token = a.token, None
                a.emit(a.dec.evaluated(tok, i))
                if a.dec.finish:
                    self._end(a)
                    continue
            elif a.pending:
                continue
            self._next(a, None, i)  # NOTE: the first choice ends the prompt's time (Decoding.choose)
        return shape

    def end(self, seq: int, finish: str) -> None:
        """End sequence `seq` now (its last step says `finish`)."""
        a = self.active[seq]
        a.dec.finish = finish
        self._end(a)

    def _gather(self) -> tuple[list[tuple[int, int, bool]], int, list[tuple[_Active, int]]]:
        """This step's entries (every sampled token first, then prompt chunks while n_batch
        allows), how many are sampled tokens, and the prompt chunks taken (sequence, tokens)."""
        entries = [(a.token, a.dec.seq, True) for a in self.active.values() if a.token is not None]
        n_decode = len(entries)
        room = self.engine.n_batch - n_decode
        chunks: list[tuple[_Active, int]] = []
        for a in self.active.values():
            if not a.pending or room <= 0:
                continue
            n = min(room, len(a.pending))
            last = n == len(a.pending)
            entries += [(t, a.dec.seq, last and j == n - 1) for j, t in enumerate(a.pending[:n])]
            chunks.append((a, n))
            room -= n
        return entries, n_decode, chunks

    def _next(self, a: _Active, logits: np.ndarray | None, row: int) -> None:
        a.token = a.dec.choose(logits, row)
        if a.token is None:
            self._end(a)

    def _end(self, a: _Active) -> None:
        del self.active[a.dec.seq]
        a.emit(a.dec.end())


def stream_generate(engine, prompt: Sequence[int], *, sampler: Sampler | None = None, max_tokens: int = -1,
                    stop: StopRules = StopRules(), should_stop: Callable[[], bool] | None = None,
                    prompt_logits: str = "last", on_prompt: Callable[[np.ndarray | None], None] | None = None,
                    keep_logits: bool = False, cache_layers: set[int] | None = None,
                    special: bool = False, n_probs: int | None = None) -> Iterator[GenerationStep]:
    """Evaluate `prompt` in sequence 0 (n_batch chunks; empty: continue from the context's last
    output), then run the BatchLoop on that one sequence: sample, evaluate and yield tokens until a
    stop rule, `max_tokens` (-1: none), a full context or `should_stop()` ends it. `prompt_logits`
    'all' hands every prompt row to `on_prompt` (called once the prompt is evaluated, before any
    decode step); greedy when `sampler` is None. The last step carries the cache figures of
    `cache_layers` (None: every layer) for the prompt and the decode. `special`: control tokens are
    text too (tool-call formats whose markers are control tokens). `n_probs` set: each step carries
    its token's probability and the top n_probs (TokenProbs)."""
    dec = Decoding(engine, 0, n_prompt=len(prompt), sampler=sampler, max_tokens=max_tokens, stop=stop,
                   should_stop=should_stop, keep_logits=keep_logits, special=special, n_probs=n_probs)
    s0 = _cache_total(engine, cache_layers)
    t0 = time.perf_counter()
    last = engine.eval(list(prompt), logits=prompt_logits) if prompt else None
    prompt_seconds = time.perf_counter() - t0
    s1 = _cache_total(engine, cache_layers)
    if on_prompt:
        on_prompt(last)
    if last is not None and last.ndim == 2:
        last = last[-1]
    s2 = _cache_total(engine, cache_layers)
    out: list[GenerationStep] = []
    loop = BatchLoop(engine)
    loop.add(dec, out.append, logits=last)
    dec.prompt_seconds = prompt_seconds  # the prompt's evaluation (the loop took over after it)
    while True:
        for step in out:
            if step.finish:
                yield replace(step, prompt_cache=s1 - s0, cache=_cache_total(engine, cache_layers) - s2)
                return
            yield step
        out.clear()
        loop.step()
