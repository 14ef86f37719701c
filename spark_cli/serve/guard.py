"""Who may talk to the server, checked before any route (plain ASGI: streaming untouched):

1. `Host` must name this server: an IP literal, `localhost`, the `--host` name or one of
   `--allowed-hosts` (a DNS-rebinding page sends its own name);
2. a browser's cross-origin request (`Origin` of another site) is refused unless `--cors`
   allows that origin (`localhost`: any origin on this machine, as llama-server's
   --cors-origins localhost); a preflight (OPTIONS) is answered here, before the key check, 200
   with the allow headers for an allowed origin and without them for another (the browser then
   sends nothing), as llama-server answers it;
3. with a key, every path but /health (and Vertex AI's AIP_HEALTH_ROUTE) needs `Authorization: Bearer KEY` (scheme in any case)
   or `x-api-key: KEY` (Anthropic's header).

Under /v1/messages the refusals are in Anthropic's error shape.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from typing import Iterable
from urllib.parse import urlsplit

from . import anthropic

ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version"


def _error(path: str, status: int, message: str, kind: str, headers: Iterable[tuple[bytes, bytes]] = ()):
    body = json.dumps(anthropic.error_body(status, message) if anthropic.is_messages_path(path) else
                      {"error": {"message": message, "type": kind, "code": status, "param": None}}).encode()

    async def respond(send) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": body})
    return respond


def host_name(value: str) -> str:
    """The host part of a Host header (no port; IPv6 without brackets), lower-case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def loopback_origin(origin: str) -> bool:
    """An origin on this machine: http(s)://localhost, 127.0.0.1 or [::1], any port (llama-server's
    --cors-origins localhost); not localhost.evil.com."""
    try:
        return urlsplit(origin.strip()).hostname in ("localhost", "127.0.0.1", "::1")
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    if host_name(host) == "localhost":
        return True
    try:
        return ipaddress.ip_address(host_name(host)).is_loopback
    except ValueError:
        return False


class Guard:
    def __init__(self, app, *, key: str | None = None, host: str = "127.0.0.1",
                 allowed_hosts: Iterable[str] = (), cors: Iterable[str] = (), public: Iterable[str] = ("/health",)):
        self.app = app
        self.public = frozenset(public)  # the paths that need no key
        self.key = key.encode() if key else None
        self.hosts = {"localhost", host_name(host), *(host_name(h) for h in allowed_hosts if h)}
        self.any_host = "*" in self.hosts
        self.cors = {o.strip().rstrip("/").lower() for o in cors if o.strip()}

    def host_ok(self, value: str | None) -> bool:
        if value is None:  # HTTP/1.0 without Host: not a browser
            return True
        name = host_name(value)
        return self.any_host or name in self.hosts or _is_ip(name) or name.endswith(".localhost")

    def origin_ok(self, origin: str, host: str | None) -> bool:
        o = origin.strip().rstrip("/").lower()
        if "*" in self.cors or o in self.cors or "localhost" in self.cors and loopback_origin(o):
            return True
        # NOTE: the same origin as the Host the browser sent is not cross-origin
        return host is not None and o.split("://", 1)[-1] == host.strip().lower()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: dict[bytes, bytes] = {}
        for k, v in scope["headers"]:
            headers.setdefault(k, v)
        get = lambda k: headers[k].decode("latin-1") if k in headers else None  # noqa: E731
        host, origin = get(b"host"), get(b"origin")
        if not self.host_ok(host):
            await _error(scope["path"], 400, f"Host {host!r} is not this server's name (start spark serve with --allowed-hosts "
                              f"{host_name(host or '')} to allow it)", "invalid_request_error")(send)
            return
        cors_headers: list[tuple[bytes, bytes]] = []
        if origin is not None:
            allowed = self.origin_ok(origin, host)
            if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
                # NOTE: a preflight of another origin gets no allow headers: the browser refuses the request
                allow = [(b"Access-Control-Allow-Origin", origin.encode("latin-1")), (b"Vary", b"Origin"),
                         (b"Access-Control-Allow-Methods", ALLOW_METHODS.encode()),
                         (b"Access-Control-Allow-Headers", headers.get(b"access-control-request-headers",
                                                                       ALLOW_HEADERS.encode())),
                         (b"Access-Control-Max-Age", b"600")] if allowed else [(b"Vary", b"Origin")]
                await send({"type": "http.response.start", "status": 200,
                            "headers": [*allow, (b"content-length", b"0")]})
                await send({"type": "http.response.body", "body": b""})
                return
            if not allowed:
                await _error(scope["path"], 403, f"Origin {origin!r} is not allowed (start spark serve with --cors {origin} "
                                  "to allow that site)", "permission_error")(send)
                return
            # NOTE: spelled as llama-server spells them (some clients look the names up case-sensitively)
            cors_headers = [(b"Access-Control-Allow-Origin", origin.encode("latin-1")), (b"Vary", b"Origin")]
        if self.key is not None and scope["path"] not in self.public and not self._key_ok(headers):
            await _error(scope["path"], 401, "Invalid API Key", "authentication_error", cors_headers)(send)
            return
        if not cors_headers:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors_headers]}
            await send(message)
        await self.app(scope, receive, send_with_cors)

    def _key_ok(self, headers: dict[bytes, bytes]) -> bool:
        key = self.key or b""
        if b"x-api-key" in headers and secrets.compare_digest(headers[b"x-api-key"].strip(), key):
            return True
        scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), key)
