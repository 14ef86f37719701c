"""What this process exchanged with its RPC servers: the kernel's TCP counters (Linux TCP_INFO) of
the sockets connected to the endpoints, read through a duplicate of each descriptor.

Mechanism-independent: it counts stock llama.cpp and Spark alike, every command ggml's RPC client
sends (a command is 2-3 writes: its id, its size, its payload) and every reply it waits for (2
writes on the server: the size, then the payload). With TCP_NODELAY each write is one data segment
while it is under the loopback MTU, so the segment counts are exact message counts for small
messages; the byte counts are exact always. Elsewhere (not Linux, no RPC endpoint) it reads None.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

_TCP_INFO_LEN = 232
# offsets in Linux's struct tcp_info (include/uapi/linux/tcp.h)
_BYTES_RECEIVED = 128  # u64 tcpi_bytes_received
_DATA_SEGS_IN = 152  # u32 tcpi_data_segs_in
_DATA_SEGS_OUT = 156  # u32 tcpi_data_segs_out
_BYTES_SENT = 200  # u64 tcpi_bytes_sent (Linux 4.19)


@dataclass(frozen=True)
class Traffic:
    """Counters summed over the sockets to the endpoints (subtract two readings for a phase)."""

    segs_out: int = 0  # data segments sent (client -> server)
    segs_in: int = 0  # data segments received (server -> client: replies)
    bytes_out: int = 0
    bytes_in: int = 0

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.segs_out - other.segs_out, self.segs_in - other.segs_in,
                       self.bytes_out - other.bytes_out, self.bytes_in - other.bytes_in)

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.segs_out + other.segs_out, self.segs_in + other.segs_in,
                       self.bytes_out + other.bytes_out, self.bytes_in + other.bytes_in)


def _peers(endpoints: list[str]) -> set[tuple[str, int]]:
    out = set()
    for ep in endpoints:
        host, port = ep.rsplit(":", 1)
        try:
            for info in socket.getaddrinfo(host.strip("[]"), int(port), socket.AF_INET, socket.SOCK_STREAM):
                out.add((info[4][0], int(port)))
        except OSError:
            continue
    return out


def _info(fd: int, peers: set[tuple[str, int]]) -> Traffic | None:
    """The counters of descriptor fd when it is a TCP socket connected to one of `peers`."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return None
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM or s.getpeername() not in peers:
            return None
        raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    finally:
        s.close()
    if len(raw) < _BYTES_SENT + 8:
        return None
    return Traffic(segs_out=struct.unpack_from("I", raw, _DATA_SEGS_OUT)[0],
                   segs_in=struct.unpack_from("I", raw, _DATA_SEGS_IN)[0],
                   bytes_out=struct.unpack_from("Q", raw, _BYTES_SENT)[0],
                   bytes_in=struct.unpack_from("Q", raw, _BYTES_RECEIVED)[0])


def read(endpoints: list[str]) -> Traffic | None:
    """This process's traffic with the RPC servers at `endpoints` so far; None without an endpoint,
    without /proc (not Linux) or without a connected socket."""
    peers = _peers(endpoints)
    if not peers or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    found = [t for t in (_info(fd, peers) for fd in fds) if t is not None]
    return sum(found[1:], found[0]) if found else None
