"""llama.cpp's own server test suite against `spark serve` (issue 24): the stand-in for the
llama-server binary (scripts/llama-server-shim) maps llama-server's flags or refuses them, and
the suite runner (scripts/llama_server_suite.py) on a subset of the suite passes exactly the
tests tests/data/llama_server_suite_expected.json records, so a regression shows by name."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "scripts" / "llama-server-shim"
RUNNER = ROOT / "scripts" / "llama_server_suite.py"
EXPECTED = Path(__file__).parent / "data" / "llama_server_suite_expected.json"


def _load(path: Path, name: str):
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_shim_maps_llama_servers_flags():
    shim = _load(SHIM, "llama_server_shim")
    # the command line llama.cpp's utils.py gives its tinyllama2 preset
    argv = ["--port", "8080", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--offline",
            "--hf-repo", "ggml-org/test-model-stories260K", "--batch-size", "32", "--no-slots",
            "--alias", "tinyllama-2", "--ctx-size", "512", "--parallel", "2", "--n-predict", "64", "--no-jinja",
            "--metrics", "-kvu", "--api-key", "k", "-ub", "16", "-t", "1", "--reasoning-format=none"]
    out, has_model = shim.translate(argv)
    assert has_model
    assert out == ["--port", "8080", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--batch-size", "32",
                   "--no-slots", "--alias", "tinyllama-2", "--ctx-size", "512", "--parallel", "2", "--n-predict",
                   "64", "--no-jinja", "--metrics", "-kvu", "--api-key", "k", "--ubatch-size", "16", "--threads",
                   "1", "--reasoning-format", "none"]
    assert shim.translate(["-m", "x.gguf", "--cors-origins", "http://a"])[0] == ["--cors", "http://a"]
    assert shim.translate(["-m", "x.gguf", "-v"])[0] == shim.translate(["-m", "x.gguf", "--verbose"])[0] == [
        "--verbose"]
    assert not shim.translate(["--port", "1"])[1]  # no model: router mode
    # router mode's flags are spark serve's (it is the router when given no MODEL)
    assert shim.translate(["--models-dir", "d", "--models-max", "2", "--models-preset=p.ini", "--no-models-autoload",
                           "--models_autoload"]) == (["--models-dir", "d", "--models-max", "2", "--models-preset",
                                                      "p.ini", "--no-models-autoload", "--models-autoload"], False)
    # issue 49: reasoning controls, tags, and the flags Spark accepts with no effect (its --help says why)
    assert shim.translate(["-m", "x.gguf", "--reasoning", "off", "-rea", "on", "--reasoning-budget", "0", "--tags",
                           "a,b", "--media-path", "d", "--cache-ram", "100", "--no-cache-idle-slots",
                           "--ui-mcp-proxy", "--context-shift", "--embedding", "--pooling", "last"])[0] == [
        "--reasoning", "off", "--reasoning", "on", "--reasoning-budget", "0", "--tags", "a,b", "--media-path", "d",
        "--cache-ram", "100", "--no-cache-idle-slots", "--ui-mcp-proxy", "--context-shift", "--embedding", "--pooling",
        "last"]
    # sleeping on idle, several addresses, backend sampling (no effect: the same tokens); a long flag's
    # underscores are dashes, as llama-server's parser reads them
    assert shim.translate(["-m", "x.gguf", "--sleep-idle-seconds", "1", "--host", "127.0.0.1,::1",
                           "--backend_sampling", "-bs", "--n_predict=8"])[0] == [
        "--sleep-idle-seconds", "1", "--host", "127.0.0.1,::1", "--backend-sampling", "-bs", "--n-predict", "8"]


def test_shim_serves_each_preset_a_tiny_model_with_its_tokenizer():
    shim = _load(SHIM, "llama_server_shim")
    assert shim.preset_model(["--hf-repo", "ggml-org/test-model-stories260K", "--port", "1"]) == ("llama", "llama-spm")
    assert shim.preset_model(["-hf", "ggml-org/test-model-stories260K-infill"]) == ("llama", "starcoder")
    assert shim.preset_model(["--hf-repo=ggml-org/models", "--hf-file", "bert-bge-small/ggml-model-f16.gguf"]) == (
        "llama", "bert-bge")
    # the reranker: Spark's tiny BERT with a classifier head (spark serve refuses --reranking without one)
    assert shim.preset_model(["--hf-repo", "ggml-org/models", "--hf-file",
                              "jina-reranker-v1-tiny-en/ggml-model-f16.gguf"]) == ("bert-reranker", "bert-bge")
    assert shim.preset_model(["-m", "x.gguf"]) == shim.DEFAULT_PRESET == ("llama", None)
    from spark_cli.models.tiny_models import TINY_MODELS, TINY_RERANKER, TINY_VOCABS

    assert {v for _, v in shim.PRESETS.values()} <= set(TINY_VOCABS)
    assert {n for n, _ in shim.PRESETS.values()} <= {*TINY_MODELS, TINY_RERANKER}


@pytest.mark.parametrize("argv,why", [
    (["-hf", "x", "--lora", "a.gguf"], "--lora: not in spark serve"),
    (["-hf", "x", "--spec_type", "ngram"], "--spec-type: speculative decoding"),
    (["-hf", "x", "--model-draft", "d.gguf"], "speculative decoding"),
])
def test_shim_refuses_what_spark_cannot_do(argv, why):
    r = subprocess.run([sys.executable, str(SHIM), *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("llama-server-shim: ") and why in r.stderr, r.stderr


@pytest.mark.model
def test_suite_subset_passes_what_is_recorded(tmp_path):
    """The runner on the expectation file's suite files, each preset served by the tiny llama with
    its tokenizer (the shim's PRESETS): per file, the tests that pass are the recorded ones (a new
    pass means: record it; a lost one is a regression)."""
    expected = json.loads(EXPECTED.read_text())
    runner = _load(RUNNER, "llama_server_suite")
    missing = runner.missing_modules(sys.executable, runner.REQUIRED)
    if missing:
        pytest.skip(f"llama.cpp's server suite needs {', '.join(missing)} (its requirements.txt)")
    try:
        suite = runner.find_suite()
    except SystemExit as e:
        pytest.skip(str(e))
    out = tmp_path / "suite.json"
    r = subprocess.run([sys.executable, str(RUNNER), "--files", ",".join(expected["files"]), "--suite", str(suite),
                        "--per-test", "60", "--total", "600", "-o", str(out)],
                       capture_output=True, text=True, timeout=660, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert not got["cut_short"], r.stdout
    for name, want in expected["files"].items():
        tests = got["files"][name]["tests"]
        passed = sorted(t for t, res in tests.items() if res["outcome"] == "passed")
        # NOTE: a test the suite skips here (test_server_multiple_addresses without IPv6 loopback) is no regression
        wanted = sorted(t for t in want["passed"] if tests.get(t, {}).get("outcome") != "skipped")
        assert got["files"][name]["collected"] == want["collected"], name
        assert passed == wanted, (name, {t: tests.get(t) for t in set(wanted) ^ set(passed)})
