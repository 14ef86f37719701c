#!/usr/bin/env python3
"""Uploads per token and hit rates of the native expert cache by slot count.

Runs the demo model on a local RPC stand-in GPU (or --rpc), every MoE layer cached with
S slots (P pinned = the most-routed experts of a warm-up run), greedy decoding after a few
prompts, and checks that the logits equal the all-resident reference run bit for bit.

Usage: .venv/bin/python scripts/cache_sweep.py [--experts 16 --used 4] [--slots 5,6,8,12] [--pinned 0,2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spark_cli.models.demo_model import build_demo_model  # noqa: E402
from spark_cli.core.trace import DECODE as PHASE_DECODE  # noqa: E402
from spark_cli.native.engine import CacheLayer, Engine, EngineOptions  # noqa: E402
from spark_cli.core.gguf_info import load_geometry  # noqa: E402
from spark_cli.native.rpc import RpcServer  # noqa: E402

PROMPTS = [
    "Explain how a steam engine works, step by step.",
    "Write a Python function that merges two sorted lists.",
    "What are the main causes of the French Revolution?",
]


def run(eng: Engine, n_decode: int) -> list[np.ndarray]:
    out = []
    for p in PROMPTS:
        eng.reset()
        logits = eng.eval(eng.vocab.tokenize(eng.vocab.chat_prompt([{"role": "user", "content": p}])), logits="last")
        out.append(logits)
        for _ in range(n_decode):
            logits = eng.eval([int(np.argmax(logits))], logits="last")
            out.append(logits)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--used", type=int, default=4)
    ap.add_argument("--slots", default="5,6,8,10,12")
    ap.add_argument("--pinned", default="0,2")
    ap.add_argument("-n", "--n-decode", type=int, default=32)
    ap.add_argument("--rpc", default=None)
    a = ap.parse_args()

    model = build_demo_model(n_expert=a.experts, n_expert_used=a.used)
    g = load_geometry(model)
    server = None if a.rpc else RpcServer().start()
    endpoint = a.rpc or server.endpoint
    try:
        base = dict(n_ctx=1024, rpc=[endpoint])
        with Engine(EngineOptions(model, count_experts=True, **base)) as eng:
            ref = run(eng, a.n_decode)
            hot = eng.cache.routing_counts(PHASE_DECODE)
        n_tok = len(PROMPTS) * a.n_decode
        print(f"model {model.name}: E={g.n_expert} k={g.n_expert_used}, {len(g.moe_layers)} MoE layers, "
              f"{n_tok} decode tokens, endpoint {endpoint}")
        print(f"{'S':>3} {'P':>3} {'hit rate':>9} {'uploads/token':>14} {'MiB/token':>10} {'upload ms/token':>16} exact")
        for s in (int(x) for x in a.slots.split(",")):
            for p in (int(x) for x in a.pinned.split(",")):
                if s - p < g.n_expert_used or s >= g.n_expert:
                    continue
                layers = [CacheLayer(il, s, tuple(int(e) for e in np.argsort(-hot[il])[:p])) for il in g.moe_layers]
                with Engine(EngineOptions(model, cache_layers=layers, **base)) as eng:
                    got = run(eng, a.n_decode)
                    st = eng.cache.stats()
                exact = all(np.array_equal(x, y) for x, y in zip(ref, got))
                hits = sum(v.hits for v in st.values())
                misses = sum(v.misses for v in st.values())
                pinned_up = p * len(layers)
                uploads = sum(v.uploads for v in st.values()) - pinned_up
                mib = (sum(v.bytes_uploaded for v in st.values())) / 2**20
                ms = sum(v.upload_us for v in st.values()) / 1000
                print(f"{s:>3} {p:>3} {hits / max(1, hits + misses):>9.1%} {uploads / n_tok:>14.2f} "
                      f"{mib / n_tok:>10.2f} {ms / n_tok:>16.2f} {'yes' if exact else 'NO'}")
                if not exact:
                    return 1
    finally:
        if server:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
