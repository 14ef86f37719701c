"""The demo model: SmolLM2-135M upcycled into a MoE (`spark demo-model`).

The demo model keeps SmolLM2's Q4_1 weights: every expert is the dense FFN with its
hidden neurons permuted in 32-row groups (same function, different bytes) and its down
projection scaled a few percent, so each expert slice is distinct yet greedy output
stays that of SmolLM2. The router (demo_router.py) is either fit to SmolLM2's own FFN
inputs on bundled training text (`fit`, the default: experts group tokens by content) or
a seeded random matrix with uneven row norms (`random`: popularity skew, little content).
Every file is cached and rebuilt bit-identically from its parameters.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType

from ..errors import ModelFileError
from ..files.paths import models_dir
from .demo_router import DEFAULT_ROUTER, ROUTERS, fit_routers, random_router
from .gguf_write import Tensor, array_tensor, cached_build, read_kvs, write_gguf
from .smollm2 import fetch_smollm2, source_reader

# Bump when the bytes a build writes change, so stale cached files are not reused.
DEMO_FORMAT_VERSION = 2  # 2: the router kind is part of the name; `fit` routers

_Q4_1_BLOCK = 32  # values per Q4_1 block: fp16 d, fp16 m, 16 bytes of nibbles
_Q4_1_BYTES = 20


def demo_model_name(n_expert: int = 16, n_expert_used: int = 4, seed: int = 0, router: str = DEFAULT_ROUTER) -> str:
    return f"smollm2-moe-e{n_expert}-k{n_expert_used}-s{seed}-{router}-v{DEMO_FORMAT_VERSION}.gguf"


def build_demo_model(n_expert: int = 16, n_expert_used: int = 4, seed: int = 0,
                     out_dir: Path | str | None = None, router: str = DEFAULT_ROUTER) -> Path:
    """SmolLM2-135M upcycled to `n_expert` experts, `n_expert_used` routed per token; cached.
    `router`: fit (content-fit, the default) or random (see demo_router.py)."""
    if not 2 <= n_expert <= 256:
        raise ValueError(f"n_expert: must be in 2..256, got {n_expert}")
    if not 1 <= n_expert_used <= n_expert:
        raise ValueError(f"n_expert_used: must be in 1..{n_expert}, got {n_expert_used}")
    if router not in ROUTERS:
        raise ValueError(f"router: expected one of {', '.join(ROUTERS)}, got {router!r}")
    out = Path(out_dir) if out_dir is not None else models_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / demo_model_name(n_expert, n_expert_used, seed, router)
    return cached_build(path, lambda p: _upcycle(fetch_smollm2(), p, n_expert, n_expert_used, seed, router))


def _upcycle(src: Path, dst: Path, n_expert: int, k: int, seed: int, router: str) -> None:
    reader = source_reader(src)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ModelFileError(f"{src}: architecture {arch!r}, expected 'llama'")
    kvs = [kv for kv in read_kvs(reader, lambda k_: True)
           if kv[0] not in ("llama.expert_count", "llama.expert_used_count", "general.name")]
    title = f"SmolLM2 135M upcycled MoE {n_expert}x top-{k}" + ("" if router == "random" else f" ({router} router)")
    kvs.insert(0, ("general.name", title, GGUFValueType.STRING, None))  # random: version 1's bytes
    kvs += [("llama.expert_count", n_expert, GGUFValueType.UINT32, None),
            ("llama.expert_used_count", k, GGUFValueType.UINT32, None)]

    by_name = {t.name: t for t in reader.tensors}
    n_layer = reader.fields["llama.block_count"].contents()
    rng = np.random.default_rng(np.random.SeedSequence([seed, n_expert, k, 0x5EA4]))
    # Per-expert down scale: evenly spread over +-5 %, in a seeded order.
    scales = 1.0 + 0.05 * rng.permutation(np.linspace(-1.0, 1.0, n_expert))
    perms, routers = {}, {}
    for il in range(n_layer):
        # one permutation of the 32-neuron groups per (layer, expert), shared by gate/up/down
        n_groups = by_name[f"blk.{il}.ffn_gate.weight"].data.shape[0] // _Q4_1_BLOCK
        perms[il] = np.stack([rng.permutation(n_groups) for _ in range(n_expert)])
        norm_w = np.asarray(by_name[f"blk.{il}.ffn_norm.weight"].data, dtype=np.float32)
        routers[il] = random_router(rng, n_expert, norm_w)  # drawn for `fit` too: the same perms either way
    if router == "fit":
        fit_rng = np.random.default_rng(np.random.SeedSequence([seed, n_expert, k, 0xF17]))
        routers = fit_routers(src, n_layer, n_expert, k, fit_rng)

    tensors: list[Tensor] = []
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] != "blk" or parts[2] not in ("ffn_gate", "ffn_up", "ffn_down"):
            raw = None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type
            tensors.append(Tensor(t.name, tuple(t.data.shape), t.data.dtype, raw, lambda t=t: t.data))
            continue
        il, kind = int(parts[1]), parts[2]
        if t.tensor_type != QT.Q4_1:
            raise ModelFileError(f"{src}: {t.name} is {t.tensor_type.name}, expected Q4_1")
        if il in routers:  # the router goes just before the layer's first expert tensor
            tensors.append(array_tensor(f"blk.{il}.ffn_gate_inp.weight", routers.pop(il)))
        if kind == "ffn_down":
            make = lambda t=t, p=perms[il]: _stack_down(t.data, p, scales)  # noqa: E731
        else:
            make = lambda t=t, p=perms[il]: _stack_rows(t.data, p)  # noqa: E731
        shape = (n_expert, *t.data.shape)
        tensors.append(Tensor(f"blk.{il}.{kind}_exps.weight", shape, np.dtype(np.uint8), QT.Q4_1, make))
    write_gguf(dst, "llama", kvs, tensors)


def _stack_rows(data: np.ndarray, perms: np.ndarray) -> np.ndarray:
    """gate/up [n_ff rows, n_embd bytes] -> [E, n_ff, bytes], rows permuted in groups of 32."""
    n_ff, nb = data.shape
    groups = np.asarray(data).reshape(n_ff // _Q4_1_BLOCK, _Q4_1_BLOCK, nb)
    return np.stack([groups[p].reshape(n_ff, nb) for p in perms])


def _stack_down(data: np.ndarray, perms: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """down [n_embd rows, n_ff bytes] -> [E, n_embd, bytes]: blocks permuted, d and m scaled."""
    n_embd, nb = data.shape
    blocks = np.asarray(data).reshape(n_embd, nb // _Q4_1_BYTES, _Q4_1_BYTES)
    out = np.empty((len(perms), n_embd, nb // _Q4_1_BYTES, _Q4_1_BYTES), dtype=np.uint8)
    for e, p in enumerate(perms):
        b = blocks[:, p, :].copy()
        dm = b[:, :, :4].copy().view(np.float16)  # [n_embd, n_blocks, 2]: d, m
        b[:, :, :4] = (dm.astype(np.float32) * np.float32(scales[e])).astype(np.float16).view(np.uint8)
        out[e] = b
    return out.reshape(len(perms), n_embd, nb)
