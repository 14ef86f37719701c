"""The one thread that owns the engine: loads it, then serves requests in its -np slots.

Requests wait in a bounded FIFO queue (full: 503) until a slot is free; one that asks for a
slot (llama-server's id_slot) waits for that one, out of the queue (still counted). Each slot is one
sequence of the KV cache; every step decodes the next token of every busy slot, and chunks of
the prompts still pending, in one llama_decode (continuous batching, native/generate.BatchLoop),
so a slot that finishes takes the next request at once. Each job's events come from its own
slot only. A job's `cancel` event ends it at the next step (client gone, shutdown) and frees its
slot. An engine failure is fatal: every running and queued job gets a 503, and `on_fatal` tells
the process to exit non-zero. With `sleep_idle` (--sleep-idle-seconds) the engine is freed after
that long idle and loaded again, by the same `open_engine`, for the next job (sleep.py).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core.context_shift import ContextShift
from ..native.embed import EmbedError
from ..native.engine import KVFullError
from ..native.generate import BatchLoop, Decoding, GenerationStep, PromptProgress, StopRules, TokenProbs
from ..runs.chat_session import AnswerFigures, Sampling, make_sampler
from ..errors import SparkError
from ..files.slot_file import SlotFileError
from .generation import ContextError, RequestPrompt
from .learn import Learner
from .prepared_chat import PreparedChat
from . import slot_actions
from .slot_actions import SlotAction
from .sleep import WAKE, IdleSleep
from .slots import DecodeCounts, Slot, pick_slot
from .protocol import ApiError, Timings, TokenLogprob, Usage, unavailable
from .stats import ServerStats


@dataclass
class Started:
    prompt_tokens: int
    prompt: str = ""  # the prompt's text (a chat's as rendered)
    slot: int = 0  # the slot (KV sequence) that serves it
    shown: str | None = None  # the prompt as llama-server shows it (Job.show_prompt)


@dataclass
class Text:
    text: str
    probs: list[TokenLogprob] | None = None  # of the tokens this text completes (asked for: n_probs)
    n_generated: int = 0  # tokens generated so far
    tokens: tuple[int, ...] = ()  # the generated tokens this text completes
    timings: Timings | None = None  # the request's so far (timings_per_token)


@dataclass
class Progress:
    """How far the prompt is evaluated (Job.progress): llama-server's prompt_progress, and the
    timings so far (the prompt's: nothing generated yet)."""

    progress: PromptProgress
    timings: Timings


@dataclass
class Done:
    finish: str  # eog | stop | length | context | interrupted
    usage: Usage
    stop_word: str | None = None  # the stop string that ended it (finish "stop")
    timings: Timings | None = None
    shifted: bool = False  # the context was shifted (--context-shift): llama-server's `truncated`


@dataclass
class Failed:
    error: ApiError


@dataclass
class Embedded:
    """An embedding job's answer (Job.embed): [n_tokens, n_embd] with pooling none, else one vector."""

    vectors: Any  # numpy array
    n_tokens: int


@dataclass
class SlotDone:
    """A slot action's answer (Job.slot_action): llama-server's body of it."""

    body: dict[str, Any]


Event = Started | Text | Progress | Done | Failed | Embedded | SlotDone


@dataclass
class Job:
    """One request: a chat (serve/prepared_chat.PreparedChat: rendered with the model's template, tools
    included) or a completion (text), and where its events go; `count_only`: Started with the
    prompt's tokens and text, then Done, nothing generated; `progress`: Progress events while the
    prompt is evaluated (llama-server's return_progress)."""

    emit: Callable[[Event], None]
    sampling: Sampling
    chat: PreparedChat | None = None
    text: str | list[int | str] | None = None  # a completion's prompt: text, or token ids and texts
    stops: list[str] = field(default_factory=list)
    count_only: bool = False
    cache_prompt: bool = True  # False: reuse nothing from the KV cache
    progress: bool = False
    id_slot: int = -1  # the slot it asked for (waited for while busy); -1: the free one that holds most of it
    embed: bool = False  # the prompt's embeddings (Embedded), nothing generated
    show_prompt: bool = False  # Started.shown: the prompt's tokens detokenized, as llama-server's `prompt`
    slot_action: SlotAction | None = None  # save, restore or erase slot id_slot (SlotDone), nothing generated
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def resolve_bias(sampling: Sampling, engine) -> Sampling:
    """llama-server's text keys of logit_bias: every token of the text (tokenized without special
    tokens) gets the bias."""
    if not any(isinstance(t, str) for t, _ in sampling.logit_bias):
        return sampling
    pairs: list[tuple[int, float]] = []
    for t, b in sampling.logit_bias:
        toks = engine.vocab.tokenize(t, add_special=False, parse_special=False) if isinstance(t, str) else [t]
        pairs += [(tok, b) for tok in toks]
    return dataclasses.replace(sampling, logit_bias=tuple(pairs))


def _bad_bias(sampling: Sampling, n_vocab: int | None) -> str | None:
    """Why a logit bias cannot apply (a token past the vocabulary), or None."""
    for tok, _ in sampling.logit_bias:
        if n_vocab is not None and tok >= n_vocab:
            return f"logit_bias: token {tok} is not in the vocabulary (0 to {n_vocab - 1})"
    return None


class _ProbsFeed:
    """Token probabilities as they come (engine thread), handed out with the text that follows
    them: a token whose text a stop string cut never gets handed out (llama-server drops those too)."""

    def __init__(self, engine, wanted: bool):
        self.engine, self.wanted = engine, wanted
        self.pending: list[TokenLogprob] = []

    def _entry(self, token: int, prob: float, post: bool, top: tuple[TokenLogprob, ...] = ()) -> TokenLogprob:
        return TokenLogprob(token, self.engine.vocab.piece(token, special=True), prob, top, post)

    def add(self, p: TokenProbs) -> None:
        self.pending.append(self._entry(p.token, p.prob, p.post, tuple(self._entry(t, q, p.post) for t, q in p.top)))

    def take(self) -> list[TokenLogprob] | None:
        if not self.wanted:
            return None
        out, self.pending = self.pending, []
        return out


def _progress(p: PromptProgress) -> Progress:
    return Progress(p, Timings(p.cache, p.processed - p.cache, p.seconds))


class Worker:
    def __init__(self, open_engine: Callable[[], Any], cached_layers: set[int], stats: ServerStats,
                 learner: Learner, max_queue: int = 32, on_fatal: Callable[[str, int], None] | None = None,
                 sleep_idle: float | None = None, no_generation: str | None = None, context_shift: bool = False):
        self._open = open_engine
        self.context_shift = context_shift  # --context-shift (where the model's cache can shift: Engine.can_shift)
        self.no_generation = no_generation  # why this model generates nothing (core/embedding.cannot_generate)
        self.cached_layers = cached_layers
        self.stats = stats
        self.learner = learner
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.idle = IdleSleep(sleep_idle, self.queue)
        # called on the engine thread: True before a sleep frees the engine, False once it is back
        self.on_sleep: list[Callable[[bool], None]] = []
        self.eog_tokens: tuple[int, ...] = ()  # the model's end-of-generation tokens (kept while asleep)
        self.on_fatal = on_fatal or (lambda msg, code: None)
        self.engine = None
        self.ready = threading.Event()
        self.fatal: str | None = None
        self.closing = False
        self.slots: list[Slot] = []
        self._pinned: list[Job] = []  # taken from the queue for a slot (id_slot) busy then: the engine thread's
        self._loop: BatchLoop | None = None
        self._counts: DecodeCounts | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name="spark-engine", daemon=True)

    # -- called from the web side ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ApiError(503) while loading, failed, shutting down or full (the jobs
        that wait for their slot count), ApiError(400) for an id_slot this server does not have, ApiError(501)
        for generating on a model that cannot (a reranker's encoder)."""
        if self.no_generation and not (job.embed or job.count_only or job.slot_action is not None):
            raise ApiError(501, self.no_generation, "not_supported_error")
        if self.fatal:
            raise unavailable(f"the engine failed: {self.fatal}")
        if self.closing:
            raise unavailable("the server is shutting down")
        if not self.ready.is_set():
            raise unavailable("Loading model")
        if not -1 <= job.id_slot < len(self.slots):
            raise ApiError(400, f"id_slot: {job.id_slot} is not a slot of this server (0 to {len(self.slots) - 1}, "
                                "or -1 for any; spark serve -np sets how many)", param="id_slot")
        full = self.waiting() >= self.queue.maxsize
        if not full:
            try:
                self.queue.put_nowait(job)
            except queue.Full:
                full = True
        if full:
            self.stats.rejected()
            raise unavailable(f"the request queue is full ({self.queue.maxsize} waiting); retry later")
        self.stats.set_deferred(self.waiting())

    def waiting(self) -> int:
        """Jobs not started yet: in the queue, or out of it waiting for the slot they asked for."""
        return self.queue.qsize() + len(self._pinned)

    @property
    def asleep(self) -> bool:
        return self.idle.asleep

    def running(self) -> list[Job]:
        return [s.job for s in list(self.slots) if s.job is not None]

    def shutdown(self, grace: float, stuck_after: float = 2.0) -> bool:
        """Take no more jobs, refuse the queued ones, give the running ones `grace` seconds in all,
        then cancel them. False when the engine thread is still inside one step `stuck_after`
        seconds later (a native call cannot be interrupted): its requests get a 503, the counts
        so far go to the learner, and the engine is left for the process's exit to free."""
        self.closing = True
        self._refuse_queued(unavailable("the server is shutting down"))
        deadline = time.monotonic() + grace
        for job in self.running():
            if not job.done.wait(max(0.0, deadline - time.monotonic())):
                job.cancel.set()
        self.queue.put(None)
        self._thread.join(timeout=stuck_after)
        if not self._thread.is_alive():
            return True
        self.abort("the server is shutting down (the request's step did not end)")
        self.harvest_now()
        return False

    def slots_info(self) -> list[dict]:
        """llama-server's GET /slots: one entry per slot."""
        n_ctx = getattr(self.engine, "n_ctx", 0)
        return [s.info(n_ctx) for s in list(self.slots)]

    # -- the engine thread ---------------------------------------------------------------------

    def _load(self) -> bool:
        """Open the engine (at start, and after a sleep) and its slots; False once it failed (fatal)."""
        try:
            self.engine = self._open()
            self.stats.set_cache(self.engine)
        except SparkError as e:
            self._die(e.one_line(), 2)
            return False
        except Exception as e:  # noqa: BLE001 - reported in one line, exit non-zero
            self._die(f"{type(e).__name__}: {e}", 2)
            return False
        eng = self.engine
        if not self.slots:  # NOTE: after a sleep the same slots (their task counts) serve again, empty
            self.slots = [Slot(i) for i in range(getattr(eng, "n_seq", 1))]
        self.eog_tokens = tuple(getattr(eng.vocab, "eog_tokens", ()))
        self.stats.set_slots(len(self.slots))
        self._loop = BatchLoop(eng)
        self._counts = DecodeCounts(eng, self.learner)
        return True

    def _main(self) -> None:
        if not self._load():
            return
        self.ready.set()
        while not self.fatal:
            self._admit()
            if not self._loop.busy:
                if self._stopping:
                    break
                self._counts.flush()
                job = self._next()
                self.stats.set_deferred(self.waiting())
                if job is None:
                    break
                self._start(job)  # NOTE: every slot is free here, the one a job asks for too
                continue
            self._step()
        if self._counts is not None:
            self._counts.flush()
        self._refuse_pinned(unavailable(f"the engine failed: {self.fatal}" if self.fatal else
                                        "the server is shutting down"))

    def _next(self) -> Job | None:
        """The next job (None: shut down), the engine idle meanwhile; with sleep_idle, it sleeps after
        that long and wakes for the next job or for a reader (sleep.WAKE)."""
        idle = self.idle
        idle.touch()
        while True:
            try:
                job = self.queue.get(timeout=idle.left())
            except queue.Empty:
                if not idle.fall_asleep():
                    continue
                self._sleep()
                job = self.queue.get()
                if job is None:
                    return None
                if not self._wake():
                    if job is not WAKE:
                        job.emit(Failed(unavailable(f"the engine failed: {self.fatal}")))
                        job.done.set()
                    return None
            if job is not WAKE:
                return job

    def _sleep(self) -> None:
        """Free the engine (the model, its KV cache and expert cache); what /props and /metrics
        report meanwhile is kept first (on_sleep, the stats' snapshot)."""
        self._counts.flush()
        for hook in self.on_sleep:
            hook(True)
        self.stats.sleep(self.engine)
        for slot in self.slots:
            slot.kv = []
        self.close_engine()
        self._loop = self._counts = None

    def _wake(self) -> bool:
        """Load the engine again as at start (False: it failed, fatal)."""
        if not self._load():
            return False
        for hook in reversed(self.on_sleep):
            hook(False)
        self.stats.wake()
        self.idle.woke()
        return True

    def _admit(self) -> None:
        """Start waiting jobs while a slot is free: first those whose slot (id_slot) is, then the
        queue's in order (one whose slot is busy waits for it, out of the queue)."""
        if self.closing and self._pinned:
            self._refuse_pinned(unavailable("the server is shutting down"))
        while not self._stopping:
            free = {s.id for s in self.slots if s.job is None}
            job = next((j for j in self._pinned if j.id_slot in free or j.cancel.is_set()), None)
            if job is not None:
                self._pinned.remove(job)
            elif not free:
                return
            else:
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    return
                if job is WAKE:  # NOTE: the engine is awake already
                    continue
                if job is None:
                    self._stopping = True
                    return
                if job.id_slot >= 0 and job.id_slot not in free:
                    self._pinned.append(job)
                    continue
            self.stats.set_deferred(self.waiting())
            self._start(job)

    def _refuse_pinned(self, err: ApiError) -> None:
        """Answer the jobs that wait for their slot (the engine thread's; the queue's: _refuse_queued)."""
        for job in self._pinned:
            job.emit(Failed(err))
            job.done.set()
        self._pinned.clear()
        self.stats.set_deferred(self.waiting())

    def _step(self) -> None:
        busy = sum(1 for s in self.slots if s.job is not None)
        try:
            shape = self._loop.step(before=self._counts.before)
            if shape.decode_tokens or shape.prompt_tokens:
                self._counts.after(shape)
                self.stats.add_decode(busy)
        except KVFullError:
            self._evict()
        except SparkError as e:
            self._engine_failed(e.one_line())
        except Exception as e:  # noqa: BLE001 - reported as a failed engine, not a traceback
            self._engine_failed(f"{type(e).__name__}: {e}")

    def _evict(self) -> None:
        """No room in the unified KV cache for this step: the idle slot used longest ago forgets its
        cached tokens; with none left, the running sequence that holds most ends (context)."""
        eng = self.engine
        idle = [s for s in self.slots if s.job is None and eng.seq_pos(s.id) > 0]
        if idle:
            slot = min(idle, key=lambda s: s.last_used)
        else:
            slot = max((s for s in self.slots if s.job is not None), key=lambda s: eng.seq_pos(s.id))
            self._loop.end(slot.id, "context")
        eng.seq_clear(slot.id)
        slot.kv = []

    def _start(self, job: Job) -> None:
        """_begin, guarded: a bug while starting one job answers that job with a 500 and frees the slot
        it took, and the engine thread goes on (an exception here used to end it: every later request
        hung)."""
        try:
            self._begin(job)
        except Exception as e:  # noqa: BLE001 - a bug in one request must not take the server down
            self._start_failed(job, e)

    def _start_failed(self, job: Job, e: Exception) -> None:
        for slot in self.slots:
            if slot.job is job:  # NOTE: its sequence may hold part of the prompt: forgotten
                self.engine.seq_clear(slot.id)
                slot.end(0)
        self.stats.set_processing(sum(1 for s in self.slots if s.job is not None))
        job.emit(Failed(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")))
        job.done.set()

    def _begin(self, job: Job) -> None:
        """Prepare a job's prompt and put it in the free slot that holds most of it; a job that
        cannot run (bad input, count_only) is answered here without a slot."""
        if job.cancel.is_set():
            job.done.set()
            return
        eng = self.engine
        if job.slot_action is not None:
            self._slot_action(job)
            return
        try:
            job.sampling = resolve_bias(job.sampling, eng)
            req = self._prompt(job)
            shown = eng.vocab.server_text(req[0]) if req is not None and job.show_prompt else None
        except Exception as e:  # noqa: BLE001 - a bug in one request must not take the server down
            job.emit(Failed(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")))
            req = None
        if req is None:
            job.done.set()
            return
        toks, text = req
        if job.embed:
            self._embed(job, toks)
            return
        try:
            sampler = make_sampler(eng, job.sampling)
        except SparkError as e:  # a grammar llama.cpp refuses: this request's 400, the engine goes on
            job.emit(Failed(ApiError(400, e.one_line(), param="grammar" if job.sampling.grammar else None)))
            job.done.set()
            return
        slot = pick_slot(self.slots, toks if job.cache_prompt else [], job.id_slot)
        keep = min(slot.common(toks), len(toks) - 1) if job.cache_prompt else 0
        kept = eng.truncate(keep, seq=slot.id)
        slot.begin(job, toks, kept)
        sampler.prime(toks)
        chat = job.chat
        shift = (ContextShift(job.sampling.n_keep, job.sampling.n_discard, len(toks), eng.vocab.adds_bos)
                 if self.context_shift and eng.can_shift else None)
        dec = Decoding(eng, slot.id, n_prompt=len(toks) - kept, sampler=sampler, shift=shift,
                       max_tokens=job.sampling.n_predict, stop=StopRules(strings=tuple(job.stops)),
                       should_stop=lambda: job.cancel.is_set() or bool(self.fatal),
                       special=chat is not None and chat.fmt.special, n_probs=job.sampling.n_probs,
                       post_sampling=job.sampling.post_sampling_probs)
        slot.sampler = sampler
        slot.probs = _ProbsFeed(eng, job.sampling.n_probs is not None)
        job.emit(Started(len(toks), text, slot.id, shown))
        self.stats.set_processing(sum(1 for s in self.slots if s.job is not None))
        self._loop.add(dec, lambda step: self._on_step(slot, step), prompt=toks[kept:], cached=kept,
                       on_progress=(lambda p: job.emit(_progress(p))) if job.progress else None)

    def _slot_action(self, job: Job) -> None:
        """Save, restore or erase the slot the job names (free now: its id_slot waited for it)."""
        assert job.slot_action is not None
        try:
            job.emit(SlotDone(slot_actions.run(self.engine, self.slots[job.id_slot], job.slot_action)))
        except SlotFileError as e:
            job.emit(Failed(ApiError(400, e.message, param="filename")))
        except SparkError as e:  # a write that failed (disk full, permissions): the server goes on
            job.emit(Failed(ApiError(500, e.one_line(), "server_error")))
        except Exception as e:  # noqa: BLE001 - a bug in one request must not take the server down
            job.emit(Failed(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")))
        finally:
            job.done.set()

    def _embed(self, job: Job, toks: list[int]) -> None:
        """An embedding job, at once in a free slot's sequence (which forgets what it held)."""
        slot = pick_slot(self.slots, [], job.id_slot)
        try:
            t0 = time.perf_counter()
            vectors = self.engine.embed(toks, slot.id)
            # NOTE: as llama-server's: an embedding samples nothing, but its prompt is counted and costs a decode
            self.stats.add_request(AnswerFigures(prompt_tokens=len(toks), prompt_seconds=time.perf_counter() - t0))
            self.stats.add_decode(0)
            job.emit(Embedded(vectors, len(toks)))
        except EmbedError as e:
            job.emit(Failed(ApiError(400, e.message)))
        except KVFullError:
            job.emit(Failed(unavailable("the KV cache has no room for this prompt now; retry later")))
        except SparkError as e:
            job.emit(Failed(ApiError(500, e.one_line(), "server_error")))
        except Exception as e:  # noqa: BLE001 - a bug in one request must not take the server down
            job.emit(Failed(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")))
        finally:
            slot.kv = []
            job.done.set()

    def _prompt(self, job: Job) -> tuple[list[int], str] | None:
        """The job's prompt tokens and text, or None once it has been answered (a 400, count_only)."""
        bad = _bad_bias(job.sampling, getattr(self.engine, "n_vocab", None))
        if bad:
            job.emit(Failed(ApiError(400, bad, param="logit_bias")))
            return None
        req = RequestPrompt(self.engine)
        chat = job.chat
        try:
            if chat is not None:
                text = req.set_chat(chat.messages, chat.tools, chat.extras, prefill=chat.prefill,
                                    add_generation_prompt=chat.add_generation_prompt)
            else:
                text = req.set_text(job.text or "")
            if job.count_only:
                job.emit(Started(len(req.tokens), text))
                job.emit(Done("length", Usage(len(req.tokens))))
                return None
            if not job.embed:  # NOTE: an embedding's bound is one micro-batch, said first (native/embed.py)
                req.check_fits()
        except ContextError as e:
            job.emit(Failed(ApiError(400, e.message, "exceed_context_size_error",
                                     extra={"n_prompt_tokens": e.n_prompt, "n_ctx": e.n_ctx})))
            return None
        except SparkError as e:
            job.emit(Failed(ApiError(400, e.one_line())))
            return None
        return req.tokens, text

    def _on_step(self, slot: Slot, step: GenerationStep) -> None:
        """A step of the slot's sequence: text to its job, or its end."""
        job = slot.job
        if step.token is not None:
            slot.generated.append(step.token)
        if step.probs is not None:
            slot.probs.add(step.probs)
        if step.text:
            n = len(slot.generated)
            job.emit(Text(step.text, slot.probs.take(), n, tuple(slot.generated[slot.sent:]),
                          Timings(slot.reused, step.prompt_tokens, step.prompt_seconds, step.generated_tokens,
                                  step.gen_seconds)))
            slot.sent = n
        if step.finish:
            self._finish(slot, step)

    def _finish(self, slot: Slot, step: GenerationStep) -> None:
        job = slot.job
        fig = AnswerFigures(prompt_tokens=step.prompt_tokens, reused_tokens=slot.reused,
                            generated_tokens=step.generated_tokens, prompt_seconds=step.prompt_seconds,
                            gen_seconds=step.gen_seconds, stop=step.finish)
        slot.end(self.engine.seq_pos(slot.id), step.shifts)
        self.stats.set_processing(sum(1 for s in self.slots if s.job is not None))
        self.stats.add_request(fig)
        self.stats.set_cache(self.engine)
        usage = Usage(fig.reused_tokens + fig.prompt_tokens, fig.reused_tokens, fig.generated_tokens)
        if not self.fatal:
            job.emit(Done(fig.stop, usage, step.stop_word, Timings(fig.reused_tokens, fig.prompt_tokens,
                                                                   fig.prompt_seconds, fig.generated_tokens,
                                                                   fig.gen_seconds), shifted=bool(step.shifts)))
        job.done.set()

    def _engine_failed(self, message: str) -> None:
        """A decode failed: every running job gets a 503 and the server exits (1)."""
        self.harvest_now()
        err = unavailable(f"the engine failed: {message}")
        self.fatal = message
        for slot in self.slots:
            if slot.job is not None:
                slot.job.emit(Failed(err))
                slot.job.done.set()
                slot.end(0)
        self._die(message, 1)

    def _refuse_queued(self, err: ApiError) -> None:
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._stopping = True
                continue
            if job is WAKE:
                continue
            job.emit(Failed(err))
            job.done.set()
        self.stats.set_deferred(self.waiting())

    def abort(self, message: str) -> None:
        """The engine cannot go on (called from the thread that failed): 503 to everyone waiting."""
        self.fatal = message
        err = unavailable(message)
        for job in self.running():
            job.emit(Failed(err))
        self._refuse_queued(err)

    def harvest_now(self) -> None:
        """Hand the decode counts so far to the learner (the device is lost)."""
        if self._counts is not None:
            self._counts.flush()

    def _die(self, message: str, code: int) -> None:
        self.fatal = message
        self._refuse_queued(unavailable(f"the engine failed: {message}"))
        self.on_fatal(message, code)

    def close_engine(self) -> None:
        for slot in self.slots:
            slot.close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
