#!/usr/bin/env python3
"""Exactness of the expert cache on a real device: cached against all-resident logits.

For each miss path (upload, cpu): prompts of 1, 4, 12, 20 and 40 tokens, each followed by
`--decode` tokens, with S = P + k slots per MoE layer (every miss evicts). Every configuration
is fed the all-resident run's greedy tokens, so logits are compared position by position even
where an argmax would flip. The bound is what stock --cpu-moe (every expert on the CPU) shows
on the same prompts: on CUDA each expert's output equals the device or the CPU kernel's, so a
cached run may differ from all-resident by about that much (exactness.within_bound); on the
RPC stand-in both sides run ggml-cpu and every run must be bit-identical. Also reports the
scheduler's graph splits of a decode step against the all-resident graph's plus 2 per cached
layer (each cached layer's host nodes are one CPU split, and the device split after it).

Usage: gpu_check.py MODEL [--rpc HOST:PORT] [--decode 64] [--json F]   (exit 1 if a check fails)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spark_cli.native.engine import CacheLayer, Engine, EngineOptions  # noqa: E402
from spark_cli.native.expert_cache import CacheStats  # noqa: E402
from spark_cli.runs.exactness import MIXED_SLACK, logits, reference, within_bound  # noqa: E402
from spark_cli.core.gguf_info import load_geometry  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rpc", default=None)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    g = load_geometry(a.model)
    k, pinned = g.n_expert_used, 1
    base = dict(n_ctx=512, n_batch=512, n_ubatch=512, rpc=[a.rpc] if a.rpc else [])
    report: dict = {"model": a.model.name, "graphs": "off" if os.environ.get("GGML_CUDA_DISABLE_GRAPHS") else "on",
                    "decode": a.decode, "configs": {}}

    ref = reference(EngineOptions(a.model, **base), a.decode)
    report["device"], report["graph_splits_resident"] = ref.device, ref.splits

    def compare(name: str, opts: dict, miss_path: str | None = None) -> dict:
        with Engine(EngineOptions(a.model, **base, **opts)) as eng:
            if miss_path:
                eng.cache.set_miss_path(miss_path)
            rows = []
            for p, ref_logits, fed in zip(ref.prompts, ref.logits, ref.fed):
                got, _ = logits(eng, p, fed, len(fed))
                d = np.abs(got.astype(np.float64) - ref_logits)
                rows.append({"prompt_tokens": len(p), "bit_exact": bool(np.array_equal(got, ref_logits)),
                             "max_abs_diff": float(d.max()),
                             "argmax_agree": float(np.mean(got.argmax(1) == ref_logits.argmax(1)))})
            out = {"rows": rows, "bit_exact": all(r["bit_exact"] for r in rows),
                   "max_abs_diff": max(r["max_abs_diff"] for r in rows), "graph_splits": eng.graph_splits()}
            if miss_path:
                st = eng.cache.stats()
                out["stats"] = dataclasses.asdict(CacheStats.total(st.values()))
        report["configs"][name] = out
        print(f"{name:<14} exact={out['bit_exact']!s:<5} max|d|={out['max_abs_diff']:.3g} "
              f"splits(bs=1)={out['graph_splits']}", flush=True)
        return out

    stock = compare("stock-cpu-moe", {"host_layers": list(g.moe_layers)})
    bound = stock["max_abs_diff"]
    ok = True
    for path in ("upload", "cpu"):
        layers = [CacheLayer(il, pinned + k, tuple(range(pinned)), miss_path=path) for il in g.moe_layers]
        res = compare(f"cached-{path}", {"cache_layers": layers}, path)
        want_splits = None if ref.splits is None else ref.splits + 2 * len(layers)
        res["graph_splits_expected"] = want_splits
        exact_needed = a.rpc is not None  # the stand-in runs ggml-cpu on both sides
        res["pass"] = res["bit_exact"] or (not exact_needed and within_bound(res["max_abs_diff"], bound))
        res["splits_pass"] = None not in (res["graph_splits"], want_splits) and res["graph_splits"] <= want_splits
        ok = ok and res["pass"] and res["splits_pass"]
        print(f"  {path}: {'PASS' if res['pass'] else 'FAIL'} (bound {MIXED_SLACK} x {bound:.3g}), splits "
              f"{res['graph_splits']} vs expected <= {want_splits}", flush=True)
    report["pass"] = ok
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
