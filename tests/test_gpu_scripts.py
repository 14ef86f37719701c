"""The GPU-day scripts (scripts/gpu_bench.sh, gpu_check.sh, gpu_check.py) against this checkout,
without a GPU: a lent card's 15 minutes must not go to a script that calls an API the code no
longer has. A CPU rehearsal (SPARK_GPU_CUDA=0, the header's knobs) found two such faults: the demo
model was built beside the llama.cpp build although its fit router runs the built library, and
the library check called `devices(memory=True)`, which had gone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "scripts" / "gpu_bench.sh"


def _python_snippets() -> list[str]:
    """Every `"$PY" -c "..."` of gpu_bench.sh that imports Spark, with the script's $E and $K."""
    text = BENCH.read_text()
    found = re.findall(r'"\$PY" -c "(from spark_cli[^"]*)"', text)
    return [s.replace("$E", "16").replace("$K", "4") for s in found]


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.model
def test_the_bench_scripts_python_runs_against_this_checkout() -> None:
    snippets = _python_snippets()
    assert len(snippets) >= 3, snippets  # the library check and both demo model builds
    for code in snippets:
        r = _run(code)
        assert r.returncode == 0, (code, r.stderr[-2000:])
        out = r.stdout.strip()
        if "listed(" in code:
            assert out.startswith("devices: ") and "CPU (CPU, " in out, out
        else:
            assert Path(out).is_file() and out.endswith(".gguf"), out


def test_stage2_builds_the_demo_model_only_after_the_library_is_built() -> None:
    """The fit router runs dense SmolLM2 through the built library (models/demo_router.py)."""
    stage2 = BENCH.read_text().split("cmd_stage2() {", 1)[1].split("\n}\n", 1)[0]
    assert stage2.index("wait_build") < stage2.index("use_build") < stage2.index("build_demo_model")


def test_the_bench_lines_use_flags_and_configs_spark_bench_has() -> None:
    from typer.main import get_command

    from spark_cli import cli
    from spark_cli.runs.bench import CONFIG_NAMES

    text = BENCH.read_text()
    cli._register()  # every command on the app, as `spark` has them
    bench = get_command(cli.app).commands["bench"]
    flags = {o for p in bench.params for o in getattr(p, "opts", [])}
    lines = [l for l in text.replace("\\\n", " ").splitlines() if "spark_cli.cli bench" in l]  # continued lines joined
    assert len(lines) == 2
    knobs = re.findall(r'^(?:BENCH_ARGS|UB4_ARGS)=\$\{[A-Z0-9_]+:-(.*)\}$', text, re.M)
    used = set()
    for line in lines + knobs:
        used |= set(re.findall(r'(?:^|[\s"])(--?[a-z][a-z0-9-]*)', line.split("spark_cli.cli bench", 1)[-1]))
    assert {"--residency", "--configs", "-o", "-p", "-n", "-r", "-ub"} <= used, used
    assert used <= flags, used - flags
    configs = re.search(r"^CONFIGS=\$\{SPARK_GPU_CONFIGS:-([^}]*)\}$", text, re.M).group(1).split(",")
    assert set(configs) <= set(CONFIG_NAMES), configs


@pytest.mark.model
def test_gpu_check_passes_on_the_stand_in(small_model, rpc_server, tmp_path) -> None:
    """scripts/gpu_check.py as gpu_check.sh runs it, on the RPC stand-in: bit-identical there."""
    import json

    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), str(small_model), "--rpc",
                        rpc_server.endpoint, "--decode", "4", "--json", str(out)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "PASS" in r.stdout and "FAIL" not in r.stdout
    assert json.loads(out.read_text())
