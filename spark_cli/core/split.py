"""Which device each layer lands on: llama.cpp's layer split, the one home of that rule.

llama.cpp (llama_model_base::load_tensors, src/llama-model.cpp) with every layer offloaded
(-ngl -1, Spark's) assigns the repeating layers 0..n_layer-1 and the output layer (index
n_layer: output norm and matrix) to devices by cumulative proportions, in float32:

    splits[i] = (p[0] + ... + p[i]) / (p[0] + ... + p[n-1])
    device(il) = upper_bound(splits, float(il) / (n_layer + 1))     il = 0 .. n_layer

where p is `tensor_split` (-ts), or each device's free memory when -ts is absent or all zero.
The input layer (token embeddings) stays on the CPU. So the output layer goes where a layer
n_layer would: the last device with a share, not -mg (llama.cpp reads main_gpu only with -sm none
and row). -sm none keeps the whole model on the -mg device (llama_prepare_model_devices drops
the others); -sm row and tensor split matrices across devices, which the expert cache does not
do (it places whole experts of a layer on that layer's device): refused.

Spark always hands llama.cpp the proportions it planned with (model params `tensor_split`), so
the plan's assignment is the one llama.cpp makes: -ts if given, else each device's budget
(its free memory less a margin without --vram, so nearly llama.cpp's own default).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import UsageError

SPLIT_MODES = {"none": 0, "layer": 1}  # enum llama_split_mode; row (2) and tensor (3) are refused
REFUSED_MODES = ("row", "tensor")


def parse_split_mode(text: str | None) -> str:
    """-sm/--split-mode: none or layer (default); row and tensor refused with one line."""
    mode = (text or "layer").strip().lower()
    if mode in REFUSED_MODES:
        raise UsageError(f"--split-mode {mode}: Spark places experts itself, whole experts on each layer's device; "
                         "row and tensor splits are not supported", hint="use -sm layer (the default) or -sm none")
    if mode not in SPLIT_MODES:
        raise UsageError(f"--split-mode {text}: expected none or layer")
    return mode


def parse_tensor_split(text: str | None, n_devices: int | None = None) -> tuple[float, ...] | None:
    """-ts/--tensor-split as llama.cpp spells it: proportions per device, `3,1` or `3/1`
    (fewer values than devices: the rest get 0). None when absent or all zero (llama.cpp's
    default then applies)."""
    if text is None or not str(text).strip():
        return None
    parts = [p for p in re.split(r"[,/]+", str(text).strip()) if p.strip()]
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        raise UsageError(f"--tensor-split {text}: expected proportions per device, e.g. 3,1") from None
    if not values or any(not np.isfinite(v) or v < 0 for v in values):
        raise UsageError(f"--tensor-split {text}: proportions must be numbers >= 0, e.g. 3,1")
    if n_devices is not None and len(values) > n_devices:
        raise UsageError(f"--tensor-split {text}: {len(values)} proportions for {n_devices} "
                         f"device{'s' * (n_devices != 1)}", hint="give one per device, in -dev order")
    if not any(values):
        return None
    if n_devices is not None:
        values = values + (0.0,) * (n_devices - len(values))
    return values


def as_float32(values: Sequence[float]) -> tuple[float, ...]:
    """The proportions as llama.cpp holds them (float), as Python floats (exact)."""
    return tuple(float(v) for v in np.asarray(values, dtype=np.float32))


def layer_devices(n_layer: int, proportions: Sequence[float]) -> tuple[int, ...]:
    """Device index of layers 0..n_layer-1 and, last, of the output layer (n_layer + 1 entries),
    as llama.cpp assigns them for these proportions (the module docstring's rule, in float32)."""
    p = np.asarray(proportions, dtype=np.float32)
    if p.size == 0:
        raise ValueError("no device")
    if not (p > 0).any():
        raise ValueError("every proportion is zero: llama.cpp would split by free memory")
    splits = np.empty(p.size, dtype=np.float32)
    total = np.float32(0.0)
    for i, v in enumerate(p):
        total = np.float32(total + v)
        splits[i] = total
    splits = (splits / total).astype(np.float32)
    act = np.float32(n_layer + 1)
    return tuple(min(int(np.searchsorted(splits, np.float32(il) / act, side="right")), p.size - 1)
                 for il in range(n_layer + 1))


@dataclass(frozen=True)
class Split:
    """The devices a plan spreads a model over: their budgets, names and the layer split."""

    budgets: tuple[int, ...]  # bytes per device the plan may use, in -dev order (-sm none: the main device's)
    names: tuple[str, ...] = ()  # ggml device names ("" where planned without the device)
    tensor_split: tuple[float, ...] = ()  # float32 proportions llama.cpp gets (empty: one device)
    mode: str = "layer"  # layer | none
    main_gpu: int = 0  # -mg: index among the selected devices of the device -sm none keeps

    def __post_init__(self) -> None:
        if not self.names:
            object.__setattr__(self, "names", ("",) * len(self.budgets))
        if len(self.names) != len(self.budgets):
            raise ValueError("one name per budget")

    @property
    def n_devices(self) -> int:
        return len(self.budgets)

    def layer_devices(self, n_layer: int) -> tuple[int, ...]:
        """Device index (into budgets) of each layer and, last, of the output layer."""
        if self.n_devices <= 1 or not self.tensor_split:
            return (0,) * (n_layer + 1)
        return layer_devices(n_layer, self.tensor_split)


def single(budget: int, name: str = "") -> Split:
    return Split((budget,), (name,))


def make_split(budgets: Sequence[int], names: Sequence[str], tensor_split: Sequence[float] | None = None,
               mode: str = "layer", main_gpu: int = 0) -> Split:
    """The Split of the selected devices: -sm none keeps the -mg device alone; -sm layer splits the
    layers by -ts, else by the budgets (MiB)."""
    budgets, names = tuple(int(b) for b in budgets), tuple(names)
    n = len(budgets)
    if not 0 <= main_gpu < max(n, 1):
        raise UsageError(f"--main-gpu {main_gpu}: {n} device{'s' * (n != 1)} selected",
                         hint=f"give 0 to {n - 1}" if n > 1 else "give 0 (or drop -mg)")
    if mode == "none":
        return Split((budgets[main_gpu],), (names[main_gpu],), (), "none", main_gpu)
    if n <= 1:
        return Split(budgets, names)
    if tensor_split is not None and len(tensor_split) > n:
        raise UsageError(f"--tensor-split: {len(tensor_split)} proportions for {n} devices",
                         hint="give one per device, in -dev order")
    ts = tuple(tensor_split or ()) + (0.0,) * (n - len(tensor_split or ()))
    if not any(ts):
        ts = tuple(float(max(1, b >> 20)) for b in budgets)
    return Split(budgets, names, as_float32(ts), "layer", main_gpu)
