"""Routing skew and the held-out test of a static placement.

Skew per layer (decode routing): entropy in bits and normalized by log2(E), share of
the top-k experts, and the coverage curve (share of routing served by the top n).
Held-out cold-hit: place experts from train counts, then measure on a test trace the
share of routed decode (token, expert) occurrences that miss the placement.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence, Union

import numpy as np

from ..files.atomic import atomic_write_bytes
from ..errors import PlanError
from .profile import RoutingProfile
from .simulator import cold_hit_rate
from .trace import RoutingTrace

CountsSource = Union[RoutingProfile, RoutingTrace, np.ndarray]
BytesPerExpert = Union[Mapping[int, int], Sequence[int], np.ndarray]  # per layer


@dataclass
class LayerSkew:
    layer: int
    routed: float  # decode (token, slot) occurrences
    entropy_bits: float
    entropy_norm: float  # entropy / log2(E): 1 = uniform, 0 = one expert
    top_k_share: float
    coverage: np.ndarray  # float64 [E]: share covered by the top n experts, n = 1..E


@dataclass
class HeldOut:
    residency: float  # share of all MoE expert bytes held resident
    budget_bytes: int
    resident_experts: int
    cold_hit: float  # test misses with a placement from the train counts
    oracle_cold_hit: float  # test misses with a placement from the test counts themselves


def decode_counts(source: CountsSource, fallback_all: bool = False) -> np.ndarray:
    """Decode counts [n_layer, E]; with `fallback_all`, all counts when decode has none."""
    if isinstance(source, RoutingProfile):
        dec, pre = source.decode, source.prefill
    elif isinstance(source, RoutingTrace):
        dec, pre = source.counts("decode"), source.counts("prefill")
    else:
        return np.asarray(source, dtype=np.float64)
    return dec + pre if fallback_all and not dec.any() else dec


def _entropy_bits(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0: no -0.0


def coverage_curve(row: np.ndarray) -> np.ndarray:
    """Share of a layer's routing covered by its top n experts, n = 1..E."""
    total = float(row.sum())
    if total <= 0:
        return np.zeros(row.size)
    return np.cumsum(np.sort(row)[::-1]) / total


def layer_skew(counts: np.ndarray, k: int, layers: Iterable[int] | None = None) -> list[LayerSkew]:
    """Skew of each layer with routing (or of `layers`), from counts [n_layer, E]."""
    counts = np.asarray(counts, dtype=np.float64)
    n_expert = counts.shape[1]
    if layers is None:
        layers = [int(l) for l in np.flatnonzero(counts.sum(axis=1) > 0)]
    out = []
    for layer in layers:
        row = counts[layer]
        total = float(row.sum())
        h = _entropy_bits(row / total) if total > 0 else 0.0
        cov = coverage_curve(row)
        out.append(LayerSkew(
            layer=layer, routed=total, entropy_bits=h,
            entropy_norm=h / np.log2(n_expert) if n_expert > 1 else 0.0,
            top_k_share=float(cov[min(k, n_expert) - 1]) if total > 0 else 0.0,
            coverage=cov))
    return out


def _bytes_array(bytes_per_expert: BytesPerExpert, n_layer: int) -> np.ndarray:
    if isinstance(bytes_per_expert, Mapping):
        out = np.zeros(n_layer, dtype=np.int64)
        for layer, b in bytes_per_expert.items():
            out[int(layer)] = int(b)
        return out
    out = np.asarray(bytes_per_expert, dtype=np.int64)
    if out.shape != (n_layer,):
        raise PlanError(f"bytes per expert has shape {out.shape}, expected [{n_layer}]")
    return out


def greedy_placement(counts: np.ndarray, bytes_per_expert: BytesPerExpert,
                     budget_bytes: int, floor_k: int, moe_layers: Iterable[int]) -> dict[int, set[int]]:
    """Experts to keep resident: a floor, then the best count per byte that still fits.

    Each MoE layer first gets its `floor_k` most-routed experts (ties: lower id) so that
    a decode token's k experts can fit; the rest goes greedily by count / bytes
    (ties: higher count, lower layer, lower id), skipping any expert that no longer fits.
    """
    counts = np.asarray(counts, dtype=np.float64)
    n_layer, n_expert = counts.shape
    bpe = _bytes_array(bytes_per_expert, n_layer)
    moe = sorted(set(int(l) for l in moe_layers))
    if any(bpe[l] <= 0 for l in moe):
        raise PlanError("bytes per expert must be positive for every MoE layer")
    floor_k = min(floor_k, n_expert)
    placement: dict[int, set[int]] = {}
    used = 0
    for layer in moe:
        top = np.argsort(-counts[layer], kind="stable")[:floor_k]
        placement[layer] = {int(e) for e in top}
        used += floor_k * int(bpe[layer])
    if used > budget_bytes:
        raise PlanError(f"budget of {budget_bytes} bytes cannot hold {floor_k} experts per MoE "
                        f"layer ({used} bytes)", hint="raise the budget or use fewer MoE layers")
    cand = [(-counts[l, e] / bpe[l], -counts[l, e], l, e)
            for l in moe for e in range(n_expert) if e not in placement[l]]
    cand.sort()
    for _, _, layer, e in cand:
        if used + bpe[layer] <= budget_bytes:
            placement[layer].add(e)
            used += int(bpe[layer])
    return placement


def held_out_cold_hit(train: CountsSource, test: RoutingTrace,
                      bytes_per_expert: BytesPerExpert,
                      residencies: Sequence[float] = (0.4, 0.6, 0.8),
                      floor_k: int | None = None) -> list[HeldOut]:
    """Cold-hit on `test` of placements built from `train` decode counts.

    Train counts fall back to prefill + decode when train has no decode tokens.
    Residency r gives a budget of floor(r * sum over MoE layers of E * bytes_per_expert).
    """
    train_counts = decode_counts(train, fallback_all=True)
    if train_counts.shape != (test.n_layer, test.n_expert):
        raise PlanError(f"train counts {train_counts.shape} do not match the test trace "
                        f"[{test.n_layer}, {test.n_expert}]")
    moe = test.moe_layers()
    bpe = _bytes_array(bytes_per_expert, test.n_layer)
    total = sum(int(bpe[l]) * test.n_expert for l in moe)
    k = test.k if floor_k is None else floor_k
    oracle_counts = decode_counts(test, fallback_all=True)
    out = []
    for r in residencies:
        budget = int(np.floor(r * total + 1e-9))  # 0.29 * 100 is 28.999...96
        place = greedy_placement(train_counts, bpe, budget, k, moe)
        oracle = greedy_placement(oracle_counts, bpe, budget, k, moe)
        out.append(HeldOut(residency=float(r), budget_bytes=budget,
                           resident_experts=sum(len(s) for s in place.values()),
                           cold_hit=cold_hit_rate(test, place),
                           oracle_cold_hit=cold_hit_rate(test, oracle)))
    return out


def heatmap_png(counts: np.ndarray, path: Path | str, title: str, flag: str | None = None) -> Path:
    """Per-layer routing shares as a [layer x expert] heatmap PNG, written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: slow import
    from matplotlib.figure import Figure

    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=1, keepdims=True)
    shares = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    n_layer, n_expert = counts.shape
    fig = Figure(figsize=(min(4 + n_expert / 8, 16), min(2 + n_layer / 4, 12)), dpi=100)
    FigureCanvasAgg(fig)  # Agg without touching pyplot's global backend
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="share of layer routing")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(path, buf.getvalue(), flag)
