#!/usr/bin/env python3
"""Which policy should `--policy auto` fall back to with no trace yet (simulator.DEFAULT_POLICY)?

    .venv/bin/python scripts/default_policy.py MODEL TRACE [--profile P] [--residency 0.4,0.6,0.8]

With no trace the planner places from the counts alone (pins and k policy slots per layer); this
makes that plan at each residency (bench.residency_budget: everything else + that share of the
expert bytes), without counts and with the profile's decode counts, then replays TRACE's decode
steps through each native policy on the cpu path (what auto and cpu replay: planner.replay_path)
and the upload path. Prints the share of routed experts found on the device, and the best.
Build the demo trace with `spark profile run --gen 64 --trace TRACE --profile P` (bundled corpus).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spark_cli.core import planner  # noqa: E402
from spark_cli.core.gguf_info import load_geometry  # noqa: E402
from spark_cli.core.profile import RoutingProfile  # noqa: E402
from spark_cli.core.simulator import ONLINE_POLICIES  # noqa: E402
from spark_cli.core.trace import RoutingTrace  # noqa: E402
from spark_cli.runs.bench import residency_budget  # noqa: E402

N_CTX = 4096  # the demo's context (its trained context, at most 4096)


def hits(plan: planner.Plan, trace: RoutingTrace, path: str) -> dict[str, float]:
    return {p: 1.0 - planner.replayed_miss(replace(plan, policy=p), trace, path) for p in ONLINE_POLICIES}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("trace")
    ap.add_argument("--profile", help="profile whose decode counts place the pins (also: none)")
    ap.add_argument("--residency", default="0.4,0.5,0.6,0.7,0.8")
    a = ap.parse_args()
    g = load_geometry(a.model, require_moe=True)
    trace = RoutingTrace.load(a.trace)
    counts = {"no counts": None}
    if a.profile:
        counts["profile"] = RoutingProfile.load(a.profile).decode
    print(f"{trace.n_decode} decode steps; % of routed decode experts on the device (best in [])")
    for share in (float(s) for s in a.residency.split(",")):
        for label, c in counts.items():
            plan = planner.plan_for(g, planner.PlanRequest(residency_budget(g, N_CTX, share), N_CTX,
                                                           profile_counts=c)).plan
            for path in ("cpu", "upload"):
                h = hits(plan, trace, path)
                best = max(ONLINE_POLICIES, key=lambda p: h[p])
                cells = " ".join(f"[{p} {100 * v:.1f}]" if p == best else f"{p} {100 * v:.1f}" for p, v in h.items())
                print(f"residency {share:.1f} {label:9s} {path:6s}: {cells}")


if __name__ == "__main__":
    main()
