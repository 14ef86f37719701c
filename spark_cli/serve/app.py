"""The HTTP side: a Starlette app with llama-server's endpoints over the engine worker."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..runs.chat_session import Sampling
from . import metrics
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


async def _generate(request: Request, chat: bool) -> Response:
    st: ServerState = request.app.state.spark
    try:
        raw = await _read_body(request, st.max_body)
    except _ClientGone:
        return Response(status_code=499)
    req = parse(ChatRequest if chat else CompletionRequest, raw)
    feed = _Feed(request)
    job = Job(feed.emit, _sampling(req), messages=req.message_dicts() if chat else None,
              text=None if chat else req.prompt, stops=req.stops, cancel=feed.cancel)
    st.worker.submit(job)
    env = Envelope(chat, req.model or st.model_name)
    streaming = False
    try:
        first = await feed.next()
        if isinstance(first, Failed):
            raise first.error
        assert isinstance(first, Started)
        if req.stream:
            streaming = True
            return StreamingResponse(_stream(feed, env, chat, req.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
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
        if not streaming:
            feed.cancel.set()  # NOTE: a no-op once the job is done; stops it if this handler ends early


async def _stream(feed: _Feed, env: Envelope, chat: bool,
                  include_usage: bool) -> AsyncIterator[bytes]:
    try:
        if chat:
            yield sse(env.chunk(text="", role=True))
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


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


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
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error,
                                                       Exception: _on_crash})
    state.started = state.started or int(time.time())
    app.state.spark = state
    app.state.registry = metrics.registry_for(state.stats)
    return Guard(app, key=state.api_key, host=state.host, allowed_hosts=state.allowed_hosts, cors=state.cors)
