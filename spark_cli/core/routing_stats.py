"""How real a model's routing looks: the figures published for real MoE models, from counts and traces.

- skew: per-layer routing entropy / log2(E), and the share of routed (token, slot) occurrences
  served by the top 20% of experts (uniform routing: 20%);
- locality: the share of a token's k experts that one of the previous `window` tokens also
  used (a llama.cpp cache peer reports 84% for 8 tokens on Qwen3.5; uniform top-k: see
  `uniform_overlap`);
- placement: cold-hit (routed occurrences whose expert is not resident) at one residency,
  for a placement that ignores routing (any m of E experts: 1 - m/E) against the greedy
  placement from profile counts, on a held-out trace; run on another domain's trace it is the
  domain-shift figure (Luce Spark: 36% uniform, 6.6% calibrated, 16% code against a chat profile).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from .report import BytesPerExpert, held_out_cold_hit, layer_skew
from .trace import DECODE, RoutingTrace, phase_code

WINDOW = 8
TOP_SHARE = 0.2
RESIDENCY = 0.6
PUBLISHED = {  # real models, for comparison (see the module docstring)
    "overlap_8": 0.84,  # llama.cpp cache peer, Qwen3.5
    "cold_hit_uniform": 0.36, "cold_hit_profile": 0.066, "cold_hit_shift": 0.16,  # Luce Spark
}


@dataclass
class Skew:
    entropy_norm: list[float]  # per MoE layer
    top_share: list[float]  # per MoE layer: share served by the top ceil(TOP_SHARE * E) experts
    n_top: int

    @property
    def mean_entropy(self) -> float:
        return float(np.mean(self.entropy_norm)) if self.entropy_norm else 0.0

    @property
    def mean_top_share(self) -> float:
        return float(np.mean(self.top_share)) if self.top_share else 0.0


@dataclass
class Placement:
    residency: float
    resident_experts: int
    uniform: float  # cold-hit of any placement that ignores routing (expected)
    profile: float  # cold-hit of the greedy placement from the train counts
    oracle: float  # cold-hit of the greedy placement from the test's own counts


def skew(counts: np.ndarray, k: int) -> Skew:
    """Entropy and top-20% share of every layer with routing in counts [n_layer, E]."""
    n_expert = np.asarray(counts).shape[1]
    n_top = max(1, math.ceil(TOP_SHARE * n_expert))
    rows = layer_skew(counts, k)
    return Skew([s.entropy_norm for s in rows], [float(s.coverage[n_top - 1]) for s in rows], n_top)


def recent_overlap(trace: RoutingTrace, window: int = WINDOW, phases: Sequence[int | str] = ("prefill", "decode")) -> float:
    """Mean share of a token's experts used by one of the previous `window` tokens (rows of
    `phases`, in trace order; tokens with fewer than `window` predecessors are skipped)."""
    rows = tokens_of(trace, phases).ids
    hit = total = 0
    for layer in trace.moe_layers():
        ids = rows[:, layer, :].astype(np.int64)
        n = len(ids)
        if n <= window:
            continue
        used = np.zeros((n, trace.n_expert), dtype=np.int64)
        np.add.at(used, (np.repeat(np.arange(n), ids.shape[1]), ids.ravel()), 1)
        used = np.minimum(used, 1)
        cum = np.vstack([np.zeros((1, trace.n_expert), np.int64), np.cumsum(used, axis=0)])
        t = np.arange(window, n)
        seen = (cum[t] - cum[t - window]) > 0  # used by one of rows t-window .. t-1
        hit += int((seen & (used[t] > 0)).sum())
        total += int(used[t].sum())
    return hit / total if total else 0.0


def uniform_overlap(n_expert: int, k: int, window: int = WINDOW) -> float:
    """The same share when every token picks k of E experts uniformly and independently: an expert
    is in one token's set with probability k/E. (E=16, k=4: 0.90; Qwen3.5's E=256, k=8: 0.22.)"""
    return 1.0 - (1.0 - k / n_expert) ** window


def tokens_of(trace: RoutingTrace, phases: Sequence[int | str]) -> RoutingTrace:
    """The rows of `phases`, each read as one token (a decode row): static placements count
    every routed token alike, whichever step fed it."""
    keep = np.isin(trace.phase, [phase_code(p) for p in phases])
    n = int(keep.sum())
    return RoutingTrace(trace.ids[keep], np.full(n, DECODE, np.uint8), np.arange(n, dtype=np.int32),
                        trace.n_expert, trace.fingerprint)


def placement(train_counts: np.ndarray, test: RoutingTrace, bytes_per_expert: BytesPerExpert,
              residency: float = RESIDENCY, phases: Sequence[int | str] = ("prefill", "decode")) -> Placement:
    """Cold-hit on `test` at `residency`: routing-blind placement against the train counts' placement."""
    tokens = tokens_of(test, phases)
    (h,) = held_out_cold_hit(np.asarray(train_counts, dtype=np.float64), tokens, bytes_per_expert, [residency])
    slots = len(test.moe_layers()) * test.n_expert
    return Placement(residency, h.resident_experts, 1.0 - h.resident_experts / slots, h.cold_hit, h.oracle_cold_hit)


def routing_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over layers routed in both of the total-variation distance between the layers'
    routing histograms (0: the same shares, 1: disjoint experts)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    sa, sb = a.sum(axis=1), b.sum(axis=1)
    both = (sa > 0) & (sb > 0)
    if not both.any():
        return 0.0
    pa, pb = a[both] / sa[both, None], b[both] / sb[both, None]
    return float(np.mean(0.5 * np.abs(pa - pb).sum(axis=1)))


def realism_json(sk: Skew, overlap: float | None, places: dict[str, Placement]) -> dict[str, Any]:
    """One JSON object of the figures (and the published ones they compare with)."""
    return {"entropy_norm": sk.entropy_norm, "top_share": sk.top_share, "top_experts": sk.n_top,
            "mean_entropy_norm": sk.mean_entropy, "mean_top_share": sk.mean_top_share,
            f"overlap_{WINDOW}": overlap, "placement": {name: asdict(p) for name, p in places.items()},
            "published": PUBLISHED}
