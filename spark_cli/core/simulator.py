"""Replay a routing trace through expert-cache policies, one layer at a time.

This module is the executable specification of the native cache's policies: every rule
below is integer arithmetic with explicit tie-breaks, so C++ can follow it line by line.

Bank of one layer (as native): S slots, slots 0..P-1 hold the pinned experts (never
evicted, never touched), slots P..S-1 are managed by the policy. cap = S - P.

Step rule (every policy, both miss paths; docs/design.md):
- a step with `n_tokens * k > cap` is a *stock* step: no state change, no hits/misses;
- otherwise `distinct` = the step's ids in order of first appearance; resident ones are
  hits and are handled first (in `distinct` order), then the misses (in `distinct` order,
  except "belady" in the cpu path: soonest next use first);
- a slot used by this step (a hit, a miss placed this step, a pending admission) is never
  a victim; a miss takes the lowest-index free non-pinned slot before any victim.

Miss paths:
- "upload": a miss is uploaded into a slot and is resident for this step (native today).
- "auto": as "cpu", except that each step's misses not admitted in it are split per expert
  (`split_misses`): the ones with most entries are uploaded into staging slices for that step
  only, while that ends the step sooner by the layer's costs (`MissCosts`); the rest run on the
  CPU (an admitted miss too: its upload runs in the background, never twice in a step).
  On the "upload" path a step too large for the slots stages its misses too (most entries
  first, no costs) while the staging slices last.
- the RAM tier (native's file tier, `fill_free`): a step too large for the slots first fills the
  free LRU slots (a cold start) with its misses, most entries first (LayerCache.fill_free); the
  rest are read for that step only. Hits are not touched and nothing is counted, as above.
- "cpu": a miss is computed on the CPU (`cpu_experts`); it may be *admitted* into a slot by
  a background upload that becomes usable at the layer's NEXT decode step (pending until
  then: a pending slot is never read and never a victim). At most `max_admit` admissions
  per layer per decode step; a miss not admitted (bound reached, no evictable slot, or
  refused by the policy's admission rule) counts in `admit_skipped`. Prefill steps
  (n_tokens > 1) are read-only in this path: hits are counted but nothing is touched,
  counted, aged or admitted.

Per-layer policy state (the rules of each policy: LayerCache):
- `tick`: a per-layer counter, +1 per touch; `slot_tick[s]` = tick of the last touch of
  slot s (unique, so "least recent" never ties). Native uses one counter for all layers;
  only the order within a layer matters, so the results are the same.
- `freq[e]` (lfu-aged, tinylfu): uint32 per expert of the layer (resident or not), +1 per
  counted step that routes e (saturating); `age` counts counted steps and when it reaches
  `window` every freq is halved (`freq >>= 1`) and `age` = 0. A counted step is a
  non-stock step that is not read-only.
- `slot_seg[s]` (slru): 0 probation, 1 protected.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..errors import PlanError
from .trace import DECODE, RoutingTrace, phase_code

POLICIES = ("lru", "lru-pinned", "lfu-aged", "slru", "tinylfu", "belady")
ALIASES = {"lfu": "lfu-aged"}  # the name before issue 12
ONLINE_POLICIES = ("lru", "lfu-aged", "slru", "tinylfu")  # what a cache can run (no oracle)
# --policy auto with no trace yet, and a plan without "policy". Measured on the demo model (fit router,
# E=16 k=4), plans from the counts alone at 40-80% residency replayed on the cpu path (auto's): on the
# held-out eval text tinylfu finds 1-9 points more experts on the device than any other; on the bundled
# corpus lfu-aged leads it by 0.3-1.8 (upload path: the two are equal). Reproduce: spark profile run
# --corpus spark_cli/data/router/eval --gen 192 --trace T.npz --profile P.json, then
# scripts/default_policy.py MODEL T.npz --profile P.json (docs/demo-model.md).
DEFAULT_POLICY = "tinylfu"
# the native cache's enum llama_expert_cache_policy (belady is an oracle: simulator only)
NATIVE_POLICY_IDS = {"lru": 0, "lru-pinned": 0, "lfu-aged": 1, "slru": 2, "tinylfu": 3}


class MissPath(StrEnum):
    """--miss-path, in its order: where a cached layer computes an expert that is not on the device.
    A str: a plan file records it as its name. layer: the per-layer rule before issue 25."""

    AUTO = "auto"
    CPU = "cpu"
    UPLOAD = "upload"
    LAYER = "layer"


FIXED_MISS_PATHS = (MissPath.UPLOAD, MissPath.CPU)  # the two fixed sides (calibration measures both)
LAYER_MISS_PATHS = (*FIXED_MISS_PATHS, MissPath.AUTO)  # what one cached layer runs: auto splits each step's misses per expert
_INF = 1 << 62
_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class PolicyParams:
    """Tunables of the policies (integers only).

    window: lfu-aged/tinylfu halve every count each `window` counted steps of a layer
        (0: never age; counts saturate at 2**32 - 1).
    protected_num/protected_den: slru protected segment holds at most
        cap * protected_num // protected_den slots.
    """

    window: int = 16  # tuned on the first half of a held-out demo trace (scripts/policy_sweep.py)
    protected_num: int = 3  # likewise: 3/4 of the policy slots protected
    protected_den: int = 4

    def __post_init__(self) -> None:
        if self.window < 0 or self.protected_den <= 0 or not 0 <= self.protected_num <= self.protected_den:
            raise PlanError(f"invalid policy parameters {self}")


@dataclass(frozen=True)
class MissCosts:
    """The per-expert split's costs in integer nanoseconds (native: llama_expert_cache_costs).

    A missed expert with t entries in a step takes cpu_expert_ns + t * cpu_ns on the CPU (at the
    run's threads) and upload_ns to upload into a staging slice; concurrent: uploads run beside
    the CPU work (a second device queue), else before it.
    """

    cpu_ns: int = 0
    upload_ns: int = 0
    concurrent: bool = False
    cpu_expert_ns: int = 0

    def cpu(self, entries: int) -> int:
        return self.cpu_expert_ns + entries * self.cpu_ns

    def ends(self, upload: int, cpu: int) -> int:
        return max(upload, cpu) if self.concurrent else upload + cpu


def split_misses(misses: Sequence[int], entries: Mapping[int, int], n_stage: int, costs: MissCosts,
                 by_cost: bool) -> list[int]:
    """The misses staged (uploaded for this step), in staging-slice order: most entries first
    (then lower id) while a slice is left and, by_cost, while moving one more ends the step
    sooner; entries only fall along that order, so the first that does not help ends it."""
    order = sorted(misses, key=lambda e: (-entries[e], e))
    cpu_left = sum(costs.cpu(entries[e]) for e in order)
    up = 0
    staged: list[int] = []
    for e in order:
        if len(staged) >= n_stage:
            break
        if by_cost:
            c = costs.cpu(entries[e])
            if costs.ends(up + costs.upload_ns, cpu_left - c) >= costs.ends(up, cpu_left):
                break
            up += costs.upload_ns
            cpu_left -= c
        staged.append(e)
    return staged


@dataclass
class LayerStats:
    layer: int
    slots: int
    pinned: int
    hits: int = 0  # distinct experts per cached step found resident (pinned included)
    misses: int = 0  # distinct experts per cached step not resident (uploaded or computed on the CPU)
    uploads: int = 0  # admissions + pinned uploads at start
    admissions: int = 0  # experts written into a slot: every miss (upload path) or admitted misses (cpu)
    admit_skipped: int = 0  # cpu path: misses not admitted
    cpu_experts: int = 0  # misses computed on the CPU (cpu path: every miss; auto: the ones not staged)
    staged: int = 0  # misses uploaded into staging slices for their step (auto; upload-path large steps)
    cached_steps: int = 0
    stock_steps: int = 0
    stock_accesses: int = 0  # distinct experts in stock steps: served from host
    hits_decode: int = 0
    misses_decode: int = 0
    miss_steps_decode: int = 0  # decode steps with at least one miss (each waits on its reads)
    admissions_decode: int = 0
    stock_steps_decode: int = 0
    stock_accesses_decode: int = 0
    final_resident: tuple[int, ...] = ()  # pinned (sorted), then least -> most recently touched

    @property
    def accesses(self) -> int:
        return self.hits + self.misses + self.stock_accesses

    @property
    def hit_rate(self) -> float:
        """Share of distinct (step, expert) accesses served from VRAM; stock steps miss."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def hit_rate_decode(self) -> float:
        n = self.hits_decode + self.misses_decode + self.stock_accesses_decode
        return self.hits_decode / n if n else 0.0


@dataclass
class SimResult:
    policy: str
    layers: dict[int, LayerStats]
    tokens: int  # token rows replayed
    decode_tokens: int
    bytes_per_expert: dict[int, int] | None = None
    phases: tuple[str, ...] = ("decode",)
    miss_path: str = "upload"

    def _sum(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.layers.values())

    hits = property(lambda self: self._sum("hits"))
    misses = property(lambda self: self._sum("misses"))
    uploads = property(lambda self: self._sum("uploads"))
    admissions = property(lambda self: self._sum("admissions"))
    admit_skipped = property(lambda self: self._sum("admit_skipped"))
    cpu_experts = property(lambda self: self._sum("cpu_experts"))
    staged = property(lambda self: self._sum("staged"))
    stock_steps = property(lambda self: self._sum("stock_steps"))
    hits_decode = property(lambda self: self._sum("hits_decode"))
    misses_decode = property(lambda self: self._sum("misses_decode"))
    miss_steps_decode = property(lambda self: self._sum("miss_steps_decode"))
    stock_steps_decode = property(lambda self: self._sum("stock_steps_decode"))

    @property
    def uploads_decode(self) -> int:
        return self._sum("admissions_decode")  # pinned uploads happen once, before decoding

    @property
    def hit_rate(self) -> float:
        n = self._sum("accesses")
        return self.hits / n if n else 0.0

    @property
    def hit_rate_decode(self) -> float:
        n = self.hits_decode + self.misses_decode + self._sum("stock_accesses_decode")
        return self.hits_decode / n if n else 0.0

    @property
    def uploads_per_token(self) -> float:
        """Expert uploads (admissions) per decode token, all layers together."""
        return self.uploads_decode / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def bytes_per_token(self) -> float | None:
        """Bytes uploaded per decode token, given bytes per expert per layer."""
        if self.bytes_per_expert is None:
            return None
        if not self.decode_tokens:
            return 0.0
        total = sum(s.admissions_decode * self.bytes_per_expert[s.layer] for s in self.layers.values())
        return total / self.decode_tokens


# ---------------------------------------------------------------- the policies, slot by slot


@dataclass
class StepOutcome:
    """What one cached step did (expert ids; `admitted` as (expert, slot))."""

    hits: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    admitted: list[tuple[int, int]] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    skipped: int = 0
    staged: list[int] = field(default_factory=list)  # misses uploaded into staging slices, in slice order


class LayerCache:
    """One layer's bank under one policy and miss path: the specification of `step()`.

    Per slot s: slot_expert[s] (-1 free), slot_tick[s], slot_seg[s] (slru),
    slot_pending[s] (cpu path: admitted, usable from the next decode step).
    Per expert e: expert_slot[e] (-1 not resident), freq[e] (lfu-aged, tinylfu).

    Hit of slot s >= P (not read-only):
        lru, lfu-aged, tinylfu: slot_tick[s] = ++tick.
        slru: slot_tick[s] = ++tick; if slot_seg[s] == 0: slot_seg[s] = 1 and, if the
            protected slots now exceed cap * num // den, the protected slot with the
            smallest tick goes back to probation (slot_seg = 0, tick kept).
    Insert (a miss placed or admitted in slot s): slot_tick[s] = ++tick, slot_seg[s] = 0.
    Victim, among occupied slots s >= P that are neither used by this step nor pending,
    the smallest key:
        lru: slot_tick[s];  lfu-aged, tinylfu: (freq[slot_expert[s]], slot_tick[s]);
        slru: (slot_seg[s], slot_tick[s]);  belady: (-next_use[slot_expert[s]], slot_tick[s]).
    Admission (cpu path, free slot: always; else against the victim v):
        tinylfu: freq[e] > freq[slot_expert[v]];  others: always;
        belady: land_use[e] < next_use[slot_expert[v]] (land_use: e's next use at or after
        the next decode step, where the admission lands).
    The slru demotion may pick a slot used by this step (demotion is not eviction);
    evicting a protected slot lowers the protected count.
    """

    def __init__(self, n_expert: int, slots: int, pinned: Sequence[int], policy: str,
                 miss_path: str = "upload", max_admit: int = 1 << 30,
                 params: PolicyParams = PolicyParams(), n_stage: int = 0, costs: MissCosts = MissCosts(),
                 fill_free: bool = False):
        policy = ALIASES.get(policy, policy)
        self.fills_free = fill_free  # the RAM tier: a step too large for the slots fills the free ones
        if policy not in POLICIES:
            raise PlanError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
        self.n_stage, self.costs = max(0, n_stage), costs
        pin = list(dict.fromkeys(int(e) for e in pinned))
        if len(pin) > slots:
            raise PlanError(f"{len(pin)} pinned experts do not fit {slots} slots")
        self.policy, self.miss_path, self.max_admit, self.params = policy, miss_path, max_admit, params
        self.P, self.S = len(pin), slots
        self.slot_expert = pin + [-1] * (slots - len(pin))
        self.slot_tick = [0] * slots
        self.slot_seg = [0] * slots
        self.slot_pending = [False] * slots
        self.expert_slot = [-1] * n_expert
        for s, e in enumerate(pin):
            self.expert_slot[e] = s
        self.freq = [0] * n_expert
        self.next_use = [_INF] * n_expert  # belady: next step index that routes e
        self.age = 0
        self.tick = 0
        self.protected = 0
        self.protected_cap = (slots - len(pin)) * params.protected_num // params.protected_den
        self.pending: list[int] = []
        self.n_free = slots - len(pin)
        self.counts = policy in ("lfu-aged", "tinylfu")

    def _free_slot(self) -> int:
        if not self.n_free:
            return -1
        for s in range(self.P, self.S):
            if self.slot_expert[s] < 0:
                return s
        return -1

    def _victim(self, used: set[int]) -> int:
        """The evictable slot with the smallest key (see the class docstring); -1 if none."""
        se, tick, pend = self.slot_expert, self.slot_tick, self.slot_pending
        cands = [s for s in range(self.P, self.S) if s not in used and not pend[s] and se[s] >= 0]
        if not cands:
            return -1
        p = self.policy
        if p in ("lfu-aged", "tinylfu"):
            f = self.freq
            return min(cands, key=lambda s: (f[se[s]], tick[s]))
        if p == "slru":
            seg = self.slot_seg
            return min(cands, key=lambda s: (seg[s], tick[s]))
        if p == "belady":
            nu = self.next_use
            return min(cands, key=lambda s: (-nu[se[s]], tick[s]))
        return min(cands, key=tick.__getitem__)

    def _touch(self, s: int) -> None:
        self.tick += 1
        self.slot_tick[s] = self.tick
        if self.policy == "slru" and self.slot_seg[s] == 0:
            self.slot_seg[s] = 1
            self.protected += 1
            if self.protected > self.protected_cap:
                d = min((t for t in range(self.P, self.S) if self.slot_seg[t] == 1),
                        key=lambda t: self.slot_tick[t])
                self.slot_seg[d] = 0
                self.protected -= 1

    def _place(self, e: int, s: int, out: StepOutcome) -> None:
        old = self.slot_expert[s]
        if old >= 0:
            self.expert_slot[old] = -1
            out.evicted.append(old)
            if self.slot_seg[s] == 1:
                self.protected -= 1
        else:
            self.n_free -= 1
        self.slot_expert[s] = e
        self.expert_slot[e] = s
        self.slot_seg[s] = 0
        self.tick += 1
        self.slot_tick[s] = self.tick

    def fill_free(self, entries: Mapping[int, int]) -> list[tuple[int, int]]:
        """A step too large for the LRU slots while some are free (the RAM tier's prompt; native
        slots.fill_free): its misses with most entries (then lower id), as many as there are free
        slots, are placed, the one with most entries last (the most recent). Hits are not touched
        and no count changes. `entries`: the step's routed entries per distinct expert. Returns the
        (expert, slot) placements in the order they were made. (Upload path: no slot is pending.)"""
        if not self.n_free:
            return []
        misses = sorted((e for e in entries if self.expert_slot[e] < 0), key=lambda e: (-entries[e], e))
        out = StepOutcome()
        placed = []
        for e in reversed(misses[:self.n_free]):
            s = self._free_slot()
            self._place(e, s, out)
            placed.append((e, s))
        return placed

    def _admits(self, e: int, victim: int, land: int) -> bool:
        v = self.slot_expert[victim]
        if self.policy == "tinylfu":
            return self.freq[e] > self.freq[v]
        if self.policy == "belady":
            return land < self.next_use[v]
        return True

    def step(self, distinct: Sequence[int], decode: bool = True,
             next_use: Sequence[int] | None = None, land_use: Sequence[int] | None = None,
             large: bool = False, entries: Mapping[int, int] | None = None) -> StepOutcome:
        """One cached (non-stock) step.

        belady only, per distinct expert: `next_use`, the index of the next step that
        routes it; `land_use` (cpu path), of the next such step where an admission made
        now is usable (the next decode step or later). `entries`: the step's entries per
        expert, for the per-expert split (staging slices; None: one per distinct expert).
        """
        cpu = self.miss_path in ("cpu", "auto")
        # a step too large for the policy's slots (n_tokens * k > S - P) runs its misses on the
        # CPU in either path and changes nothing, as a prefill step on the cpu path does
        readonly = large or (cpu and not decode)
        if cpu and not readonly:  # last decode step's admissions have landed
            for s in self.pending:
                self.slot_pending[s] = False
            self.pending = []
        if self.counts and not readonly:
            for e in distinct:
                if self.freq[e] < _U32:
                    self.freq[e] += 1
        land: dict[int, int] = {}
        if next_use is not None:
            for e, n in zip(distinct, next_use):
                self.next_use[e] = n
            land = dict(zip(distinct, land_use if land_use is not None else next_use))
        out = StepOutcome()
        used: set[int] = set()
        for e in distinct:
            s = self.expert_slot[e]
            if s >= 0 and not self.slot_pending[s]:
                out.hits.append(e)
                used.add(s)
                if s >= self.P and not readonly:
                    self._touch(s)
            else:
                out.misses.append(e)
        if readonly:
            if large and self.fills_free:
                out.admitted = self.fill_free(entries if entries is not None else dict.fromkeys(out.misses, 1))
        elif not cpu:
            for e in out.misses:
                s = self._free_slot()
                if s < 0:
                    s = self._victim(used)
                    assert s >= 0, "no evictable slot: the step is larger than the policy's slots"
                self._place(e, s, out)
                used.add(s)
                out.admitted.append((e, s))
        else:
            order = out.misses
            if self.policy == "belady":  # soonest usable next use first; ties in distinct order
                order = sorted(order, key=lambda e: land[e])
            for e in order:
                if len(out.admitted) >= self.max_admit:
                    out.skipped += 1
                    continue
                s = self._free_slot()
                if s < 0:
                    s = self._victim(used)
                    if s < 0 or not self._admits(e, s, land.get(e, _INF)):
                        out.skipped += 1
                        continue
                self._place(e, s, out)
                used.add(s)
                self.slot_pending[s] = True
                self.pending.append(s)
                out.admitted.append((e, s))
        if self.n_stage and (self.miss_path == "auto" or (large and self.miss_path == "upload")):
            n = entries if entries is not None else dict.fromkeys(out.misses, 1)
            admitted = {e for e, _ in out.admitted}  # computed on the CPU while their upload runs
            out.staged = split_misses([e for e in out.misses if e not in admitted], n, self.n_stage, self.costs,
                                      self.miss_path == "auto")
        if self.counts and not readonly and self.params.window > 0:
            self.age += 1
            if self.age >= self.params.window:
                self.freq = [c >> 1 for c in self.freq]
                self.age = 0
        return out

    def resident(self) -> tuple[int, ...]:
        """Pinned experts (sorted), then the others from least to most recently touched."""
        rest = sorted((self.slot_tick[s], self.slot_expert[s]) for s in range(self.P, self.S)
                      if self.slot_expert[s] >= 0)
        return tuple(sorted(self.slot_expert[: self.P])) + tuple(e for _, e in rest)


# ---------------------------------------------------------------- replaying a trace


@dataclass
class _Steps:
    """Replayed steps of one layer: parallel arrays, distinct ids as python lists."""

    decode: np.ndarray  # bool [n_steps]
    n_tokens: np.ndarray  # int64 [n_steps]
    n_distinct: np.ndarray  # int64 [n_steps]
    distinct: list[list[int]]
    entries: list[dict[int, int]] | None = None  # per step: routed entries per expert (the per-expert split's)


def _layer_steps(trace: RoutingTrace, layer: int, keep: np.ndarray, with_entries: bool = False) -> _Steps:
    lo = trace.step_bounds()[:-1]
    col = trace.ids[:, layer, :]
    # -1 rows: the layer did not run (or, for the last layer, routed only the output rows,
    # which come first in their step)
    valid = (col[:, 0] >= 0).astype(np.int64)
    nval = np.add.reduceat(valid, lo) if lo.size else np.zeros(0, dtype=np.int64)
    sel = keep[lo] & (nval > 0) if lo.size else np.zeros(0, dtype=bool)
    lo, nval = lo[sel], nval[sel]
    srt = np.sort(col, axis=1)
    dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1)  # rows routing one expert twice
    rows = col.tolist()  # python ints: much faster than numpy scalars in the loops
    distinct = []
    entries: list[dict[int, int]] | None = [] if with_entries else None
    for a, m in zip(lo.tolist(), nval.tolist()):
        if m == 1 and not dup[a]:
            distinct.append(rows[a])
        else:
            distinct.append(list(dict.fromkeys(e for r in rows[a:a + m] for e in r)))
        if entries is not None:
            n: dict[int, int] = {}
            for r in rows[a:a + m]:
                for e in r:
                    n[e] = n.get(e, 0) + 1
            entries.append(n)
    return _Steps(decode=trace.phase[lo] == DECODE, n_tokens=nval,
                  n_distinct=np.fromiter(map(len, distinct), dtype=np.int64, count=len(distinct)),
                  distinct=distinct, entries=entries)


@dataclass
class _Run:
    """Per cached step: hits, misses, admissions, skipped admissions; and the end state."""

    hits: np.ndarray
    misses: np.ndarray
    admissions: np.ndarray
    skipped: np.ndarray
    resident: tuple[int, ...]
    cpu: np.ndarray  # misses computed on the CPU
    staged: np.ndarray | None = None  # misses staged for their step


def _next_uses(steps: list[list[int]], decode: Sequence[bool] | None = None) -> list[list[int]]:
    """For each step and each of its distinct experts, the index of its next step (or _INF).

    With `decode`: the next step at or after the next decode step (where a cpu-path
    admission made in this step is usable).
    """
    last: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(steps)
    if decode is None:
        for t in range(len(steps) - 1, -1, -1):
            out[t] = [last.get(e, _INF) for e in steps[t]]
            for e in steps[t]:
                last[e] = t
        return out
    # from_d[e]: first use of e at or after the decode step following t
    first_from: dict[int, int] = {}  # first use of e at index >= t + 1
    from_d: dict[int, int] = {}
    for t in range(len(steps) - 1, -1, -1):
        if t + 1 < len(steps) and decode[t + 1]:
            from_d = dict(first_from)  # the next decode step is t + 1
        out[t] = [from_d.get(e, _INF) for e in steps[t]]
        for e in steps[t]:
            first_from[e] = t
    return out


def _run_lru_upload(steps: list[list[int]], pin: set[int], cap: int,
                    large: Sequence[bool] | None = None) -> tuple[list[int], list[int]]:
    """Plain LRU, upload path: an OrderedDict reproduces the resident set (design.md).
    A large step (misses on the CPU) only counts its misses."""
    lru: OrderedDict[int, None] = OrderedDict()
    out = []
    for t, distinct in enumerate(steps):
        if large is not None and large[t]:
            out.append(sum(1 for e in distinct if e not in lru and e not in pin))
            continue
        misses = []
        for e in distinct:
            if e in lru:
                lru.move_to_end(e)  # hits are touched before any miss is filled
            elif e not in pin:
                misses.append(e)
        for e in misses:
            if len(lru) >= cap:
                lru.popitem(last=False)  # never touched this step: distinct <= cap
            lru[e] = None
        out.append(len(misses))
    return list(lru), out


def _run(steps: list[list[int]], decode: list[bool], n_expert: int, slots: int, pin: Sequence[int],
         policy: str, miss_path: str, max_admit: int, params: PolicyParams,
         large: list[bool] | None = None, n_stage: int = 0, costs: MissCosts = MissCosts(),
         entries: list[dict[int, int]] | None = None, fill_free: bool = False) -> _Run:
    n_distinct = np.fromiter(map(len, steps), dtype=np.int64, count=len(steps))
    large = large if large is not None else [False] * len(steps)
    big = np.asarray(large, dtype=bool)
    if policy in ("lru", "lru-pinned") and miss_path == "upload" and not n_stage and not fill_free:
        lru, misses = _run_lru_upload(steps, set(pin), slots - len(set(pin)), large)
        m = np.asarray(misses, dtype=np.int64)
        return _Run(n_distinct - m, m, np.where(big, 0, m), np.zeros_like(m),
                    tuple(sorted(set(pin))) + tuple(lru), np.where(big, m, 0))
    cache = LayerCache(n_expert, slots, pin, policy, miss_path, max_admit, params, n_stage, costs, fill_free)
    nxt = land = None
    if policy == "belady":
        nxt = _next_uses(steps)
        land = _next_uses(steps, decode) if miss_path != "upload" else nxt
    out: list[tuple[int, int, int, int, int]] = []
    for t, distinct in enumerate(steps):
        o = cache.step(distinct, decode[t], nxt[t] if nxt is not None else None,
                       land[t] if land is not None else None, large=large[t],
                       entries=entries[t] if entries is not None else None)
        out.append((len(o.hits), len(o.misses), len(o.admitted), o.skipped, len(o.staged)))
    a = np.asarray(out, dtype=np.int64).reshape(len(steps), 5)
    on_cpu = (a[:, 1] if miss_path != "upload" else np.where(big, a[:, 1], 0)) - a[:, 4]
    return _Run(a[:, 0], a[:, 1], a[:, 2], a[:, 3], cache.resident(), on_cpu, a[:, 4])


def _replay(steps: _Steps, k: int, n_expert: int, layer: int, slots: int, pinned: Sequence[int],
            policy: str, miss_path: str = "upload", max_admit: int | None = None,
            params: PolicyParams = PolicyParams(), cpu_path: bool = True, n_stage: int = 0,
            costs: MissCosts = MissCosts(), fill_free: bool = False) -> LayerStats:
    """cpu_path: the layer can compute misses on the CPU (native: its expert ops have a CPU
    recipe), so steps too large for the slots run resident experts from the bank and the rest
    on the CPU; without it they are stock steps (host weights, nothing counted). fill_free: the
    RAM tier (cpu_path too): those steps fill the free slots (LayerCache.fill_free)."""
    pin = list(dict.fromkeys(int(e) for e in pinned))
    if len(pin) > slots:
        raise PlanError(f"layer {layer}: {len(pin)} pinned experts do not fit {slots} slots")
    cap = slots - len(pin)
    too_large = steps.n_tokens * k > cap
    stock = too_large & (not cpu_path)
    cached = np.flatnonzero(~stock)
    dec = steps.decode[cached]
    idx = cached.tolist()
    r = _run([steps.distinct[i] for i in idx], dec.tolist(), n_expert, slots, pin, policy,
             miss_path, k if max_admit is None or max_admit < 0 else max_admit, params,
             too_large[cached].tolist(), n_stage if cpu_path else 0, costs,
             [steps.entries[i] for i in idx] if steps.entries is not None else None, fill_free)
    sd = stock & steps.decode
    return LayerStats(
        layer=layer, slots=slots, pinned=len(pin),
        hits=int(r.hits.sum()), misses=int(r.misses.sum()), uploads=len(pin) + int(r.admissions.sum()),
        admissions=int(r.admissions.sum()), admit_skipped=int(r.skipped.sum()),
        cpu_experts=int(r.cpu.sum()), staged=int(r.staged.sum()) if r.staged is not None else 0,
        cached_steps=int(cached.size), stock_steps=int(stock.sum()),
        stock_accesses=int(steps.n_distinct[stock].sum()),
        hits_decode=int(r.hits[dec].sum()), misses_decode=int(r.misses[dec].sum()),
        miss_steps_decode=int((r.misses[dec] > 0).sum()),
        admissions_decode=int(r.admissions[dec].sum()),
        stock_steps_decode=int(sd.sum()), stock_accesses_decode=int(steps.n_distinct[sd].sum()),
        final_resident=r.resident)


def _phase_mask(trace: RoutingTrace, phases: Iterable[str | int]) -> tuple[np.ndarray, tuple[str, ...]]:
    codes = {phase_code(p) for p in phases}
    names = tuple(n for n, c in (("prefill", 0), ("decode", 1)) if c in codes)
    return np.isin(trace.phase, list(codes)), names


def canonical_policy(policy: str) -> str:
    """The stable name of a policy (aliases resolved); PlanError when unknown."""
    p = ALIASES.get(policy, policy)
    if p not in POLICIES:
        raise PlanError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    return p


def _check(policy: str, pinned: Mapping[int, Sequence[int]] | None, miss_path: str) -> str:
    p = canonical_policy(policy)
    if p == "lru" and pinned and any(pinned.values()):
        raise PlanError("policy 'lru' has no pinned experts; use 'lru-pinned'")
    if miss_path not in LAYER_MISS_PATHS:
        raise PlanError(f"unknown miss path {miss_path!r}: expected one of {', '.join(LAYER_MISS_PATHS)}")
    return p


def simulate(trace: RoutingTrace, policy: str, slots: Mapping[int, int] | int,
             pinned: Mapping[int, Sequence[int]] | None = None,
             bytes_per_expert: Mapping[int, int] | Sequence[int] | None = None,
             phases: Sequence[str | int] = ("decode",), miss_path: str = "upload",
             max_admit: int | None = None, params: PolicyParams | None = None,
             cpu_path: bool = False, n_stage: int = 0, costs: MissCosts = MissCosts(),
             ram_tier: bool = False) -> SimResult:
    """Replay the steps of `phases` (others are skipped: no state change, not counted).

    ram_tier: the layers are the RAM tier's (native's file tier): a step too large for the slots
    fills the free slots and counts its misses (pass phases=("prefill", "decode") to replay the
    prompt's warming too).

    n_stage, costs: the per-expert split (auto; upload-path steps too large for the slots) with
    that many staging slices, its cost rule exactly as native (MissCosts; cpu_path only).

    cpu_path: steps too large for the slots run from the bank plus the CPU, read-only (the
    native cache on a layer with a CPU recipe); False: they are stock steps (host weights).

    `slots` is one count for every MoE layer or a per-layer dict; layers absent from the
    dict are not simulated. Pass phases=("prefill", "decode") to match the native cache.
    max_admit: cpu path admissions per decode step (None or < 0: k, as native).
    """
    policy = _check(policy, pinned, miss_path)
    params = params or PolicyParams()
    keep, names = _phase_mask(trace, phases)
    moe = trace.moe_layers()
    if isinstance(slots, Mapping):
        per_layer = {int(l): int(s) for l, s in slots.items() if int(l) in moe}
    else:
        per_layer = {l: int(slots) for l in moe}
    pinned = pinned or {}
    layers = {}
    for layer, s in sorted(per_layer.items()):
        steps = _layer_steps(trace, layer, keep, with_entries=n_stage > 0 or ram_tier)
        layers[layer] = _replay(steps, trace.k, trace.n_expert, layer, s, pinned.get(layer, ()), policy,
                                miss_path, max_admit, params, cpu_path or ram_tier, n_stage, costs, ram_tier)
    bpe = None
    if bytes_per_expert is not None:
        items = bytes_per_expert.items() if isinstance(bytes_per_expert, Mapping) \
            else enumerate(bytes_per_expert)
        bpe = {int(l): int(b) for l, b in items}
    return SimResult(policy=policy, layers=layers, tokens=int(np.count_nonzero(keep)),
                     decode_tokens=int(np.count_nonzero(keep & (trace.phase == DECODE))),
                     bytes_per_expert=bpe, phases=names, miss_path=miss_path)


class LayerTrace:
    """The steps of `phases` of one layer of a trace, read once, to replay many placements
    of that layer on them (the planner prices pins against slots this way)."""

    def __init__(self, trace: RoutingTrace, layer: int, phases: Sequence[str | int] = ("decode",)):
        keep, _ = _phase_mask(trace, phases)
        self.layer, self.k, self.n_expert = layer, trace.k, trace.n_expert
        self._steps = _layer_steps(trace, layer, keep)

    def replay(self, slots: int, pinned: Sequence[int] = (), policy: str = DEFAULT_POLICY,
               miss_path: str = "upload", max_admit: int | None = None, params: PolicyParams | None = None,
               cpu_path: bool = True) -> LayerStats:
        """This layer with `slots` slots, `pinned` in the first ones, through `policy` (as simulate;
        cpu_path True: steps too large for the slots run from the bank plus the CPU, as native)."""
        policy = _check(policy, {self.layer: pinned} if pinned else None, miss_path)
        return _replay(self._steps, self.k, self.n_expert, self.layer, int(slots), pinned, policy, miss_path,
                       max_admit, params or PolicyParams(), cpu_path)


def miss_ratio_curve(trace: RoutingTrace, layer: int, slot_counts: Sequence[int],
                     policy: str = "lru", pinned: Sequence[int] | None = None,
                     phases: Sequence[str | int] = ("decode",), miss_path: str = "upload",
                     params: PolicyParams | None = None) -> list[float]:
    """1 - hit_rate of one layer for each slot count (stock steps count as misses)."""
    lt = LayerTrace(trace, layer, phases)
    out = []
    for s in slot_counts:
        st = lt.replay(int(s), pinned or (), policy, miss_path, None, params)
        out.append(1.0 - st.hit_rate if st.accesses else 0.0)
    return out


def cold_hit_rate(trace: RoutingTrace, resident: Mapping[int, set[int] | Iterable[int]]) -> float:
    """Share of routed (token, expert) decode occurrences whose expert is not resident.

    Static placement, no cache; MoE layers absent from `resident` hold nothing.
    """
    dec = trace.ids[trace.phase == DECODE]
    total = cold = 0
    for layer in trace.moe_layers():
        col = dec[:, layer, :].ravel()
        col = col[col >= 0]
        total += col.size
        res = np.fromiter(resident.get(layer, ()), dtype=np.int64)
        cold += int(np.count_nonzero(~np.isin(col, res)))
    return cold / total if total else 0.0


@dataclass
class SimRow:
    slots: int
    policy: str
    pinned: int
    hit_rate: float
    uploads_per_token: float
    bytes_per_token: float | None
    miss_path: str = "upload"
    vs_belady: float | None = None  # hit rate / Belady's at the same slots and miss path
    default: bool = False  # the policy a cache runs unless told otherwise
    staged_per_token: float = 0.0  # auto: misses uploaded into staging slices for their step, per token


def simulate_rows(trace, slot_counts: Sequence[int], policies: Sequence[str], *, pinned_from: np.ndarray | None,
                  bytes_per_expert: dict[int, int] | None, k: int, pin: int | None = None,
                  phases: Sequence[str] = ("decode",), miss_paths: Sequence[str] = ("upload",),
                  max_admit: int | None = None, params=None, n_stage: int = 0,
                  costs: MissCosts = MissCosts()) -> list[SimRow]:
    """Each policy at each slot count and miss path; lru-pinned pins the top experts of
    `pinned_from` ([n_layer, E] counts; none without it): `pin` per layer, default half
    the slots, keeping at least k LRU slots. auto: the per-expert split with `n_stage` staging
    slices and `costs` (steps too large for the slots run from the bank plus CPU and staging)."""
    all_phases = len(phases) > 1
    rows = []
    moe = trace.moe_layers()
    for miss_path in miss_paths:
        for s in slot_counts:
            group = []
            for policy in policies:
                pinned: dict[int, list[int]] = {}
                n_pin = 0
                if policy == "lru-pinned" and pinned_from is not None:
                    n_pin = max(0, min(s // 2 if pin is None else pin, s - k, trace.n_expert))
                    for layer in moe:
                        order = np.argsort(-pinned_from[layer], kind="stable")
                        pinned[layer] = [int(e) for e in order[:n_pin]]
                split = miss_path == "auto"
                r = simulate(trace, policy, s, pinned=pinned or None, bytes_per_expert=bytes_per_expert,
                             phases=phases, miss_path=miss_path, max_admit=max_admit, params=params,
                             cpu_path=split, n_stage=n_stage if split else 0, costs=costs)
                if all_phases:
                    tokens = r.tokens
                    hit, ups = r.hit_rate, (r.admissions / tokens if tokens else 0.0)
                    bpt = (sum(st.admissions * bytes_per_expert.get(st.layer, 0) for st in r.layers.values()) / tokens
                           if bytes_per_expert is not None and tokens else (0.0 if bytes_per_expert else None))
                else:
                    hit, ups, bpt = r.hit_rate_decode, r.uploads_per_token, r.bytes_per_token
                n_tok = r.tokens if all_phases else r.decode_tokens
                group.append(SimRow(s, r.policy, n_pin, hit, ups, bpt, miss_path,
                                    default=canonical_policy(policy) == DEFAULT_POLICY,
                                    staged_per_token=r.staged / n_tok if n_tok else 0.0))
            best = [r.hit_rate for r in group if r.policy == "belady"]
            for r in group:
                r.vs_belady = r.hit_rate / best[0] if best and best[0] > 0 else None
            rows += group
    return rows
