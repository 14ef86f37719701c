"""Router mode's HTTP client to its children: one request per connection to 127.0.0.1:PORT, the
answer's status and headers, then its body as it comes (a stream's events one by one).

h11 (uvicorn's HTTP/1.1 parser, already a dependency) on asyncio streams: no client library. The
router's own headers stay at the router: the client's key (the child has a key of its own, which
only the router knows), Origin (checked at the router), hop-by-hop headers; the child's CORS and
framing headers are the router's to send.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable

import h11

CHILD_HOST = "127.0.0.1"  # children listen here only (the router may listen on 0.0.0.0)
# request headers not passed on (lower-case)
DROP_REQUEST = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"te", b"trailer",
                b"upgrade", b"proxy-authorization", b"proxy-connection", b"accept-encoding", b"authorization",
                b"x-api-key", b"origin", b"referer", b"cookie"}
# answer headers not passed back: framing, and what the router's own middleware sends
DROP_RESPONSE = {b"server", b"date", b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"vary"}


class UpstreamError(Exception):
    """The child could not be reached, or broke off its answer."""


def request_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers a child gets (DROP_REQUEST left out)."""
    return [(k, v) for k, v in headers if k.lower() not in DROP_REQUEST]


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A child's answer headers the client gets: no framing, no CORS (the router adds its own)."""
    return [(k.lower(), v) for k, v in headers
            if k.lower() not in DROP_RESPONSE and not k.lower().startswith(b"access-control-")]


@dataclass
class Upstream:
    """A child's answer being read: status and headers now, the body through chunks()."""

    status: int
    headers: list[tuple[bytes, bytes]]
    _reader: asyncio.StreamReader
    _writer: asyncio.StreamWriter
    _conn: h11.Connection
    _done: bool = field(default=False)

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as the child sends it; UpstreamError if it breaks off."""
        try:
            while not self._done:
                ev = await _next_event(self._conn, self._reader)
                if isinstance(ev, h11.Data):
                    yield bytes(ev.data)
                elif isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
                    self._done = True
        finally:
            self.close()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def close(self) -> None:
        self._done = True
        if not self._writer.is_closing():
            self._writer.close()


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        try:
            ev = conn.next_event()
        except h11.RemoteProtocolError as e:
            raise UpstreamError(f"the model's server broke off its answer ({e})") from None
        if ev is not h11.NEED_DATA:
            return ev
        try:
            data = await reader.read(1 << 16)
        except OSError as e:
            raise UpstreamError(f"the model's server broke off its answer ({e.strerror or e})") from None
        conn.receive_data(data)


async def send(port: int, method: str, target: str, headers: Iterable[tuple[bytes, bytes]] = (), body: bytes = b"",
               key: str | None = None, connect_timeout: float = 10.0) -> Upstream:
    """Send one request to the child on `port` and read its status and headers (`key`: the child's
    own API key, as a bearer token). UpstreamError when it cannot be reached or answers nonsense."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(CHILD_HOST, port), connect_timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise UpstreamError(f"cannot reach the model's server on port {port} "
                            f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
    conn = h11.Connection(h11.CLIENT)
    hdrs = [(b"host", f"{CHILD_HOST}:{port}".encode()), *request_headers(headers), (b"connection", b"close")]
    if key:
        hdrs.append((b"authorization", b"Bearer " + key.encode()))
    if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        hdrs.append((b"content-length", str(len(body)).encode()))
    try:
        out = conn.send(h11.Request(method=method, target=target.encode(), headers=hdrs))
        if body:
            out += conn.send(h11.Data(data=body))
        out += conn.send(h11.EndOfMessage())
        writer.write(out)
        await writer.drain()
        while True:
            ev = await _next_event(conn, reader)
            if isinstance(ev, h11.Response):
                return Upstream(ev.status_code, list(ev.headers), reader, writer, conn)
            if isinstance(ev, h11.ConnectionClosed):
                raise UpstreamError(f"the model's server on port {port} closed the connection without an answer")
    except (OSError, h11.LocalProtocolError) as e:
        writer.close()
        raise UpstreamError(f"the model's server on port {port}: {getattr(e, 'strerror', None) or e}") from None
    except BaseException:
        writer.close()
        raise


async def get_json(port: int, path: str, key: str | None = None, timeout: float = 5.0) -> tuple[int, Any]:
    """GET a child's JSON endpoint: (status, body; None when not JSON). UpstreamError or
    asyncio.TimeoutError when it does not answer in `timeout` seconds."""

    async def call() -> tuple[int, Any]:
        up = await send(port, "GET", path, key=key, connect_timeout=timeout)
        raw = await up.read()
        try:
            return up.status, json.loads(raw)
        except ValueError:
            return up.status, None

    return await asyncio.wait_for(call(), timeout)
