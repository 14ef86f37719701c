"""The server process: bind, load in the background (/health says 503 meanwhile), serve,
and on SIGTERM/SIGINT drain, fold the routing counts and exit 0 (non-zero if the engine failed).

uvicorn runs in a thread of its own (so it installs no signal handlers); the main thread
owns the signals and the shutdown order: refuse new work, finish or cancel the running
request, stop HTTP, fold, close the engine.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..native import faults
from ..errors import SparkError
from .app import ServerState, create_app
from .learn import Learner
from .worker import Worker


@dataclass
class Outcome:
    code: int                # 0: stopped by a signal; else the engine's failure
    message: str | None      # why, when code != 0
    folded_tokens: float     # decode tokens folded into the profile over the whole run


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (so /health can answer)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SparkError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise SparkError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                         hint="is another server on that port? pick one with --port") from None
    sock.set_inheritable(True)
    return sock


def serve(state: ServerState, learner: Learner, sock: socket.socket, *, grace: float = 10.0,
          on_ready: Callable[[], None] | None = None) -> Outcome:
    import uvicorn

    worker: Worker = state.worker
    stop = threading.Event()
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

    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=int(grace) + 5)
    http = uvicorn.Server(config)
    http_thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, name="spark-http", daemon=True)
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
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
            worker.shutdown(grace)
            http.should_exit = True
            http_thread.join(timeout=grace + 10)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        try:
            learner.close()
        finally:
            worker.close_engine()
            sock.close()
    message, code = failure[0] if failure else (None, 0)
    return Outcome(code, message, learner.folded_tokens)
