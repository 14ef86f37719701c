"""Device memory that is not weights: KV cache, compute buffer, CUDA overhead; --vram sizes.

The compute buffer here is an estimate: the planner's fit loop uses it only as its first guess,
then plans with llama.cpp's own figure from a dry run (runs/dry_run.py, core/bill.py). It stays
the bill where no dry run is possible (no device, `spark plan --no-measure`, bench's baselines).
DEVICE_OVERHEAD_BYTES is what no dry run can see (CUDA context, cuBLAS workspace, pools): it is
kept on top of the measured bill too (planner.unmeasured_overhead).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from .gguf_info import ModelGeometry
from .units import MiB

# CUDA context, cuBLAS workspace and allocator slack that nvidia-smi shows before any tensor.
DEVICE_OVERHEAD_BYTES = 300 * MiB
COMPUTE_FLOOR_BYTES = 64 * MiB
KV_CELL_PAD = 256  # llama.cpp pads the KV cache size to 256 cells



@dataclass(frozen=True)
class KVType:
    """A KV cache type as llama.cpp's -ctk/-ctv name it: its ggml_type id and block layout."""

    ggml_id: int  # enum ggml_type
    block: int  # elements per block
    block_bytes: int  # bytes per block


# The KV cache types llama.cpp accepts (common/arg.cpp kv_cache_types), priced here and set by the engine.
KV_TYPES: dict[str, KVType] = {
    "f32": KVType(0, 1, 4),
    "f16": KVType(1, 1, 2),
    "bf16": KVType(30, 1, 2),
    "q8_0": KVType(8, 32, 34),
    "q4_0": KVType(2, 32, 18),
    "q4_1": KVType(3, 32, 20),
    "iq4_nl": KVType(20, 32, 18),
    "q5_0": KVType(6, 32, 22),
    "q5_1": KVType(7, 32, 24),
}


def kv_type(name: str, flag: str = "--cache-type-k") -> KVType:
    """The KVType of a -ctk/-ctv value (case-insensitive); UsageError naming the flag otherwise."""
    t = KV_TYPES.get(name.lower())
    if t is None:
        raise UsageError(f"{flag}: unknown KV cache type {name!r}", hint=f"use one of {', '.join(KV_TYPES)}")
    return t


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def row_bytes(ggml_type: str, n: int) -> int:
    """Bytes of `n` elements of a KV cache type (partial blocks round up)."""
    t = kv_type(ggml_type)
    return -(-n // t.block) * t.block_bytes


def kv_ctx_seq(n_ctx: int, n_seq: int = 1, unified: bool = False) -> int:
    """Cells of one KV stream (llama.cpp's n_ctx_seq, llama-context.cpp): n_ctx padded to 256; with
    several sequences and no --kv-unified, each has its own stream of pad256(n_ctx / n_seq) cells."""
    cells = _pad(max(n_ctx, 1), KV_CELL_PAD)
    if unified or n_seq <= 1:
        return cells
    cells = _pad(cells // n_seq, KV_CELL_PAD)
    if cells == 0:
        raise UsageError(f"--parallel {n_seq}: more sequences than -c {n_ctx} has cells")
    return cells


def kv_streams(n_seq: int = 1, unified: bool = False) -> int:
    """KV streams llama.cpp allocates: one per sequence, or one shared with --kv-unified."""
    return 1 if unified else max(1, n_seq)


def kv_cells(geometry: ModelGeometry, n_ctx: int, layer: int, n_ubatch: int = 512, n_seq: int = 1,
             unified: bool = False) -> int:
    """KV cells one stream of a layer keeps (kv_cache_bytes multiplies by kv_streams): n_ctx_seq
    (kv_ctx_seq), or for a sliding-window layer pad256(min(n_ctx_seq, window * (n_seq if unified,
    else 1) + n_ubatch)) (llama.cpp's non-full SWA cache, llama-kv-cache-iswa.cpp)."""
    cells = kv_ctx_seq(n_ctx, n_seq, unified)
    if geometry.sliding_window and geometry.swa_layers and geometry.swa_layers[layer]:
        window = geometry.sliding_window * (max(1, n_seq) if unified else 1)
        cells = _pad(min(cells, window + n_ubatch), KV_CELL_PAD)
    return cells


def kv_cache_bytes(geometry: ModelGeometry, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
                   n_ubatch: int = 512, n_seq: int = 1, unified: bool = False) -> int:
    """KV cache of `n_seq` sequences (-np) on the device, plus the recurrent state of hybrid models.

    Per layer with attention: kv_cells * kv_streams * (row(type_k, n_head_kv * key_length)
    + row(type_v, n_head_kv * value_length)). MLA models (deepseek2 GGUFs with
    `attention.key_length_mla`) cache only the latent: key_length = kv_lora_rank + rope
    dims with one KV head, and no V, as llama.cpp does. Old MLA-less deepseek2 files
    fall through the general formula. Recurrent layers add their f32 state instead, one per
    sequence whether or not the KV cache is unified (llama.cpp's rs_size = max(1, n_seq_max)).
    The sum of kv_layer_bytes over the layers.
    """
    return sum(kv_layer_bytes(geometry, n_ctx, type_k, type_v, n_ubatch, n_seq, unified))


def kv_layer_bytes(geometry: ModelGeometry, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
                   n_ubatch: int = 512, n_seq: int = 1, unified: bool = False) -> list[int]:
    """kv_cache_bytes per layer (llama.cpp keeps each layer's KV cells and recurrent state on the
    layer's device). A geometry without per-layer recurrent flags (built by hand) puts the whole
    recurrent state on layer 0."""
    g = geometry
    streams = kv_streams(n_seq, unified)
    out = [0] * g.n_layer
    for il in range(g.n_layer):
        if g.kv_heads:
            heads = g.kv_heads[il]
        else:  # geometries built by hand: every loaded layer has attention
            heads = 0 if g.layers[il].is_nextn else g.n_head_kv
        if heads <= 0:
            continue
        k = row_bytes(type_k, heads * g.key_length)
        v = 0 if g.is_mla else row_bytes(type_v, heads * g.value_length)
        out[il] = kv_cells(g, n_ctx, il, n_ubatch, n_seq, unified) * streams * (k + v)
    state = g.recurrent_state_bytes * max(1, n_seq)
    rec = [il for il, r in enumerate(g.recurrent_layers) if r]
    if state and rec and state % len(rec) == 0:
        for il in rec:
            out[il] += state // len(rec)
    elif state and out:
        out[0] += state
    return out


def compute_buffer_bytes(geometry: ModelGeometry, n_ctx: int, n_ubatch: int = 512, n_seq: int = 1,
                         unified: bool = False, logits: bool = True) -> int:
    """Estimate of llama.cpp's device compute buffer for a worst-case ubatch.

    llama.cpp reserves the graph of one full ubatch with every token an output, and
    its allocator reuses memory between nodes, so the peak is roughly:
      logits   n_ubatch * n_vocab * 4            (usually the largest term)
      mask     n_ctx_seq * n_ubatch * 2          (f16 KQ mask: one stream's cells per token,
                                                 kv_ctx_seq)
      hidden   n_ubatch * n_embd * 4 * 6         (residual, norms, projections)
      + the larger of attention (n_ubatch * n_head * head_dim * 4 * 3, flash attention
        assumed, as llama.cpp enables it on CUDA by default) and the MoE FFN
        (n_ubatch * k * n_ff_exp * 4 * 3 + router n_ubatch * n_expert * 4 * 2),
    and never less than COMPUTE_FLOOR_BYTES. Within ~20% of what llama.cpp prints for
    the models we measured; the overhead constant absorbs the rest. `logits` False: a device
    without the output layer (another device of a layer split computes the logits).
    """
    g = geometry
    nt = max(n_ubatch, 1)
    logits = nt * g.n_vocab * 4 if logits else 0
    mask = kv_ctx_seq(n_ctx, n_seq, unified) * nt * 2
    hidden = nt * g.n_embd * 4 * 6
    attn = nt * g.n_head * max(g.key_length, g.value_length) * 4 * 3
    moe = nt * g.n_expert_used * g.n_ff_exp * 4 * 3 + nt * g.n_expert * 4 * 2
    return max(COMPUTE_FLOOR_BYTES, logits + mask + hidden + max(attn, moe))


