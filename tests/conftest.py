"""Shared fixtures: the small demo model, tiny architectures, an RPC stand-in GPU."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

# Tests that run llama.cpp on the CPU alone pass repack=False (-nr): on CPUs with AMX, llama.cpp
# repacks weights into AMX buffers and llama_decode segfaults in ggml_backend_amx_mul_mat (the
# unpatched build too; upstream ggml-org/llama.cpp#20824). A segfault would end the whole run.
NO_REPACK_WHY = "AMX repacking segfaults upstream (ggml-org/llama.cpp#20824)"


def _cuda_present() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return r.returncode == 0 and "GPU" in r.stdout


def pytest_collection_modifyitems(config, items):
    if _cuda_present():
        return
    skip = pytest.mark.skip(reason="no CUDA device present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def small_model():
    """Upcycled SmolLM2 with 8 experts, top-2, content-fit router (the tests' demo model)."""
    from spark_cli.runs.demo_model import build_demo_model

    return build_demo_model(n_expert=8, n_expert_used=2)


@pytest.fixture(scope="session")
def small_random_model():
    """The same with the seeded random router (demo format 1's): exactness holds for both routers."""
    from spark_cli.runs.demo_model import build_demo_model

    return build_demo_model(n_expert=8, n_expert_used=2, router="random")


@pytest.fixture(scope="session")
def rpc_server():
    """One RPC server subprocess on a free 127.0.0.1 port for the whole session."""
    from spark_cli.native.rpc import RpcServer

    srv = RpcServer(threads=os.cpu_count() or 1).start()
    yield srv
    proc = srv.proc
    srv.stop()
    assert proc is not None and proc.poll() is not None, "the RPC server process was left running"


def cli_runner(monkeypatch, capsys, command: str, register):
    """cli.main with only one command group registered on a fresh app (the real error
    boundary), rich pinned to a wide console and no local GPU (--rpc still selects the
    stand-in); run(*args) -> (rc, stdout, stderr)."""
    import typer

    from spark_cli import cli
    from spark_cli.native import devices
    from spark_cli.commands import common

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, context_settings=cli.CONTEXT)

    @app.callback()
    def _root() -> None:
        pass

    monkeypatch.setattr(cli, "app", app)
    monkeypatch.setattr(cli, "_register", lambda: register(app))
    monkeypatch.setattr(common.console, "_width", 200)
    monkeypatch.setattr(common.err_console, "_width", 200)
    monkeypatch.setattr(devices, "local_gpus", lambda: [])  # no local GPU unless a test says so
    monkeypatch.delenv("SPARK_DEBUG", raising=False)

    def run(*args) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli.main([command, *map(str, args)])
        out, err = capsys.readouterr()
        return rc, out, err

    return run
