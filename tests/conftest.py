"""Shared fixtures: the small demo model, tiny architectures, an RPC stand-in GPU."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

# Tests that run llama.cpp on the CPU alone pass repack=False (-nr): on CPUs with AMX, llama.cpp
# repacks weights into AMX buffers and llama_decode segfaults in ggml_backend_amx_mul_mat (the
# unpatched build too; upstream ggml-org/llama.cpp#20824). A segfault would end the whole run.
NO_REPACK_WHY = "AMX repacking segfaults upstream (ggml-org/llama.cpp#20824)"

# The self-check (runs/self_check.py) runs before the first cached run on each device: off for the
# suite (every cached test would pay for it, and SPARK_HOME is often a temp folder), on in its own tests
# (tests/test_self_check.py). Set here, so subprocesses of spark inherit it.
os.environ["SPARK_SELF_CHECK"] = "0"

# What Spark builds and downloads once (shared with the user's SPARK_HOME, so a run of the suite builds
# nothing twice); everything else it keeps there is state a run measures or leaves behind.
SHARED_HOME_FOLDERS = ("downloads", "models", "native", "venvs", "vulkan")


def _own_spark_home() -> tuple[Path, Path]:
    """Give the suite a SPARK_HOME of its own, so what its runs measure under a loaded machine (CPU,
    disk and device calibrations: `spark plan --predict-for` and the RAM tier read them) and what
    they leave (recovered files, pending profiles) never reach the user's; its SHARED_HOME_FOLDERS
    link to the user's. Set here, so subprocesses of spark inherit it. -> (the user's, the suite's)."""
    from spark_cli.files.paths import spark_home

    user = spark_home()
    own = Path(tempfile.mkdtemp(prefix="spark-test-home-"))
    for name in SHARED_HOME_FOLDERS:
        (user / name).mkdir(parents=True, exist_ok=True)
        (own / name).symlink_to(user / name, target_is_directory=True)
    os.environ["SPARK_HOME"] = str(own)
    atexit.register(shutil.rmtree, own, ignore_errors=True)
    return user, own


USER_SPARK_HOME, SUITE_SPARK_HOME = _own_spark_home()


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
    from spark_cli.models.demo_model import build_demo_model

    return build_demo_model(n_expert=8, n_expert_used=2)


@pytest.fixture(scope="session")
def small_random_model():
    """The same with the seeded random router (demo format 1's): exactness holds for both routers."""
    from spark_cli.models.demo_model import build_demo_model

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


def keep_device_costs(monkeypatch, home, model, device: str | None, rpc: list[str], stop_us: float):
    """Point SPARK_HOME at `home` and keep device costs there for `model` on the device -dev/--rpc
    select (this machine's thread count), as `spark bench` keeps what it measured: stop_us 0, a
    device whose stops are free (every layer worth caching); a large one, stock's placement."""
    from spark_cli.core.cost_model import DeviceCosts
    from spark_cli.core.gguf_info import load_geometry
    from spark_cli.native import devices
    from spark_cli.runs import device_costs
    from spark_cli.runs.miss_path import device_key

    monkeypatch.setenv("SPARK_HOME", str(home))
    dev = devices.select(devices.parse(device, rpc))[0]
    threads = os.cpu_count() or 1
    costs = DeviceCosts(device_key(dev), "kept by a test", threads, base_tg_us=20_000.0, base_pp_us=8_000.0,
                        stop_us=stop_us, host_tg_us=1_500.0, host_pp_us=300.0, cached_pp_us=150.0,
                        miss_cpu_us=300.0, miss_upload_us=900.0)
    device_costs.save(home, load_geometry(model).fingerprint, costs, [])
    return costs
