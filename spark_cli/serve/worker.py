"""The one thread that owns the engine: loads it, then serves queued requests in order.

Requests wait in a bounded FIFO queue (full: 503). Each runs to completion before the next
starts, so answers never interleave; a job's `cancel` event stops its generation at the
next token (client gone, shutdown). An engine failure is fatal: the job and every queued
one get a 503, and `on_fatal` tells the process to exit non-zero.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..native.generate import TokenProbs
from ..runs.chat_session import Sampling
from ..errors import SparkError
from .generation import ContextError, RequestSession
from .learn import Learner
from .protocol import ApiError, Timings, TokenLogprob, Usage, unavailable
from .stats import ServerStats

if TYPE_CHECKING:
    from .chat import PreparedChat


@dataclass
class Started:
    prompt_tokens: int
    prompt: str = ""  # the prompt's text (a chat's as rendered)


@dataclass
class Text:
    text: str
    probs: list[TokenLogprob] | None = None  # of the tokens this text completes (asked for: n_probs)
    n_generated: int = 0  # tokens generated so far


@dataclass
class Done:
    finish: str  # eog | stop | length | context | interrupted
    usage: Usage
    stop_word: str | None = None  # the stop string that ended it (finish "stop")
    timings: Timings | None = None


@dataclass
class Failed:
    error: ApiError


Event = Started | Text | Done | Failed


@dataclass
class Job:
    """One request: a chat (serve/chat.PreparedChat: rendered with the model's template, tools
    included) or a completion (text), and where its events go; `count_only`: Started with the
    prompt's tokens and text, then Done, nothing generated."""

    emit: Callable[[Event], None]
    sampling: Sampling
    chat: PreparedChat | None = None
    text: str | list[int | str] | None = None  # a completion's prompt: text, or token ids and texts
    stops: list[str] = field(default_factory=list)
    count_only: bool = False
    cache_prompt: bool = True  # False: reuse nothing from the KV cache
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


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

    def _entry(self, token: int, prob: float, top: tuple[TokenLogprob, ...] = ()) -> TokenLogprob:
        return TokenLogprob(token, self.engine.piece(token, special=True), prob, top)

    def add(self, p: TokenProbs) -> None:
        self.pending.append(self._entry(p.token, p.prob, tuple(self._entry(t, q) for t, q in p.top)))

    def take(self) -> list[TokenLogprob] | None:
        if not self.wanted:
            return None
        out, self.pending = self.pending, []
        return out


class Worker:
    def __init__(self, open_engine: Callable[[], Any], cached_layers: set[int], stats: ServerStats,
                 learner: Learner, max_queue: int = 32, on_fatal: Callable[[str, int], None] | None = None):
        self._open = open_engine
        self.cached_layers = cached_layers
        self.stats = stats
        self.learner = learner
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.on_fatal = on_fatal or (lambda msg, code: None)
        self.engine = None
        self.ready = threading.Event()
        self.fatal: str | None = None
        self.closing = False
        self.current: Job | None = None
        self._session: RequestSession | None = None
        self._kv: list[int] = []
        self._thread = threading.Thread(target=self._main, name="spark-engine", daemon=True)

    # -- called from the web side ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ApiError(503) while loading, failed, shutting down or full."""
        if self.fatal:
            raise unavailable(f"the engine failed: {self.fatal}")
        if self.closing:
            raise unavailable("the server is shutting down")
        if not self.ready.is_set():
            raise unavailable("Loading model")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self.stats.rejected()
            raise unavailable(f"the request queue is full ({self.queue.maxsize} waiting); retry later") from None
        self.stats.set_deferred(self.queue.qsize())

    def shutdown(self, grace: float) -> None:
        """Take no more jobs, refuse the queued ones, give the running one `grace` seconds."""
        self.closing = True
        self._refuse_queued(unavailable("the server is shutting down"))
        job = self.current
        if job is not None and not job.done.wait(grace):
            job.cancel.set()
        self.queue.put(None)
        self._thread.join()

    # -- the engine thread ---------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.engine = self._open()
            self.stats.set_cache(self.engine)
        except SparkError as e:
            self._die(e.one_line(), 2)
            return
        except Exception as e:  # noqa: BLE001 - reported in one line, exit non-zero
            self._die(f"{type(e).__name__}: {e}", 2)
            return
        self.ready.set()
        while True:
            job = self.queue.get()
            self.stats.set_deferred(self.queue.qsize())
            if job is None:
                break
            if job.cancel.is_set():
                job.done.set()
                continue
            self.current = job
            try:
                self._serve(job)
            except Exception as e:  # noqa: BLE001 - a bug in one request must not take the server down
                job.emit(Failed(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")))
                self._kv = []
                self.engine.reset()
            finally:
                self.current = None
                job.done.set()
            if self.fatal:
                break

    def _serve(self, job: Job) -> None:
        eng = self.engine
        chat = job.chat
        bad = _bad_bias(job.sampling, getattr(eng, "n_vocab", None))
        if bad:
            job.emit(Failed(ApiError(400, bad, param="logit_bias")))
            return
        sess = RequestSession(eng, job.sampling, self._kv if job.cache_prompt else [], self.cached_layers)
        try:
            try:
                if chat is not None:
                    prompt = sess.set_chat(chat.messages, chat.tools, chat.extras, prefill=chat.prefill)
                else:
                    prompt = sess.set_text(job.text or "")
                if job.count_only:
                    job.emit(Started(sess.prompt_tokens, prompt))
                    job.emit(Done("length", Usage(sess.prompt_tokens)))
                    return
                sess.check_fits("")
            except ContextError as e:
                job.emit(Failed(ApiError(400, e.message, "exceed_context_size_error",
                                         extra={"n_prompt_tokens": e.n_prompt, "n_ctx": e.n_ctx})))
                return
            except SparkError as e:
                job.emit(Failed(ApiError(400, e.one_line())))
                return
            n_prompt = sess.prompt_tokens
            job.emit(Started(n_prompt, prompt))
            self.stats.set_processing(1)
            self._session = sess
            probs = _ProbsFeed(eng, job.sampling.n_probs is not None)
            ans = sess.run(lambda piece: job.emit(Text(piece, probs.take(), sess.n_generated)),
                           lambda: job.cancel.is_set() or bool(self.fatal), stops=job.stops,
                           special=chat is not None and chat.fmt.special, on_probs=probs.add)
        finally:
            self._session = None
            self.stats.set_processing(0)
            sess.close()
        fig = ans.figures
        self._kv = sess.kv
        self.stats.add_request(fig)
        self.stats.set_cache(eng)
        self.learner.add(sess.learned.counts, sess.learned.tokens)
        usage = Usage(n_prompt, fig.reused_tokens, fig.generated_tokens)
        if ans.error:
            msg = f"the engine failed: {ans.error}"
            job.emit(Failed(unavailable(msg)))
            self._die(ans.error, 1)
            return
        job.emit(Done(fig.stop, usage, ans.stop_word, Timings(fig.reused_tokens, fig.prompt_tokens, fig.prompt_seconds,
                                                          fig.generated_tokens, fig.gen_seconds)))

    def _refuse_queued(self, err: ApiError) -> None:
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                continue
            job.emit(Failed(err))
            job.done.set()
        self.stats.set_deferred(0)

    def abort(self, message: str) -> None:
        """The engine cannot go on (called from the thread that failed): 503 to everyone waiting."""
        self.fatal = message
        err = unavailable(message)
        job = self.current
        if job is not None:
            job.emit(Failed(err))
        self._refuse_queued(err)

    def harvest_now(self) -> None:
        """Hand the running request's decode counts so far to the learner (the device is lost)."""
        sess = self._session
        if sess is not None:
            sess.harvest_now()
            self.learner.add(sess.learned.counts, sess.learned.tokens)
            sess.learned.counts, sess.learned.tokens = None, 0

    def _die(self, message: str, code: int) -> None:
        self.fatal = message
        self._refuse_queued(unavailable(f"the engine failed: {message}"))
        self.on_fatal(message, code)

    def close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

