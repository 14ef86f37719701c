"""The server process: bind, load in the background (/health says 503 meanwhile), serve,
and on SIGTERM/SIGINT drain, fold the routing counts and exit 0 (non-zero if the engine failed).

uvicorn runs in a thread of its own (so it installs no signal handlers); the main thread
owns the signals and the shutdown order: refuse new work, finish or cancel the running
request, stop HTTP, fold, close the engine.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..native import faults
from .app import ServerState, create_app
from .learn import Learner
# NOTE: re-exported: the command and the tests reach the listening side as server.*
from .listen import (CLOSE, FD_RESERVE, MAX_CONNECTIONS, READ_TIMEOUT, AcceptErrors, Refusals,  # noqa: F401
                     ambiguous_framing, bind, bind_all, fd_ceiling, hosts, protocol_class, url_host)
from .protocol import LOG
from .worker import Worker


@dataclass
class Outcome:
    code: int                # 0: stopped by a signal; else the engine's failure
    message: str | None      # why, when code != 0
    folded_tokens: float     # decode tokens folded into the profile over the whole run


def _until_eof(stop: threading.Event) -> None:
    """Set `stop` once stdin reaches its end (the router that started this server closed it, or died)."""
    try:
        while os.read(0, 4096):  # NOTE: the raw descriptor: a thread blocked in sys.stdin holds its lock at exit
            pass
    except OSError:
        pass
    stop.set()


def _warnings_to_stderr() -> logging.Handler:
    """protocol.warn's lines on stderr, as `spark serve: warning: ...` (the handler, to remove at exit)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("spark serve: warning: %(message)s"))
    LOG.addHandler(handler)
    LOG.propagate = False
    return handler


def serve(state: ServerState, learner: Learner, socks: list[socket.socket], *, grace: float = 3.0,
          on_ready: Callable[[], None] | None = None, read_timeout: float = READ_TIMEOUT,
          max_connections: int = MAX_CONNECTIONS, watch_stdin: bool = False) -> Outcome:
    """Serve until SIGTERM/SIGINT (or, with `watch_stdin`, until stdin closes: a router's child whose
    router is gone), then shut down in order."""
    import uvicorn

    worker: Worker = state.worker
    stop = threading.Event()
    stopped = True
    failure: list[tuple[str, int]] = []

    def on_fatal(message: str, code: int) -> None:
        failure.append((message, code))
        stop.set()

    worker.on_fatal = on_fatal

    def keep_on_loss() -> str | None:
        # NOTE: called by faults' abort hook when the device or RPC server is gone; the process ends after it
        worker.abort((faults.last_error() or faults.describe("")).message)  # 503 to the running request and the queue
        worker.harvest_now()
        time.sleep(1.0)  # the HTTP thread sends the 503s meanwhile
        learner.close()
        n = learner.folded_tokens
        return f"{n:.0f} decode tokens of routing folded into the profile while serving" if learner.enabled else None

    refusals = Refusals()
    accept_errors = AcceptErrors(refusals)
    logging.getLogger("asyncio").addFilter(accept_errors)
    warnings = _warnings_to_stderr()
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=int(grace) + 3, timeout_keep_alive=5,
                            http=protocol_class(read_timeout, max_connections, refusals))
    http = uvicorn.Server(config)
    http_thread = threading.Thread(target=http.run, kwargs={"sockets": socks}, name="spark-http", daemon=True)
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    if watch_stdin:
        threading.Thread(target=_until_eof, args=(stop,), name="spark-stdin", daemon=True).start()
    try:
        with faults.keeper(keep_on_loss):
            http_thread.start()
            worker.start()
            learner.start()
            announced = False
            while not stop.wait(0.2):
                if not announced and worker.ready.is_set():
                    announced = True
                    if on_ready:
                        on_ready()
                if not http_thread.is_alive():
                    failure.append(("the HTTP server stopped", 1))
                    break
            stopped = worker.shutdown(grace)
            http.should_exit = True
            http_thread.join(timeout=grace + 10)
    finally:
        logging.getLogger("asyncio").removeFilter(accept_errors)
        LOG.removeHandler(warnings)
        for s, h in old.items():
            signal.signal(s, h)
        try:
            learner.close()
        finally:
            if stopped:  # NOTE: an engine still inside a native step is not freed under it
                worker.close_engine()
            for sock in socks:
                sock.close()
    message, code = failure[0] if failure else (None, 0)
    return Outcome(code, message, learner.folded_tokens)
