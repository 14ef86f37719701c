"""Device loss: ggml aborts the process when an RPC server dies mid-run; Spark reports it.

An abort that is not a device loss (a GGML_ASSERT while the servers still answer and the
message names no device error) is reported as llama.cpp's internal error, with its text.

ggml calls its abort callback (`ggml_set_abort_callback`) with the message it would print,
then `abort()`s. Spark's callback runs the *keepers* registered for the current run (chat
folds its routing counts, bench writes its partial report), prints one red line naming the
server and what to do, and ends the process with exit code 1 before abort() can dump a
backtrace. GGML_NO_BACKTRACE is set as well, for any path that bypasses the callback.

The RPC hello probe (`probe_rpc`) checks an endpoint before ggml connects to it, with a
timeout: ggml's own connect has none and would hang on a server that accepts and never
answers, or abort on something that is not an RPC server.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import struct
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

from ..errors import DeviceLostError, InternalError, SparkError

RPC_CMD_HELLO = 14  # ggml-rpc.cpp: "RPC_CMD_HELLO must be always 14"
RPC_PROTO_MAJOR = 7  # ggml-rpc.h RPC_PROTO_MAJOR_VERSION of the vendored ggml
RPC_CONN_CAPS_SIZE = 24  # transport.h
HELLO_RSP_SIZE = 4 + RPC_CONN_CAPS_SIZE  # major, minor, patch, padding, conn_caps
DEFAULT_RPC_TIMEOUT = 10.0

Keeper = Callable[[], "str | None"]  # keeps what the run gathered; returns a note for the error line

_keepers: list[Keeper] = []
_endpoints: list[str] = []
_installed = False
_callback = None  # the ctypes callback must outlive the process's use of it
_lock = threading.Lock()


def rpc_timeout() -> float:
    """Seconds to wait for an RPC server's hello (SPARK_RPC_TIMEOUT, default 10)."""
    try:
        return max(0.1, float(os.environ.get("SPARK_RPC_TIMEOUT", DEFAULT_RPC_TIMEOUT)))
    except ValueError:
        return DEFAULT_RPC_TIMEOUT


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            break
        buf += part
    return buf


def probe_rpc(endpoint: str, timeout: float | None = None) -> tuple[int, int, int]:
    """Connect to `endpoint` and exchange ggml's RPC hello; returns the server's version.

    Raises SparkError in one line: nothing listening, no answer within `timeout`, or an
    answer that is not a ggml RPC server's (of this protocol version).
    """
    timeout = rpc_timeout() if timeout is None else timeout
    host, port = endpoint.rsplit(":", 1)
    start_hint = f"start one with: spark rpc-server --port {port}"
    try:
        sock = socket.create_connection((host, int(port)), timeout=min(timeout, 5.0))
    except socket.timeout:
        raise SparkError(f"--rpc {endpoint}: no answer to a connection within {min(timeout, 5.0):.0f} s",
                         hint="check the host and the firewall") from None
    except OSError as e:
        raise SparkError(f"--rpc {endpoint}: no RPC server answers there ({e.strerror or e})",
                         hint=start_hint) from None
    with sock:
        sock.settimeout(timeout)
        try:
            sock.sendall(bytes([RPC_CMD_HELLO]) + struct.pack("<Q", RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE))
            head = _recv_exact(sock, 8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            body = _recv_exact(sock, HELLO_RSP_SIZE) if size == HELLO_RSP_SIZE else b""
        except socket.timeout:
            raise SparkError(f"--rpc {endpoint}: the server accepted the connection but did not answer "
                             f"the RPC hello within {timeout:.0f} s",
                             hint="is it a ggml RPC server, and is it busy with another client?") from None
        except OSError as e:
            raise SparkError(f"--rpc {endpoint}: the connection failed during the RPC hello "
                             f"({e.strerror or e})", hint="is it a ggml RPC server?") from None
    if len(body) != HELLO_RSP_SIZE:
        raise SparkError(f"--rpc {endpoint}: not a ggml RPC server (it did not answer the RPC hello)",
                         hint=f"point --rpc at a spark rpc-server or llama.cpp rpc-server; {start_hint}")
    major, minor, patch = body[0], body[1], body[2]
    if major != RPC_PROTO_MAJOR:
        raise SparkError(f"--rpc {endpoint}: RPC server protocol {major}.{minor}.{patch}, this Spark speaks "
                         f"{RPC_PROTO_MAJOR}.x", hint="run a server built from the same llama.cpp version")
    return major, minor, patch


# ---------------------------------------------------------------- the abort hook


def install(libdir: Path) -> None:
    """Route ggml's aborts through `_on_abort` (once per process); libdir holds libggml-base."""
    global _installed, _callback
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    with _lock:
        if _installed:
            return
        _installed = True
        proto = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
        _callback = proto(_on_abort)
        # NOTE: wheels copy libggml-base.so and libggml-base.so.0 as two files, so a process
        # holds two copies with a callback each: set it in every copy
        for path in sorted({p.resolve() for p in Path(libdir).glob("libggml-base.so*")}):
            try:
                fn = ctypes.CDLL(str(path), mode=getattr(os, "RTLD_GLOBAL", 0)).ggml_set_abort_callback
            except (OSError, AttributeError):
                continue  # an older ggml: GGML_NO_BACKTRACE alone keeps the dump away
            fn.restype = ctypes.c_void_p
            fn.argtypes = [proto]
            fn(_callback)


def using_endpoints(endpoints: list[str]) -> None:
    """Remember the RPC servers this process talks to, to name them when one is lost."""
    for ep in endpoints:
        if ep not in _endpoints:
            _endpoints.append(ep)


@contextlib.contextmanager
def keeper(fn: Keeper) -> Iterator[None]:
    """While the block runs, a device loss first calls `fn` to keep what was gathered."""
    _keepers.append(fn)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _keepers.remove(fn)


def _alive(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


# messages of a device's own failure (a CUDA/Vulkan/HIP error, a lost device, no memory)
DEVICE_MARKERS = ("cuda error", "cublas", "vulkan", "vk::", "devicelost", "device lost", "hip error", "rocm",
                  "sycl", "metal", "out of memory", "illegal memory", "ecc error")

_last: SparkError | None = None


def last_error() -> SparkError | None:
    """The error of the abort in progress (for keepers that pass it on, e.g. serve's 503)."""
    return _last


def describe(message: str) -> SparkError:
    """The one-line error for a ggml abort message: a lost RPC server or device, else (the
    servers still answer, no device error in the message) llama.cpp's own internal abort."""
    text = message.strip()
    first = text.splitlines()[0] if text else "ggml aborted"
    why = first.split(": ", 1)[1] if first.count(":") >= 2 and ".c" in first.split(":", 1)[0] else first
    where = first.split(": ", 1)[0] if why != first else ""
    dead = [ep for ep in _endpoints if not _alive(ep)]
    if dead or "RPC" in why:
        names = ", ".join(dead or _endpoints) or "the RPC server"
        port = (dead or _endpoints)[0].rsplit(":", 1)[1] if (dead or _endpoints) else "PORT"
        return DeviceLostError(f"lost the RPC server {names} ({why})",
                               hint=f"check that it runs (spark rpc-server --port {port}), then run again")
    if not text or any(m in message.lower() for m in DEVICE_MARKERS):
        return DeviceLostError(f"the device failed: {why}", hint="check the device (nvidia-smi), then run again")
    at = f" at {Path(where).name}" if where else ""
    return InternalError(f"internal error: llama.cpp aborted: {why}{at}",
                         hint="not a device fault (the device and RPC servers still answer); please report it "
                              "with SPARK_DEBUG=1's output")


def run_keepers() -> list[str]:
    notes = []
    for fn in reversed(list(_keepers)):
        try:
            note = fn()
        except BaseException as e:  # noqa: BLE001 - one keeper failing must not stop the others
            note = f"could not keep everything ({type(e).__name__}: {e})".splitlines()[0]
        if note:
            notes.append(note)
    return notes


def _plain(line: str) -> None:
    print(f"error: {line}", file=sys.stderr)


_printer: Callable[[str], None] = _plain


def set_printer(fn: Callable[[str], None]) -> None:
    """How the one line of a device loss is printed (the CLI's red error line)."""
    global _printer
    _printer = fn


def _on_abort(message: bytes | None) -> None:
    global _last
    text = (message or b"").decode("utf-8", "replace")
    try:
        err = _last = describe(text)
        notes = run_keepers()
        line = type(err)("; ".join([err.message, *notes]), hint=err.hint).one_line()
        if os.environ.get("SPARK_DEBUG"):
            print(text, file=sys.stderr)
        try:
            if sys.stderr.isatty():
                sys.stderr.write("\x1b[?25h\n")  # a live progress display hid the cursor
            _printer(line)
        except Exception:  # noqa: BLE001
            print(f"error: {line}", file=sys.stderr)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        os._exit(err.exit_code if "err" in locals() else 1)
