#!/usr/bin/env python3
"""Measure how real a demo model's routing looks (issue 23): skew, locality, held-out and
domain-shift cold-hit, on the held-out text of spark_cli/data/router/eval (never router training).

    python scripts/router_realism.py [--router fit|random] [-E 16 -k 4] [--json]

prose_a is the profile; prose_b is held-out prose; code.md is the domain shift (code against a
prose profile). Routing is captured on the CPU with the eval callback, every token an output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spark_cli.core import routing_stats as rs  # noqa: E402
from spark_cli.core.gguf_info import load_geometry  # noqa: E402
from spark_cli.models.demo_model import build_demo_model  # noqa: E402
from spark_cli.models.demo_router import eval_traces  # noqa: E402


def measure(model: Path) -> dict:
    geo = load_geometry(model, require_moe=True)
    tr = eval_traces(model)
    bpe = {l.index: l.expert_bytes_per_expert for l in geo.layers if l.is_moe}
    prof = tr["prose_a"].counts()
    sk = rs.skew(prof, geo.n_expert_used)
    places = {"prose_b (held out)": rs.placement(prof, tr["prose_b"], bpe),
              "code (domain shift)": rs.placement(prof, tr["code"], bpe)}
    out = rs.realism_json(sk, float(sum(rs.recent_overlap(t) for t in tr.values()) / len(tr)), places)
    out.update(model=model.name, uniform_overlap=rs.uniform_overlap(geo.n_expert, geo.n_expert_used),
               code_vs_prose_distance=rs.routing_distance(tr["code"].counts(), prof),
               prose_vs_prose_distance=rs.routing_distance(tr["prose_b"].counts(), prof),
               tokens={k: int(t.n_rows) for k, t in tr.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--router", default="fit")
    ap.add_argument("-E", type=int, default=16)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = measure(build_demo_model(a.E, a.k, router=a.router))
    if a.json:
        print(json.dumps(r))
        return
    print(f"{r['model']}: tokens {r['tokens']}")
    print(f"entropy/max {r['mean_entropy_norm']:.3f}  top-20% ({r['top_experts']}) share {r['mean_top_share']:.3f}")
    print(f"overlap with previous 8 tokens {r['overlap_8']:.3f} (uniform routing {r['uniform_overlap']:.3f})")
    for name, p in r["placement"].items():
        print(f"cold-hit at {p['residency']:.0%} on {name}: blind {p['uniform']:.3f}  profile {p['profile']:.3f}  "
              f"oracle {p['oracle']:.3f}")
    print(f"routing distance code vs prose {r['code_vs_prose_distance']:.3f}, prose_b vs prose_a "
          f"{r['prose_vs_prose_distance']:.3f}")


if __name__ == "__main__":
    main()
