"""The RAM tier: when a model's weights do not fit the run's RAM, the model file is the tier below.

The non-expert weights stay resident. Each MoE layer gets slots in RAM (the native file tier's
banks): its hottest experts by the profile's decode counts pinned, the rest of the slots LRU; an
expert that is not resident is read from the model file when routed (preads, a step's reads in
flight together) instead of being faulted in through the mapping. A prefill ubatch that routes to
more experts than the LRU slots hold reads each missing expert once into a staging slice (one
layer's worth, shared by the layers), so prompts keep their ubatch, and their kernels.

Sizes are the GGUF's own tensor bytes (gguf_info); the RAM the run needs besides the weights
(KV cache, compute buffers, the runtime) is the caller's to subtract first. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import units
from .gguf_info import ModelGeometry
from ..errors import PlanError

LRU_SHARE = 0.5  # of a layer's slots left to LRU (the rest pin the hottest experts), at least 2 x k


@dataclass(frozen=True)
class RamLayer:
    il: int
    n_slots: int
    pinned: tuple[int, ...]
    expert_bytes: int  # one expert across the layer's expert tensors

    @property
    def bank_bytes(self) -> int:
        return self.n_slots * self.expert_bytes  # NOTE: no guard slice: every routed expert is read into a slot


@dataclass(frozen=True)
class RamTier:
    """What sits where when the weights do not fit `budget`: resident weights, RAM slots, the file."""

    budget: int  # bytes of RAM for weights
    source: str  # where the budget came from (--ram, a cgroup, psutil, SPARK_RAM_LIMIT)
    resident_bytes: int  # weights resident besides the tier's layers (non-expert; with a device, its host weights)
    layers: tuple[RamLayer, ...]
    total_expert_bytes: int  # the routed-expert bytes of the tier's layers
    n_stage: int  # staging slices (the experts of a layer not pinned)
    stage_bytes: int

    @property
    def bank_bytes(self) -> int:
        """RAM the native banks take: every layer's slots, and the staging slices."""
        return sum(l.bank_bytes for l in self.layers) + self.stage_bytes

    @property
    def resident_share(self) -> float:
        """Share of the expert bytes held in RAM slots."""
        held = sum(l.n_slots * l.expert_bytes for l in self.layers)
        return held / self.total_expert_bytes if self.total_expert_bytes else 1.0

    def line(self) -> str:
        return (f"RAM tier: {units.fmt_bytes(self.budget)} for weights ({self.source}): "
                f"{units.fmt_bytes(self.resident_bytes)} of other weights resident, {units.fmt_bytes(self.bank_bytes)} "
                f"of expert slots ({self.resident_share:.0%} of the experts), the rest read from the model file")


def resident_bytes(g: ModelGeometry) -> int:
    """The weights that stay resident in a CPU run: everything but the routed experts."""
    return g.global_bytes + sum(l.nonexpert_bytes for l in g.layers)


def expert_bytes(g: ModelGeometry, layers: Sequence[int]) -> int:
    """The routed-expert bytes of `layers`."""
    return sum(g.layers[il].expert_bytes_per_expert * g.n_expert for il in layers)


def slot_floor(g: ModelGeometry, il: int) -> int:
    """The RAM a layer in the tier needs at least: k slots."""
    return g.n_expert_used * g.layers[il].expert_bytes_per_expert


def three_tier_need(g: ModelGeometry, cached: Sequence[int], host: Sequence[int]) -> int:
    """The least RAM a device placement's host weights take (planned, before a dry run measures them):
    the input embeddings llama.cpp keeps on the CPU, the cached layers' experts whole (their device
    misses' source) and, for the host layers, the RAM tier's floor (minimum)."""
    resident = g.token_embd_bytes + expert_bytes(g, cached)
    return minimum(g, host, resident) if host else resident


def fits(g: ModelGeometry, budget: int) -> bool:
    return resident_bytes(g) + g.total_expert_bytes <= budget


def stage_bytes(g: ModelGeometry, layers: Sequence[int] | None = None) -> int:
    """A layer's worth of staging slices (the largest layer's experts), shared by every layer."""
    layers = g.moe_layers if layers is None else layers
    return g.n_expert * max((g.layers[il].expert_bytes_per_expert for il in layers), default=0)


def minimum(g: ModelGeometry, layers: Sequence[int] | None = None, resident: int | None = None) -> int:
    """The smallest budget the file tier runs in: the resident weights, the staging slices and k LRU
    slots per layer in the tier (default: every MoE layer, a CPU run's)."""
    layers = g.moe_layers if layers is None else layers
    resident = resident_bytes(g) if resident is None else resident
    return resident + stage_bytes(g, layers) + sum(slot_floor(g, il) for il in layers)


def plan(g: ModelGeometry, budget: int, source: str, counts: np.ndarray | None = None,
         flag: str = "--ram", layers: Sequence[int] | None = None, resident: int | None = None) -> RamTier | None:
    """The RAM tier for `budget` bytes of weights (None: everything fits, nothing changes).
    `counts`: the profile's decode counts [n_layer, n_expert] (None: no pins, all slots LRU).
    `layers`: the MoE layers whose experts the tier holds (default: every one, a CPU run's; with a
    device, the plan's host layers: three tiers); `resident`: the weights that stay resident in RAM
    besides them (default: the non-expert weights, a CPU run's; with a device, the dry run's host
    weights less those layers' experts).
    PlanError, one line, when the budget cannot hold the resident weights and k slots a layer."""
    moe = list(g.moe_layers if layers is None else layers)
    resident = resident_bytes(g) if resident is None else resident
    if resident + expert_bytes(g, moe) <= budget:
        return None
    need = minimum(g, moe, resident)
    if not moe or budget < need:
        what = (f"its non-expert weights ({units.fmt_bytes(resident)})" if layers is None else
                f"the weights the plan keeps in RAM ({units.fmt_bytes(resident)}: the cached layers' host experts "
                "and the weights llama.cpp keeps on the CPU)")
        tail = (f", a layer of staging slices and {g.n_expert_used} expert slots per MoE layer in RAM" if moe else
                " with no host layer to read from the file")
        raise PlanError(f"{flag}: {units.fmt_bytes(budget)} for weights ({source}) is too small for this model: "
                        f"{what}{tail} need {units.fmt_bytes(need)}",
                        hint="give the run more RAM (--ram, the container's memory limit), more --vram, "
                             "or use a smaller model")
    left = budget - resident - stage_bytes(g, moe)
    per_slot = sum(g.layers[il].expert_bytes_per_expert for il in moe)
    # NOTE: one slot count for every layer, spread evenly, the rest to early layers
    n_slots = min(g.n_expert, left // per_slot)
    out = []
    spare = left - n_slots * per_slot
    for il in moe:
        eb = g.layers[il].expert_bytes_per_expert
        s = n_slots
        if s < g.n_expert and spare >= eb:
            s, spare = s + 1, spare - eb
        out.append(RamLayer(il, int(s), _pins(counts, il, int(s), g.n_expert_used), eb))
    return RamTier(budget, source, resident, tuple(out), expert_bytes(g, moe), g.n_expert, stage_bytes(g, moe))


def _pins(counts: np.ndarray | None, il: int, n_slots: int, k: int) -> tuple[int, ...]:
    """The layer's hottest experts by decode count (ties: lower id), leaving LRU_SHARE of the slots, at
    least 2 x k, to LRU; none without counts."""
    if counts is None or il >= counts.shape[0] or counts[il].sum() <= 0:
        return ()
    lru = min(n_slots, max(2 * k, int(np.ceil(n_slots * LRU_SHARE))))
    row = counts[il]
    order = sorted(range(row.shape[0]), key=lambda e: (-int(row[e]), e))
    return tuple(int(e) for e in order[:n_slots - lru] if row[e] > 0)



@dataclass(frozen=True)
class DecodeMisses:
    """Per decode token: distinct experts not in RAM (each read from the file), and the layer steps
    with at least one (each waits on its reads: cost_model.file_tier_tg)."""

    per_token: float
    steps_per_token: float


def decode_misses(slots: dict[int, int], pinned: dict[int, tuple[int, ...]], trace) -> DecodeMisses | None:
    """The trace replayed through the RAM slots under the native policy (core/simulator.py, exact; a
    prompt's steps warm the free slots, as native); None without decode steps."""
    from .simulator import DEFAULT_POLICY, simulate

    if trace is None or not slots:
        return None
    sim = simulate(trace, DEFAULT_POLICY, slots, pinned, phases=("prefill", "decode"), ram_tier=True)
    if sim.decode_tokens == 0:
        return None
    return DecodeMisses(sim.misses_decode / sim.decode_tokens, sim.miss_steps_decode / sim.decode_tokens)


def replay(tier: RamTier, trace) -> DecodeMisses | None:
    """decode_misses for this tier's slots and pins."""
    return decode_misses({l.il: l.n_slots for l in tier.layers}, {l.il: l.pinned for l in tier.layers}, trace)


def mean_expert_bytes(tier: RamTier) -> float:
    return sum(l.expert_bytes for l in tier.layers) / len(tier.layers)
