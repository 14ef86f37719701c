"""`spark rpc-server` and `spark devices`."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from ..core.units import parse_size
from ..native import devices, llama_lib, rpc
from ..files.paths import spark_home
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
    run_check: bool = typer.Option(False, "--self-check", help="run the self-check on each GPU-type device now "
                                   "(again where one is kept); it otherwise runs before the first cached run"),
) -> None:
    """List the ggml devices this build sees (CPU, CUDA, Vulkan, RPC): the names -dev takes, and each
    GPU-type device's self-check (the cache path against all-resident: passed, failed or not run)."""

    from ..runs import self_check

    endpoints = parse_endpoints(rpc) if rpc else []
    devs = devices.listed(connect(endpoints) if endpoints else [])
    home = spark_home()
    checks = {d.name: _check(d, endpoints, home, run_check) for d in devs if d.is_gpu}
    if as_json:
        typer.echo(json.dumps([{"name": d.name, "type": d.type, "description": d.description, "free": d.free,
                                "total": d.total, "self_check": _check_json(d, checks)} for d in devs], indent=1))
        return
    t = Table("name", "type", "description", "free GiB", "total GiB", "self-check")
    for d in devs:
        t.add_row(d.name, d.type, d.description, f"{d.free / 2**30:.2f}", f"{d.total / 2**30:.2f}",
                  self_check.cell(checks[d.name]) if d.is_gpu else "-")
    console.print(Whole(t))
    if not any(d.is_gpu for d in devs) and llama_lib.idle_backends():
        console.print(f"[yellow]note:[/] {devices.no_gpu_reason()}: runs use the CPU", soft_wrap=True)


def _check(dev, endpoints: list[str], home, run: bool) -> "self_check.Result | None":
    """The device's kept self-check; with --self-check, one run now (and kept)."""
    from ..runs import self_check

    if run:
        return self_check.ensure(dev, endpoints, home, force=True)[0]
    return self_check.load(home, self_check.key_of(dev))


def _check_json(dev, checks: dict) -> dict | None:
    """--json's self_check: null for a device that is not GPU-type; else its status and the kept result."""
    if not dev.is_gpu:
        return None
    res = checks[dev.name]
    if res is None:
        return {"status": "not run"}
    return {"status": "passed" if res.passed else "failed", **res.to_dict()}


def register(app: typer.Typer) -> None:
    app.command("rpc-server", cls=SparkCommand)(rpc_server_cmd)
    app.command("devices", cls=SparkCommand)(devices_cmd)
