"""Hand-made ModelGeometry for planner and vram tests (no GGUF needed)."""

from __future__ import annotations

from typing import Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from spark_cli.core.gguf_info import ExpertTensor, LayerGeometry, ModelGeometry

MiB = 1 << 20
Q8_0_BLOCK, Q8_0_BYTES = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0]  # every hand-made weight is Q8_0


def _weights(n_bytes: int) -> int:
    return n_bytes // Q8_0_BYTES * Q8_0_BLOCK


def make_geometry(n_layer: int = 4, n_expert: int = 8, k: int = 2, bpe: int | Sequence[int] = 10 * MiB,
                  dense: Sequence[int] = (0,), other: int = 2 * MiB, shared: int = 0, n_embd: int = 256,
                  n_head: int = 4, n_head_kv: int = 2, head_dim: int = 64, n_vocab: int = 1000,
                  global_bytes: int = 20 * MiB, token_embd: int = 8 * MiB, nextn: int = 0,
                  bias: int = 0, kv_heads: Sequence[int] | None = None, swa: Sequence[bool] = (),
                  sliding_window: int = 0, is_mla: bool = False, recurrent_state: int = 0,
                  fingerprint: str = "f" * 64) -> ModelGeometry:
    bpes = [bpe] * n_layer if isinstance(bpe, int) else list(bpe)
    layers = []
    for i in range(n_layer):
        moe = i not in dense
        b = bpes[i]
        experts = (
            ExpertTensor(f"blk.{i}.ffn_gate_up_exps.weight", "gate_up", "Q8_0", (b - b // 3) * n_expert,
                         b - b // 3, n_expert, _weights(b - b // 3)),
            ExpertTensor(f"blk.{i}.ffn_down_exps.weight", "down", "Q8_0", (b // 3) * n_expert, b // 3, n_expert,
                         _weights(b // 3)),
        ) if moe else ()
        layers.append(LayerGeometry(
            index=i, is_moe=moe, experts=experts, expert_bytes_per_expert=b if moe else 0,
            shared_bytes=shared if moe else 0, other_bytes=other + (bias if moe else 0),
            expert_bias_bytes=bias if moe else 0, is_nextn=i >= n_layer - nextn,
            matrix_params=_weights(other + (shared if moe else 0))))
    return ModelGeometry(
        path="/models/hand.gguf", arch="qwen3moe", n_layer=n_layer, n_expert=n_expert, n_expert_used=k,
        n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, key_length=head_dim, value_length=head_dim,
        context_length=32768, layers=tuple(layers), global_bytes=global_bytes, file_size=0,
        fingerprint=fingerprint, tensor_layout_hash="a" * 64, chat_template=None, n_vocab=n_vocab,
        n_ff_exp=128, token_embd_bytes=token_embd, output_tied=False,
        kv_heads=tuple(kv_heads) if kv_heads is not None else tuple(
            0 if i >= n_layer - nextn else n_head_kv for i in range(n_layer)),
        swa_layers=tuple(swa), sliding_window=sliding_window, is_mla=is_mla,
        recurrent_state_bytes=recurrent_state, n_layer_nextn=nextn)
