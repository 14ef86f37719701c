"""A content-fit router: spherical k-means of a layer's FFN inputs, centroids as router rows.

A learned MoE router is a linear map whose rows point at groups of hidden states; clustering
the states a model actually produces gives the same kind of map without training. The states
are centred (their mean is what every token shares), clustered on the unit sphere, and each
centroid, made orthogonal to the mean, becomes a row: `row . x = row . (x - mean)`, so a token
goes to the groups its centred state is closest to. A temperature then makes the top-k softmax
as peaked as a trained router's (ROUTER_TOP_K_MASS). All math is float64 and seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Mean softmax mass of the k routed experts. Trained routers are peaked but not one-hot (top-k
# mass of roughly 0.6-0.9 is typical for Mixtral/Qwen-style routers); llama.cpp's llama MoE
# renormalises the k weights, so this sets their spread, not which experts are picked.
ROUTER_TOP_K_MASS = 0.75
KMEANS_ITERS = 60


@dataclass
class FitRouter:
    rows: np.ndarray  # float32 [E, n_embd]
    sizes: np.ndarray  # int64 [E]: training states per cluster
    agreement: float  # share of training states whose top-1 expert is their own cluster
    scale: float  # the temperature's factor on the unit centroid rows


def _unit(a: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(a, axis=-1, keepdims=True)
    return a / np.maximum(n, 1e-12)


def _kmeans_pp(x: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding on the sphere (cosine distance), seeded."""
    centres = [x[int(rng.integers(len(x)))]]
    best = 1.0 - x @ centres[0]
    for _ in range(1, n):
        w = np.maximum(best, 0.0)
        total = float(w.sum())
        i = int(rng.choice(len(x), p=w / total)) if total > 0 else int(rng.integers(len(x)))
        centres.append(x[i])
        best = np.minimum(best, 1.0 - x @ x[i])
    return np.stack(centres)


def spherical_kmeans(x: np.ndarray, n: int, rng: np.random.Generator,
                     iters: int = KMEANS_ITERS) -> tuple[np.ndarray, np.ndarray]:
    """(unit centroids [n, d], labels [N]) of unit rows `x`; an emptied cluster takes the worst-fit point."""
    if len(x) < n:
        raise ValueError(f"spherical k-means: {len(x)} points for {n} clusters")
    c = _kmeans_pp(x, n, rng)
    labels = np.full(len(x), -1)
    for _ in range(iters):
        sim = x @ c.T
        new = np.argmax(sim, axis=1)
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(n):
            members = labels == j
            if not members.any():  # reseed: the point farthest from its own centroid
                worst = int(np.argmin(sim[np.arange(len(x)), labels]))
                labels[worst] = j
                members = labels == j
            c[j] = _unit(x[members].sum(axis=0))
    return c, labels


def _top_k_mass(logits: np.ndarray, k: int) -> float:
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    return float(np.mean(np.sort(p, axis=1)[:, -k:].sum(axis=1)))


def temperature_scale(logits: np.ndarray, k: int, target: float = ROUTER_TOP_K_MASS) -> float:
    """The factor s for which softmax(s * logits) gives its top k a mean mass of `target` (bisection)."""
    n_expert = logits.shape[1]
    if not k / n_expert < target < 1.0:
        raise ValueError(f"top-{k} mass target {target} must be in ({k / n_expert:.3f}, 1)")
    lo, hi = 1e-3, 1e6
    for _ in range(80):  # geometric bisection: top-k mass grows with s
        mid = float(np.sqrt(lo * hi))
        if _top_k_mass(mid * logits, k) < target:
            lo = mid
        else:
            hi = mid
    return float(np.sqrt(lo * hi))


def fit_router(states: np.ndarray, n_expert: int, k: int, rng: np.random.Generator) -> FitRouter:
    """Router rows [E, n_embd] from one layer's FFN inputs [N, n_embd]."""
    x = np.asarray(states, dtype=np.float64)
    mean = x.mean(axis=0)
    centred = _unit(x - mean)
    c, labels = spherical_kmeans(centred, n_expert, rng)
    m = _unit(mean)
    rows = c - np.outer(c @ m, m)  # orthogonal to the mean: logits see x - mean only
    logits = x @ rows.T
    scale = temperature_scale(logits, k)
    agreement = float(np.mean(np.argmax(logits, axis=1) == labels))
    return FitRouter(rows=(rows * scale).astype(np.float32), sizes=np.bincount(labels, minlength=n_expert),
                     agreement=agreement, scale=scale)
