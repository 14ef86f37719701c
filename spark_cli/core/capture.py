"""Routing records (native trace or eval-callback capture) -> counts and RoutingTrace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .trace import DECODE, RoutingTrace, TraceBuilder


@dataclass
class TopkRecord:
    il: int
    phase: int
    ids: np.ndarray  # [n_tokens, k] int32
    scores: np.ndarray | None = None  # capture_scores: [n_tokens, n_expert] f32, the scores the top-k ranked


def records_to_counts(records: Iterable[TopkRecord], n_layer: int, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """(prefill, decode) routed-occurrence counts, each [n_layer, n_expert]."""
    out = np.zeros((2, n_layer, n_expert), dtype=np.int64)
    for r in records:
        ids = r.ids[(r.ids >= 0) & (r.ids < n_expert)]
        np.add.at(out[r.phase, r.il], ids, 1)
    return out[0], out[1]


def records_to_trace(records: Iterable[TopkRecord], n_layer: int, n_expert: int, fingerprint: str) -> RoutingTrace:
    records = list(records)
    k = max((r.ids.shape[1] for r in records), default=1)
    b = TraceBuilder(n_layer=n_layer, k=k, n_expert=n_expert, fingerprint=fingerprint)
    for r in records:
        b.add(r.il, r.ids.shape[0], r.ids.shape[1], "decode" if r.phase == DECODE else "prefill", r.ids)
    return b.build()
