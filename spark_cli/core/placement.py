"""Where expert tensors go: the tensor-override patterns a plan carries and the engine applies.

One source for "which tensors are experts": the names gguf_info found with models.toml's
expert_patterns. A cached layer keeps exactly those weights in host RAM (the expert
biases stay with the layer on the device, as the planner prices them); a stock
`--n-cpu-moe` layer moves llama.cpp's own regex, biases included, to the CPU.
Pure: no llama_cpp.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import UsageError
from .gguf_info import ModelGeometry

STOCK_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's LLM_FFN_EXPS_REGEX
HOST = "host"  # the device's pinned host buffer type where it has one (cached experts)
CPU = "CPU"  # the CPU buffer type (stock offload: computed on the CPU)


@dataclass(frozen=True)
class TensorOverride:
    """llama.cpp's `-ot PATTERN=TARGET`: tensors whose name matches go to TARGET's buffer type."""

    pattern: str
    target: str  # HOST, CPU, or a buffer type name (CUDA0, RPC[...])

    def to_dict(self) -> dict[str, str]:
        return {"pattern": self.pattern, "target": self.target}


def _alt(items: Iterable[str]) -> str:
    return "|".join(items)


def cached_expert_overrides(g: ModelGeometry, layers: Iterable[int]) -> tuple[TensorOverride, ...]:
    """Expert weights of `layers` to host RAM: one exact pattern per set of tensor suffixes.
    Layers the model does not have are left to the expert cache to refuse (ERR_LAYER)."""
    by_suffix: dict[tuple[str, ...], list[int]] = {}
    for il in sorted(i for i in set(layers) if 0 <= i < len(g.layers)):
        names = tuple(sorted(t.name[len(f"blk.{il}."):] for t in g.layers[il].experts))
        if names:
            by_suffix.setdefault(names, []).append(il)
    out = []
    for suffixes, ils in by_suffix.items():
        pat = rf"^blk\.({_alt(str(i) for i in ils)})\.({_alt(re.escape(s) for s in suffixes)})$"
        out.append(TensorOverride(pat, HOST))
    return tuple(out)


def stock_patterns(layers: Iterable[int]) -> tuple[str, ...]:
    """What llama.cpp's `--n-cpu-moe` adds for these layers (expert weights and biases)."""
    return tuple(f"blk\\.{i}{STOCK_EXPS_REGEX}" for i in sorted(set(layers)))


def stock_overrides(layers: Iterable[int]) -> tuple[TensorOverride, ...]:
    return tuple(TensorOverride(p, CPU) for p in stock_patterns(layers))


def parse_override_tensor(values: Sequence[str] | None, g: ModelGeometry | None = None) -> tuple[TensorOverride, ...]:
    """`-ot PATTERN=BUFFER[,PATTERN=BUFFER]` (repeatable) -> overrides; a pattern that
    matches an expert tensor is refused: Spark places experts (--vram, --plan)."""
    out: list[TensorOverride] = []
    for value in values or ():
        for part in value.split(","):
            pat, eq, target = part.strip().rpartition("=")
            if not eq or not pat or not target:
                raise UsageError(f"-ot {part!r}: expected PATTERN=BUFFER", hint="e.g. -ot 'token_embd=CPU'")
            try:
                rx = re.compile(pat)
            except re.error as e:
                raise UsageError(f"-ot {pat!r}: invalid regex ({e})") from None
            if g is not None:
                hit = next((t.name for l in g.layers for t in l.experts if rx.search(t.name)), None)
                if hit is not None:
                    raise UsageError(f"-ot {pat!r}: matches the expert tensor {hit}",
                                     hint="Spark places experts itself: use --vram or --plan; -ot is for other tensors")
            out.append(TensorOverride(pat, target))
    return tuple(out)
