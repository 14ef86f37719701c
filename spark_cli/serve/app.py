"""The HTTP side: a Starlette app with llama-server's endpoints over the engine worker."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runs.chat_session import Sampling
from . import metrics
from .chat import ChatConfig, ChatRun, prepare
from .guard import Guard
from .protocol import FINISH, ApiError, ChatRequest, CompletionRequest, Envelope, parse, sse, unavailable
from .stats import ServerStats
from .worker import Done, Event, Failed, Job, Started, Text, Worker

MAX_BODY_BYTES = 1 << 20
POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there


@dataclass
class ServerState:
    worker: Worker
    stats: ServerStats
    model_name: str  # the GGUF's file name, listed by /v1/models
    api_key: str | None = None
    host: str = "127.0.0.1"  # the bound address: a Host header may name it
    allowed_hosts: tuple[str, ...] = ()  # more names a Host header may give (--allowed-hosts)
    cors: tuple[str, ...] = ()  # browser origins allowed (--cors)
    max_body: int = MAX_BODY_BYTES
    started: int = 0
    chat: ChatConfig = field(default_factory=ChatConfig)  # the model's tool-call format, --reasoning-format


class _ClientGone(Exception):
    pass


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = ApiError(413, f"the request body is over {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_big
    except ClientDisconnect:  # gone, or closed by the read deadline: nobody to answer
        raise _ClientGone from None
    return bytes(body)


class _Feed:
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
                    raise _ClientGone
            try:
                return await asyncio.wait_for(self.events.get(), timeout=POLL_SECONDS)
            except asyncio.TimeoutError:
                pass


def _sampling(req) -> Sampling:
    seed = req.seed if req.seed is not None and req.seed >= 0 else secrets.randbelow(1 << 31)
    return Sampling(temp=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed, n_predict=req.limit)


async def _queue(request: Request, job_for: Callable[[_Feed], Job]) -> tuple[_Feed, Started]:
    """Submit a job; its Started event (or its failure, raised as ApiError)."""
    feed = _Feed(request)
    request.app.state.spark.worker.submit(job_for(feed))
    try:
        first = await feed.next()
    except BaseException:
        feed.cancel.set()
        raise
    if isinstance(first, Failed):
        raise first.error
    assert isinstance(first, Started)
    return feed, first


async def open_chat(request: Request, req: ChatRequest) -> tuple[ChatRun, _Feed]:
    """Queue a chat (serve/chat.py) and wait until its prompt is rendered and fits. Set
    `feed.cancel` when done with it (a no-op once the job ended; stops it if the client left)."""
    st: ServerState = request.app.state.spark
    prepared = prepare(req, st.chat)
    sampling = dataclasses.replace(_sampling(req), grammar=prepared.grammar)
    feed, started = await _queue(request, lambda f: Job(f.emit, sampling, chat=prepared, stops=req.stops,
                                                       cancel=f.cancel))
    return ChatRun(prepared, started.prompt, feed.next), feed


async def chat_completions(request: Request) -> Response:
    st: ServerState = request.app.state.spark
    try:
        req = parse(ChatRequest, await _read_body(request, st.max_body))
        run, feed = await open_chat(request, req)
    except _ClientGone:
        return Response(status_code=499)
    env = Envelope(True, req.model or st.model_name)
    if req.stream:
        return StreamingResponse(_chat_stream(run, feed, env, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        async for _ in run.deltas():
            pass
    except _ClientGone:
        return Response(status_code=499)
    finally:
        feed.cancel.set()
    out = run.output
    return JSONResponse(env.message(out.content, out.reasoning_content, [c.to_openai() for c in out.tool_calls],
                                    run.finish_reason or "stop", run.usage))


async def _chat_stream(run: ChatRun, feed: _Feed, env: Envelope, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        yield sse(env.chunk(text="", role=True))
        try:
            async for d in run.deltas():
                yield sse(env.delta(d.content, d.reasoning_content,
                                    d.tool_call.to_openai() if d.tool_call is not None else None))
        except ApiError as e:
            yield sse(e.body())
            return
        yield sse(env.chunk(finish=run.finish_reason))
        if include_usage:
            yield sse(env.usage_chunk(run.usage))
        yield sse("[DONE]")
    except _ClientGone:
        return
    finally:
        feed.cancel.set()


async def apply_template(request: Request) -> Response:
    """llama-server's POST /apply-template: the prompt a chat body renders to."""
    st: ServerState = request.app.state.spark
    try:
        req = parse(ChatRequest, await _read_body(request, st.max_body))
        prepared = prepare(req, st.chat)
        feed, started = await _queue(request, lambda f: Job(f.emit, _sampling(req), chat=prepared,
                                                           render_only=True, cancel=f.cancel))
    except _ClientGone:
        return Response(status_code=499)
    feed.cancel.set()
    return JSONResponse({"prompt": started.prompt})


async def completions(request: Request) -> Response:
    st: ServerState = request.app.state.spark
    try:
        req = parse(CompletionRequest, await _read_body(request, st.max_body))
        feed, _ = await _queue(request, lambda f: Job(f.emit, _sampling(req), text=req.prompt, stops=req.stops,
                                                     cancel=f.cancel))
    except _ClientGone:
        return Response(status_code=499)
    env = Envelope(False, req.model or st.model_name)
    if req.stream:
        return StreamingResponse(_stream(feed, env, req.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        parts: list[str] = []
        while True:
            ev = await feed.next()
            if isinstance(ev, Text):
                parts.append(ev.text)
            elif isinstance(ev, Done):
                return JSONResponse(env.full("".join(parts), FINISH[ev.finish], ev.usage))
            elif isinstance(ev, Failed):
                raise ev.error
    except _ClientGone:
        return Response(status_code=499)
    finally:
        feed.cancel.set()  # NOTE: a no-op once the job is done; stops it if this handler ends early


async def _stream(feed: _Feed, env: Envelope, include_usage: bool) -> AsyncIterator[bytes]:
    try:
        while True:
            ev = await feed.next()
            if isinstance(ev, Text):
                yield sse(env.chunk(text=ev.text))
            elif isinstance(ev, Done):
                yield sse(env.chunk(finish=FINISH[ev.finish]))
                if include_usage:
                    yield sse(env.usage_chunk(ev.usage))
                yield sse("[DONE]")
                return
            elif isinstance(ev, Failed):
                yield sse(ev.error.body())
                return
    except _ClientGone:
        return
    finally:
        feed.cancel.set()  # NOTE: a no-op once the job is done; stops it when the client went away


async def models(request: Request) -> Response:
    st: ServerState = request.app.state.spark
    card = {"id": st.model_name, "object": "model", "created": st.started, "owned_by": "spark"}
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    w: Worker = request.app.state.spark.worker
    if w.fatal:
        return _error(unavailable(f"the engine failed: {w.fatal}"))
    if not w.ready.is_set():
        return _error(unavailable("Loading model"))
    return JSONResponse({"status": "ok"})


async def metrics_page(request: Request) -> Response:
    return Response(metrics.render(request.app.state.registry), media_type=metrics.CONTENT_TYPE)


async def _on_api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError)
    return _error(e)


async def _on_http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
    return _error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind))


async def _on_crash(request: Request, e: Exception) -> Response:
    return _error(ApiError(500, f"internal error: {type(e).__name__}", "server_error"))


def create_app(state: ServerState) -> Any:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/apply-template", apply_template, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error,
                                                       Exception: _on_crash})
    state.started = state.started or int(time.time())
    app.state.spark = state
    app.state.registry = metrics.registry_for(state.stats)
    return Guard(app, key=state.api_key, host=state.host, allowed_hosts=state.allowed_hosts, cors=state.cors)
