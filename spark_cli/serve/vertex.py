"""Vertex AI's prediction protocol, as llama-server serves it when the environment says
`AIP_MODE=PREDICTION` (Vertex AI's custom-container variables):

- the server listens on `AIP_HTTP_PORT` (default 8080; over --port);
- `POST AIP_PREDICT_ROUTE` (default /predict) takes `{"instances": [...]}` (128 at most): each
  instance is one request to one of the server's routes, named by its `@requestFormat`: the
  route's path, or its camelCase alias (the path without /v1, in camelCase:
  `chatCompletions`, `completions` (OpenAI's /v1/completions), `completion`, `responses`,
  `messages`, `tokenize`, `applyTemplate`, ...; the first route of a name wins). They run at once
  (on different slots with -np), and the answer is `{"predictions": [...]}` in the instances'
  order: each the route's body, or its `{"error": ...}` (an instance that is not an object, has
  no string @requestFormat, names no route, or asks for `stream`: the predict route answers
  whole; llama-server answers such an instance unstreamed instead);
- `AIP_HEALTH_ROUTE`, when set: /health under that name too (public, as /health is).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from pydantic import Field
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import UsageError
from .chat import ClientGone, read_body
from .protocol import ApiError, Strict, parse

MAX_INSTANCES = 128
FORMAT_KEY = "@requestFormat"
Endpoint = Callable[[Request], Awaitable[Response]]


def _route(value: str) -> str:
    return value if value.startswith("/") else "/" + value


@dataclass(frozen=True)
class Vertex:
    port: int = 8080
    predict_route: str = "/predict"
    health_route: str = ""  # "": none besides /health

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Vertex | None":
        """None unless AIP_MODE is PREDICTION; an empty variable is unset."""
        if env.get("AIP_MODE") != "PREDICTION":
            return None
        port = env.get("AIP_HTTP_PORT") or "8080"
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"AIP_HTTP_PORT={port}: not a port number (1 to 65535)")
        health = env.get("AIP_HEALTH_ROUTE") or ""
        return cls(int(port), _route(env.get("AIP_PREDICT_ROUTE") or "/predict"), _route(health) if health else "")


def format_alias(path: str) -> str:
    """A route's @requestFormat name: "/v1/chat/completions" -> "chatCompletions",
    "/apply-template" -> "applyTemplate" (llama-server's)."""
    words = [w for w in path.removeprefix("/v1").replace("-", "/").replace("_", "/").split("/") if w]
    return "".join(w if i == 0 else w[:1].upper() + w[1:] for i, w in enumerate(words))


class PredictRequest(Strict):
    instances: list[Any] = Field(max_length=MAX_INSTANCES)


def _sub_request(request: Request, path: str, body: bytes) -> Request:
    """One instance as a request of its own to `path`: its body, the outer request's headers, and
    the outer connection (a client that leaves cancels every instance)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-length"]
    scope = {**request.scope, "path": path, "raw_path": path.encode(), "method": "POST",
             "headers": [*headers, (b"content-length", str(len(body)).encode())]}
    return Request(scope, receive)


def _bad(message: str, param: str | None = None) -> dict[str, Any]:
    return ApiError(400, message, param=param).body()


async def _predict_one(request: Request, instance: Any, endpoints: Mapping[str, tuple[str, Endpoint]]) -> Any:
    if not isinstance(instance, dict):
        return _bad("each instance must be a JSON object")
    fmt = instance.get(FORMAT_KEY)
    if not isinstance(fmt, str):
        return _bad(f"each instance must include a string {FORMAT_KEY}", FORMAT_KEY)
    if instance.get("stream"):
        return _bad("stream: the predict route answers whole (send stream false, or leave it out)", "stream")
    if fmt not in endpoints:
        return _bad(f"no handler registered for {FORMAT_KEY}: {fmt}", FORMAT_KEY)
    path, endpoint = endpoints[fmt]
    payload = json.dumps({k: v for k, v in instance.items() if k != FORMAT_KEY}).encode()
    try:
        res = await endpoint(_sub_request(request, path, payload))
    except ApiError as e:
        return e.body()
    except HTTPException as e:
        if e.status_code == 499:
            raise ClientGone from None
        return ApiError(e.status_code, str(e.detail)).body()
    except ClientGone:
        raise
    except Exception as e:  # NOTE: this instance's 500, as llama-server's; the others are answered
        return ApiError(500, f"internal error: {type(e).__name__}", "server_error").body()
    if res.status_code == 499:
        raise ClientGone
    if isinstance(res, StreamingResponse):  # NOTE: no route streams without stream: true; kept as llama-server's
        return ApiError(500, "predict route does not support streaming responses", "server_error").body()
    try:
        return json.loads(res.body) if res.body else None
    except ValueError:
        return res.body.decode("utf-8", "replace")  # /metrics' text, as llama-server's


def predict_endpoint(endpoints: Mapping[str, tuple[str, Endpoint]]) -> Endpoint:
    async def predict(request: Request) -> Response:
        st = request.app.state.spark
        try:
            req = parse(PredictRequest, await read_body(request, st.max_body))
            answers = await asyncio.gather(*(_predict_one(request, i, endpoints) for i in req.instances))
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse({"predictions": list(answers)})
    return predict


def routes(vertex: Vertex, served: list[Route], health: Endpoint) -> list[Route]:
    """The predict route over `served` (and the health route's other name)."""
    paths = {r.path for r in served}
    if vertex.predict_route in paths:
        raise UsageError(f"AIP_PREDICT_ROUTE={vertex.predict_route} is one of spark serve's own routes")
    endpoints: dict[str, tuple[str, Endpoint]] = {}
    for r in served:
        endpoints.setdefault(format_alias(r.path), (r.path, r.endpoint))
        endpoints.setdefault(r.path, (r.path, r.endpoint))
    out = [Route(vertex.predict_route, predict_endpoint(endpoints), methods=["POST"])]
    if vertex.health_route and vertex.health_route not in paths:
        out.append(Route(vertex.health_route, health, methods=["GET"]))
    return out
