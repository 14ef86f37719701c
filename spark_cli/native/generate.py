"""The one generation loop, in the spirit of mlx-lm's `stream_generate`: prompt tokens in, one
`GenerationStep` per token out, then a last step that says why it ended.

Chat, serve, bench, calibration, profiling and the exactness helper all run it; they differ only
in the sampler (llama.cpp's chain, numpy greedy, or given tokens), the stop rules and what they do
between steps. Every token yielded has been evaluated, so the KV cache always holds prompt +
yielded tokens; an end-of-generation or stop token is never evaluated.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np

from .expert_cache import CacheStats

FINISH_REASONS = ("eog", "stop", "length", "context", "interrupted")


class Sampler(Protocol):
    def sample(self, engine, logits: np.ndarray | None) -> int:
        """The next token, from `logits` (the last output row) or the context itself."""

    def prime(self, prompt: Sequence[int]) -> None:
        """Take `prompt` as the history that penalties look back on (samplers without any: nothing)."""


class NativeSampler:
    """A llama.cpp sampler chain (Engine.make_sampler); reads the context's last logits row.
    `penalties`: the chain's penalties sampler (None: none), whose history `prime` sets."""

    def __init__(self, lc, chain, penalties=None, window: int = 0):
        self.lc, self.chain, self.penalties, self.window = lc, chain, penalties, window

    def prime(self, prompt: Sequence[int]) -> None:
        """Make the prompt's last tokens the penalties' history, as llama-server does (the
        grammar, earlier in the chain, sees only generated tokens)."""
        if self.penalties is None or self.chain is None:
            return
        self.lc.llama_sampler_reset(self.penalties)
        for tok in prompt[-self.window:]:
            self.lc.llama_sampler_accept(self.penalties, tok)

    def sample(self, engine, logits: np.ndarray | None) -> int:
        return int(self.lc.llama_sampler_sample(self.chain, engine.ctx, -1))

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

    def sample(self, engine, logits: np.ndarray | None) -> int:
        row = engine.last_logits() if logits is None else logits
        tok = int(np.argmax(row))
        if self.skip_eog and engine.is_eog(tok):
            row = row.copy()
            while engine.is_eog(tok):
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

    def sample(self, engine, logits: np.ndarray | None) -> int:
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


@dataclass(frozen=True)
class TokenProbs:
    """A sampled token's probability and the n most probable of the distribution it was drawn
    from: the softmax of the raw logits (llama-server's, before any sampler), as (token, prob)."""

    token: int
    prob: float
    top: tuple[tuple[int, float], ...]

    @classmethod
    def of(cls, logits: np.ndarray, token: int, n: int) -> "TokenProbs":
        z = logits.astype(np.float64) - float(np.max(logits))
        p = np.exp(z)
        p /= p.sum()
        n = min(max(n, 0), len(p))
        best = np.argpartition(-p, n - 1)[:n] if n else np.zeros(0, dtype=np.int64)
        best = best[np.argsort(-p[best], kind="stable")]
        return cls(int(token), float(p[token]), tuple((int(t), float(p[t])) for t in best))


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
    if not getattr(engine, "cache_enabled", False):
        return CacheStats()
    return CacheStats.total(s for il, s in engine.cache_stats().items() if layers is None or il in layers)


def stream_generate(engine, prompt: Sequence[int], *, sampler: Sampler | None = None, max_tokens: int = -1,
                    stop: StopRules = StopRules(), should_stop: Callable[[], bool] | None = None,
                    prompt_logits: str = "last", on_prompt: Callable[[np.ndarray | None], None] | None = None,
                    keep_logits: bool = False, cache_layers: set[int] | None = None,
                    special: bool = False, n_probs: int | None = None) -> Iterator[GenerationStep]:
    """Evaluate `prompt` (n_batch chunks; empty: continue from the context's last output), then
    sample, evaluate and yield tokens until a stop rule, `max_tokens` (-1: none), a full context or
    `should_stop()` ends it. `prompt_logits` 'all' hands every prompt row to `on_prompt` (called once
    the prompt is evaluated, before any decode step); greedy when `sampler` is None. The last step
    carries the cache figures of `cache_layers` (None: every layer) for the prompt and the decode.
    `special`: control tokens are text too (tool-call formats whose markers are control tokens).
    `n_probs` set: each step carries its token's probability and the top n_probs (TokenProbs)."""
    sampler = sampler or Greedy()
    filt = StopFilter(stop.strings)
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
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
    n_prompt, n = len(prompt), 0
    t1 = time.perf_counter()
    finish = None
    while finish is None:
        if 0 <= max_tokens <= n:
            finish = "length"
        elif should_stop and should_stop():
            finish = "interrupted"
        elif engine.n_past >= engine.n_ctx:
            finish = "context"
        else:
            tok = sampler.sample(engine, last)
            probs = None
            if n_probs is not None:
                probs = TokenProbs.of(engine.last_logits() if last is None else last, tok, n_probs)
            if stop.eog and engine.is_eog(tok):
                finish = "eog"
            elif tok in stop.token_ids:
                finish = "stop"
            else:
                last = engine.eval([tok], logits="last")
                n += 1
                text = filt.feed(dec.decode(engine.piece(tok, special=True) if special else engine.piece(tok)))
                if filt.hit:
                    finish = "stop"
                yield GenerationStep(tok, text, n_prompt, prompt_seconds, n, time.perf_counter() - t1,
                                     logits=last if keep_logits else None, probs=probs)
    tail = filt.feed(dec.decode(b"", final=True)) + filt.flush()
    gen_seconds = time.perf_counter() - t1
    s3 = _cache_total(engine, cache_layers)
    yield GenerationStep(None, tail, n_prompt, prompt_seconds, n, gen_seconds, finish,
                         prompt_cache=s1 - s0, cache=s3 - s2, stop_word=filt.matched)
