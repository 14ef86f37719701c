"""One request through the engine's queue, as OpenAI-shaped bodies: the boundary every API calls.

In: a validated `protocol.ChatRequest` (OpenAI-shaped: messages with assistant `tool_calls`
and `role: "tool"`, `tools`, `tool_choice`, `response_format`, `reasoning_format`,
`chat_template_kwargs`), a `CompletionRequest` or llama.cpp's `llama_api.NativeCompletionRequest`.

1. `prepare(req, config) -> PreparedChat` checks what the template cannot (a forced schema that
   is not valid JSON Schema: ApiError 400) and decides the template inputs (tool_choice none:
   rendered without tools, never parsed), the GBNF grammar (`required` or a named function:
   one call in the model's format; `response_format`: JSON valid against the schema; none for
   auto), the schemas the output is checked against after generation (OutputSchemas: what the
   grammar relaxed breaks them, a warning in the log) and the output parser
   (core/chat_output.py: the model's tool-call format, `--reasoning-format`).
2. `open_run(request, req, worker, model, config)` prepares a chat, submits it to the worker
   (which renders the prompt with the model's template, tools included, and counts it) and
   waits until it starts (ApiError when it cannot: queue full, over the context, a template
   that raises). `count_only`: render and count the prompt, generate nothing (`run.prompt` is
   the text: /apply-template; `run.prompt_tokens`: Anthropic's count_tokens). `open_choices`
   queues `req.n` jobs at once (llama-server's n_cmpl: choice j samples with the seed + j) and
   waits for the first; `Choices` renders them as one body or one stream, choice by index.
3. Either `await run.result()` is the OpenAI body (`chat.completion`: message.content,
   .reasoning_content, .tool_calls, finish_reason `tool_calls` when it called and was not cut by
   max_tokens (then `length`, as llama-server's); or
   `text_completion`) or `run.chunks()` yields the OpenAI chunks (the role chunk, deltas of
   content / reasoning_content / tool_calls (a call whole, with its index, once complete), the
   finish chunk, and the usage chunk when asked); `logprobs` ride on the chunks of the tokens
   they belong to, `timings` on the body and the last chunk; a stream with `return_progress`
   first has chunks with `prompt_progress` (worker.Progress: a PromptProgress, its to_dict() the
   JSON, for any route to render). `run.events()` is the raw stream (text pieces, then Done;
   Progress before them when asked) that llama.cpp's /completion renders. All raise ApiError when the
   engine fails meanwhile and `ClientGone` when the client left (the job is cancelled).

The OpenAI routes (app.py) and the Anthropic adapter (anthropic_routes.py) are two renderings
of these; there is no other way to the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable

from starlette.requests import ClientDisconnect, Request

from ..core.chat_output import ChatDelta, OutputParser
from ..core.chat_template import TemplateSet
from ..core.reasoning import ReasoningDefault, ReasoningError, check_budget, template_kwargs
from ..core.tool_calls import HERMES, ToolFormat, format_for, param_types
from ..core.gbnf import GrammarError, GrammarLimits, check
from ..native.grammar import json_schema_gbnf, tool_call_gbnf
from ..runs.chat_session import Sampling
from .protocol import (FINISH, ApiError, ChatRequest, Envelope, GenerationRequest, Timings, TokenLogprob, Usage,
                       build_fingerprint, event_sse, warn)
from .prepared_chat import OutputSchemas, PreparedChat
from .worker import Done, Event, Failed, Job, Progress, Started, Text, Worker

POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    too_big = ApiError(413, f"the request body is over {limit} bytes")
    # NOTE: beside Transfer-Encoding the length means nothing (RFC 9112 6.3: the chunks are the body)
    declared = "" if "transfer-encoding" in request.headers else request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
    except ClientDisconnect:  # gone, or closed by the read deadline: nobody to answer
        raise ClientGone from None
    return bytes(body)


# ---------------------------------------------------------------- preparation


@dataclass(frozen=True)
class Defaults:
    """What a request that does not say gets: --temp, --seed (-1: random), --n-predict (-1: no
    limit), --verbose (every OpenAI answer carries `__verbose`)."""

    temp: float = 0.8
    seed: int = -1
    n_predict: int = -1
    verbose: bool = False


@dataclass(frozen=True)
class ChatConfig:
    """What a server knows before any request: the model's tool-call format, --reasoning-format,
    the request defaults, the grammar bounds (--grammar-max-*), the build (system_fingerprint),
    --reasoning and --reasoning-budget (`thinking`) and the templates' text they are judged on."""

    fmt: ToolFormat = HERMES
    reasoning: str = "auto"
    defaults: Defaults = Defaults()
    grammar_limits: GrammarLimits = GrammarLimits()
    fingerprint: str = field(default_factory=lambda: build_fingerprint())
    thinking: ReasoningDefault = ReasoningDefault()
    template_source: str = ""  # every template the model renders with, joined (does it think?)

    @classmethod
    def for_model(cls, templates: TemplateSet, arch: str, reasoning: str = "auto", **kw: Any) -> "ChatConfig":
        tmpl = templates.pick(with_tools=True)
        return cls(format_for(tmpl.source if tmpl else "", arch), reasoning,
                   template_source="\n".join(templates.templates.values()), **kw)


def own_grammar(req: GenerationRequest, limits: GrammarLimits = GrammarLimits()) -> str | None:
    """llama-server's `json_schema` (over `grammar`): the GBNF a request asks for itself, checked
    against `limits` before llama.cpp parses it (ApiError 400 naming the field)."""
    name = "json_schema" if req.json_schema is not None else "grammar"
    try:
        if req.json_schema is not None:
            return json_schema_gbnf(req.json_schema, "json_schema", limits)
        if req.grammar is not None:
            check(req.grammar, limits)
        return req.grammar
    except GrammarError as e:
        message = e.message if e.message.startswith(name) else f"{name}: {e.message}"
        raise ApiError(400, message, param=name) from None


def prepare(req: ChatRequest, config: ChatConfig) -> PreparedChat:
    """With tool_choice auto the tools are only rendered and parsed (no grammar: no schema keyword
    can refuse them); a forced choice or a response_format schema builds the grammar, and the
    output is checked against the schemas it came from (OutputSchemas)."""
    choice, tools = req.choice, req.tool_dicts()
    grammar, schemas = None, OutputSchemas()
    answer_schema = req.response_format.schema() if req.response_format is not None else None
    try:
        if tools and choice not in ("auto", "none"):
            forced = [(i, t) for i, t in enumerate(tools) if choice in ("required", t["function"]["name"])]
            grammar = tool_call_gbnf(config.fmt, forced, config.grammar_limits)
            schemas = OutputSchemas({t["function"]["name"]: t["function"].get("parameters") or {} for _, t in forced})
        elif answer_schema is not None:
            grammar = json_schema_gbnf(answer_schema, limits=config.grammar_limits)
            schemas = OutputSchemas(answer=answer_schema)
    except GrammarError as e:
        raise ApiError(400, e.message, param=e.message.split(":", 1)[0]) from None
    if grammar is None and req.json_schema is not None:
        schemas = OutputSchemas(answer=req.json_schema)
    grammar = grammar or own_grammar(req, config.grammar_limits)
    on = bool(tools) and choice != "none"
    try:
        param = "reasoning_budget_tokens" if req.reasoning_budget_tokens is not None else "thinking_budget_tokens"
        extras = template_kwargs(config.thinking, config.template_source, req.template_kwargs(),
                                 check_budget(req.reasoning_budget, param))
    except ReasoningError as e:
        raise ApiError(400, str(e), param=e.param) from None
    return PreparedChat(req.message_dicts(), tools if on else None, extras, grammar,
                        config.fmt, on, req.reasoning_format or config.reasoning, param_types(tools) if on else {},
                        req.parallel_tool_calls, req.prefill, schemas, req.add_generation_prompt)


# ---------------------------------------------------------------- the run


class Feed:
    """A job's events, read on the event loop; a client that went away sets `cancel`."""

    def __init__(self, request: Request):
        self.request = request
        self.cancel = threading.Event()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self._checked = time.monotonic()

    def emit(self, ev: Event) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop is gone (shutdown): nobody listens
            pass

    async def next(self) -> Event:
        while True:
            # NOTE: check the client between events too: a steady token stream never times out
            if time.monotonic() - self._checked >= POLL_SECONDS:
                self._checked = time.monotonic()
                if await self.request.is_disconnected():
                    self.cancel.set()
                    raise ClientGone
            try:
                return await asyncio.wait_for(self.events.get(), timeout=POLL_SECONDS)
            except asyncio.TimeoutError:
                pass


async def one_event(request: Request, worker: Worker, **job: Any) -> Event:
    """Run a job whose answer is one event (an embedding, a slot action) and return that event; the
    job's failure is raised, and the job is cancelled when the client goes (ClientGone) or the wait is."""
    feed = Feed(request)
    worker.submit(Job(feed.emit, Sampling(), cancel=feed.cancel, **job))
    try:
        ev = await feed.next()
    except BaseException:
        feed.cancel.set()
        raise
    if isinstance(ev, Failed):
        raise ev.error
    return ev


# what each of `samplers`' codes turns off when it is left out (no temperature: the distribution as it is)
SAMPLER_OFF: dict[str, dict[str, Any]] = {
    "e": {"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}, "k": {"top_k": 0},
    "y": {"typical_p": 1.0}, "p": {"top_p": 1.0}, "m": {"min_p": 0.0}, "t": {"temp": 1.0},
}


def sampling_for(req: GenerationRequest, defaults: Defaults, grammar: str | None = None) -> Sampling:
    """The request's sampler settings, the server's defaults where it says nothing, and the
    samplers `samplers` leaves out turned off."""
    s = _sampling(req, defaults, grammar)
    for code, off in SAMPLER_OFF.items():
        if req.samplers is not None and code not in req.samplers:
            s = dataclasses.replace(s, **off)
    return s


def _sampling(req: GenerationRequest, defaults: Defaults, grammar: str | None) -> Sampling:
    seed = req.seed if req.seed is not None else defaults.seed
    limit = req.asked_limit
    return Sampling(temp=req.temperature if req.temperature is not None else defaults.temp, top_k=req.top_k,
                    top_p=req.top_p, seed=seed if seed >= 0 else secrets.randbelow(1 << 31),
                    n_predict=limit if limit is not None else defaults.n_predict, min_p=req.min_p,
                    repeat_penalty=req.repeat_penalty, repeat_last_n=req.repeat_last_n, grammar=grammar,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                    typical_p=req.typical_p, logit_bias=req.bias, n_probs=req.n_probs, ban_eog=req.ignore_eos,
                    post_sampling_probs=req.post_sampling_probs, n_keep=req.n_keep, n_discard=req.n_discard)


def _delta_chunk(env: Envelope, d: ChatDelta, probs: list[TokenLogprob] | None,
                 timings: Timings | None = None) -> dict[str, Any]:
    return env.delta(d.content, d.reasoning_content, d.tool_call.to_openai() if d.tool_call is not None else None,
                     probs, timings)


@dataclass
class Run:
    """A started request. `prompt` is a chat's rendered prompt text; `parser` splits a chat's
    output into content, reasoning and tool calls (None: a completion); `with_probs`: logprobs
    were asked for. Once done: `usage`, `timings`, `stop_word` (the stop sequence that ended it),
    `finish_reason` (OpenAI's) and `probs` (every token's, with_probs)."""

    feed: Feed
    env: Envelope
    prompt_tokens: int
    prompt: str = ""
    parser: OutputParser | None = None
    with_probs: bool = False
    sampling: Sampling | None = None  # what it samples with
    slot: int = 0  # the server slot that serves it
    usage: Usage | None = None
    timings: Timings | None = None
    stop_word: str | None = None
    finish: str = ""  # the engine's: eog | stop | length | context | interrupted
    shifted: bool = False  # the context was shifted (--context-shift): llama-server's `truncated`
    shown_prompt: str | None = None  # the prompt as llama-server shows it (Started.shown)
    finish_reason: str | None = None
    probs: list[TokenLogprob] = field(default_factory=list)
    per_token_timings: bool = False  # timings_per_token: every chunk carries the timings so far
    schemas: OutputSchemas = OutputSchemas()  # a forced grammar's: the output is checked against them
    tokens: list[int] = field(default_factory=list)  # the generated tokens handed out so far
    pieces: list[str] = field(default_factory=list)  # the generated text handed out so far (before any parsing)
    _timings_now: Timings | None = None  # the last text's

    @property
    def text(self) -> str:
        """The generated text handed out so far, as the model wrote it."""
        return "".join(self.pieces)

    def _probs(self, got: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
        """A whole answer's logprobs: a list (maybe empty) when asked for, else None."""
        return (got or []) if self.with_probs else None

    def _chunk_probs(self, got: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
        """A chunk's: only when it completes tokens, as llama-server's."""
        return got if self.with_probs and got else None

    async def events(self) -> AsyncIterator[Text | Progress | Done]:
        """The raw stream: Text pieces (with their tokens' probabilities), then Done; Progress
        before the first Text when the job asked for it (Job.progress)."""
        while True:
            ev = await self.feed.next()
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Done):
                self.usage, self.stop_word, self.finish_reason = ev.usage, ev.stop_word, FINISH[ev.finish]
                self.finish = ev.finish
                self.timings = ev.timings
                self.shifted = ev.shifted
            if isinstance(ev, Text):
                self.probs += ev.probs or []
                self.tokens += ev.tokens
                self.pieces.append(ev.text)
                self._timings_now = ev.timings
            if isinstance(ev, (Text, Progress, Done)):
                yield ev
            if isinstance(ev, Done):
                return

    async def _deltas(self) -> AsyncIterator[tuple[ChatDelta, list[TokenLogprob]] | Progress | Done]:
        """A chat's parsed deltas, each with the probabilities of the tokens that made it (a
        text the parser holds back passes its tokens on), then its Done (finish_reason
        `tool_calls` when it called); Progress events pass through."""
        assert self.parser is not None
        owed: list[TokenLogprob] = []
        async for ev in self.events():
            if isinstance(ev, Text):
                owed += ev.probs or []
                for d in self.parser.feed(ev.text):
                    yield d, owed
                    owed = []
            elif isinstance(ev, Progress):
                yield ev
            else:
                for d in self.parser.finish():
                    yield d, owed
                    owed = []
                out = self.parser.result()
                # NOTE: a call cut by max_tokens right after it closed stays `length`, as llama-server's
                if out.tool_calls and self.finish_reason != "length":
                    self.finish_reason = "tool_calls"
                for problem in self.schemas.problems(out.content, out.tool_calls, self.finish_reason != "length"):
                    warn(problem)
                yield ev

    async def result(self) -> dict[str, Any]:
        if self.parser is None:
            parts: list[str] = []
            async for ev in self.events():
                if isinstance(ev, Text):
                    parts.append(ev.text)
                elif isinstance(ev, Done):
                    return self.env.full("".join(parts), self.finish_reason or "stop", ev.usage,
                                         self._probs(self.probs), self.timings)
            raise AssertionError("the job ended without Done")
        async for ev in self._deltas():
            if isinstance(ev, Done):
                out = self.parser.result()
                return self.env.message(out.content, out.reasoning_content, [c.to_openai() for c in out.tool_calls],
                                        self.finish_reason or "stop", ev.usage, self._probs(self.probs),
                                        self.timings)
        raise AssertionError("the job ended without Done")

    async def chunks(self, include_usage: bool = False) -> AsyncIterator[dict[str, Any]]:
        """The stream; the last chunk (usage, else finish) carries `timings`, as llama-server's;
        progress chunks (Envelope.progress_chunk) while the prompt is evaluated, when asked for."""
        events = self.events() if self.parser is None else self._deltas()
        if self.parser is not None:
            yield self.env.role_chunk()
        async for ev in events:
            now = self._timings_now if self.per_token_timings else None
            if isinstance(ev, Text):
                yield self.env.chunk(text=ev.text, probs=self._chunk_probs(ev.probs), timings=now)
            elif isinstance(ev, tuple):
                yield _delta_chunk(self.env, ev[0], self._chunk_probs(ev[1]), now)
            elif isinstance(ev, Progress):
                yield self.env.progress_chunk(ev.progress.to_dict(), ev.timings if self.per_token_timings else None)
            else:
                yield self.env.chunk(finish=self.finish_reason, timings=None if include_usage else self.timings)
                if include_usage:
                    yield self.env.usage_chunk(ev.usage, self.timings)

    def close(self) -> None:
        """Stop the job if it still runs (a no-op once it is done)."""
        self.feed.cancel.set()


@dataclass
class _Queued:
    """A job in the worker's queue, and what its Run is made of once it starts."""

    feed: Feed
    env: Envelope
    prepared: PreparedChat | None
    sampling: Sampling
    with_probs: bool
    per_token_timings: bool

    async def started(self) -> Run:
        """Wait for the job to start (ApiError when it cannot)."""
        try:
            first = await self.feed.next()
        except BaseException:
            self.feed.cancel.set()
            raise
        if isinstance(first, Failed):
            raise first.error
        assert isinstance(first, Started)
        parser = self.prepared.parser(first.prompt) if self.prepared else None
        return Run(self.feed, self.env, first.prompt_tokens, first.prompt, parser, self.with_probs, self.sampling,
                   first.slot, per_token_timings=self.per_token_timings, shown_prompt=first.shown,
                   schemas=self.prepared.schemas if self.prepared else OutputSchemas())


def _prepared(req: GenerationRequest, config: ChatConfig) -> tuple[PreparedChat | None, str | None]:
    """A chat's template inputs (None: a completion) and the grammar the request samples with."""
    prepared = prepare(req, config) if isinstance(req, ChatRequest) else None
    return prepared, prepared.grammar if prepared else own_grammar(req, config.grammar_limits)


async def _queue(request: Request, req: GenerationRequest, worker: Worker, model: str, config: ChatConfig,
                 count_only: bool, n: int) -> list[_Queued]:
    """`n` jobs of `req` in the worker's queue at once; job j samples with the seed + j (llama-server's
    child tasks), and answers choice j. None queued when one cannot be (ApiError)."""
    if n > worker.queue.maxsize:
        raise ApiError(400, f"n: {n} choices wait in the request queue together, which holds {worker.queue.maxsize} "
                            "(spark serve --queue)", param="n")
    # NOTE: in a thread: a large schema takes seconds to become a grammar, and the loop serves everyone
    prepared, grammar = await asyncio.to_thread(_prepared, req, config)
    sampling = sampling_for(req, config.defaults, grammar)
    env = Envelope(prepared is not None, req.model or model, config.fingerprint)
    # NOTE: only an answer with llama-server's native body shows the prompt (a detokenization per request)
    show = not count_only and (req.NATIVE or (req.verbose if req.verbose is not None else config.defaults.verbose))
    queued: list[_Queued] = []
    try:
        for j in range(n):
            feed = Feed(request)
            s = dataclasses.replace(sampling, seed=(sampling.seed + j) & 0xFFFFFFFF) if j else sampling
            worker.submit(Job(feed.emit, s, chat=prepared, text=None if prepared else req.prompt, stops=req.stops,
                              cancel=feed.cancel, count_only=count_only, cache_prompt=req.cache_prompt,
                              progress=req.stream and req.return_progress, id_slot=req.id_slot, show_prompt=show))
            queued.append(_Queued(feed, dataclasses.replace(env, index=j), prepared, s, req.n_probs is not None,
                                  req.timings_per_token))
    except BaseException:
        for q in queued:
            q.feed.cancel.set()
        raise
    return queued


async def open_run(request: Request, req: GenerationRequest, worker: Worker, model: str,
                   config: ChatConfig = ChatConfig(), count_only: bool = False) -> Run:
    """Queue `req` and wait for it to start; `count_only`: render and count the prompt, generate nothing."""
    return await (await _queue(request, req, worker, model, config, count_only, 1))[0].started()


async def _merged(gens: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async iterators as they come (each one's in its order)."""
    waiting = {asyncio.ensure_future(g.__anext__()): g for g in gens}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                g = waiting.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                waiting[asyncio.ensure_future(g.__anext__())] = g
                yield item
    finally:
        for task in waiting:
            task.cancel()


@dataclass
class Choices:
    """The `n` answers of one request (llama-server's n_cmpl): the first started, the others
    queued behind it (on other slots, or after it on the same one). One body: the first's, with
    every choice and the usage of the prompt once and of all the completions; one stream: every
    choice's chunks as they come, each with its index, the usage chunk after all of them."""

    first: Run
    rest: list[_Queued]
    runs: list[Run] = field(default_factory=list)  # every one started so far, the first first

    def __post_init__(self) -> None:
        self.runs = [self.first]

    async def _run(self, j: int) -> Run:
        if j == 0:
            return self.first
        run = await self.rest[j - 1].started()
        self.runs.append(run)
        return run

    def usage(self) -> Usage:
        u = self.first.usage or Usage()
        return Usage(u.prompt_tokens, u.cached_tokens, sum(r.usage.completion_tokens for r in self.runs if r.usage))

    async def result(self) -> dict[str, Any]:
        if not self.rest:
            return await self.first.result()

        async def body(j: int) -> dict[str, Any]:
            return await (await self._run(j)).result()

        bodies = await asyncio.gather(*(body(j) for j in range(len(self.rest) + 1)))
        return {**bodies[0], "choices": [b["choices"][0] for b in bodies], "usage": self.usage().to_dict()}

    async def chunks(self, include_usage: bool = False) -> AsyncIterator[tuple[Run, dict[str, Any]]]:
        """The stream's chunks, each with the Run of its choice (the usage chunk: the first's)."""
        if not self.rest:
            async for chunk in self.first.chunks(include_usage):
                yield self.first, chunk
            return

        async def one(j: int) -> AsyncIterator[tuple[Run, dict[str, Any]]]:
            run = await self._run(j)
            async for chunk in run.chunks():
                yield run, chunk

        async for pair in _merged([one(j) for j in range(len(self.rest) + 1)]):
            yield pair
        if include_usage:
            yield self.first, self.first.env.usage_chunk(self.usage())

    def close(self) -> None:
        """Stop every job that still runs or waits."""
        self.first.close()
        for q in self.rest:
            q.feed.cancel.set()


async def open_choices(request: Request, req: GenerationRequest, worker: Worker, model: str,
                       config: ChatConfig = ChatConfig()) -> Choices:
    """Queue `req.n` jobs of `req` and wait for the first to start."""
    queued = await _queue(request, req, worker, model, config, False, req.n)
    try:
        first = await queued[0].started()
    except BaseException:
        for q in queued[1:]:
            q.feed.cancel.set()
        raise
    return Choices(first, queued[1:])


Events = Iterable[dict[str, Any]]


async def translated_stream(run: Run, start: Events, feed: Callable[[dict[str, Any]], Events],
                            end: Callable[[], Events], error: Callable[[ApiError], dict[str, Any]]
                            ) -> AsyncIterator[bytes]:
    """A chat stream in another API's events (Anthropic's, the Responses API's), as named
    server-sent events: `start`, `feed(chunk)` for each of run.chunks(include_usage=True), `end()`;
    `error(e)` when the run fails meanwhile. The job is stopped when the client goes away."""
    try:
        for ev in start:
            yield event_sse(ev)
        async for chunk in run.chunks(include_usage=True):
            for ev in feed(chunk):
                yield event_sse(ev)
        for ev in end():
            yield event_sse(ev)
    except ApiError as e:
        yield event_sse(error(e))
    except ClientGone:
        return
    finally:
        run.close()  # NOTE: a no-op once the job is done; stops it when the client went away
