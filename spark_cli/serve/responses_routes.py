"""`POST /v1/responses` (and `/responses`) and `/v1/responses/input_tokens`: OpenAI's Responses
bodies in, translated to the OpenAI chat request (responses.chat_request), run through the one
boundary (chat.open_run: the same queue, cancellation, metrics and learning as
/v1/chat/completions), and the chat result or chunks translated back (responses.to_response,
responses.EventStream). Errors are OpenAI's shape (app.py's handlers), in a stream its error event."""

from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .chat import ClientGone, Run, open_run, read_body, translated_stream
from .protocol import ApiError, ChatRequest, parse
from .responses import (RESPONSES_PATHS, EventStream, Ids, ResponsesRequest, chat_request, responses_name,
                        to_response)


async def _open(request: Request, count_only: bool = False) -> tuple[ChatRequest, Run]:
    st = request.app.state.spark
    req = parse(ResponsesRequest, await read_body(request, st.max_body))
    chat = chat_request(req)
    try:
        return chat, await open_run(request, chat, st.worker, st.model_name, st.chat, count_only=count_only)
    except ApiError as e:  # a tool's schema the grammar refused: named as the Responses request has it
        raise e.renamed(lambda param: responses_name(param, req)) from None


async def create(request: Request) -> Response:
    try:
        chat, run = await _open(request)
    except ClientGone:
        return Response(status_code=499)
    if chat.stream:
        return StreamingResponse(_events(run), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        return JSONResponse(to_response(await run.result(), Ids(), int(time.time())))
    except ClientGone:
        return Response(status_code=499)
    finally:
        run.close()  # NOTE: a no-op once the job is done; stops it if this handler ends early


def _events(run: Run) -> AsyncIterator[bytes]:
    stream = EventStream(run.env.model, run.env.created)
    return translated_stream(run, stream.start(), stream.feed, lambda: stream.end(int(time.time())), stream.error)


async def input_tokens(request: Request) -> Response:
    """llama-server's POST /v1/responses/input_tokens: the tokens a Responses body's prompt takes."""
    try:
        _, run = await _open(request, count_only=True)
    except ClientGone:
        return Response(status_code=499)
    run.close()
    return JSONResponse({"object": "response.input_tokens", "input_tokens": run.prompt_tokens})


ROUTES = [route for path in RESPONSES_PATHS for route in (
    Route(path, create, methods=["POST"]),
    Route(path + "/input_tokens", input_tokens, methods=["POST"]),
)]
