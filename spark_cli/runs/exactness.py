"""Cached against all-resident logits on a real GPU backend (CUDA, Vulkan), where a CPU-computed
expert's output is the CPU kernel's and a device-computed one the device kernel's.

Every run is fed the all-resident run's greedy tokens, so logits are compared position by
position even where an argmax would flip. The bound for a run that mixes the two kernels is what
stock --cpu-moe (every expert on the CPU) shows against all-resident on the same prompts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..core.capture import TopkRecord
from ..native.engine import Engine, EngineOptions
from ..native.generate import Forced, Greedy, StopRules, stream_generate

# A run mixing the two kernels is of the order of the all-CPU run's difference but not strictly
# below it: per-expert differences of opposite sign cancel in one sum and not in another, and
# later layers amplify them (seen on Vulkan, gpt-oss: 0.328 against 0.315). An expert read
# from a slot before its upload landed, or dropped, is off by orders of magnitude more (seen
# on Vulkan before the filler-slot fix: 4.1 against 0.0016).
MIXED_SLACK = 2.0


def largest_diff(a: np.ndarray, b: np.ndarray) -> float:
    """The largest absolute difference of two arrays; infinite where either has a NaN (max() would
    drop a NaN and call a broken run exact)."""
    d = np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    return float("inf") if np.isnan(d).any() else float(d.max()) if d.size else 0.0


def within_bound(diff: float, bound: float) -> bool:
    """A mixed-kernel run's largest logit difference against stock --cpu-moe's (the bound)."""
    return diff <= MIXED_SLACK * bound


TEXT = ("The history of the printing press begins in the fifteenth century, when movable type "
        "changed how books were made, sold and read across Europe. ") * 4
PROMPT_TOKENS = (1, 4, 12, 20, 40)


def prompts(eng: Engine, lengths: tuple[int, ...] = PROMPT_TOKENS) -> list[list[int]]:
    toks = eng.vocab.tokenize(TEXT)
    assert len(toks) >= max(lengths)
    return [toks[:n] for n in lengths]


def logits(eng: Engine, prompt: list[int], fed: list[int] | None, n_decode: int) -> tuple[np.ndarray, list[int]]:
    """Logits of every prompt token and of each decode step, and the tokens fed (greedy where fed
    is None)."""
    eng.reset()
    rows: list[np.ndarray] = []
    out: list[int] = []
    for step in stream_generate(eng, prompt, sampler=Forced(fed) if fed is not None else Greedy(),
                                max_tokens=n_decode, stop=StopRules(eog=False), prompt_logits="all",
                                on_prompt=rows.append, keep_logits=True):
        if step.token is not None:
            out.append(step.token)
            rows.append(step.logits[None, :])
    return np.concatenate(rows), out


@dataclass
class Reference:
    prompts: list[list[int]]
    logits: list[np.ndarray]
    fed: list[list[int]]
    splits: int | None  # of the one-token graph
    device: str         # the first device used ("CPU": none)


def reference(opts: EngineOptions, n_decode: int, lengths: tuple[int, ...] = PROMPT_TOKENS) -> Reference:
    """The all-resident run: its logits and greedy tokens for each prompt."""
    with Engine(opts) as eng:
        ps = prompts(eng, lengths)
        runs = [logits(eng, p, None, n_decode) for p in ps]
        splits, device = eng.graph_splits(), (eng.devices[0].name if eng.devices else "CPU")
    return Reference(ps, [r[0] for r in runs], [r[1] for r in runs], splits, device)


def max_diff(eng: Engine, ref: Reference) -> tuple[float, bool]:
    """(largest |logit - all-resident logit| over every prompt and step, bit-identical everywhere?)."""
    worst, exact = 0.0, True
    for p, rl, fed in zip(ref.prompts, ref.logits, ref.fed):
        got, _ = logits(eng, p, fed, len(fed))
        exact = exact and bool(np.array_equal(got, rl))
        worst = max(worst, largest_diff(got, rl))
    return worst, exact


# -- routing ties -------------------------------------------------------------------------
# A routed token whose k-th and (k+1)-th expert scores nearly tie takes either expert once the
# scores move by a kernel difference (CPU against device kernels move them by ~1e-2): from that
# row on the two runs compute different experts, and its logits (and, through the KV cache,
# every later row's) differ by O(1) without anything being stale or dropped. Seen on Vulkan,
# laguna, upload path: layer 2 of the 40-token prompt's 31st token ranks expert 9 over expert 3
# by 5.3e-4 all-resident; the cached run's CPU-computed misses in layer 1 reversed that, and the
# row differed by 1.75 where stock --cpu-moe's largest row was 0.58 (itself one such flip).
# Runs are therefore compared on each prompt's rows before its first routing difference, and
# that difference must be a tie: a margin within what stock's kernel mix moves the scores.


@dataclass
class Routed:
    """One run's logits and routing, on the reference's prompts and fed tokens."""
    logits: list[np.ndarray]          # per prompt: [n_rows, n_vocab]
    ids: list[np.ndarray]             # per prompt: [n_rows, n_moe_layers, k], each row's ids sorted
    scores: list[np.ndarray] | None   # per prompt: [n_rows, n_moe_layers, n_expert] (captured runs)
    layers: tuple[int, ...] = ()      # the routed layers, in the order of the ids' second axis


@dataclass
class Flip:
    prompt: int
    row: int
    il: int
    margin: float  # the reference's score margin between the experts the two runs chose apart


@dataclass
class RoutedDiff:
    diff: float         # largest |d logit| over each prompt's rows before its first routing difference
    rows: int           # rows compared
    flips: list[Flip]   # each prompt's first routing difference (in its lowest layer)
    score_shift: float  # largest |d selection score| over the rows compared (runs with scores)


def _routes(records: list[TopkRecord], layers: list[int], n_rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Records of one prompt's steps -> ids [n_rows, n_layers, k] (sorted) and scores."""
    per = [[r for r in records if r.il == il] for il in layers]
    ids = np.stack([np.sort(np.concatenate([r.ids for r in rs]), axis=1) for rs in per], axis=1)
    assert ids.shape[0] == n_rows, f"{ids.shape[0]} routed rows for {n_rows} logit rows"
    if any(r.scores is None for r in records):
        return ids, None
    scores = np.stack([np.concatenate([r.scores for r in rs]) for rs in per], axis=1)
    assert scores.shape[0] == n_rows, f"{scores.shape[0]} rows of scores for {n_rows} logit rows"
    return ids, scores


def routed_run(eng: Engine, ref: Reference, source: str) -> Routed:
    """Logits and routing of every prompt; source: 'capture' (the engine's eval-callback records)
    or 'trace' (the expert cache's native trace of its cached layers: no callback in the graph)."""
    out = Routed([], [], [], tuple(eng.geometry.moe_layers))
    for p, fed in zip(ref.prompts, ref.fed):
        eng.records.clear()
        n_before = len(eng.cache.trace_records()) if source == "trace" else 0
        got, _ = logits(eng, p, fed, len(fed))
        recs = eng.records if source == "capture" else eng.cache.trace_records()[n_before:]
        ids, scores = _routes(list(recs), list(out.layers), len(got))
        out.logits.append(got)
        out.ids.append(ids)
        if out.scores is not None and scores is not None:
            out.scores.append(scores)
        else:
            out.scores = None
    return out


def routed_reference(opts: EngineOptions, ref: Reference) -> Routed:
    """The all-resident run's routing and selection scores (captured: a graph with callbacks,
    so its logits are not the reference's; ref's are)."""
    with Engine(dataclasses.replace(opts, capture_topk=True, capture_scores=True)) as eng:
        return routed_run(eng, ref, "capture")


def _margin(ref_ids: np.ndarray, got_ids: np.ndarray, scores: np.ndarray) -> float:
    """How far the reference ranked the experts only it chose above those only the other run chose."""
    only_ref = np.setdiff1d(ref_ids, got_ids)
    only_got = np.setdiff1d(got_ids, ref_ids)
    return float(scores[only_ref].min() - scores[only_got].max())


def _shift(a: np.ndarray, b: np.ndarray) -> float:
    both = np.isfinite(a) & np.isfinite(b)  # -inf: an expert group masked out in both
    return largest_diff(a[both], b[both]) if both.any() else 0.0


def routed_diff(ref: Reference, ref_routes: Routed, got: Routed) -> RoutedDiff:
    """got against the reference, each prompt up to its first routing difference."""
    res = RoutedDiff(0.0, 0, [], 0.0)
    for i, rl in enumerate(ref.logits):
        differ = np.any(got.ids[i] != ref_routes.ids[i], axis=2)  # [n_rows, n_layers]
        rows = np.flatnonzero(differ.any(axis=1))
        first = int(rows[0]) if len(rows) else len(rl)
        if first:
            res.diff = max(res.diff, largest_diff(got.logits[i][:first], rl[:first]))
            if got.scores is not None:
                res.score_shift = max(res.score_shift, _shift(got.scores[i][:first], ref_routes.scores[i][:first]))
        res.rows += first
        if first < len(rl):
            j = int(np.flatnonzero(differ[first])[0])
            margin = _margin(ref_routes.ids[i][first, j], got.ids[i][first, j], ref_routes.scores[i][first, j])
            res.flips.append(Flip(i, first, got.layers[j], margin))
    return res
