"""The RPC traffic reader: TCP_INFO of this process's sockets to the endpoints, nothing else."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from spark_cli.native import rpc_traffic

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO and /proc are Linux's")


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    return srv, srv.getsockname()[1]


def test_counts_the_messages_and_bytes_to_the_endpoint_only() -> None:
    srv, port = _echo_server()
    other, other_port = _echo_server()
    done = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            for _ in range(3):  # a reply (size, then payload: two writes) to each request
                conn.recv(64)
                conn.sendall(b"12345678")
                conn.sendall(b"x" * 100)
            done.wait(5)

    t = threading.Thread(target=serve)
    t.start()
    with srv, other, socket.create_connection(("127.0.0.1", port)) as c, \
            socket.create_connection(("127.0.0.1", other_port)):
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        before = rpc_traffic.read([f"127.0.0.1:{port}"])
        assert before is not None
        for _ in range(3):
            c.sendall(b"r" * 10)
            got = b""
            while len(got) < 108:
                got += c.recv(200)
        after = rpc_traffic.read([f"localhost:{port}"])
        done.set()
        t.join()
    d = after - before
    assert d.bytes_out == 30 and d.bytes_in == 3 * 108
    assert d.segs_out == 3 and 3 <= d.segs_in <= 6  # the size and the payload may share a segment
    assert rpc_traffic.read([f"127.0.0.1:{other_port}"]) is None  # closed by now


def test_no_endpoint_or_no_socket_reads_none() -> None:
    assert rpc_traffic.read([]) is None
    srv, port = _echo_server()
    with srv:
        assert rpc_traffic.read([f"127.0.0.1:{port}"]) is None  # listening, not connected from here
