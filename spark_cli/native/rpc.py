"""The RPC stand-in GPU: ggml's RPC server in a subprocess, and `--rpc` endpoints in the client.

A registered RPC endpoint is a GPU-type device with its own memory, so the expert cache runs
the same upload, remap and placement code against it as against CUDA.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO

from ..errors import DeviceError, NativeError, SparkError, UsageError
from . import faults, llama_lib

_ENDPOINT = re.compile(r"^(?P<host>[A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(?P<port>\d{1,5})$")
_registered: dict[str, list[str]] = {}  # endpoint -> device names; ggml's registry is per process


def parse_endpoints(value: str | None) -> list[str]:
    """`HOST:PORT[,HOST:PORT]` as llama.cpp's --rpc takes it."""
    if not value:
        return []
    out = []
    for part in value.split(","):
        part = part.strip()
        m = _ENDPOINT.match(part)
        if m and m.group("host").startswith("["):
            raise UsageError(f"--rpc {part}: ggml's RPC client connects over IPv4 only",
                             hint="use an IPv4 address, e.g. --rpc 127.0.0.1:50052")
        if not m or not (0 < int(m.group("port")) < 65536):
            raise UsageError(f"--rpc: '{part}' is not HOST:PORT", hint="e.g. --rpc 127.0.0.1:50052")
        out.append(part)
    return out


def _reachable(endpoint: str, timeout: float = 2.0) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def connect(endpoints: list[str]) -> list[llama_lib.Device]:
    """Register each endpoint's devices with ggml (once per process) and return them."""
    spin_briefly_beside(endpoints)
    lib = llama_lib.load()
    if not lib.rpc_available:
        raise NativeError("--rpc: this llama.cpp build has no RPC backend", hint="rebuild with scripts/bootstrap.sh")
    faults.install(lib.libdir)
    faults.using_endpoints(endpoints)
    names: list[str] = []
    for ep in endpoints:
        if ep not in _registered:
            try:
                faults.probe_rpc(ep)  # NOTE: ggml's connect has no timeout and aborts on a stranger
            except DeviceError:
                raise
            except SparkError as e:  # nothing there, a stranger, another protocol: a device error (exit 7)
                raise DeviceError(e.message, hint=e.hint) from None
            before = {d.name for d in llama_lib.devices()}
            reg = lib.rpc_add_server(ep.encode())
            if not reg:
                raise DeviceError(f"--rpc {ep}: the server did not answer the RPC handshake",
                                 hint="check that it is a ggml RPC server of the same version")
            lib.register(reg)
            _registered[ep] = [d.name for d in llama_lib.devices() if d.name not in before]
        names += _registered[ep]
    return [d for d in llama_lib.devices() if d.name in names]


def listen_address(host: str, port: int) -> str:
    """`host` as ggml's RPC server can bind it (an IPv4 address); one error line otherwise."""
    import ipaddress

    if not 0 < port < 65536:
        raise UsageError(f"--port {port}: a TCP port is 1 to 65535", hint="e.g. --port 50052")
    if host == "localhost":
        return "127.0.0.1"
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise UsageError(f"--host {host}: not an IPv4 address", hint="e.g. --host 127.0.0.1 or --host 0.0.0.0") from None
    if addr.version != 4:
        raise UsageError(f"--host {host}: ggml's RPC server binds IPv4 addresses only",
                         hint="use --host 127.0.0.1 (this machine) or --host 0.0.0.0 (every interface)")
    return host


# ggml_backend_device_i.get_memory(dev, size_t * free, size_t * total)
_GET_MEMORY = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_GET_MEMORY_SLOT = 2  # its index among the function pointers at the start of struct ggml_backend_device
_reporters: list[object] = []  # the callbacks, alive as long as the server


def report_memory(handle: int, size: int) -> None:
    """Make the device at `handle` (this process's CPU device) report `size` bytes free and total:
    the memory an RPC server's device announces to its clients (llama.cpp's rpc-server once had
    `-m MEM`). Its get_memory entry (struct ggml_backend_device starts with its function table,
    ggml-backend-impl.h) is replaced in this process; nothing is allocated or limited."""

    def get_memory(dev, free, total) -> None:
        free[0] = total[0] = size

    cb = _GET_MEMORY(get_memory)
    _reporters.append(cb)
    slot = ctypes.c_void_p.from_address(handle + _GET_MEMORY_SLOT * ctypes.sizeof(ctypes.c_void_p))
    slot.value = ctypes.cast(cb, ctypes.c_void_p).value


STAND_IN_SPINCOUNT = 2000  # GOMP_SPINCOUNT of an RPC server process (serve) and of its clients on this machine


def spin_briefly_beside(endpoints: list[str]) -> None:
    """A client of a server on this machine (a stand-in) shares its cores: the client's idle OpenMP
    workers spin only briefly too, as serve's do. Only before the library loads (OpenMP reads it
    then); a user's GOMP_SPINCOUNT wins. A GPU never loses its cores to a spinning host thread,
    so a client of a remote server keeps OpenMP's default."""
    import ipaddress

    def local(ep: str) -> bool:
        host = ep.rsplit(":", 1)[0].strip("[]")
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    if llama_lib.load.cache_info().currsize == 0 and any(local(ep) for ep in endpoints):
        os.environ.setdefault("GOMP_SPINCOUNT", str(STAND_IN_SPINCOUNT))


def serve(host: str, port: int, threads: int | None = None, mem: int | None = None) -> None:
    """Serve this machine's CPU backend over RPC in the foreground (like llama.cpp's rpc-server);
    `mem`: the memory (bytes) its device reports to clients (report_memory), else the host's RAM."""
    host = listen_address(host, port)
    # NOTE: the stand-in shares the host's cores. OpenMP's idle workers spin 300,000 rounds by default
    # after each graph, so a stand-in waiting for the host took the cores the host's own work (the CPU
    # miss path, stock's CPU experts) needed, which a GPU never does: spin briefly, then sleep. Read
    # when the library loads (spark bench, demo model, one run: tg 4.2 -> 6.2 tok/s through the cache,
    # all resident 29.5 -> 32.9).
    os.environ.setdefault("GOMP_SPINCOUNT", str(STAND_IN_SPINCOUNT))
    lib = llama_lib.load()
    if not lib.rpc_available:
        raise NativeError("rpc-server: this llama.cpp build has no RPC backend", hint="rebuild with scripts/bootstrap.sh")
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    cpu = [d for d in llama_lib.devices() if d.type == "CPU"]
    if not cpu:
        raise DeviceError("rpc-server: no CPU backend device found")
    if mem:
        report_memory(cpu[0].handle, mem)
    devs = (ctypes.c_void_p * 1)(cpu[0].handle)
    lib.rpc_start_server(f"{host}:{port}".encode(), None, threads or os.cpu_count() or 1, 1, devs)
    raise DeviceError(f"rpc-server: could not serve on {host}:{port}", hint="is the port already in use?")


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the parent dies, so a killed client leaks no server (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def drain(pipe: IO[bytes], keep: int = 50) -> tuple[threading.Thread, deque[str]]:
    """Read `pipe` to its end in a daemon thread, keeping its last `keep` lines: a child whose
    stderr nobody reads blocks once the pipe's buffer (64 KiB) is full."""
    last: deque[str] = deque(maxlen=keep)

    def run() -> None:
        for raw in iter(pipe.readline, b""):
            last.append(raw.decode(errors="replace").rstrip())

    t = threading.Thread(target=run, name="rpc-server-stderr", daemon=True)
    t.start()
    return t, last


@dataclass
class RpcServer:
    """An RPC server in a subprocess on 127.0.0.1; stop() leaves no process behind."""

    host: str = "127.0.0.1"
    port: int = 0
    threads: int | None = None
    mem: int | None = None  # bytes its device reports free and total (None: the host's RAM)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _stderr: tuple[threading.Thread, deque[str]] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "RpcServer":
        self.port = self.port or free_port(self.host)
        if _reachable(self.endpoint, timeout=0.5):  # else the wait below would find that server, not ours
            raise SparkError(f"rpc server on {self.endpoint}: the port is in use", hint="choose another port")
        cmd = [sys.executable, "-m", "spark_cli.native.rpc_main", "--host", self.host, "--port", str(self.port)]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if self.mem:
            cmd += ["--mem", str(self.mem)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        self._stderr = drain(self.proc.stderr)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._stderr[0].join(timeout=5)
                err = [line for line in self._stderr[1] if line.strip()]
                raise SparkError(f"rpc server on {self.endpoint} exited at start: {err[-1] if err else self.proc.returncode}")
            if _reachable(self.endpoint, timeout=0.5):
                return self
            time.sleep(0.1)
        self.stop()
        raise SparkError(f"rpc server on {self.endpoint} did not start within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self._stderr is not None:
            self._stderr[0].join(timeout=5)  # the pipe ends with the process
            self._stderr = None
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def __enter__(self) -> "RpcServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
