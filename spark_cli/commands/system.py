"""`spark rpc-server` and `spark devices`."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from ..core.units import parse_size
from ..native import llama_lib, rpc
from ..native.rpc import connect, parse_endpoints
from .common import JSON_HELP, RPC_HELP, console
from .help import SparkCommand
from .tables import Whole


def rpc_server_cmd(
    host: str = typer.Option("127.0.0.1", "--host", "-H", help="address to bind"),
    port: int = typer.Option(50052, "--port", "-p", help="port to listen on"),
    threads: int = typer.Option(0, "--threads", "-t", help="CPU threads (0: all cores)"),
    mem: str = typer.Option(None, "--mem", "-m", help="memory the device reports to clients, e.g. 16GiB "
                            "(default: this machine's RAM); a stand-in for a card of that size, nothing is "
                            "limited"),
) -> None:
    """Serve this machine's backend over ggml RPC in the foreground (like llama.cpp's rpc-server)."""
    size = parse_size(mem, "--mem") if mem else None
    rpc.listen_address(host, port)  # refused before the banner
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning:[/] serving on {host}: the RPC protocol has no authentication")
    console.print(f"spark rpc-server on {host}:{port} (Ctrl-C to stop)")
    rpc.serve(host, port, threads or None, size)


def devices_cmd(
    rpc: str = typer.Option(None, "--rpc", help=RPC_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """List the ggml devices this build sees (CPU, CUDA, Vulkan, RPC): the names -dev takes."""

    if rpc:
        connect(parse_endpoints(rpc))
    devs = llama_lib.devices(memory=True)
    if as_json:
        typer.echo(json.dumps([{"name": d.name, "type": d.type, "description": d.description, "free": d.free,
                                "total": d.total} for d in devs], indent=1))
        return
    t = Table("name", "type", "description", "free GiB", "total GiB")
    for d in devs:
        t.add_row(d.name, d.type, d.description, f"{d.free / 2**30:.2f}", f"{d.total / 2**30:.2f}")
    console.print(Whole(t))


def register(app: typer.Typer) -> None:
    app.command("rpc-server", cls=SparkCommand)(rpc_server_cmd)
    app.command("devices", cls=SparkCommand)(devices_cmd)
