"""Replay a routing trace through expert-cache policies, one layer at a time.

Policies share the step rule of the native cache (docs/design.md):
- a step with `n_tokens * k > S - P` is a *stock* step: no state change, no hits/misses;
- otherwise `distinct` = ids in first-appearance order; resident ones are hits and are
  touched first, then misses are filled in order; an expert needed in the current step
  is never evicted.

"lru" is "lru-pinned" with P = 0 and reproduces the native resident set exactly.
"lfu" keeps a count per expert (resident or not), +1 per step that uses it, halved every
`lfu_half_life` cached steps; it evicts the lowest count, ties by least recent.
"belady" evicts the resident expert whose next use (in cached steps) is furthest away.
Pinned experts (all policies but "lru") are resident from the start and never evicted.
Pinned experts that do not fit the slots, or an unknown policy, raise PlanError.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from .errors import PlanError
from .trace import DECODE, RoutingTrace, phase_code

POLICIES = ("lru", "lru-pinned", "lfu", "belady")
_INF = 1 << 62


@dataclass
class LayerStats:
    layer: int
    slots: int
    pinned: int
    hits: int = 0  # distinct experts per cached step found resident (pinned included)
    misses: int = 0
    uploads: int = 0  # misses + pinned uploads at start
    cached_steps: int = 0
    stock_steps: int = 0
    stock_accesses: int = 0  # distinct experts in stock steps: served from host
    hits_decode: int = 0
    misses_decode: int = 0
    stock_steps_decode: int = 0
    stock_accesses_decode: int = 0
    final_resident: tuple[int, ...] = ()  # LRU: pinned, then least -> most recent

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

    def _sum(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.layers.values())

    hits = property(lambda self: self._sum("hits"))
    misses = property(lambda self: self._sum("misses"))
    uploads = property(lambda self: self._sum("uploads"))
    stock_steps = property(lambda self: self._sum("stock_steps"))
    hits_decode = property(lambda self: self._sum("hits_decode"))
    misses_decode = property(lambda self: self._sum("misses_decode"))
    stock_steps_decode = property(lambda self: self._sum("stock_steps_decode"))

    @property
    def uploads_decode(self) -> int:
        return self.misses_decode  # pinned uploads happen once, before decoding

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
        """Expert uploads per decode token, all layers together."""
        return self.uploads_decode / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def bytes_per_token(self) -> float | None:
        """Bytes uploaded per decode token, given bytes per expert per layer."""
        if self.bytes_per_expert is None:
            return None
        if not self.decode_tokens:
            return 0.0
        total = sum(s.misses_decode * self.bytes_per_expert[s.layer] for s in self.layers.values())
        return total / self.decode_tokens


@dataclass
class _Steps:
    """Replayed steps of one layer: parallel arrays, distinct ids as python lists."""

    decode: np.ndarray  # bool [n_steps]
    n_tokens: np.ndarray  # int64 [n_steps]
    n_distinct: np.ndarray  # int64 [n_steps]
    distinct: list[list[int]]


def _layer_steps(trace: RoutingTrace, layer: int, keep: np.ndarray) -> _Steps:
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
    for a, m in zip(lo.tolist(), nval.tolist()):
        if m == 1 and not dup[a]:
            distinct.append(rows[a])
        else:
            distinct.append(list(dict.fromkeys(e for r in rows[a:a + m] for e in r)))
    return _Steps(decode=trace.phase[lo] == DECODE, n_tokens=nval,
                  n_distinct=np.fromiter(map(len, distinct), dtype=np.int64, count=len(distinct)),
                  distinct=distinct)


def _replay(steps: _Steps, k: int, layer: int, slots: int, pinned: Sequence[int],
            policy: str, lfu_half_life: int) -> LayerStats:
    pin = set(pinned)
    if len(pin) > slots:
        raise PlanError(f"layer {layer}: {len(pin)} pinned experts do not fit {slots} slots")
    cap = slots - len(pin)
    stock = steps.n_tokens * k > cap
    cached = np.flatnonzero(~stock)
    run = {"lru": _run_lru, "lru-pinned": _run_lru, "lfu": _run_lfu, "belady": _run_belady}[policy]
    resident, misses = run([steps.distinct[i] for i in cached.tolist()], pin, cap, lfu_half_life)
    misses = np.asarray(misses, dtype=np.int64)
    hits = steps.n_distinct[cached] - misses
    dec = steps.decode[cached]
    sd = stock & steps.decode
    return LayerStats(
        layer=layer, slots=slots, pinned=len(pin),
        hits=int(hits.sum()), misses=int(misses.sum()), uploads=len(pin) + int(misses.sum()),
        cached_steps=int(cached.size), stock_steps=int(stock.sum()),
        stock_accesses=int(steps.n_distinct[stock].sum()),
        hits_decode=int(hits[dec].sum()), misses_decode=int(misses[dec].sum()),
        stock_steps_decode=int(sd.sum()), stock_accesses_decode=int(steps.n_distinct[sd].sum()),
        final_resident=tuple(sorted(pin)) + tuple(resident))


# Each runner takes the cached steps' distinct ids and returns
# (final resident non-pinned experts, misses per step).

def _run_lru(steps: list[list[int]], pin: set[int], cap: int, _: int) -> tuple[list[int], list[int]]:
    lru: OrderedDict[int, None] = OrderedDict()
    out = []
    for distinct in steps:
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


def _run_lfu(steps: list[list[int]], pin: set[int], cap: int, half_life: int) -> tuple[list[int], list[int]]:
    # Halving every count each half-life == adding 2**epoch per use instead: same order,
    # so heap keys stay valid. Rescaled every 64 epochs to keep floats finite.
    count: dict[int, float] = {}  # every expert seen, resident or not
    last: dict[int, int] = {}  # resident expert -> step of last use
    heap: list[tuple[float, int, int]] = []  # (count, last use, expert); stale entries skipped
    inc, out = 1.0, []
    for t, distinct in enumerate(steps):
        if half_life > 0 and t and t % half_life == 0:
            inc *= 2.0
            if inc >= 2.0 ** 64:
                count = {e: c / inc for e, c in count.items()}
                inc = 1.0
                heap = [(count[e], u, e) for e, u in last.items()]
                heapq.heapify(heap)
        if len(heap) > 8 * cap + 64:
            heap = [(count[e], u, e) for e, u in last.items()]
            heapq.heapify(heap)
        misses = []
        for e in distinct:
            count[e] = count.get(e, 0.0) + inc
            if e in last:
                last[e] = t
                heapq.heappush(heap, (count[e], t, e))
            elif e not in pin:
                misses.append(e)
        for e in misses:
            if len(last) >= cap:
                held = []  # experts of this step: never evicted
                while True:
                    c, u, v = heapq.heappop(heap)
                    if last.get(v) != u or count[v] != c:
                        continue
                    if u == t:
                        held.append((c, u, v))
                        continue
                    del last[v]
                    break
                for item in held:
                    heapq.heappush(heap, item)
            last[e] = t
            heapq.heappush(heap, (count[e], t, e))
        out.append(len(misses))
    return sorted(last, key=lambda r: (last[r], r)), out


def _run_belady(steps: list[list[int]], pin: set[int], cap: int, _: int) -> tuple[list[int], list[int]]:
    last: dict[int, int] = {}
    next_use: list[list[int]] = [[]] * len(steps)
    for t in range(len(steps) - 1, -1, -1):  # reverse pass: next cached use per occurrence
        next_use[t] = [last.get(e, _INF) for e in steps[t]]
        for e in steps[t]:
            last[e] = t
    nxt: dict[int, int] = {}  # resident expert -> its next use
    heap: list[tuple[int, int]] = []  # (-next_use, expert); stale entries skipped on pop
    out = []
    for distinct, nus in zip(steps, next_use):
        if len(heap) > 8 * cap + 64:  # drop stale entries
            heap = [(-n, e) for e, n in nxt.items()]
            heapq.heapify(heap)
        misses = []
        for e, nu in zip(distinct, nus):
            if e in nxt:
                nxt[e] = nu
                heapq.heappush(heap, (-nu, e))
            elif e not in pin:
                misses.append((e, nu))
        now = set(distinct) if misses else ()
        for e, nu in misses:
            if len(nxt) >= cap:
                held = []  # experts of this step: never evicted
                while True:
                    neg, v = heapq.heappop(heap)
                    if nxt.get(v) != -neg:
                        continue
                    if v in now:
                        held.append((neg, v))
                        continue
                    del nxt[v]
                    break
                for item in held:
                    heapq.heappush(heap, item)
            nxt[e] = nu
            heapq.heappush(heap, (-nu, e))
        out.append(len(misses))
    return sorted(nxt), out


def _phase_mask(trace: RoutingTrace, phases: Iterable[str | int]) -> tuple[np.ndarray, tuple[str, ...]]:
    codes = {phase_code(p) for p in phases}
    names = tuple(n for n, c in (("prefill", 0), ("decode", 1)) if c in codes)
    return np.isin(trace.phase, list(codes)), names


def _check_policy(policy: str, pinned: Mapping[int, Sequence[int]] | None) -> None:
    if policy not in POLICIES:
        raise PlanError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    if policy == "lru" and pinned and any(pinned.values()):
        raise PlanError("policy 'lru' has no pinned experts; use 'lru-pinned'")


def simulate(trace: RoutingTrace, policy: str, slots: Mapping[int, int] | int,
             pinned: Mapping[int, Sequence[int]] | None = None,
             bytes_per_expert: Mapping[int, int] | Sequence[int] | None = None,
             phases: Sequence[str | int] = ("decode",), lfu_half_life: int = 128) -> SimResult:
    """Replay the steps of `phases` (others are skipped: no state change, not counted).

    `slots` is one count for every MoE layer or a per-layer dict; layers absent from the
    dict are not simulated. Pass phases=("prefill", "decode") to match the native cache.
    """
    _check_policy(policy, pinned)
    keep, names = _phase_mask(trace, phases)
    moe = trace.moe_layers()
    if isinstance(slots, Mapping):
        per_layer = {int(l): int(s) for l, s in slots.items() if int(l) in moe}
    else:
        per_layer = {l: int(slots) for l in moe}
    pinned = pinned or {}
    layers = {}
    for layer, s in sorted(per_layer.items()):
        steps = _layer_steps(trace, layer, keep)
        layers[layer] = _replay(steps, trace.k, layer, s, pinned.get(layer, ()), policy, lfu_half_life)
    bpe = None
    if bytes_per_expert is not None:
        items = bytes_per_expert.items() if isinstance(bytes_per_expert, Mapping) \
            else enumerate(bytes_per_expert)
        bpe = {int(l): int(b) for l, b in items}
    return SimResult(policy=policy, layers=layers, tokens=int(np.count_nonzero(keep)),
                     decode_tokens=int(np.count_nonzero(keep & (trace.phase == DECODE))),
                     bytes_per_expert=bpe, phases=names)


def miss_ratio_curve(trace: RoutingTrace, layer: int, slot_counts: Sequence[int],
                     policy: str = "lru", pinned: Sequence[int] | None = None,
                     phases: Sequence[str | int] = ("decode",), lfu_half_life: int = 128) -> list[float]:
    """1 - hit_rate of one layer for each slot count (stock steps count as misses)."""
    _check_policy(policy, {layer: pinned} if pinned else None)
    keep, _ = _phase_mask(trace, phases)
    steps = _layer_steps(trace, layer, keep)
    out = []
    for s in slot_counts:
        st = _replay(steps, trace.k, layer, int(s), pinned or (), policy, lfu_half_life)
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


def simulate_rows(trace, slot_counts: Sequence[int], policies: Sequence[str], *, pinned_from: np.ndarray | None,
                  bytes_per_expert: dict[int, int] | None, k: int, pin: int | None = None,
                  phases: Sequence[str] = ("decode",), lfu_half_life: int = 128) -> list[SimRow]:
    """Each policy at each slot count; lru-pinned pins the top experts of `pinned_from`
    ([n_layer, E] counts; none without it): `pin` per layer, default half the slots,
    keeping at least k LRU slots."""
    all_phases = len(phases) > 1
    rows = []
    moe = trace.moe_layers()
    for s in slot_counts:
        for policy in policies:
            pinned: dict[int, list[int]] = {}
            n_pin = 0
            if policy == "lru-pinned" and pinned_from is not None:
                n_pin = max(0, min(s // 2 if pin is None else pin, s - k, trace.n_expert))
                for layer in moe:
                    order = np.argsort(-pinned_from[layer], kind="stable")
                    pinned[layer] = [int(e) for e in order[:n_pin]]
            r = simulate(trace, policy, s, pinned=pinned or None, bytes_per_expert=bytes_per_expert,
                         phases=phases, lfu_half_life=lfu_half_life)
            if all_phases:
                tokens = r.tokens
                hit, ups = r.hit_rate, (r.misses / tokens if tokens else 0.0)
                bpt = (sum(st.misses * bytes_per_expert.get(st.layer, 0) for st in r.layers.values()) / tokens
                       if bytes_per_expert is not None and tokens else (0.0 if bytes_per_expert else None))
            else:
                hit, ups, bpt = r.hit_rate_decode, r.uploads_per_token, r.bytes_per_token
            rows.append(SimRow(s, policy, n_pin, hit, ups, bpt))
    return rows
