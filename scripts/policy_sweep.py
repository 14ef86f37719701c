#!/usr/bin/env python3
"""Tune the cache policies on one part of a trace and report them on the rest.

    .venv/bin/python scripts/policy_sweep.py TRACE.npz [--train 0.5] [--slots 6,8,10,12]

The decode steps of TRACE are cut in two (the first `--train` share to tune on, the rest
to report on). Each tunable policy's parameters are swept on the training part, scored
by the mean over the slot counts of hit rate / Belady's hit rate (both miss paths); the
best setting is then replayed on the held-out part, where the table is printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spark_cli.core.simulator import FIXED_MISS_PATHS, PolicyParams, simulate  # noqa: E402
from spark_cli.core.trace import RoutingTrace  # noqa: E402

GRID = {
    "lru": [PolicyParams()],
    "lfu-aged": [PolicyParams(window=w) for w in (8, 16, 32, 64, 128, 256, 0)],
    "slru": [PolicyParams(protected_num=n, protected_den=4) for n in (1, 2, 3)],
    "tinylfu": [PolicyParams(window=w) for w in (8, 16, 32, 64, 128, 256, 0)],
}


def hit_rate(trace: RoutingTrace, policy: str, slots: int, path: str, params: PolicyParams) -> float:
    return simulate(trace, policy, slots, miss_path=path, params=params).hit_rate_decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--train", type=float, default=0.5)
    ap.add_argument("--slots", default="6,8,10,12")
    ap.add_argument("--json", help="write the held-out rows here")
    args = ap.parse_args()
    slots = [int(s) for s in args.slots.split(",")]
    full = RoutingTrace.load(args.trace).decode_steps()
    train, test = full.split(args.train)
    print(f"{args.trace}: {full.n_rows} decode steps, {len(full.moe_layers())} MoE layers x {full.n_expert} "
          f"experts, top-{full.k}; tuning on {train.n_rows}, reporting on {test.n_rows}")
    belady = {(p, s, part): hit_rate(t, "belady", s, p, PolicyParams())
              for p in FIXED_MISS_PATHS for s in slots for part, t in (("train", train), ("test", test))}
    chosen: dict[str, PolicyParams] = {}
    for policy, grid in GRID.items():
        scores = []
        for params in grid:
            ratios = [hit_rate(train, policy, s, p, params) / belady[(p, s, "train")]
                      for p, s in itertools.product(FIXED_MISS_PATHS, slots)]
            scores.append((sum(ratios) / len(ratios), params))
            if len(grid) > 1:
                print(f"  train {policy:9s} {params}: mean vs Belady {scores[-1][0]:.4f}")
        chosen[policy] = max(scores, key=lambda x: x[0])[1]
        print(f"chosen {policy}: {chosen[policy]}")
    rows = []
    for p in FIXED_MISS_PATHS:
        print(f"\nheld-out ({test.n_rows} decode steps), miss path {p}: hit rate (vs Belady)")
        print("policy     " + "".join(f"{s:>18d}" for s in slots))
        for policy in (*GRID, "belady"):
            cells = []
            for s in slots:
                h = belady[(p, s, "test")] if policy == "belady" else hit_rate(test, policy, s, p, chosen[policy])
                r = h / belady[(p, s, "test")]
                cells.append(f"{h:.4f} ({r:.3f})")
                rows.append({"miss_path": p, "policy": policy, "slots": s, "hit_rate": h, "vs_belady": r})
            print(f"{policy:10s} " + "".join(f"{c:>18s}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"chosen": {k: v.__dict__ for k, v in chosen.items()},
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
