"""A conversation over one Engine: history, context trimming, per-answer figures, learning.

No terminal here: `spark chat` renders what this module returns, and tests drive it directly.
The KV cache keeps the tokens already evaluated; each turn evaluates only the suffix of the
newly formatted prompt that differs from them.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..files.atomic import atomic_write_text
from ..errors import SparkError
from ..native.expert_cache import CacheStats
from ..native.generate import Rates, StopRules, TokenProbs, stream_generate
from .session import decode_counts



@dataclass(frozen=True)
class Sampling:
    temp: float = 0.8  # 0: greedy
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0
    n_predict: int = -1  # -1: until end of generation or a full context
    min_p: float = 0.05
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64
    grammar: str | None = None  # GBNF that every answer must match (native/grammar.py)
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0
    typical_p: float = 1.0  # 1.0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias added to its logit)
    n_probs: int | None = None  # each token's probability and the top n_probs (GenerationStep.probs)
    post_sampling_probs: bool = False  # those probabilities after the sampler chain, not of the raw logits
    ban_eog: bool = False  # never sample an end-of-generation token (ignore_eos)
    n_keep: int = 0  # context shift (spark serve --context-shift): prompt tokens kept (-1: all)
    n_discard: int = 0  # context shift: tokens dropped per shift (0: half of those after n_keep)


def make_sampler(engine, s: Sampling):
    """The engine's llama.cpp sampler chain for these settings (close it when done)."""
    return engine.make_sampler(s.temp, s.top_k, s.top_p, s.seed, s.min_p, s.repeat_penalty, s.repeat_last_n,
                               s.grammar, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                               typical_p=s.typical_p, logit_bias=s.logit_bias, ban_eog=s.ban_eog)


CACHE_KEYS = ("hits", "misses", "uploads", "bytes_uploaded", "syncs", "blocking_upload_bytes",
              "async_upload_bytes", "cpu_expert_bytes")  # of `cache`, flat in to_dict
PER_TOKEN_KEYS = ("syncs", "blocking_upload_bytes", "async_upload_bytes", "cpu_expert_bytes")


@dataclass
class AnswerFigures(Rates):
    """What one answer cost; `cache` is the delta over this answer, cached layers only."""

    prompt_tokens: int = 0  # evaluated for this prompt
    reused_tokens: int = 0  # kept from the KV cache (common prefix with the last turn)
    generated_tokens: int = 0  # sampled and evaluated one at a time (decode)
    prompt_seconds: float = 0.0
    gen_seconds: float = 0.0
    cache: CacheStats = field(default_factory=CacheStats)
    miss_path: str = ""  # cpu, upload or a per-layer mix
    cached_layers: int = 0
    cpu_threads: int | None = None  # threads of the CPU work (llama.cpp, the CPU miss path)
    vram_bytes: int | None = None
    vram_source: str = ""  # measured | planned | "" (no device)
    dropped_turns: int = 0
    stop: str = ""  # eog | stop | length | context | interrupted | error

    @property
    def hit_rate(self) -> float | None:
        return self.cache.hit_rate

    def per_token(self, value: int) -> float | None:
        """A counter of this answer per token evaluated (prompt and generated)."""
        n = self.prompt_tokens + self.generated_tokens
        return value / n if n else None

    def __add__(self, other: "AnswerFigures") -> "AnswerFigures":
        """Sums of the counts, times and cache figures (a session's totals)."""
        return replace(self, **{k: getattr(self, k) + getattr(other, k) for k in (
            "prompt_tokens", "reused_tokens", "generated_tokens", "prompt_seconds", "gen_seconds", "cache",
            "dropped_turns")})

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["cache"]
        c = self.cache
        d.update({k: getattr(c, k) for k in CACHE_KEYS})
        d.update(prompt_tps=self.prompt_tps, gen_tps=self.gen_tps, hit_rate=self.hit_rate,
                 **{f"{k}_per_token": self.per_token(getattr(c, k)) for k in PER_TOKEN_KEYS})
        return d


@dataclass
class Answer:
    text: str
    figures: AnswerFigures
    error: str | None = None
    stop_word: str | None = None  # the stop string that ended it


@dataclass
class _Learned:
    """Decode routing counts of this session, taken as deltas around each generation."""

    counts: np.ndarray | None = None  # [n_layer, n_expert]
    tokens: int = 0
    mark: np.ndarray | None = field(default=None, repr=False)


def prompt_tokens(engine, text: str) -> list[int]:
    """A rendered chat prompt's tokens (special tokens parsed, one BOS)."""
    toks = engine.vocab.tokenize(text, add_special=True, parse_special=True)
    # NOTE: templates that write their own BOS would otherwise get two
    if len(toks) > 1 and toks[0] == toks[1] and toks[0] == engine.vocab.bos_token:
        toks = toks[1:]
    return toks


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    """History and generation over an open Engine (which the caller owns and closes)."""

    def __init__(self, engine, sampling: Sampling = Sampling(), system: str | None = None,
                 cached_layers: set[int] | None = None, vram_probe: Callable[[], tuple[int | None, str]] | None = None):
        self.engine = engine
        self.sampling = sampling
        self.system = system or None
        self.turns: list[tuple[dict, dict]] = []  # (user, assistant) messages within the context
        self.transcript: list[dict] = []  # every message since the start or /reset, for /save
        self.answers: list[AnswerFigures] = []
        self.cached_layers = set(cached_layers or ())
        self.vram_probe = vram_probe
        self.learned = _Learned()
        self._generating: list[int] | None = None  # tokens of the answer being decoded, for harvest_now
        self._kv: list[int] = []  # tokens whose KV entries are in the context, in order
        self._sampler = make_sampler(engine, sampling)

    # -- conversation state ----------------------------------------------------------------

    def messages(self, user: str | None = None) -> list[dict]:
        return self._messages_with(self.turns, user)

    def _messages_with(self, turns: list[tuple[dict, dict]], user: str | None) -> list[dict]:
        out = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in turns:
            out += [u, a]
        if user is not None:
            out.append({"role": "user", "content": user})
        return out

    def set_system(self, text: str | None) -> None:
        self.system = (text or "").strip() or None
        self.transcript.append({"role": "system", "content": self.system or ""})

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and the KV cache."""
        self.turns.clear()
        self.transcript.clear()
        self.engine.reset()
        self._kv = []

    def _tokens(self, messages: list[dict]) -> list[int]:
        return self._prompt_tokens(self.engine.vocab.chat_prompt(messages))

    def _prompt_tokens(self, text: str) -> list[int]:
        return prompt_tokens(self.engine, text)

    def _fit(self, user: str) -> tuple[list[int], int]:
        """(prompt tokens, oldest turns to drop) so that prompt + a reserve for the answer fits."""
        n_ctx = self.engine.n_ctx
        n = self.sampling.n_predict
        reserve = min(n if n >= 0 else n_ctx // 4, n_ctx // 2)
        keep = list(self.turns)
        toks = self._tokens(self.messages(user))
        while keep and len(toks) + reserve > n_ctx:
            keep.pop(0)
            toks = self._tokens(self._messages_with(keep, user))
        if len(toks) >= n_ctx:
            raise SparkError(f"the prompt needs {len(toks)} tokens but the context holds {n_ctx}",
                             hint="raise --ctx-size or shorten the prompt")
        return toks, len(self.turns) - len(keep)

    def check_fits(self, user: str) -> None:
        """Raise SparkError if `user` cannot fit in the context even without history."""
        self._fit(user)

    # -- one answer ------------------------------------------------------------------------

    def answer(self, user: str, on_text: Callable[[str], None] | None = None,
               should_stop: Callable[[], bool] | None = None,
               on_notice: Callable[[str], None] | None = None, stops: Sequence[str] = (),
               special: bool = False, on_probs: Callable[[TokenProbs], None] | None = None) -> Answer:
        """Generate the reply to `user`; stream pieces to on_text (text that may begin one of
        `stops` is held back; a stop string ends the answer, cut). Raises SparkError before
        anything is evaluated when the prompt cannot fit; later failures come back in
        Answer.error (the session and its learned counts stay). With Sampling.n_probs, each
        evaluated token's probabilities go to on_probs before its text goes to on_text."""
        eng = self.engine
        toks, dropped = self._fit(user)
        del self.turns[:dropped]
        fig = AnswerFigures(dropped_turns=dropped, cached_layers=len(self.cached_layers),
                            cpu_threads=getattr(eng, "cpu_threads", None))
        if dropped and on_notice:
            on_notice("context full: dropped the oldest " + (f"{dropped} turns" if dropped > 1 else "turn"))
        keep = common_prefix(self._kv, toks)
        keep = min(keep, len(toks) - 1)  # evaluate at least one token to get fresh logits
        text_parts: list[str] = []
        generated: list[int] = []
        error = stop_word = None
        decoding = False

        def prompt_done(_logits) -> None:
            nonlocal decoding
            self._kv = list(toks)
            self._mark()  # NOTE: a prompt's last layer runs one row (its logits row): not decode
            decoding = True
            self._generating = generated

        try:
            keep = eng.truncate(keep)
            self._kv = self._kv[:keep]
            fig.reused_tokens = keep
            fig.prompt_tokens = len(toks) - keep
            self._sampler.prime(toks)
            for step in stream_generate(eng, toks[keep:], sampler=self._sampler, max_tokens=self.sampling.n_predict,
                                        stop=StopRules(strings=tuple(stops)), should_stop=should_stop,
                                        on_prompt=prompt_done, cache_layers=self.cached_layers,
                                        special=special, n_probs=self.sampling.n_probs):
                fig.prompt_seconds, fig.gen_seconds = step.prompt_seconds, step.gen_seconds
                if step.token is not None:
                    generated.append(step.token)
                    self._kv.append(step.token)
                if step.probs is not None and on_probs:
                    on_probs(step.probs)
                if step.text:
                    text_parts.append(step.text)
                    if on_text:
                        on_text(step.text)
                if step.finish:
                    fig.stop, fig.cache, stop_word = step.finish, step.prompt_cache + step.cache, step.stop_word
        except SparkError as e:
            error, fig.stop = e.one_line(), "error"
        except Exception as e:  # noqa: BLE001 - one failed answer must not end the session
            error, fig.stop = f"{type(e).__name__}: {e}", "error"
        finally:
            self._generating = None
            self._harvest(decoding, len(generated))
            if fig.stop == "error":
                # NOTE: the KV cache may hold a half-evaluated batch: start the next turn afresh
                eng.reset()
                self._kv = []
        fig.generated_tokens = len(generated)
        if self.cached_layers:
            paths = {p for il, p in eng.cache.miss_paths().items() if il in self.cached_layers}
            fig.miss_path = paths.pop() if len(paths) == 1 else "mixed"
        if self.vram_probe:
            fig.vram_bytes, fig.vram_source = self.vram_probe()
        text = "".join(text_parts)
        u = {"role": "user", "content": user}
        a = {"role": "assistant", "content": text}
        if text:
            self.turns.append((u, a))
        self.transcript += [u, {**a, "stop": fig.stop, "figures": fig.to_dict()}]
        self.answers.append(fig)
        return Answer(text, fig, error, stop_word)

    @property
    def n_generated(self) -> int:
        """Tokens of the answer being generated so far (0 between answers)."""
        return len(self._generating or ())

    # -- learning --------------------------------------------------------------------------

    def _mark(self) -> None:
        self.learned.mark = decode_counts(self.engine)

    def harvest_now(self) -> None:
        """Take the decode counts of an answer still being generated (the device is lost)."""
        if self._generating is not None:
            self._harvest(True, len(self._generating))
            self._generating = []

    def _harvest(self, decoding: bool, n_tokens: int) -> None:
        """Add the decode counts since the mark; prompt-phase counts are dropped."""
        now = decode_counts(self.engine)
        if now is None:
            return
        L = self.learned
        if decoding and L.mark is not None:
            delta = now - L.mark
            L.counts = delta if L.counts is None else L.counts + delta
            L.tokens += n_tokens
        L.mark = now

    # -- figures, saving, teardown ---------------------------------------------------------

    def layer_stats(self) -> dict[int, CacheStats]:
        return self.engine.cache.stats()

    def totals(self) -> AnswerFigures:
        t = AnswerFigures(cached_layers=len(self.cached_layers), cpu_threads=getattr(self.engine, "cpu_threads", None))
        for f in self.answers:
            t = t + f
        return t

    def to_json(self, model: str | None = None) -> dict:
        return {
            "format": "spark-chat",
            "version": 1,
            "model": model,
            "saved": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "sampling": asdict(self.sampling),
            "system": self.system,
            "messages": self.transcript,
            "totals": self.totals().to_dict(),
        }

    def save(self, path: Path | str, model: str | None = None) -> Path:
        """Write the conversation as JSON; a folder, a device or a missing folder is a SparkError."""
        path = Path(path).expanduser()
        atomic_write_text(path, json.dumps(self.to_json(model), indent=2, ensure_ascii=False) + "\n", "/save",
                          make_parent=False)
        return path

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
