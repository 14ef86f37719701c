"""`spark rpc-server` and `spark devices`."""

from __future__ import annotations

import typer
from rich.table import Table

from .common import console


def register(app: typer.Typer) -> None:
    @app.command("rpc-server")
    def rpc_server(
        host: str = typer.Option("127.0.0.1", "--host", "-H", help="address to bind"),
        port: int = typer.Option(50052, "--port", "-p", help="port to listen on"),
        threads: int = typer.Option(0, "--threads", "-t", help="CPU threads (0: all cores)"),
    ) -> None:
        """Serve this machine's backend over ggml RPC in the foreground (like llama.cpp's rpc-server)."""
        from ..rpc import listen_address, serve

        listen_address(host, port)  # refused before the banner
        if host not in ("127.0.0.1", "localhost", "::1"):
            console.print(f"[yellow]warning:[/] serving on {host}: the RPC protocol has no authentication")
        console.print(f"spark rpc-server on {host}:{port} (Ctrl-C to stop)")
        serve(host, port, threads or None)

    @app.command("devices")
    def devices_cmd(rpc: str = typer.Option(None, "--rpc", help="RPC servers HOST:PORT[,...]")) -> None:
        """List the ggml devices this build sees (CPU, CUDA, RPC)."""
        from .. import llama_lib
        from ..rpc import connect, parse_endpoints

        if rpc:
            connect(parse_endpoints(rpc))
        t = Table("name", "type", "description", "free GiB", "total GiB")
        for d in llama_lib.devices(memory=True):
            t.add_row(d.name, d.type, d.description, f"{d.free / 2**30:.2f}", f"{d.total / 2**30:.2f}")
        console.print(t)
