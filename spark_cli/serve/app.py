"""The HTTP side: a Starlette app with llama-server's endpoints over the engine worker."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..core.fim import NoFim
from . import anthropic, llama_api, metrics
from .anthropic_routes import ROUTES as ANTHROPIC_ROUTES
from .responses_routes import ROUTES as RESPONSES_ROUTES
from .slot_routes import ROUTES as SLOT_ROUTES
from .rerank import ROUTES as RERANK_ROUTES
from .chat import ChatConfig, Choices, ClientGone, Run, open_choices, open_run, read_body
from .llama_api import NativeCompletionRequest
from .infill import InfillRequest, infill_prompt
from .embeddings import embeddings_native, embeddings_oai
from .guard import Guard
from .sleep import awake
from .protocol import (SAMPLING_DEFAULTS, ApiError, ChatRequest, CompletionRequest, DetokenizeRequest,
                       GenerationRequest, TokenizeRequest, parse, piece_json, sse, unavailable)
from .stats import ServerStats
from .vertex import Vertex, routes as predict_routes
from .worker import Progress, Text, Worker

MAX_BODY_BYTES = 1 << 20
# /tokenize's content at most: this many bytes per token of a slot's context (a text past it cannot
# be one prompt; tokens average 4 bytes, long ones 16 to 32), and at least MIN_TOKENIZE_BYTES (a
# small -c still counts a document). Special tokens cost llama.cpp superlinear time (520 KB of
# them: 7 s), so the bound also bounds each request's work.
TOKENIZE_BYTES_PER_TOKEN = 32
MIN_TOKENIZE_BYTES = 64 << 10


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
    model_path: str = ""  # the GGUF served (/props)
    placement: dict[str, Any] = field(default_factory=dict)  # Spark's placement summary (/props)
    metrics: bool = True  # GET /metrics served (--no-metrics: 501, as llama-server without --metrics)
    slots_endpoint: bool = True  # GET /slots served (--no-slots: 501, as llama-server's)
    vertex: Vertex | None = None  # Vertex AI's predict route (AIP_MODE=PREDICTION)
    meta: dict[str, Any] = field(default_factory=dict)  # the model's, for /v1/models (n_ctx_train, n_embd, size)
    aliases: tuple[str, ...] = ()  # --alias's names (comma-separated), listed by /v1/models
    pooling: str | None = None  # --embedding's pooling (embeddings.py); None: no embeddings (501)
    slot_save_path: Path | None = None  # --slot-save-path (slot_routes.py); None: no slot actions (501)
    model_id: str = ""  # the GGUF's fingerprint: a slot file restores only into the model that saved it
    tags: tuple[str, ...] = ()  # --tags, listed by /v1/models


def _error(e: ApiError, path: str = "") -> JSONResponse:
    """OpenAI's error shape, or Anthropic's under /v1/messages."""
    if anthropic.is_messages_path(path):
        return JSONResponse(anthropic.error_body(e.status, e.message), status_code=anthropic.error_status(e.status))
    return JSONResponse(e.body(), status_code=e.status)


async def _generate(request: Request, chat: bool) -> Response:
    st: ServerState = request.app.state.spark
    try:
        raw = await read_body(request, st.max_body)
        req = parse(ChatRequest if chat else CompletionRequest, raw)
        choices = await open_choices(request, req, st.worker, st.model_name, st.chat)
    except ClientGone:
        return Response(status_code=499)
    verbose = req.verbose if req.verbose is not None else st.chat.defaults.verbose
    if req.stream:
        return StreamingResponse(_stream(st, choices, req, verbose), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        body = await choices.result()
        if verbose:
            body["__verbose"] = _native_final(st, choices.first, req, choices.first.text)
        return JSONResponse(body)
    except ClientGone:
        return Response(status_code=499)
    finally:
        choices.close()  # NOTE: a no-op once the jobs are done; stops them if this handler ends early


async def _stream(st: ServerState, choices: Choices, req: GenerationRequest, verbose: bool) -> AsyncIterator[bytes]:
    """The OpenAI stream; `verbose`: each choice's finish chunk carries `__verbose` (llama-server's)."""
    try:
        async for run, chunk in choices.chunks(req.include_usage):
            if verbose and chunk["choices"] and chunk["choices"][0]["finish_reason"] is not None:
                chunk["__verbose"] = _native_final(st, run, req, "")  # NOTE: a stream's has no content
            yield sse(chunk)
        yield sse("[DONE]")
    except ApiError as e:
        yield sse(e.body())
    except ClientGone:
        return
    finally:
        choices.close()  # NOTE: a no-op once the jobs are done; stops them when the client went away


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def native_completion(request: Request) -> Response:
    """llama.cpp's POST /completion (llama_api.py)."""
    st: ServerState = request.app.state.spark
    try:
        req = parse(NativeCompletionRequest, await read_body(request, st.max_body))
        prompts = req.prompts
        if len(prompts) > 1:
            return await _native_batch(request, req, prompts)
    except ClientGone:
        return Response(status_code=499)
    return await _native_one(request, req.model_copy(update={"prompt": prompts[0]}))


async def infill(request: Request) -> Response:
    """llama-server's POST /infill (infill.py): a FIM prompt of the model's tokens, answered as
    /completion; a model without FIM tokens: 400 naming the ones it lacks."""
    st: ServerState = request.app.state.spark
    req = await _body(request, InfillRequest)
    async with _awake(st):
        try:
            tokens = await asyncio.to_thread(infill_prompt, _engine(st), req, st.chat.defaults.n_predict)
        except NoFim as e:
            raise ApiError(400, str(e), "not_supported_error") from None
    return await _native_one(request, req.model_copy(update={"prompt": tokens}))


async def _native_one(request: Request, req: NativeCompletionRequest) -> Response:
    """One /completion prompt (or an /infill's ids): its body, or its stream."""
    st: ServerState = request.app.state.spark
    try:
        run = await open_run(request, req, st.worker, st.model_name, st.chat)
    except ClientGone:
        return Response(status_code=499)
    if req.stream:
        return StreamingResponse(_native_stream(st, run, req), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        parts = [ev.text async for ev in run.events() if isinstance(ev, Text)]
        return JSONResponse(_native_final(st, run, req, "".join(parts)))
    except ClientGone:
        return Response(status_code=499)
    finally:
        run.close()


async def _native_batch(request: Request, req: NativeCompletionRequest, prompts: list) -> Response:
    """Several prompts in one /completion: a list of bodies, each with its `index`, as llama-server's."""
    st: ServerState = request.app.state.spark
    if req.stream:
        raise ApiError(400, "stream: spark serve streams one prompt per request (send the prompts apart, or "
                            "without stream)", param="stream")
    bodies = []
    for i, prompt in enumerate(prompts):
        one = req.model_copy(update={"prompt": prompt})
        run = await open_run(request, one, st.worker, st.model_name, st.chat)
        try:
            parts = [ev.text async for ev in run.events() if isinstance(ev, Text)]
        finally:
            run.close()
        bodies.append(_native_final(st, run, one, "".join(parts), i))
    return JSONResponse(bodies)


def _native_final(st: ServerState, run: Run, req: GenerationRequest, content: str, index: int = 0) -> dict[str, Any]:
    """llama-server's final body of /completion (the fields response_fields keeps), which is also
    the `__verbose` of an OpenAI answer."""
    assert run.usage is not None and run.sampling is not None
    # NOTE: ignore_eos's -inf biases are listed in generation_settings, as llama-server's
    eog = st.worker.eog_tokens if run.sampling.ban_eog else ()
    prompt = run.shown_prompt if run.shown_prompt is not None else run.prompt
    body = llama_api.final_body(content, req.model or run.env.model, prompt, run.finish, run.stop_word,
                                run.usage, run.timings, llama_api.settings(run.sampling, req, eog),
                                run.probs if run.with_probs else None, run.slot,
                                run.tokens if req.return_tokens else None, index, shifted=run.shifted)
    return llama_api.picked(body, req.response_fields)


async def _native_stream(st: ServerState, run: Run, req: NativeCompletionRequest) -> AsyncIterator[bytes]:
    try:
        async for ev in run.events():
            if isinstance(ev, Text):
                yield sse(llama_api.piece_event(ev.text, run.prompt_tokens, ev.n_generated, ev.probs, run.slot,
                                                list(ev.tokens),  # NOTE: always, as llama-server's pieces
                                                ev.timings if req.timings_per_token else None))
            elif isinstance(ev, Progress):
                yield sse(llama_api.progress_event(ev.progress.to_dict(), run.prompt_tokens, run.slot,
                                                   ev.timings if req.timings_per_token else None))
        yield sse(_native_final(st, run, req, ""))
    except ApiError as e:
        yield sse(e.body())
    except ClientGone:
        return
    finally:
        run.close()


async def _counted_chat(request: Request) -> Run | Response:
    """A chat body rendered and counted, nothing generated (499: the client left)."""
    st: ServerState = request.app.state.spark
    try:
        req = parse(ChatRequest, await read_body(request, st.max_body))
        run = await open_run(request, req, st.worker, st.model_name, st.chat, count_only=True)
    except ClientGone:
        return Response(status_code=499)
    run.close()
    return run


async def apply_template(request: Request) -> Response:
    """llama-server's POST /apply-template: the prompt a chat body renders to."""
    run = await _counted_chat(request)
    return run if isinstance(run, Response) else JSONResponse({"prompt": run.prompt})


async def count_chat_tokens(request: Request) -> Response:
    """llama-server's POST /v1/chat/completions/input_tokens: the tokens a chat body's prompt takes."""
    run = await _counted_chat(request)
    return run if isinstance(run, Response) else JSONResponse({"input_tokens": run.prompt_tokens})


def not_supported(message: str) -> ApiError:
    """llama-server's ERROR_TYPE_NOT_SUPPORTED: an endpoint turned off by a flag."""
    return ApiError(501, message, "not_supported_error")


def _awake(st: ServerState, wake: bool = True):
    """The engine kept loaded for the block (sleep.awake): a sleeping one is woken, or with wake=False
    left asleep (the block gets False: answer from what was kept)."""
    return awake(st.worker.idle, lambda: bool(st.worker.fatal), wake)


def _engine(st: ServerState) -> Any:
    """The loaded engine, for what reads only the vocabulary and the model (tokenize, /props), inside
    `async with _awake(st)`."""
    w = st.worker
    if w.fatal:
        raise unavailable(f"the engine failed: {w.fatal}")
    if not w.ready.is_set() or w.engine is None:
        raise unavailable("Loading model")
    return w.engine


async def _body(request: Request, model: type[Any]) -> Any:
    st: ServerState = request.app.state.spark
    try:
        return parse(model, await read_body(request, st.max_body))
    except ClientGone:
        raise HTTPException(499, "the client went away") from None


def tokenize_limit(n_ctx: int) -> int:
    """The bytes of content /tokenize takes from a server whose slots hold `n_ctx` tokens."""
    return max(MIN_TOKENIZE_BYTES, TOKENIZE_BYTES_PER_TOKEN * n_ctx)


def _tokenized(eng: Any, req: TokenizeRequest) -> JSONResponse:
    ids = eng.vocab.tokenize(req.content, add_special=req.add_special, parse_special=req.parse_special)
    if not req.with_pieces:
        return JSONResponse({"tokens": ids})
    return JSONResponse({"tokens": [{"id": t, "piece": piece_json(eng.vocab.piece(t, special=True))} for t in ids]})


async def tokenize(request: Request) -> Response:
    """llama-server's POST /tokenize: ids, or {id, piece} with with_pieces (a piece that is not
    UTF-8 as its bytes). In a thread (llama_tokenize only reads the vocabulary, as llama-server's
    HTTP threads call it beside the decode): the loop answers the others meanwhile."""
    st: ServerState = request.app.state.spark
    req = await _body(request, TokenizeRequest)
    async with _awake(st):
        eng = _engine(st)
        size, limit = len(req.content.encode("utf-8")), tokenize_limit(eng.n_ctx)
        if size > limit:
            raise ApiError(400, f"content: {size} bytes, over the {limit}-byte limit ({TOKENIZE_BYTES_PER_TOKEN} "
                                f"bytes per token of a slot's {eng.n_ctx}-token context, at least "
                                f"{MIN_TOKENIZE_BYTES}); send it in parts, or start spark serve with a larger -c",
                           param="content")
        return await asyncio.to_thread(_tokenized, eng, req)


def _detokenized(eng: Any, tokens: list[int]) -> JSONResponse:
    # NOTE: control tokens as their text, as llama-server's
    text = b"".join(eng.vocab.piece(t, special=True) for t in tokens).decode("utf-8", errors="replace")
    return JSONResponse({"content": text})


async def detokenize(request: Request) -> Response:
    """llama-server's POST /detokenize, in a thread as /tokenize (a body holds half a million ids)."""
    st: ServerState = request.app.state.spark
    req = await _body(request, DetokenizeRequest)
    async with _awake(st):
        eng = _engine(st)
        n_vocab = getattr(eng, "n_vocab", None)
        bad = [t for t in req.tokens if n_vocab is not None and t >= n_vocab]
        if bad:
            raise ApiError(400, f"tokens: {bad[0]} is not in the vocabulary (0 to {n_vocab - 1})", param="tokens")
        return await asyncio.to_thread(_detokenized, eng, req.tokens)


async def props(request: Request) -> Response:
    """llama-server's GET /props: the model, context, templates, build and default sampling, and
    Spark's placement (the expert cache's layers and budget); while the engine sleeps, as it was
    when it fell asleep (is_sleeping true), without waking it."""
    st: ServerState = request.app.state.spark
    async with _awake(st, wake=False) as up:
        if not up and request.app.state.kept:
            return JSONResponse(request.app.state.kept["props"])
        return JSONResponse(_props_body(st, _engine(st)))


def _props_body(st: ServerState, eng: Any, sleeping: bool = False) -> dict[str, Any]:
    d = st.chat.defaults
    plain, tools = eng.vocab.chat_template(False), eng.vocab.chat_template(True)
    body: dict[str, Any] = {
        "default_generation_settings": {"n_ctx": eng.n_ctx, "params": {
            "temperature": d.temp, "seed": d.seed, "n_predict": d.n_predict, "max_tokens": d.n_predict,
            **SAMPLING_DEFAULTS}},
        "total_slots": len(st.worker.slots) or 1,
        "model_alias": st.model_name,
        "model_path": st.model_path,
        "chat_template": plain.source if plain is not None else "",
        "bos_token": eng.vocab.piece(eng.vocab.bos_token, special=True).decode("utf-8", "replace") if eng.vocab.bos_token >= 0 else "",
        "eos_token": eng.vocab.piece(eng.vocab.eos_token, special=True).decode("utf-8", "replace") if eng.vocab.eos_token >= 0 else "",
        "build_info": st.chat.fingerprint,
        "modalities": {"vision": False, "audio": False},
        "is_sleeping": sleeping,
        "spark": {"placement": st.placement},
    }
    if tools is not None and tools is not plain:
        body["chat_template_tool_use"] = tools.source
    return body


async def slots(request: Request) -> Response:
    """llama-server's GET /slots: each slot, busy or idle, and what it holds."""
    st: ServerState = request.app.state.spark
    if not st.slots_endpoint:
        raise not_supported("This server does not support slots endpoint. Start it with `--slots`")
    async with _awake(st):
        _engine(st)
        return JSONResponse(st.worker.slots_info())


async def models(request: Request) -> Response:
    """OpenAI's model list; `meta` as llama-server's (n_ctx_train, n_embd, size, and n_vocab once
    loaded) and the context each slot serves (n_ctx, Spark's), where clients look for the length."""
    st: ServerState = request.app.state.spark
    meta = dict(st.meta)
    async with _awake(st, wake=False) as up:
        eng = st.worker.engine if up and st.worker.ready.is_set() and not st.worker.fatal else None
        if eng is not None:
            meta.update(n_vocab=getattr(eng, "n_vocab", None), n_ctx=eng.n_ctx)
        elif not up and request.app.state.kept:
            meta.update(request.app.state.kept["meta"])
    card = {"id": st.model_name, "object": "model", "created": st.started, "owned_by": "spark",
            "aliases": list(st.aliases or (st.model_name,)), "tags": list(st.tags),
            "meta": {k: v for k, v in meta.items() if v is not None}}
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    w: Worker = request.app.state.spark.worker
    if w.fatal:
        return _error(unavailable(f"the engine failed: {w.fatal}"))
    if not w.ready.is_set():
        return _error(unavailable("Loading model"))
    return JSONResponse({"status": "ok"})


async def metrics_page(request: Request) -> Response:
    st: ServerState = request.app.state.spark
    if not st.metrics:
        raise not_supported("This server does not support metrics endpoint. Start it with `--metrics`")
    resp = Response(request.app.state.metrics.render(), media_type=metrics.CONTENT_TYPE)
    # NOTE: spelled as llama-server spells it (Starlette lowercases names; some clients compare case)
    resp.raw_headers.append((b"Process-Start-Time-Unix", str(st.started).encode()))
    return resp


async def _on_api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError)
    return _error(e, request.url.path)


async def _on_http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
    return _error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind), request.url.path)


async def _on_crash(request: Request, e: Exception) -> Response:
    return _error(ApiError(500, f"internal error: {type(e).__name__}", "server_error"), request.url.path)


def create_app(state: ServerState) -> Any:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", native_completion, methods=["POST"]),  # llama-server's: /completion's
        Route("/apply-template", apply_template, methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", count_chat_tokens, methods=["POST"]),
        Route("/chat/completions/input_tokens", count_chat_tokens, methods=["POST"]),
        Route("/completion", native_completion, methods=["POST"]),
        Route("/infill", infill, methods=["POST"]),
        Route("/embedding", embeddings_native, methods=["POST"]),
        Route("/embeddings", embeddings_native, methods=["POST"]),
        Route("/v1/embeddings", embeddings_oai, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/props", props, methods=["GET"]),
        Route("/slots", slots, methods=["GET"]),
        *ANTHROPIC_ROUTES,
        *RESPONSES_ROUTES,
        *SLOT_ROUTES,
        *RERANK_ROUTES,
    ]
    if state.vertex is not None:
        routes += predict_routes(state.vertex, routes, health)
    app = Starlette(routes=routes, exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error,
                                                       Exception: _on_crash})
    state.started = state.started or int(time.time())
    app.state.spark = state
    app.state.metrics = metrics.Metrics(state.stats)
    app.state.kept = {}  # /props and /models while the engine sleeps (--sleep-idle-seconds)

    def keep(asleep: bool) -> None:
        eng = state.worker.engine
        if asleep and eng is not None:
            app.state.kept = {"props": _props_body(state, eng, sleeping=True),
                              "meta": {"n_vocab": getattr(eng, "n_vocab", None), "n_ctx": eng.n_ctx}}

    state.worker.on_sleep.append(keep)
    public = ("/health", state.vertex.health_route if state.vertex is not None else "")
    return Guard(app, key=state.api_key, host=state.host, allowed_hosts=state.allowed_hosts, cors=state.cors,
                 public=tuple(p for p in public if p))
