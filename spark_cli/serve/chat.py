"""One request through the engine's queue, as OpenAI-shaped bodies: the boundary every API calls.

`open_run(request, req, worker, model)` submits a validated `ChatRequest` (or
`CompletionRequest`) to the worker and waits until it starts (ApiError when it cannot:
queue full, over the context); then either `await run.result()` is the OpenAI body
(`chat.completion` / `text_completion`) or `run.chunks()` yields the OpenAI chunks (the
role chunk, content chunks, the finish chunk, and the usage chunk when asked). Both raise
ApiError when the engine fails meanwhile and `ClientGone` when the client left (the job is
cancelled). The OpenAI routes (app.py) and the Anthropic adapter (anthropic_routes.py) are
two renderings of these; there is no other way to the engine.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import ClientDisconnect, Request

from ..runs.chat_session import Sampling
from .protocol import FINISH, ApiError, ChatRequest, CompletionRequest, Envelope, Usage
from .worker import Done, Event, Failed, Job, Started, Text, Worker

POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there


class ClientGone(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
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
        raise ClientGone from None
    return bytes(body)


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


def _sampling(req: ChatRequest | CompletionRequest) -> Sampling:
    seed = req.seed if req.seed is not None and req.seed >= 0 else secrets.randbelow(1 << 31)
    return Sampling(temp=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed, n_predict=req.limit)


@dataclass
class Run:
    """A started request; `usage` and `stop_word` (the stop sequence that ended it) once done."""

    feed: Feed
    env: Envelope
    prompt_tokens: int
    usage: Usage | None = None
    stop_word: str | None = None

    async def _events(self) -> AsyncIterator[Text | Done]:
        while True:
            ev = await self.feed.next()
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Done):
                self.usage, self.stop_word = ev.usage, ev.stop_word
            if isinstance(ev, (Text, Done)):
                yield ev
            if isinstance(ev, Done):
                return

    async def result(self) -> dict[str, Any]:
        parts: list[str] = []
        async for ev in self._events():
            if isinstance(ev, Text):
                parts.append(ev.text)
            else:
                return self.env.full("".join(parts), FINISH[ev.finish], ev.usage)
        raise AssertionError("the job ended without Done")

    async def chunks(self, include_usage: bool = False) -> AsyncIterator[dict[str, Any]]:
        if self.env.chat:
            yield self.env.chunk(text="", role=True)
        async for ev in self._events():
            if isinstance(ev, Text):
                yield self.env.chunk(text=ev.text)
            else:
                yield self.env.chunk(finish=FINISH[ev.finish])
                if include_usage:
                    yield self.env.usage_chunk(ev.usage)

    def close(self) -> None:
        """Stop the job if it still runs (a no-op once it is done)."""
        self.feed.cancel.set()


async def open_run(request: Request, req: ChatRequest | CompletionRequest, worker: Worker, model: str,
                   count_only: bool = False) -> Run:
    """Queue `req` and wait for it to start; `count_only`: render and count the prompt, generate nothing."""
    chat = isinstance(req, ChatRequest)
    feed = Feed(request)
    job = Job(feed.emit, _sampling(req), messages=req.message_dicts() if chat else None,
              text=None if chat else req.prompt, stops=req.stops, cancel=feed.cancel, count_only=count_only)
    worker.submit(job)
    try:
        first = await feed.next()
    except BaseException:
        feed.cancel.set()
        raise
    if isinstance(first, Failed):
        raise first.error
    assert isinstance(first, Started)
    return Run(feed, Envelope(chat, req.model or model), first.prompt_tokens)
