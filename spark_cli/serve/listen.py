"""The listening side of `spark serve` (the single-model server's and the router's): the sockets
bound to --host's addresses, and uvicorn's HTTP/1.1 protocol with a deadline to read each request, a
cap on connections (and on descriptors) and a close after a request framed two ways."""

from __future__ import annotations

import json
import logging
import resource
import socket
import sys
import time

from ..errors import SparkError


def hosts(text: str) -> list[str]:
    """--host's addresses: comma-separated, as llama-server's (blanks dropped)."""
    out = [h.strip() for h in text.split(",") if h.strip()]
    if not out:
        raise SparkError(f"--host {text!r}: no address (give one, or several comma-separated)")
    return out


def url_host(addr: str) -> str:
    """An address as a URL writes it (IPv6 in brackets)."""
    return f"[{addr}]" if ":" in addr else addr


def bind_all(names: list[str], port: int) -> list[socket.socket]:
    """A listening socket per address, bound before the model loads (so /health can answer), all on
    one port: port 0 picks a free one for the first, the others take the same. With several, an
    IPv6 socket takes only IPv6 (as llama-server's: `::` beside `0.0.0.0` binds both)."""
    socks: list[socket.socket] = []
    try:
        for host in names:
            socks.append(bind(host, port, v6_only=len(names) > 1))
            port = socks[0].getsockname()[1]
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def bind(host: str, port: int, v6_only: bool = False) -> socket.socket:
    """The listening socket, bound before the model loads (so /health can answer)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SparkError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if v6_only and family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise SparkError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                         hint="is another server on that port? pick one with --port") from None
    sock.set_inheritable(True)
    return sock


READ_TIMEOUT = 30.0  # seconds a connection may take to send a whole request (headers and body)
MAX_CONNECTIONS = 256  # open connections at most (fewer under a low descriptor limit)
FD_RESERVE = 32  # descriptors kept free for the engine, profile writes, logs


def _say(line: str) -> None:
    print(f"spark serve: {line}", file=sys.stderr, flush=True)


class Refusals:
    """Say once that connections are being refused, not once per attempt (again only after
    QUIET seconds without a refusal)."""

    QUIET = 10.0

    def __init__(self) -> None:
        self.active = False
        self.last = 0.0

    def refused(self, why: str) -> None:
        self.last = time.monotonic()
        if not self.active:
            self.active = True
            _say(f"refusing new connections: {why} (said once until it clears)")

    def cleared(self) -> None:
        if self.active and time.monotonic() - self.last > self.QUIET:
            self.active = False


class AcceptErrors(logging.Filter):
    """asyncio logs a traceback for every failed accept() (EMFILE): keep only the first, as one line."""

    def __init__(self, refusals: Refusals):
        super().__init__()
        self.refusals = refusals

    def filter(self, record: logging.LogRecord) -> bool:
        if "accept" not in str(record.msg):
            return True
        self.refusals.refused("out of file descriptors (raise ulimit -n)")
        return False


def fd_ceiling() -> int:
    """The lowest descriptor number a new connection may have: RLIMIT_NOFILE less a reserve
    (descriptors are handed out lowest first, so a connection's number says how many are in use)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else max(16, soft - FD_RESERVE)


CLOSE = (b"connection", b"close")


def ambiguous_framing(headers: list[tuple[bytes, bytes]]) -> bool:
    """A request with both Content-Length and Transfer-Encoding (lower-case names): its body is
    the chunks, and the connection must close after the answer (RFC 9112 6.1: request smuggling)."""
    names = {k for k, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def protocol_class(read_timeout: float, max_connections: int, refusals: Refusals):
    """uvicorn's h11 protocol with a deadline to read each request, a cap on connections, and a
    close after a request framed both ways (ambiguous_framing)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    ceiling = fd_ceiling()
    busy = json.dumps({"error": {"message": "the server has too many open connections; try again",
                                 "type": "unavailable_error", "code": 503, "param": None}}).encode()
    busy = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(busy)).encode() + b"\r\n\r\n" + busy)

    class GuardedH11(H11Protocol):
        _read_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            fd = sock.fileno() if sock is not None else 0
            if len(self.connections) > max_connections or fd >= ceiling:
                refusals.refused(f"{len(self.connections) - 1} connections are open" +
                                 (" (the cap, --max-connections)" if fd < ceiling else
                                  ", and the descriptor limit (ulimit -n) is near"))
                transport.write(busy)
                transport.close()
                return
            if len(self.connections) <= max_connections // 2 and fd < ceiling - FD_RESERVE:
                refusals.cleared()
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(read_timeout, self._read_expired)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_expired(self) -> None:
            self._read_timer = None
            # NOTE: only while the request is still being read; a request in the queue or being answered has no deadline
            if (not self.transport.is_closing() and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE)
                    and self.conn.their_state in (h11.IDLE, h11.SEND_BODY)):
                self.transport.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle and self.cycle is not None and ambiguous_framing(self.cycle.scope["headers"]):
                # NOTE: as if it said Connection: close: uvicorn answers with that header, h11 then closes
                self.cycle.scope["headers"].append(CLOSE)
                self.cycle.keep_alive = False

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11
