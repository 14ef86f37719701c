"""Read-ahead for the RAM tier: while layer l computes, read the experts layer l+1 will likely route
to that are not in its RAM slots, so that its step finds them read (issue 45).

The predictor (`CoRoutingPredictor`, integers only, so native can replay it exactly):
- per pair of consecutive MoE layers (l, l+1) it counts, over the decode steps it was shown,
  n[a] = steps routing a at l and co[a][e] = steps routing a at l and e at l+1 (uint32, saturating;
  with `window` > 0 every count of the pair is halved, `>>= 1`, each `window` updates of the pair);
- at a step, given R = the experts layer l routed, each expert e of l+1 scores
      score(e) = sum over a in R with n[a] > 0 of (co[a][e] << 16) // n[a]
  (the sum of e's conditional frequencies given each routed expert, 16-bit fixed point), and
  prob(e) = score(e) // |R| estimates the chance that l+1 routes e;
- the prediction is the experts of l+1 not resident in its slots with prob(e) >= min_prob and
  score(e) > 0, highest score first (ties: lower id), at most `ahead` of them.
- update(l, R, R'): after layer l+1 routed R' at the same step, the pair's counts learn (R, R').
The last MoE layer predicts nothing (no next layer); the first is never predicted.
Measured on the demo model's decode routing (issue 45's note): this conditional sum beats raw
co-occurrence counts and adding the previous token's same-layer transitions (both worse), the max
or noisy-or of the conditionals (no better, and no chance the break-even rule can gate) and aging
(no change); adding the layer before l too gains half a point, not worth its state.

How many to read (`break_even`, `choose_ahead`): a layer's reads ahead hide only behind its own
compute, so where one read takes longer than a layer computes, each read ahead delays the next
layer; it pays when its chance of being used is above 1 - overlap / read, which min_prob gates.

The replay (`replay`): a trace's decode steps through the RAM tier's slots and pins under the native
policy (core/simulator.py's LayerCache, exactly as `simulate` runs it), the predictor learning
online as it goes. A read-ahead lands in a staging buffer, not a slot: the cache sees the same
steps as without read-ahead (same hits, misses and evictions), and a miss that was read ahead
costs no read at its step. So: bytes read per token with read-ahead = the misses not read ahead
+ every read ahead (used or not). Pure: no llama_cpp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from ..errors import PlanError
from .cost_model import DiskCosts, file_tier_tg_ahead
from .simulator import DEFAULT_POLICY, LayerCache
from .trace import DECODE, RoutingTrace

FIXED_BITS = 16
ONE = 1 << FIXED_BITS  # prob 1.0 in the predictor's fixed point
_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class AheadParams:
    """ahead: experts read ahead per layer at most (P; 0: off). min_prob: an expert is read ahead only
    when its estimated chance is at least this (fixed point, ONE = 1.0). window: halve a layer pair's
    counts every `window` updates of it (0: never)."""

    ahead: int = 1
    min_prob: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        if self.ahead < 0 or not 0 <= self.min_prob <= ONE or self.window < 0:
            raise PlanError(f"invalid read-ahead parameters {self}")


@dataclass
class _Pair:
    """The counts of one pair of consecutive MoE layers (l, l+1)."""

    n: list[int]  # [E]: steps routing a at l
    co: list[list[int]]  # [E][E]: steps routing a at l and e at l+1
    updates: int = 0


class CoRoutingPredictor:
    """Which experts of the next MoE layer to read ahead, from this layer's routing (module docstring)."""

    def __init__(self, layers: Sequence[int], n_expert: int, params: AheadParams = AheadParams()):
        self.layers = tuple(sorted(int(l) for l in layers))
        self.n_expert, self.params = int(n_expert), params
        self.next = {a: b for a, b in zip(self.layers, self.layers[1:])}
        self.pairs = {l: _Pair([0] * n_expert, [[0] * n_expert for _ in range(n_expert)]) for l in self.next}

    def next_layer(self, layer: int) -> int | None:
        """The MoE layer after `layer` (None: the last)."""
        return self.next.get(layer)

    def scores(self, layer: int, routed: Sequence[int]) -> list[int]:
        """score(e) for every expert of the layer after `layer` (all 0 for the last layer)."""
        pair = self.pairs.get(layer)
        out = [0] * self.n_expert
        if pair is None:
            return out
        for a in dict.fromkeys(routed):
            na = pair.n[a]
            if na:
                row = pair.co[a]
                for e in range(self.n_expert):
                    out[e] += (row[e] << FIXED_BITS) // na
        return out

    def predict(self, layer: int, routed: Sequence[int], resident: Collection[int],
                ahead: int | None = None) -> list[int]:
        """Up to `ahead` (default: the params') experts of the layer after `layer` to read ahead:
        not in `resident` (its RAM slots), best first."""
        p = self.params.ahead if ahead is None else ahead
        distinct = len(set(routed))
        if p <= 0 or not distinct or layer not in self.pairs:
            return []
        sc = self.scores(layer, routed)
        floor = self.params.min_prob
        cand = [e for e in range(self.n_expert)
                if sc[e] > 0 and e not in resident and sc[e] // distinct >= floor]
        cand.sort(key=lambda e: (-sc[e], e))
        return cand[:p]

    def update(self, layer: int, routed: Sequence[int], next_routed: Sequence[int]) -> None:
        """Learn one step: `layer` routed `routed` and the layer after it `next_routed`."""
        pair = self.pairs.get(layer)
        if pair is None:
            return
        nxt = list(dict.fromkeys(next_routed))
        for a in dict.fromkeys(routed):
            if pair.n[a] < _U32:
                pair.n[a] += 1
            row = pair.co[a]
            for e in nxt:
                if row[e] < _U32:
                    row[e] += 1
        pair.updates += 1
        w = self.params.window
        if w and pair.updates >= w:
            pair.updates = 0
            pair.n = [c >> 1 for c in pair.n]
            pair.co = [[c >> 1 for c in row] for row in pair.co]

    def learn(self, trace: RoutingTrace) -> "CoRoutingPredictor":
        """Learn every one-token decode step of `trace` (e.g. a profile's ring of recent steps) in order:
        a warm start."""
        dec = trace.decode_steps()
        for row in dec.ids.tolist():
            for l, nl in self.next.items():
                if row[l][0] >= 0 and row[nl][0] >= 0:
                    self.update(l, row[l], row[nl])
        return self


# ---------------------------------------------------------------- the replay


@dataclass
class AheadReplay:
    """A trace's decode steps through a RAM tier's slots, with read-ahead; counts over all MoE layers."""

    ahead: int  # P
    tokens: int  # decode steps replayed
    misses: int  # distinct routed experts not in the RAM slots (read from the file without read-ahead)
    covered: int  # misses that were read ahead (no read at their step)
    reads_ahead: int  # experts read ahead, used or not
    bytes_missed: int  # the misses' bytes (without read-ahead: all that is read)
    bytes_covered: int  # the covered misses' bytes
    bytes_ahead: int  # the reads ahead's bytes
    uncovered_steps: int = 0  # layer steps with a miss that was not read ahead (each waits on a read)
    # reads ahead issued per layer step -> how many layer steps issued that many (the cost model's input)
    ahead_steps: dict[int, int] = field(default_factory=dict)

    def per_token(self, n: float) -> float:
        return n / self.tokens if self.tokens else 0.0

    @property
    def misses_per_token(self) -> float:
        return self.per_token(self.misses)

    @property
    def uncovered_per_token(self) -> float:
        return self.per_token(self.misses - self.covered)

    @property
    def uncovered_steps_per_token(self) -> float:
        return self.per_token(self.uncovered_steps)

    @property
    def reads_ahead_per_token(self) -> float:
        return self.per_token(self.reads_ahead)

    @property
    def unused_per_token(self) -> float:
        """Reads ahead that no step used, per token."""
        return self.per_token(self.reads_ahead - self.covered)

    @property
    def recall(self) -> float:
        """Share of the misses read ahead."""
        return self.covered / self.misses if self.misses else 0.0

    @property
    def precision(self) -> float:
        """Share of the reads ahead that a step used."""
        return self.covered / self.reads_ahead if self.reads_ahead else 0.0

    @property
    def bytes_per_token(self) -> float:
        """Bytes read from the file per token with read-ahead: misses not read ahead + every read ahead."""
        return self.per_token(self.bytes_missed - self.bytes_covered + self.bytes_ahead)

    @property
    def bytes_per_token_without(self) -> float:
        return self.per_token(self.bytes_missed)

    def ahead_steps_per_token(self) -> dict[int, float]:
        return {q: self.per_token(n) for q, n in sorted(self.ahead_steps.items())}


@dataclass
class _LayerRun:
    """One layer's decode steps through its slots: per step, the routed ids, the resident set before the
    step and the misses."""

    routed: list[list[int]]
    resident: list[frozenset[int]]
    misses: list[list[int]]


def _layer_run(trace: RoutingTrace, layer: int, slots: int, pinned: Sequence[int], policy: str) -> _LayerRun:
    """`layer`'s steps through its RAM slots as native runs them (LayerCache with fill_free: a prompt
    too large for the LRU slots fills the free ones); for each one-token decode step, in trace order
    (trace.decode_steps()'s), its routed experts, the resident set before it and its misses."""
    cache = LayerCache(trace.n_expert, slots, pinned, policy, "upload", fill_free=True)
    cap = slots - len(set(pinned))
    routed: list[list[int]] = []
    resident: list[frozenset[int]] = []
    misses: list[list[int]] = []
    for phase, ids in trace.steps(layer):
        rows = [r for r in ids.tolist() if r[0] >= 0]
        distinct = list(dict.fromkeys(e for r in rows for e in r if e >= 0))
        if rows and len(rows) * len(rows[0]) > cap:
            entries: dict[int, int] = {}
            for r in rows:
                for e in r:
                    entries[e] = entries.get(e, 0) + 1
            cache.step(distinct, phase == DECODE, large=True, entries=entries)
            continue
        one = phase == DECODE and ids.shape[0] == 1
        if one:
            routed.append(distinct)
            resident.append(frozenset(e for e in range(trace.n_expert) if cache.expert_slot[e] >= 0))
        o = cache.step(distinct, phase == DECODE)
        if one:
            misses.append(o.misses)
    return _LayerRun(routed, resident, misses)


def replay(trace: RoutingTrace, slots: Mapping[int, int], pinned: Mapping[int, Sequence[int]],
           expert_bytes: Mapping[int, int], params: AheadParams = AheadParams(),
           predictor: CoRoutingPredictor | None = None, policy: str = DEFAULT_POLICY) -> AheadReplay:
    """The one-token decode steps of `trace` through `slots` RAM slots per MoE layer (`pinned` first)
    under `policy` (the native one), reading ahead with `params` and `predictor` (default: a fresh
    CoRoutingPredictor over the layers of `slots`; a given one, e.g. warmed by `learn`, is set to `params`),
    which learns each step after predicting it. A prompt's steps warm the free slots first, as native.
    The misses equal simulate(trace, policy, slots, pinned, phases=("prefill", "decode"),
    ram_tier=True)'s decode misses."""
    dec = trace.decode_steps()
    layers = sorted(int(l) for l in slots)
    pred = predictor or CoRoutingPredictor(layers, trace.n_expert, params)
    pred.params = params
    runs = {l: _layer_run(trace, l, int(slots[l]), tuple(pinned.get(l, ())), policy) for l in layers}
    out = AheadReplay(params.ahead, dec.n_rows, 0, 0, 0, 0, 0, 0)
    for t in range(dec.n_rows):
        covered: dict[int, int] = {}  # layer -> its misses at this token read ahead by the layer before
        for l in layers:
            r = runs[l]
            out.misses += len(r.misses[t])
            out.bytes_missed += len(r.misses[t]) * expert_bytes[l]
            out.uncovered_steps += len(r.misses[t]) > covered.get(l, 0)
            nl = pred.next_layer(l)
            if nl is None:
                continue
            nr = runs[nl]
            ahead = pred.predict(l, r.routed[t], nr.resident[t])
            used = set(ahead) & set(nr.misses[t])
            covered[nl] = len(used)
            out.reads_ahead += len(ahead)
            out.covered += len(used)
            out.bytes_ahead += len(ahead) * expert_bytes[nl]
            out.bytes_covered += len(used) * expert_bytes[nl]
            out.ahead_steps[len(ahead)] = out.ahead_steps.get(len(ahead), 0) + 1
            pred.update(l, r.routed[t], nr.routed[t])
    return out


# ---------------------------------------------------------------- time


def predicted_tg(r: AheadReplay, base_s: float, disk: DiskCosts, n_layers: int) -> float:
    """Seconds per token by the cost model (cost_model.file_tier_tg_ahead) for a replay: the mean expert's
    bytes, and each of the `n_layers` MoE layers' compute (base_s / n_layers) hiding the reads ahead
    issued during it."""
    n = r.misses + r.reads_ahead
    eb = (r.bytes_missed + r.bytes_ahead) / n if n else 0.0
    return file_tier_tg_ahead(base_s, r.uncovered_per_token, r.uncovered_steps_per_token, r.ahead_steps_per_token(), eb, disk,
                              base_s / n_layers if n_layers else 0.0)


def break_even(expert_bytes: float, disk: DiskCosts, overlap_s: float) -> int:
    """The min_prob (fixed point) at which a layer's one read ahead pays by the cost model: it saves a read
    when a step uses it (chance p) and makes the next layer wait read - overlap_s more either way, so it
    pays when p * read > read - overlap_s: p > 1 - overlap_s / read (0 where the compute hides a read)."""
    read_s = expert_bytes / disk.bytes_per_s
    if read_s <= 0:
        return 0
    return min(ONE, max(0, math.ceil((read_s - overlap_s) / read_s * ONE)))


@dataclass(frozen=True)
class AheadChoice:
    params: AheadParams  # ahead = 0: off
    tg_s: float  # predicted seconds per token with them
    replay: AheadReplay


def choose_ahead(trace: RoutingTrace, slots: Mapping[int, int], pinned: Mapping[int, Sequence[int]],
                 expert_bytes: Mapping[int, int], base_s: float, disk: DiskCosts,
                 options: Sequence[int] = (0, 1, 2), min_prob: int | None = None) -> list[AheadChoice]:
    """Each read-ahead depth in `options` replayed and priced, the fastest first (ties: the smaller depth).
    min_prob: None, the break-even chance of the mean expert (break_even, one MoE layer's compute of
    base_s hiding the reads)."""
    n = len(slots)
    if min_prob is None:
        eb = sum(expert_bytes[l] for l in slots) / n if n else 0.0
        min_prob = break_even(eb, disk, base_s / n if n else 0.0)
    out = []
    for p in options:
        params = AheadParams(ahead=p, min_prob=min_prob if p else 0)
        r = replay(trace, slots, pinned, expert_bytes, params)
        out.append(AheadChoice(params, predicted_tg(r, base_s, disk, n), r))
    return sorted(out, key=lambda c: (c.tg_s, c.params.ahead))
