"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's bodies in, translated to the
OpenAI chat request (anthropic.to_chat), run through the one boundary (chat.open_run: the same
queue, cancellation, metrics and learning as /v1/chat/completions), and the OpenAI-shaped
result or chunks translated back (anthropic.to_message, anthropic.EventStream)."""

from __future__ import annotations

import json
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .anthropic import (MESSAGES_PATH, CountRequest, EventStream, MessagesRequest, anthropic_param, error_body,
                        matched_stop, to_chat, to_message)
from .chat import ClientGone, Run, open_run, read_body, translated_stream
from .protocol import ApiError, ChatRequest, parse


async def _open(request: Request, model: type[CountRequest]) -> tuple[CountRequest, Run]:
    """Parse and start the request; a refusal of the translated chat request names the Messages
    field it came from (anthropic_param)."""
    st = request.app.state.spark
    req = parse(model, await read_body(request, st.max_body))
    try:
        chat = parse(ChatRequest, json.dumps(to_chat(req)).encode())
        return req, await open_run(request, chat, st.worker, st.model_name, st.chat,
                                   count_only=model is CountRequest)
    except ApiError as e:
        raise e.renamed(lambda param: anthropic_param(param, req)) from None


async def messages(request: Request) -> Response:
    try:
        req, run = await _open(request, MessagesRequest)
    except ClientGone:
        return Response(status_code=499)
    assert isinstance(req, MessagesRequest)
    if req.stream:
        return StreamingResponse(_events(run, req), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        return JSONResponse(to_message(await run.result(), matched_stop(run.stop_word, req)))
    except ClientGone:
        return Response(status_code=499)
    finally:
        run.close()  # NOTE: a no-op once the job is done; stops it if this handler ends early


def _events(run: Run, req: MessagesRequest) -> AsyncIterator[bytes]:
    stream = EventStream(run.env.model, run.prompt_tokens)
    return translated_stream(run, stream.start(), stream.feed, lambda: stream.end(matched_stop(run.stop_word, req)),
                             lambda e: error_body(e.status, e.message))


async def count_tokens(request: Request) -> Response:
    try:
        _, run = await _open(request, CountRequest)
        await run.result()  # the worker rendered and counted the prompt, and generated nothing
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse({"input_tokens": run.prompt_tokens})


ROUTES = [
    Route(MESSAGES_PATH, messages, methods=["POST"]),
    Route(MESSAGES_PATH + "/count_tokens", count_tokens, methods=["POST"]),
]
