#!/usr/bin/env python3
"""Run llama.cpp's own server test suite (tools/server/tests, vendored with llama-cpp-python)
against `spark serve`, through scripts/llama-server-shim, and record per test file how many
tests were collected, passed, failed and skipped.

The suite is copied to a temporary folder and run there with pytest (-m "not slow", one worker,
as tests.sh without xdist), LLAMA_SERVER_BIN_PATH pointing at the shim, and no network: in a
network namespace of its own when `unshare -rn` works (loopback only), else with the proxies
pointed at a dead address. Nothing downloads: the shim serves a local Spark test model (per
preset, the tiny llama with the tokenizer nearest the preset's: the shim's PRESETS, built here
before the run from local files; or --model for every preset), the
presets' download pass (ServerPreset.load_all) is skipped, test_speculative's draft model is
Spark's tiny llama placed where the suite keeps downloads (tmp/), router mode's models (CACHED:
ggml-org/tinygemma3-GGUF:Q8_0 ...) are the shim's tiny models linked into tmp/ in llama.cpp's cache
layout (its LLAMA_CACHE, where spark serve's router finds them), and where the `wget` and `filelock`
packages the suite imports are missing, stand-ins are used (wget.download raises: no network;
FileLock: a no-op lock, one worker). Each test has --per-test seconds (SIGALRM, a failure), and
the whole run --total seconds.

    python scripts/llama_server_suite.py                     # the issue-24 files
    python scripts/llama_server_suite.py --files test_tokenize.py,test_basic.py -o out.json

Writes a JSON ({"files": {name: {collected, passed, failed, skipped, tests: {test: outcome}}},
"total", "wall_s", ...}) and prints a table.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "scripts" / "llama-server-shim"

# the suite files of issue 24 (the agents and parallel issues count the others)
DEFAULT_FILES = ("test_basic.py", "test_chat_completion.py", "test_completion.py", "test_compat_gcp.py",
                 "test_compat_oai_responses.py", "test_ctx_shift.py", "test_ignore_eos.py", "test_metrics.py",
                 "test_security.py", "test_stream.py", "test_tokenize.py")
# what the suite's requirements.txt lists, as import names; aiohttp is listed but no test imports it
REQUIRED = ("pytest", "requests", "openai", "numpy", "prometheus_client")
STUBBED = ("wget", "filelock")

PLUGIN = r'''
"""Loaded by scripts/llama_server_suite.py: no preset download pass, a per-test alarm, and the
outcome of every test written to SPARK_SUITE_RESULTS."""
import json, os, signal
import pytest
import utils

utils.ServerPreset.load_all = staticmethod(lambda: None)  # only downloads the presets' models

PER_TEST = float(os.environ.get("SPARK_SUITE_PER_TEST", "120"))
_items, _out = [], {}


class TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise TestTimeout(f"over the runner's per-test limit ({PER_TEST:.0f} s)")


def pytest_collection_finish(session):
    _items.extend(item.nodeid for item in session.items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, PER_TEST)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def pytest_runtest_logreport(report):
    prev = _out.get(report.nodeid)
    if report.failed:
        why = report.longreprtext.strip().splitlines()
        last = [l for l in why if l.startswith("E ")] or why[-1:]
        _out[report.nodeid] = {"outcome": "failed", "phase": report.when,
                               "why": (last[-1] if last else "")[:300]}
    elif report.skipped and prev is None:
        _out[report.nodeid] = {"outcome": "skipped", "why": str(report.longrepr[-1])[:300]
                               if isinstance(report.longrepr, tuple) else ""}
    elif report.passed and report.when == "call" and prev is None:
        _out[report.nodeid] = {"outcome": "passed"}


def pytest_sessionfinish(session):
    with open(os.environ["SPARK_SUITE_RESULTS"], "w") as f:
        json.dump({"collected": _items, "results": _out}, f)
'''

WGET = '''"""Stand-in for the wget package (scripts/llama_server_suite.py): this run has no network."""
def download(url, out=None, bar=None):
    raise RuntimeError(f"no network in this run: {url} is not downloaded")
'''
FILELOCK = '''"""Stand-in for the filelock package (scripts/llama_server_suite.py): one pytest worker."""
class FileLock:
    def __init__(self, *args, **kwargs):
        pass
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        return False
'''


# the draft models test_speculative downloads into tmp/, stood in for by Spark's tiny llama (so those
# tests reach spark serve and say what it lacks: speculative decoding)
DRAFTS = ("stories15M-q4_0.gguf",)
# the models router mode's tests (test_router, test_stream, the router presets of test_security) find in
# llama.cpp's download cache (LLAMA_CACHE=tmp, utils.py's default), as OWNER/NAME:TAG: stood in for by
# the tiny model the shim serves for that repo's preset (its PRESETS, else DEFAULT_PRESET), placed in
# llama.cpp's cache layout (models--OWNER--NAME/refs/main, snapshots/COMMIT/NAME-TAG.gguf, a link)
CACHED = ("ggml-org/tinygemma3-GGUF:Q8_0", "ggml-org/test-model-stories260K:F32",
          "ggml-org/test-model-stories260K-infill:F32")


def load_shim():
    loader = importlib.machinery.SourceFileLoader("llama_server_shim", str(SHIM))
    shim = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(shim)
    return shim


def build_preset_models(python: str) -> str:
    """Build (or find cached) the tiny models the shim serves per preset (its PRESETS and DEFAULT_PRESET:
    the tiny llama and its vocab variants, the tiny reranker; tiny_models.py, from local files only);
    "" when done, else why not."""
    shim = load_shim()
    models = sorted({f"{n}:{v or ''}" for n, v in (shim.DEFAULT_PRESET, *shim.PRESETS.values())})
    code = ("import sys; from spark_cli.models.tiny_models import build_tiny_model\n"
            "for m in sys.argv[1:]: build_tiny_model(m.split(':')[0], vocab=m.split(':')[1] or None)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    r = subprocess.run([python, "-c", code, *models], capture_output=True, text=True, env=env)
    return "" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]


def local_models(python: str, presets: list[tuple[str, str | None]]) -> list[Path | None]:
    """Spark's cached tiny test model of each (name, vocab), when it is there."""
    code = ("import sys; from spark_cli.files.paths import models_dir; "
            "from spark_cli.models.tiny_models import tiny_model_name\n"
            "for m in sys.argv[1:]: print(models_dir() / tiny_model_name(m.split(':')[0], vocab=m.split(':')[1] or None))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    r = subprocess.run([python, "-c", code, *(f"{n}:{v or ''}" for n, v in presets)], capture_output=True, text=True,
                       env=env)
    paths = [Path(line) for line in r.stdout.splitlines()] if r.returncode == 0 else []
    return [p if p.is_file() else None for p in paths] if len(paths) == len(presets) else [None] * len(presets)


def local_draft(python: str) -> Path | None:
    """Spark's cached tiny llama test model, when it is there."""
    return local_models(python, [("llama", None)])[0]


def place_cached(python: str, cache: Path) -> list[str]:
    """Link each CACHED id's stand-in into `cache` in llama.cpp's layout (no copy); the ids placed."""
    shim = load_shim()
    wanted = [(name, *name.partition(":")[::2]) for name in CACHED]
    presets = [shim.PRESETS.get((repo, None), shim.DEFAULT_PRESET) for _, repo, _ in wanted]
    placed = []
    for (name, repo, tag), path in zip(wanted, local_models(python, presets)):
        if path is None:
            continue
        folder = cache / ("models--" + repo.replace("/", "--"))
        commit = hashlib.sha1(repo.encode()).hexdigest()  # NOTE: any 40 hex digits name a snapshot
        snap = folder / "snapshots" / commit
        snap.mkdir(parents=True, exist_ok=True)
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(commit)
        link = snap / f"{repo.rsplit('/', 1)[1]}-{tag}.gguf"
        if not link.exists():
            link.symlink_to(path)
        placed.append(name)
    return placed


def find_suite() -> Path:
    """The vendored llama.cpp's server tests in Spark's native build tree."""
    home = Path(os.environ.get("SPARK_HOME", Path.home() / ".cache" / "spark"))
    found = sorted(glob.glob(str(home / "native" / "src" / "*" / "vendor" / "llama.cpp" / "tools" / "server"
                                 / "tests")))
    if not found:
        sys.exit("llama_server_suite: no vendored llama.cpp server tests under "
                 f"{home}/native/src (build the native code first, or pass --suite)")
    return Path(found[0])


def missing_modules(python: str, names) -> list[str]:
    code = ("import importlib.util, sys; print(','.join(n for n in sys.argv[1:] "
            "if importlib.util.find_spec(n) is None))")
    out = subprocess.run([python, "-c", code, *names], capture_output=True, text=True, check=True).stdout
    return [n for n in out.strip().split(",") if n]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated() -> bool:
    """Whether `unshare -rn` gives a network namespace with a working loopback."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    r = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"], capture_output=True)
    return r.returncode == 0


def tally(raw: dict, files) -> dict:
    per: dict[str, dict] = {f: {"collected": 0, "passed": 0, "failed": 0, "skipped": 0, "tests": {}}
                            for f in files}
    for nodeid in raw["collected"]:
        path, _, name = nodeid.partition("::")
        f = per.setdefault(Path(path).name, {"collected": 0, "passed": 0, "failed": 0, "skipped": 0,
                                             "tests": {}})
        f["collected"] += 1
        res = raw["results"].get(nodeid, {"outcome": "failed", "why": "no result (the run was cut short)"})
        f[res["outcome"]] += 1
        f["tests"][name] = res
    return per


def run(files, *, suite: Path, per_test: float, total: float, python: str, model: str | None,
        drop: str | None, select: str | None = None) -> dict:
    missing = missing_modules(python, REQUIRED)
    if missing:
        return {"error": f"the suite needs {', '.join(missing)} (not installed for {python})",
                "missing": missing}
    t0 = time.monotonic()
    if not model:
        why = build_preset_models(python)
        if why:
            return {"error": f"the tiny models the shim serves per preset: {why}"}
    with tempfile.TemporaryDirectory(prefix="llama-server-suite-") as tmp:
        # NOTE: llama.cpp's layout, so the tests' ../../../models/templates/*.jinja resolve (read only: linked)
        work = Path(tmp) / "llama.cpp" / "tools" / "server" / "tests"
        shutil.copytree(suite, work, ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
        models = suite.resolve().parents[2] / "models"
        if models.is_dir():
            (Path(tmp) / "llama.cpp" / "models").symlink_to(models, target_is_directory=True)
        (work / "tmp").mkdir(exist_ok=True)
        draft = local_draft(python)
        for name in DRAFTS:  # NOTE: utils.download_file keeps a file already there: no download is tried
            if draft is not None and not (work / "tmp" / name).exists():
                (work / "tmp" / name).symlink_to(draft)
        cached = place_cached(python, work / "tmp")
        stubs = missing_modules(python, STUBBED)
        stub_dir = Path(tmp) / "stubs"
        stub_dir.mkdir()
        for name in stubs:
            (stub_dir / f"{name}.py").write_text(WGET if name == "wget" else FILELOCK)
        (work / "_spark_suite_plugin.py").write_text(PLUGIN)
        results = Path(tmp) / "results.json"
        # NOTE: no LLAMA_CACHE: utils.py's default (tmp/) is where the CACHED stand-ins are
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "PYTEST_"))
               and k not in ("LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME")}
        env.update(LLAMA_SERVER_BIN_PATH=str(SHIM), SPARK_SHIM_PYTHON=python, PORT=str(free_port()),
                   PYTHONPATH=os.pathsep.join([str(work), str(stub_dir)]), SPARK_SUITE_RESULTS=str(results),
                   SPARK_SUITE_PER_TEST=str(per_test), PYTHONDONTWRITEBYTECODE="1")
        env.pop("SLOW_TESTS", None)
        if model:
            env["SPARK_SHIM_MODEL"] = model
        if drop:
            env["SPARK_SHIM_DROP"] = drop
        cmd = [python, "-m", "pytest", "-p", "_spark_suite_plugin", "-m", "not slow", "-q", "-rN",
               "-p", "no:cacheprovider", *(["-k", select] if select else []), *(f"unit/{f}" for f in files)]
        net = isolated()
        if net:
            cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]
        else:
            dead = "http://127.0.0.1:9"
            env.update(http_proxy=dead, https_proxy=dead, HTTP_PROXY=dead, HTTPS_PROXY=dead,
                       no_proxy="127.0.0.1,localhost,::1", NO_PROXY="127.0.0.1,localhost,::1")
        log = Path(tmp) / "pytest.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=total)
                cut = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                cut = True
        tail = log.read_text(errors="replace").splitlines()[-15:]
        if not results.is_file():
            return {"error": f"pytest wrote no results (exit {proc.returncode})", "log_tail": tail}
        raw = json.loads(results.read_text())
    per = tally(raw, files)
    tot = {k: sum(f[k] for f in per.values()) for k in ("collected", "passed", "failed", "skipped")}
    return {"suite": str(suite), "files": per, "total": tot, "wall_s": round(time.monotonic() - t0, 1),
            "per_test_timeout_s": per_test, "total_timeout_s": total, "cut_short": cut,
            "network": "none (unshare -rn, loopback only)" if net else "proxies to a dead address",
            "stubs": stubs, "model": model or "tiny llama per preset (the shim's PRESETS)", "cached": cached,
            "pytest_exit": proc.returncode,
            "log_tail": tail}


def table(res: dict) -> str:
    rows = [f"{'file':32} {'collected':>9} {'passed':>7} {'failed':>7} {'skipped':>8}"]
    for name, f in res["files"].items():
        rows.append(f"{name:32} {f['collected']:9} {f['passed']:7} {f['failed']:7} {f['skipped']:8}")
    t = res["total"]
    rows.append(f"{'total':32} {t['collected']:9} {t['passed']:7} {t['failed']:7} {t['skipped']:8}")
    rows.append(f"wall {res['wall_s']} s (per test at most {res['per_test_timeout_s']:.0f} s, the run at most "
                f"{res['total_timeout_s']:.0f} s{'; CUT SHORT' if res['cut_short'] else ''}); network: "
                f"{res['network']}; stand-ins: {', '.join(res['stubs']) or 'none'}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", type=Path, help="llama.cpp's tools/server/tests (default: the vendored one)")
    ap.add_argument("--files", help="comma-separated test files (default: issue 24's eleven)")
    ap.add_argument("--per-test", type=float, default=120.0, help="seconds per test at most (120)")
    ap.add_argument("--total", type=float, default=3600.0, help="seconds for the whole run at most (3600)")
    ap.add_argument("--python", default=sys.executable, help="the Python with Spark's and the suite's packages")
    ap.add_argument("--model", help="the GGUF the shim serves for every preset (default: per preset, the tiny llama "
                    "with the tokenizer nearest the preset's; 'demo': the demo model)")
    ap.add_argument("--drop", help="spark serve flags the shim leaves out (a Spark without them)")
    ap.add_argument("-k", dest="select", help="only the tests pytest -k EXPR selects")
    ap.add_argument("-o", "--out", type=Path, help="write the JSON here")
    a = ap.parse_args(argv)
    files = tuple(f.strip() for f in a.files.split(",")) if a.files else DEFAULT_FILES
    res = run(files, suite=a.suite or find_suite(), per_test=a.per_test, total=a.total, python=a.python,
              model=a.model, drop=a.drop, select=a.select)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    if "error" in res:
        print(f"llama_server_suite: {res['error']}", file=sys.stderr)
        for line in res.get("log_tail", []):
            print("  " + line, file=sys.stderr)
        return 2
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
