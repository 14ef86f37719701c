"""Cached against all-resident logits on a real GPU backend (CUDA, Vulkan), where a CPU-computed
expert's output is the CPU kernel's and a device-computed one the device kernel's.

Every run is fed the all-resident run's greedy tokens, so logits are compared position by
position even where an argmax would flip. The bound for a run that mixes the two kernels is what
stock --cpu-moe (every expert on the CPU) shows against all-resident on the same prompts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..native.engine import Engine, EngineOptions
from ..native.generate import Forced, Greedy, StopRules, stream_generate

# A run mixing the two kernels is of the order of the all-CPU run's difference but not strictly
# below it: per-expert differences of opposite sign cancel in one sum and not in another, and
# later layers amplify them (seen on Vulkan, gpt-oss: 0.328 against 0.315). An expert read
# from a slot before its upload landed, or dropped, is off by orders of magnitude more (seen
# on Vulkan before the filler-slot fix: 4.1 against 0.0016).
MIXED_SLACK = 2.0


def within_bound(diff: float, bound: float) -> bool:
    """A mixed-kernel run's largest logit difference against stock --cpu-moe's (the bound)."""
    return diff <= MIXED_SLACK * bound


TEXT = ("The history of the printing press begins in the fifteenth century, when movable type "
        "changed how books were made, sold and read across Europe. ") * 4
PROMPT_TOKENS = (1, 4, 12, 20, 40)


def prompts(eng: Engine, lengths: tuple[int, ...] = PROMPT_TOKENS) -> list[list[int]]:
    toks = eng.tokenize(TEXT)
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
        worst = max(worst, float(np.abs(got.astype(np.float64) - rl).max()))
    return worst, exact
