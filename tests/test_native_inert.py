"""Patched but disabled == unpatched: the native patch is inert until a cache is attached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spark_cli.files.paths import spark_home

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["What is the capital of France?", "List three colours of the rainbow."]

SCRIPT = r"""
import json, sys
import numpy as np
from spark_cli.native.engine import Engine, EngineOptions
model, rpc, out = sys.argv[1], sys.argv[2], sys.argv[3]
opts = EngineOptions(model, n_ctx=256, rpc=[rpc] if rpc else [], device="auto" if rpc else "cpu", repack=False)
res = {}
with Engine(opts) as eng:
    import spark_cli.native.llama_lib as L
    res["has_cache_api"] = bool(L.load().has_expert_cache)
    arrays = {}
    for i, p in enumerate(json.loads(sys.argv[4])):
        eng.reset()
        toks = eng.vocab.tokenize(p)
        arrays[f"prefill{i}"] = eng.eval(toks, logits="all")
        gen = []
        logits = arrays[f"prefill{i}"][-1]
        for j in range(12):
            t = int(np.argmax(logits)); gen.append(t)
            logits = eng.eval([t], logits="last")
            arrays[f"step{i}_{j}"] = logits
        res[f"tokens{i}"] = gen
np.savez(out, **arrays)
print(json.dumps(res))
"""


def stock_python() -> Path:
    return Path(os.environ.get("SPARK_STOCK_PYTHON", spark_home() / "venvs" / "stock" / "bin" / "python"))


def _run(python: Path, model: Path, rpc: str, out: Path) -> tuple[dict, dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([str(python), "-c", SCRIPT, str(model), rpc, str(out), json.dumps(PROMPTS)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    with np.load(out) as z:
        arrays = {k: z[k] for k in z.files}
    return info, arrays


@pytest.mark.parametrize("where", ["cpu", "rpc"])
def test_disabled_patch_equals_unpatched_build(where, small_model, rpc_server, tmp_path):
    stock = stock_python()
    assert stock.exists(), f"{stock} missing: scripts/test builds the unpatched reference (build_native.py --stock)"
    rpc = rpc_server.endpoint if where == "rpc" else ""
    info_s, arr_s = _run(stock, small_model, rpc, tmp_path / "stock.npz")
    info_p, arr_p = _run(Path(sys.executable), small_model, rpc, tmp_path / "patched.npz")
    assert not info_s["has_cache_api"] and info_p["has_cache_api"]
    assert arr_s.keys() == arr_p.keys()
    for k in arr_s:
        assert np.array_equal(arr_s[k], arr_p[k]), f"{where}: {k} differs"
    assert [info_s[f"tokens{i}"] for i in range(len(PROMPTS))] == [info_p[f"tokens{i}"] for i in range(len(PROMPTS))]
