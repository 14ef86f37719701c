"""Router mode: `spark serve` with no MODEL serves several models, as llama-server's router does.

The models come from router_models.py (--models-dir, --models-preset, llama.cpp's cache); each is
served by a child `spark serve MODEL` that router_pool.py starts on demand. This is the HTTP side:

- GET /models (and /v1/models): every model with `status.value` loaded, loading or unloaded
  (`?reload=1` reads the sources again); POST /models/load and /models/unload; GET /props:
  `role: router`, `max_instances`, `models_autoload`, `build_info` (`?model=`: that model's);
- every model-bound request (chat, completions, embeddings, tokenize, Anthropic messages,
  responses, ...) goes to its `model`'s child (the body's field, `?model=` for a GET), loading it
  first unless --no-models-autoload (then a 400 until POST /models/load), streamed through as it
  comes; `?autoload=false|true` decides for one request;
- the router's --api-key, --cors and Host checks run here (guard.py); the children are on
  127.0.0.1 with a key only the router has;
- X-Conversation-Id: the router remembers which model serves a conversation, for /v1/stream
  (resume and stop, as llama-server's); a stop while that model loads cancels the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping
from urllib.parse import quote

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import SparkError
from . import anthropic
from .guard import Guard
from .protocol import ApiError
from .router_models import RouterModel, Sources
from .router_pool import FAKE_DELAY, LOADED, LOADING, Instance, Pool, PoolConfig
from .router_proxy import UpstreamError, Upstream, response_headers, send

MAX_BODY_BYTES = 1 << 20  # a request body at most (a child takes no more either)

# POST endpoints bound to a model: routed by the body's `model` (as llama-server's router routes them)
MODEL_POSTS = ("/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions",
               "/v1/responses", "/responses", "/v1/messages", "/v1/messages/count_tokens", "/infill", "/embedding",
               "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking", "/tokenize",
               "/detokenize", "/apply-template", "/chat/completions/input_tokens",
               "/v1/chat/completions/input_tokens", "/responses/input_tokens", "/v1/responses/input_tokens",
               "/props", "/slots/{id_slot}")
# GET endpoints bound to a model: routed by `?model=`
MODEL_GETS = ("/metrics", "/slots")


class Conversations:
    """X-Conversation-Id -> the model serving it, with a ticket per request: a stop (DELETE
    /v1/stream) forgets the entry, which cancels a request still waiting for its model to load."""

    MAX = 4096  # conversations remembered at most

    def __init__(self) -> None:
        self._map: dict[str, tuple[str, int]] = {}
        self._next = 1

    def remember(self, conv: str, model: str) -> int:
        if not conv:
            return 0
        ticket, self._next = self._next, self._next + 1
        self._map.pop(conv, None)
        self._map[conv] = (model, ticket)
        while len(self._map) > self.MAX:  # NOTE: the oldest conversations go first (best effort, as llama-server's)
            self._map.pop(next(iter(self._map)))
        return ticket

    def alive(self, conv: str, ticket: int) -> bool:
        return self._map.get(conv, ("", 0))[1] == ticket

    def lookup(self, conv: str) -> str | None:
        return self._map[conv][0] if conv in self._map else None

    def forget(self, conv: str) -> None:
        self._map.pop(conv, None)


@dataclass
class RouterState:
    """What the router's routes read."""

    pool: Pool
    rediscover: Callable[[], Mapping[str, RouterModel]]  # the sources read again (?reload=1)
    autoload: bool = True
    models_max: int = 4
    build_info: str = ""
    fake_timing: bool = False
    started: int = field(default_factory=lambda: int(time.time()))
    conversations: Conversations = field(default_factory=Conversations)
    max_body: int = MAX_BODY_BYTES


def _error(e: ApiError, path: str = "") -> JSONResponse:
    """OpenAI's error shape, or Anthropic's under /v1/messages (as the single-model server's)."""
    if anthropic.is_messages_path(path):
        return JSONResponse(anthropic.error_body(e.status, e.message), status_code=anthropic.error_status(e.status))
    return JSONResponse(e.body(), status_code=e.status)


def _state(request: Request) -> RouterState:
    return request.app.state.router


async def _read_body(request: Request, limit: int) -> bytes:
    declared = "" if "transfer-encoding" in request.headers else request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the request body is over {limit} bytes")
    except ClientDisconnect:
        raise HTTPException(499, "the client went away") from None
    return bytes(body)


async def _json_body(request: Request) -> tuple[bytes, dict[str, Any]]:
    raw = await _read_body(request, _state(request).max_body)
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return raw, body


def _model_field(body: Mapping[str, Any]) -> str:
    name = body.get("model")
    return name if isinstance(name, str) else ""


def _autoload(request: Request) -> bool:
    """--models-autoload, or the request's `?autoload=`."""
    v = request.query_params.get("autoload", "")
    return _state(request).autoload if not v else v in ("true", "1")


def _validate(st: RouterState, name: str, autoload: bool) -> Instance:
    """The instance a request names (by name or alias), as llama-server's router checks it."""
    if not name:
        raise ApiError(400, "model name is missing from the request", param="model")
    inst = st.pool.get(name)
    if inst is None:
        raise ApiError(400, f"model '{name}' not found", param="model")
    if not autoload and not inst.running:
        raise ApiError(400, "model is not loaded (POST /models/load, or start spark serve without "
                            "--no-models-autoload)", param="model")
    return inst


# ---------------------------------------------------------------- proxying


class Proxied(Response):
    """A child's answer passed on as it comes (an SSE stream event by event); the request's count on
    the child is released when it ends or the client goes away (which closes the child's connection:
    the child stops generating)."""

    def __init__(self, upstream: Upstream, release: Callable[[], None]):
        self.upstream, self.release = upstream, release
        self.status_code = upstream.status
        self.background = None
        self.raw_headers = response_headers(upstream.headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        up = self.upstream
        try:
            await send({"type": "http.response.start", "status": up.status, "headers": self.raw_headers})
            async with anyio.create_task_group() as tg:
                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                async def pump() -> None:
                    try:
                        async for chunk in up.chunks():
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    except UpstreamError:
                        pass  # NOTE: the status is sent: the answer just ends where the child broke off
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                tg.start_soon(pump)
        finally:
            up.close()
            self.release()


async def _forward(request: Request, st: RouterState, name: str, method: str, body: bytes, touch: bool,
                   target: str | None = None) -> Response:
    inst = st.pool.acquire(name, touch)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            st.pool.release(inst)

    try:
        if st.fake_timing:
            await asyncio.sleep(FAKE_DELAY)  # NOTE: llama-server's test hook: the model counts as busy meanwhile
        if target is None:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        up = await send(inst.port, method, target, request.headers.raw, body, key=st.pool.key)
    except UpstreamError as e:
        release()
        raise ApiError(502, f"model {name}: {e}", "server_error") from None
    except BaseException:
        release()
        raise
    return Proxied(up, release)


async def proxy_post(request: Request) -> Response:
    """A model-bound POST: to its model's child, loaded first (or waited for in the queue)."""
    st = _state(request)
    raw, body = await _json_body(request)
    inst = _validate(st, _model_field(body), _autoload(request))
    name = inst.model.name
    conv = request.headers.get("x-conversation-id", "")
    ticket = st.conversations.remember(conv, name)
    # NOTE: a conversation's request is cancelled by a stop (DELETE /v1/stream), not by its socket
    gone = None if ticket else request.is_disconnected
    if _autoload(request):
        await st.pool.ensure_ready(name, gone)
    if ticket and not st.conversations.alive(conv, ticket):
        raise ApiError(400, "request cancelled by a stop while the model was loading")
    return await _forward(request, st, name, "POST", raw, touch=True)


async def proxy_get(request: Request) -> Response:
    """A model-bound GET (`?model=`): to its model's child."""
    st = _state(request)
    autoload = _autoload(request)
    inst = _validate(st, request.query_params.get("model", ""), autoload)
    if autoload:
        await st.pool.ensure_ready(inst.model.name, request.is_disconnected)
    return await _forward(request, st, inst.model.name, "GET", b"", touch=False)


# ---------------------------------------------------------------- the router's own endpoints


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def props(request: Request) -> Response:
    """The router's /props (llama-server's fields), or with `?model=` that model's."""
    if request.query_params.get("model"):
        return await proxy_get(request)
    st = _state(request)
    return JSONResponse({"role": "router", "max_instances": st.models_max, "models_autoload": st.autoload,
                         "model_alias": "spark serve", "model_path": "none",
                         "default_generation_settings": {"params": {}, "n_ctx": 0}, "ui_settings": {},
                         "build_info": st.build_info, "cors_proxy_enabled": False})


def model_card(st: RouterState, inst: Instance) -> dict[str, Any]:
    """A model as GET /models lists it (llama-server's router fields)."""
    m = inst.model
    status: dict[str, Any] = {"value": inst.status, "args": list(inst.args)}
    if m.source == "preset":
        status["preset"] = m.preset_ini()
    if inst.failed:
        status.update(failed=True, exit_code=inst.exit_code if inst.exit_code is not None else 1, error=inst.why)
    card: dict[str, Any] = {"id": m.name, "aliases": list(m.aliases), "tags": list(m.tags), "object": "model",
                            "owned_by": "spark", "created": st.started, "status": status,
                            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                            "source": m.source, "can_remove": False, "path": str(m.path) if m.path else None}
    if inst.running:
        card.update({k: v for k, v in inst.info.items() if k not in card})
    return card


async def models(request: Request) -> Response:
    st = _state(request)
    if request.query_params.get("reload"):
        try:
            found = await asyncio.to_thread(st.rediscover)
        except SparkError as e:
            raise ApiError(400, f"reload: {e.one_line()}") from None
        await st.pool.reload(found)
    data = [model_card(st, i) for n, i in sorted(st.pool.instances.items()) if not i.model.hidden]
    return JSONResponse({"data": data, "object": "list"})


async def load(request: Request) -> Response:
    st = _state(request)
    _, body = await _json_body(request)
    inst = st.pool.get(_model_field(body))
    if inst is None:
        raise ApiError(404, "model is not found", "not_found_error", param="model")
    if inst.running:
        raise ApiError(400, "model is already running", param="model")
    await st.pool.load(inst.model.name)
    return JSONResponse({"success": True})


async def unload(request: Request) -> Response:
    st = _state(request)
    _, body = await _json_body(request)
    inst = st.pool.get(_model_field(body))
    if inst is None:
        raise ApiError(400, "model is not found", param="model")
    if not inst.running:
        raise ApiError(400, "model is not running", param="model")
    st.pool.unload(inst.model.name)
    return JSONResponse({"success": True})


async def no_downloads(request: Request) -> Response:
    raise ApiError(501, "spark serve never downloads or deletes models: llama-server -hf OWNER/NAME downloads one "
                        "into llama.cpp's cache, where the router finds it (GET /models?reload=1)",
                   "not_supported_error")


# ---------------------------------------------------------------- resumable streams (X-Conversation-Id)


def _owner(st: RouterState, conv: str) -> Instance | None:
    name = st.conversations.lookup(conv)
    inst = st.pool.instances.get(name) if name else None
    return inst if inst is not None and inst.status == LOADED else None


def _conv_id(request: Request) -> str:
    conv = request.query_params.get("conv_id", "")
    if not conv:
        raise ApiError(400, "Missing conversation id in path", param="conv_id")
    return conv


async def stream_get(request: Request) -> Response:
    """GET /v1/stream?conv_id=&from=: the owning child's replay; 503 while its model loads."""
    st = _state(request)
    conv = _conv_id(request)
    inst = _owner(st, conv)
    if inst is None:
        tracked = st.conversations.lookup(conv)
        waiting = st.pool.instances.get(tracked) if tracked else None
        if waiting is not None and (waiting.status == LOADING or any(e.model == tracked for e in st.pool.queue)):
            raise ApiError(503, "Stream owner model is loading, retry later", "unavailable_error")
        raise ApiError(404, "Stream not found or expired", "not_found_error")
    target = "/v1/stream?conv_id=" + quote(conv, safe="")
    if request.query_params.get("from"):
        target += "&from=" + quote(request.query_params["from"], safe="")
    return await _forward(request, st, inst.model.name, "GET", b"", touch=False, target=target)


async def stream_delete(request: Request) -> Response:
    """DELETE /v1/stream?conv_id=: the stop goes to the owning child; the conversation is forgotten
    (a request still waiting for its model is cancelled)."""
    st = _state(request)
    conv = _conv_id(request)
    inst = _owner(st, conv)
    if inst is not None:
        with contextlib.suppress(UpstreamError, asyncio.TimeoutError):
            up = await asyncio.wait_for(send(inst.port, "DELETE", "/v1/stream?conv_id=" + quote(conv, safe=""),
                                             key=st.pool.key), 1.0)
            await asyncio.wait_for(up.read(), 1.0)
    st.conversations.forget(conv)
    return Response(status_code=204)


async def streams_lookup(request: Request) -> Response:
    """POST /v1/streams/lookup {conversation_ids}: what each owning child says of its own."""
    st = _state(request)
    try:
        _, body = await _json_body(request)
    except ApiError:
        return JSONResponse([])
    ids = [c for c in body.get("conversation_ids", []) if isinstance(c, str) and c] \
        if isinstance(body.get("conversation_ids"), list) else []
    per_child: dict[int, list[str]] = {}
    for c in ids:
        inst = _owner(st, c)
        if inst is not None:
            per_child.setdefault(inst.port, []).append(c)
    out: list[Any] = []
    for port, convs in per_child.items():
        with contextlib.suppress(UpstreamError, asyncio.TimeoutError, ValueError):
            up = await asyncio.wait_for(send(port, "POST", "/v1/streams/lookup", body=json.dumps(
                {"conversation_ids": convs}).encode(), key=st.pool.key, headers=[(b"content-type", b"application/json")]),
                1.0)
            raw = await asyncio.wait_for(up.read(), 1.0)
            found = json.loads(raw) if up.status == 200 else []
            out += [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []
    return JSONResponse(out)


# ---------------------------------------------------------------- the app


async def _on_api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError)
    return _error(e, request.url.path)


async def _on_http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    kind = {404: "not_found_error"}.get(e.status_code, "invalid_request_error")
    return _error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind), request.url.path)


async def _on_crash(request: Request, e: Exception) -> Response:
    return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error"), request.url.path)


def create_router_app(state: RouterState, *, api_key: str | None = None, host: str = "127.0.0.1",
                      allowed_hosts: tuple[str, ...] = (), cors: tuple[str, ...] = (),
                      on_startup: Callable[[], Awaitable[None]] | None = None) -> Any:
    """The router's ASGI app (behind guard.py's key, Host and CORS checks); `on_startup` runs on the
    event loop once it serves."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/props", props, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models/load", load, methods=["POST"]),
        Route("/models/unload", unload, methods=["POST"]),
        Route("/models", no_downloads, methods=["POST", "DELETE"]),
        Route("/v1/stream", stream_get, methods=["GET"]),
        Route("/v1/stream", stream_delete, methods=["DELETE"]),
        Route("/v1/streams/lookup", streams_lookup, methods=["POST"]),
        *(Route(p, proxy_post, methods=["POST"]) for p in MODEL_POSTS),
        *(Route(p, proxy_get, methods=["GET"]) for p in MODEL_GETS),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Any):
        if on_startup is not None:
            await on_startup()
        yield

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: _on_api_error, HTTPException: _on_http_error, Exception: _on_crash})
    app.state.router = state
    return Guard(app, key=api_key, host=host, allowed_hosts=allowed_hosts, cors=cors, public=("/health", "/v1/health"))


# ---------------------------------------------------------------- the process


@dataclass(frozen=True)
class RouterConfig:
    """Router mode's settings: where models come from, how children start, who may call."""

    sources: Sources
    discover: Callable[[], Mapping[str, RouterModel]]
    pool: PoolConfig
    autoload: bool = True
    build_info: str = ""
    api_key: str | None = None
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors: tuple[str, ...] = ()
    read_timeout: float = 30.0
    max_connections: int = 256


def _say(line: str) -> None:
    print(f"spark serve: {line}", file=sys.stderr, flush=True)


def serve_router(config: RouterConfig, models: Mapping[str, RouterModel], socks: list[socket.socket], *,
                 on_ready: Callable[[], None] | None = None, grace: float = 15.0) -> int:
    """Serve until SIGTERM/SIGINT: then every child is stopped (killed past `grace` seconds) before
    the router exits; 0, or 1 when the HTTP server stopped on its own."""
    import uvicorn

    from .listen import Refusals, protocol_class

    pool = Pool(models, config.pool)
    state = RouterState(pool, config.discover, autoload=config.autoload, models_max=config.pool.models_max,
                        build_info=config.build_info, fake_timing=config.pool.fake_timing)
    loop_box: list[asyncio.AbstractEventLoop] = []
    started = threading.Event()

    async def startup() -> None:
        loop_box.append(asyncio.get_running_loop())
        started.set()
        for name in pool.startup_models():  # NOTE: load-on-startup, one after the other
            async def load_one(n: str = name) -> None:
                try:
                    await pool.load(n)
                except ApiError as e:
                    _say(f"load-on-startup {n}: {e.message}")
            asyncio.ensure_future(load_one())

    app = create_router_app(state, api_key=config.api_key, host=config.host, allowed_hosts=config.allowed_hosts,
                            cors=config.cors, on_startup=startup)
    uconfig = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_keep_alive=5,
                             timeout_graceful_shutdown=3,
                             http=protocol_class(config.read_timeout, config.max_connections, Refusals()))
    http = uvicorn.Server(uconfig)
    http_thread = threading.Thread(target=http.run, kwargs={"sockets": socks}, name="spark-router", daemon=True)
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        http_thread.start()
        announced = False
        while not stop.wait(0.2):
            if not announced and started.is_set():
                announced = True
                if on_ready:
                    on_ready()
            if not http_thread.is_alive():
                code = 1
                break
        if loop_box and http_thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(pool.unload_all(grace), loop_box[0])
            with contextlib.suppress(Exception):
                fut.result(timeout=grace + 5)
        http.should_exit = True
        http_thread.join(timeout=10)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        pool.kill_all()  # NOTE: whatever is still alive: no child outlives the router
        for sock in socks:
            sock.close()
    return code

