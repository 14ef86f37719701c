"""`pip install .` (not editable) gives a working `spark`: the wheel holds every subpackage and
the data files, and runs from a fresh virtualenv that cannot see this source tree."""

from __future__ import annotations

import importlib.util
import os
import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # builds a wheel and a virtualenv: not in the fast tier (-m 'not slow')


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(venv bin folder, a working directory outside the repository) with Spark's wheel installed."""
    tmp = tmp_path_factory.mktemp("pkg")
    # NOTE: build with this interpreter's setuptools and wheel where it has them (no download)
    local = all(importlib.util.find_spec(m) for m in ("setuptools", "wheel"))
    no_iso = ["--no-build-isolation"] if local else []
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *no_iso, "-w", tmp / "wheels", REPO], cwd=tmp)
    (wheel,) = (tmp / "wheels").glob("spark_cli-*.whl")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    target = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
    # the dependencies (and llama_cpp) come from this interpreter's site-packages, added as a plain
    # path: .pth files there (the editable install of this checkout) are not processed
    (target / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", env_dir / "bin" / "python", "install", "-q", "--no-deps",
          wheel], cwd=tmp)
    work = tmp / "elsewhere"
    work.mkdir()
    return env_dir / "bin", work


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["COLUMNS"] = "160"
    return env


def test_the_wheel_holds_the_package_tree(installed) -> None:
    bin_dir, work = installed
    r = _run([bin_dir / "python", "-c", "import spark_cli, spark_cli.commands.plan as p, spark_cli.serve.app as s, "
              "spark_cli.models.gguf_write as m; print(spark_cli.__file__); print(p.__file__); print(s.__file__); "
              "print(m.__file__)"], cwd=work, env=_env())
    assert len(r.stdout.split()) == 4, r.stdout
    for line in r.stdout.split():
        assert str(bin_dir.parent) in line and str(REPO) not in line, line  # the installed copy, not the checkout


@pytest.mark.parametrize("argv,words", [
    (["--help"], ["plan", "chat", "bench", "profile", "devices"]),
    (["-h"], ["plan", "chat"]),
    (["plan", "--help"], ["--ctx-size", "-ctk", "--flash-attn", "--ubatch-size", "--device", "-ot", "--json"]),
    (["chat", "-h"], ["--min-p", "--repeat-penalty", "--ctx-size", "--no-mmap", "--mlock"]),
    (["bench", "-h"], ["--threads", "--batch-size", "--output"]),
    (["profile", "run", "-h"], ["--corpus", "--ctx-size"]),
])
def test_installed_spark_runs(installed, argv, words) -> None:
    bin_dir, work = installed
    r = _run([bin_dir / "spark", *argv], cwd=work, env=_env())
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stdout, (argv, w)


def test_installed_version_and_data(installed, tmp_path) -> None:
    from spark_cli import __version__
    from spark_cli.models.tiny_models import build_tiny_model
    from spark_cli.native.version import native_key

    bin_dir, work = installed
    r = _run([bin_dir / "spark", "--version"], cwd=work, env=_env())
    assert r.stdout.startswith(f"spark {__version__}, llama-cpp-python ") and f"native {native_key()}" in r.stdout
    # models.toml and the plan code from the wheel: a dry-run plan of a tiny model
    r = _run([bin_dir / "spark", "plan", build_tiny_model("qwen3moe"), "--vram", "1GiB", "-c", "256", "--json"],
             cwd=work, env=_env())
    assert '"version": 2' in r.stdout and "warning" not in r.stderr
    assert "FutureWarning" not in r.stderr
