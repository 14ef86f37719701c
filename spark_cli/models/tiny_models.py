"""Tiny random MoE GGUFs, one or more per family in models.toml (`spark demo-model --tiny NAME`).

Each is a few MB: random weights in the tensor layout and metadata keys llama.cpp reads for
its architecture (see the vendored `src/models/<arch>.cpp`), with SmolLM2's tokenizer so that
they tokenize text. A family can have variants (qwen35moe: fused or separate gate/up, an MTP
block); `TINY_MODELS` maps each name to its `general.architecture`. Any of them can carry another
tokenizer instead, one of llama.cpp's vendored test vocabularies (`vocab=`, llama_vocab.py; e.g.
`starcoder`: FIM tokens for /infill). Every file is cached and rebuilt bit-identically from its
name, vocabulary and seed.
"""

from __future__ import annotations

import functools
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType
from gguf.quants import quantize

from ..core.chat_template import bundled
from ..files.paths import models_dir
from .gguf_write import KeyValue, Tensor, array_tensor, cached_build, read_kvs, write_gguf
from .llama_vocab import VOCABS, vendored_vocab
from .smollm2 import fetch_smollm2, source_reader

# Bump when the bytes a build of an existing name writes change, so stale cached files are not reused.
TINY_FORMAT_VERSION = 2  # 2: the families' own chat templates


def tiny_model_name(name: str, seed: int = 0, vocab: str | None = None) -> str:
    return f"tiny-{name}{f'-{vocab}' if vocab else ''}-s{seed}-v{TINY_FORMAT_VERSION}.gguf"


def build_tiny_model(name: str, seed: int = 0, out_dir: Path | str | None = None, vocab: str | None = None) -> Path:
    """A few-MB random-weight MoE GGUF of one of TINY_MODELS (a family's arch, or a variant's name);
    `vocab`: one of TINY_VOCABS' tokenizers instead of SmolLM2's. TINY_RERANKER: the dense BERT
    reranker (always bge's WordPiece)."""
    if name not in TINY_MODELS and name != TINY_RERANKER:
        raise ValueError(f"arch: must be one of {', '.join((*TINY_MODELS, TINY_RERANKER))}, got {name!r}")
    if vocab is not None and vocab not in TINY_VOCABS:
        raise ValueError(f"vocab: must be one of {', '.join(TINY_VOCABS)}, got {vocab!r}")
    if name == TINY_RERANKER and vocab not in (None, RERANKER_VOCAB):
        raise ValueError(f"vocab: the {TINY_RERANKER} model carries {RERANKER_VOCAB}'s WordPiece, got {vocab!r}")
    out = Path(out_dir) if out_dir is not None else models_dir()
    out.mkdir(parents=True, exist_ok=True)
    if name == TINY_RERANKER:
        path = out / tiny_model_name(name, seed, RERANKER_VOCAB)
        return cached_build(path, lambda p: _build_tiny_reranker(seed, p))
    path = out / tiny_model_name(name, seed, vocab)
    return cached_build(path, lambda p: _build_tiny(name, seed, p, vocab))


class _Tiny:
    """Collects KVs and seeded random tensors for one tiny model."""

    def __init__(self, arch: str, seed: int, name: str | None = None):
        self.arch = arch
        name = name or arch  # the random stream follows the model's name: variants differ
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))
        self.kvs: list[KeyValue] = []
        self.tensors: list[Tensor] = []

    def kv(self, key: str, val: Any) -> None:
        if isinstance(val, list):  # arrays of ints, as convert_hf_to_gguf writes them (INT32)
            self.kvs.append((f"{self.arch}.{key}", val, GGUFValueType.ARRAY, GGUFValueType.INT32))
            return
        vtype = {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32,
                 str: GGUFValueType.STRING}[type(val)]
        self.kvs.append((f"{self.arch}.{key}", val, vtype, None))

    def has(self, key: str) -> bool:
        return any(k == f"{self.arch}.{key}" for k, *_ in self.kvs)

    def add(self, name: str, ggml_shape: tuple[int, ...], kind: str = "w", qtype: QT = QT.F32) -> None:
        """Random tensor; kind: w (matrix, 1/sqrt(fan_in)), norm (~1), bias (small), embd (~1),
        decay (negative, ~-1: the -exp(A_log) of a recurrent layer)."""
        shape = tuple(reversed(ggml_shape))
        x = self.rng.standard_normal(shape, dtype=np.float32)
        if kind == "w":
            x *= 1.0 / np.sqrt(ggml_shape[0])
        elif kind == "norm":
            x = 1.0 + 0.1 * x
        elif kind == "bias":
            x *= 0.05
        elif kind == "decay":
            x = -np.exp(0.3 * x)
        if qtype == QT.F32:
            self.tensors.append(array_tensor(name, x))
        elif qtype == QT.F16:
            self.tensors.append(array_tensor(name, x.astype(np.float16)))
        else:
            self.tensors.append(array_tensor(name, quantize(x, qtype), qtype))

    def router(self, name: str, n_embd: int, n_expert: int) -> None:
        dirs = self.rng.standard_normal((n_expert, n_embd))
        dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
        gains = np.exp(0.6 * self.rng.standard_normal(n_expert))
        self.tensors.append(array_tensor(name, (dirs * 2.0 * gains[:, None]).astype(np.float32)))

    def experts(self, il: int, n_embd: int, n_ff: int, n_expert: int, qtype: QT, bias: bool = False,
                fused: bool = False) -> None:
        """Router and routed experts; fused: one ffn_gate_up_exps [n_embd, 2 n_ff, E] (gate rows first)."""
        self.router(f"blk.{il}.ffn_gate_inp.weight", n_embd, n_expert)
        mats = ((("gate_up", (n_embd, 2 * n_ff, n_expert)),) if fused else
                (("gate", (n_embd, n_ff, n_expert)), ("up", (n_embd, n_ff, n_expert))))
        for kind, shape in (*mats, ("down", (n_ff, n_embd, n_expert))):
            self.add(f"blk.{il}.ffn_{kind}_exps.weight", shape, qtype=qtype)
            if bias:
                self.add(f"blk.{il}.ffn_{kind}_exps.bias", (shape[1], n_expert), "bias")

    def dense_ffn(self, il: int, n_embd: int, n_ff: int, suffix: str = "") -> None:
        self.add(f"blk.{il}.ffn_gate{suffix}.weight", (n_embd, n_ff))
        self.add(f"blk.{il}.ffn_up{suffix}.weight", (n_embd, n_ff))
        self.add(f"blk.{il}.ffn_down{suffix}.weight", (n_ff, n_embd))


def _tokenizer_kvs(src: Path) -> tuple[list[KeyValue], int]:
    reader = source_reader(src)
    return read_kvs(reader, lambda k: k.startswith("tokenizer.")), len(reader.fields["tokenizer.ggml.tokens"].data)


def _build_tiny(name: str, seed: int, path: Path, vocab: str | None = None) -> None:
    tok_kvs, n_vocab = _tokenizer_kvs(vendored_vocab(vocab) if vocab else fetch_smollm2())
    if name in TINY_TEMPLATES:  # the family's own template instead of SmolLM2's
        tok_kvs = [kv for kv in tok_kvs if kv[0] != "tokenizer.chat_template"]
        tok_kvs.append(("tokenizer.chat_template", bundled(TINY_TEMPLATES[name]), GGUFValueType.STRING, None))
    arch, layout = TINY_MODELS[name], _TINY_LAYOUTS[name]
    m = _Tiny(arch, seed, name)
    title = f"spark tiny {name}" + (f" ({vocab} vocab)" if vocab else "")
    m.kvs.append(("general.name", title, GGUFValueType.STRING, None))
    n_embd, n_head, n_layer = 64, 4, 4
    m.add("token_embd.weight", (n_embd, n_vocab), "embd", QT.F16)
    n_block = layout(m, n_embd, n_head, n_layer) or n_layer  # MTP blocks come after the trunk
    m.add("output_norm.weight", (n_embd,), "norm")
    m.add("output.weight", (n_embd, n_vocab), "w", QT.F16)
    for key, val in (("context_length", 2048), ("embedding_length", n_embd), ("block_count", n_block),
                     ("attention.head_count", n_head), ("attention.layer_norm_rms_epsilon", 1e-6)):
        if not m.has(key):  # a layout may set a key itself (per-layer head counts)
            m.kv(key, val)
    write_gguf(path, arch, m.kvs + tok_kvs, m.tensors)


def _attn_norms(m: _Tiny, il: int, n_embd: int) -> None:
    m.add(f"blk.{il}.attn_norm.weight", (n_embd,), "norm")


def _gqa(m: _Tiny, il: int, n_embd: int, n_head: int, n_head_kv: int, head: int, bias: bool,
         q_rows: int | None = None) -> None:
    for proj, rows in (("q", q_rows or n_head * head), ("k", n_head_kv * head), ("v", n_head_kv * head)):
        m.add(f"blk.{il}.attn_{proj}.weight", (n_embd, rows))
        if bias:
            m.add(f"blk.{il}.attn_{proj}.bias", (rows,), "bias")
    m.add(f"blk.{il}.attn_output.weight", (n_head * head, n_embd))


def _moe_kvs(m: _Tiny, n_expert: int, k: int, n_ff: int, n_head_kv: int, head: int, n_ff_dense: int) -> None:
    m.kv("attention.head_count_kv", n_head_kv)
    m.kv("attention.key_length", head)
    if m.arch != "deepseek2":
        m.kv("attention.value_length", head)
    m.kv("feed_forward_length", n_ff_dense)
    m.kv("expert_feed_forward_length", n_ff)
    m.kv("expert_count", n_expert)
    m.kv("expert_used_count", k)


# ---------------------------------------------------------------- a reranker: dense BERT, classifier head

# NOTE: not a MoE family (no llama.cpp MoE arch has a classifier head): the stand-in for llama.cpp's
# server-suite reranker (jina-reranker-v1-tiny-en), which `spark serve --reranking` serves dense
TINY_RERANKER = "bert-reranker"
RERANKER_VOCAB = "bert-bge"  # bge-small's WordPiece: [CLS] query [SEP] document [SEP]


def _build_tiny_reranker(seed: int, path: Path) -> None:
    """llama.cpp's bert arch (src/models/bert.cpp) with pooling rank: token, type and position
    embeddings, post-norm encoder layers with biases and a GELU FFN, then the sequence-
    classification head on [CLS]: cls (dense, tanh) and cls.output (one score)."""
    tok_kvs, n_vocab = _tokenizer_kvs(vendored_vocab(RERANKER_VOCAB))
    m = _Tiny("bert", seed, TINY_RERANKER)
    m.kvs.append(("general.name", f"spark tiny {TINY_RERANKER}", GGUFValueType.STRING, None))
    n_embd, n_head, n_layer, n_ff, n_ctx = 64, 4, 2, 128, 512
    m.add("token_embd.weight", (n_embd, n_vocab), "embd", QT.F16)
    m.add("token_types.weight", (n_embd, 2), "embd")
    m.add("position_embd.weight", (n_embd, n_ctx), "embd")
    m.add("token_embd_norm.weight", (n_embd,), "norm")
    m.add("token_embd_norm.bias", (n_embd,), "bias")
    for il in range(n_layer):
        for name, rows, cols in (("attn_q", n_embd, n_embd), ("attn_k", n_embd, n_embd), ("attn_v", n_embd, n_embd),
                                 ("attn_output", n_embd, n_embd), ("ffn_up", n_embd, n_ff), ("ffn_down", n_ff, n_embd)):
            m.add(f"blk.{il}.{name}.weight", (rows, cols))
            m.add(f"blk.{il}.{name}.bias", (cols,), "bias")
        for norm in ("attn_output_norm", "layer_output_norm"):
            m.add(f"blk.{il}.{norm}.weight", (n_embd,), "norm")
            m.add(f"blk.{il}.{norm}.bias", (n_embd,), "bias")
    m.add("cls.weight", (n_embd, n_embd))
    m.add("cls.bias", (n_embd,), "bias")
    m.add("cls.output.weight", (n_embd, 1))
    m.add("cls.output.bias", (1,), "bias")
    for key, val in (("context_length", n_ctx), ("embedding_length", n_embd), ("block_count", n_layer),
                     ("feed_forward_length", n_ff), ("attention.head_count", n_head),
                     ("attention.layer_norm_epsilon", 1e-12), ("attention.causal", False),
                     ("pooling_type", 4)):  # llama_pooling_type rank
        m.kv(key, val)
    write_gguf(path, "bert", m.kvs + tok_kvs, m.tensors)


# ---------------------------------------------------------------- the first five families

def _qwen3moe(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # Qwen3-30B-A3B layout: q/k norms, head_dim * n_head != n_embd, no shared expert
    head, n_kv, n_expert, k, n_ff = 32, 2, 16, 4, 32
    for il in range(n_layer):
        _attn_norms(m, il, n_embd)
        _gqa(m, il, n_embd, n_head, n_kv, head, bias=False)
        m.add(f"blk.{il}.attn_q_norm.weight", (head,), "norm")
        m.add(f"blk.{il}.attn_k_norm.weight", (head,), "norm")
        m.add(f"blk.{il}.ffn_norm.weight", (n_embd,), "norm")
        m.experts(il, n_embd, n_ff, n_expert, QT.F16)
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_kv, head=head, n_ff_dense=n_ff * k)
    m.kv("rope.freq_base", 1000000.0)


def _qwen2moe(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # Qwen1.5-MoE layout: qkv biases, one sigmoid-gated shared expert
    head, n_kv, n_expert, k, n_ff, n_ff_sh = n_embd // n_head, 2, 8, 2, 32, 64
    for il in range(n_layer):
        _attn_norms(m, il, n_embd)
        _gqa(m, il, n_embd, n_head, n_kv, head, bias=True)
        m.add(f"blk.{il}.ffn_norm.weight", (n_embd,), "norm")
        m.experts(il, n_embd, n_ff, n_expert, QT.Q8_0)
        m.add(f"blk.{il}.ffn_gate_inp_shexp.weight", (n_embd,))
        m.dense_ffn(il, n_embd, n_ff_sh, "_shexp")
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_kv, head=head, n_ff_dense=n_ff * k)
    m.kv("expert_shared_feed_forward_length", n_ff_sh)


def _deepseek2(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # DeepSeek-V3 layout: MLA attention (q/kv low rank, absorbed k_b/v_b), one dense
    # leading layer, sigmoid gating with exp_probs_b, grouped routing, one shared expert
    q_rank, kv_rank, nope, rope, v_head = 32, 32, 16, 16, 16
    n_expert, k, n_ff, n_ff_dense, n_dense = 16, 4, 32, 128, 1
    for il in range(n_layer):
        _attn_norms(m, il, n_embd)
        m.add(f"blk.{il}.attn_q_a_norm.weight", (q_rank,), "norm")
        m.add(f"blk.{il}.attn_kv_a_norm.weight", (kv_rank,), "norm")
        m.add(f"blk.{il}.attn_q_a.weight", (n_embd, q_rank))
        m.add(f"blk.{il}.attn_q_b.weight", (q_rank, n_head * (nope + rope)))
        m.add(f"blk.{il}.attn_kv_a_mqa.weight", (n_embd, kv_rank + rope))
        m.add(f"blk.{il}.attn_k_b.weight", (nope, kv_rank, n_head))
        m.add(f"blk.{il}.attn_v_b.weight", (kv_rank, v_head, n_head))
        m.add(f"blk.{il}.attn_output.weight", (n_head * v_head, n_embd))
        m.add(f"blk.{il}.ffn_norm.weight", (n_embd,), "norm")
        if il < n_dense:
            m.dense_ffn(il, n_embd, n_ff_dense)
            continue
        m.experts(il, n_embd, n_ff, n_expert, QT.F16)
        m.add(f"blk.{il}.exp_probs_b.bias", (n_expert,), "bias")
        m.dense_ffn(il, n_embd, n_ff, "_shexp")
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=1, head=kv_rank + rope, n_ff_dense=n_ff_dense)
    m.kv("attention.value_length", kv_rank)
    m.kv("attention.key_length_mla", nope + rope)
    m.kv("attention.value_length_mla", v_head)
    m.kv("attention.q_lora_rank", q_rank)
    m.kv("attention.kv_lora_rank", kv_rank)
    m.kv("rope.dimension_count", rope)
    m.kv("leading_dense_block_count", n_dense)
    m.kv("expert_shared_count", 1)
    m.kv("expert_weights_scale", 2.5)
    m.kv("expert_weights_norm", True)
    m.kv("expert_gating_func", 2)  # sigmoid
    m.kv("expert_group_count", 4)
    m.kv("expert_group_used_count", 2)


def _glm4moe(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # GLM-4.5 layout: qkv biases, q/k norms, partial rope, post-attention norm instead of
    # ffn_norm, one dense leading layer, sigmoid gating with exp_probs_b, shared expert
    head, n_kv, n_expert, k, n_ff, n_ff_dense, n_dense = 32, 2, 8, 2, 32, 128, 1
    for il in range(n_layer):
        _attn_norms(m, il, n_embd)
        _gqa(m, il, n_embd, n_head, n_kv, head, bias=True)
        m.add(f"blk.{il}.attn_q_norm.weight", (head,), "norm")
        m.add(f"blk.{il}.attn_k_norm.weight", (head,), "norm")
        m.add(f"blk.{il}.post_attention_norm.weight", (n_embd,), "norm")
        if il < n_dense:
            m.dense_ffn(il, n_embd, n_ff_dense)
            continue
        m.experts(il, n_embd, n_ff, n_expert, QT.F32)
        m.add(f"blk.{il}.exp_probs_b.bias", (n_expert,), "bias")
        m.dense_ffn(il, n_embd, n_ff, "_shexp")
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_kv, head=head, n_ff_dense=n_ff_dense)
    m.kv("rope.dimension_count", head // 2)
    m.kv("leading_dense_block_count", n_dense)
    m.kv("expert_shared_count", 1)
    m.kv("expert_weights_scale", 2.5)
    m.kv("expert_weights_norm", True)
    m.kv("expert_gating_func", 2)  # sigmoid


def _gpt_oss(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # gpt-oss layout: MXFP4 experts with biases, router bias, attention sinks, qkv/o
    # biases, alternating sliding-window layers, post-attention norm
    head, n_kv, n_expert, k, n_ff = 32, 2, 16, 4, 64
    for il in range(n_layer):
        _attn_norms(m, il, n_embd)
        m.add(f"blk.{il}.post_attention_norm.weight", (n_embd,), "norm")
        _gqa(m, il, n_embd, n_head, n_kv, head, bias=True)
        m.add(f"blk.{il}.attn_output.bias", (n_embd,), "bias")
        m.add(f"blk.{il}.attn_sinks.weight", (n_head,), "embd")
        m.experts(il, n_embd, n_ff, n_expert, QT.MXFP4, bias=True)
        m.add(f"blk.{il}.ffn_gate_inp.bias", (n_expert,), "bias")
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_kv, head=head, n_ff_dense=n_ff)
    m.kv("rope.freq_base", 150000.0)
    m.kv("attention.sliding_window", 16)


# ---------------------------------------------------------------- hybrid gated-delta-net families

# Gated delta net geometry (llama.cpp's names): head_k_dim = head_v_dim = ssm.state_size,
# ssm.group_count K heads, ssm.time_step_rank V heads, ssm.inner_size = head_v_dim * V heads.
_GDN = dict(d_conv=4, state=16, k_heads=2, v_heads=4)


def _gdn_kvs(m: _Tiny) -> None:
    g = _GDN
    m.kv("ssm.conv_kernel", g["d_conv"])
    m.kv("ssm.state_size", g["state"])
    m.kv("ssm.group_count", g["k_heads"])
    m.kv("ssm.time_step_rank", g["v_heads"])
    m.kv("ssm.inner_size", g["state"] * g["v_heads"])


def _gdn_layer(m: _Tiny, il: int, n_embd: int, legacy: bool) -> None:
    """A linear-attention (gated delta net) layer: Qwen3.5's split projections (attn_qkv,
    attn_gate, ssm_beta, ssm_alpha) or Qwen3-Next's legacy fused ones (ssm_in, ssm_ba)."""
    g = _GDN
    key_dim, value_dim = g["state"] * g["k_heads"], g["state"] * g["v_heads"]
    conv_dim = 2 * key_dim + value_dim
    if legacy:
        m.add(f"blk.{il}.ssm_in.weight", (n_embd, 2 * key_dim + 2 * value_dim))
        m.add(f"blk.{il}.ssm_ba.weight", (n_embd, 2 * g["v_heads"]))
    else:
        m.add(f"blk.{il}.attn_qkv.weight", (n_embd, conv_dim))
        m.add(f"blk.{il}.attn_gate.weight", (n_embd, value_dim))
        m.add(f"blk.{il}.ssm_beta.weight", (n_embd, g["v_heads"]))
        m.add(f"blk.{il}.ssm_alpha.weight", (n_embd, g["v_heads"]))
    m.add(f"blk.{il}.ssm_conv1d.weight", (g["d_conv"], conv_dim))
    m.add(f"blk.{il}.ssm_dt.bias", (g["v_heads"],), "bias")
    m.add(f"blk.{il}.ssm_a", (g["v_heads"],), "decay")
    m.add(f"blk.{il}.ssm_norm.weight", (g["state"],), "norm")
    m.add(f"blk.{il}.ssm_out.weight", (value_dim, n_embd))


def _gated_attn(m: _Tiny, il: int, n_embd: int, n_head: int, n_kv: int, head: int) -> None:
    """Qwen3-Next / Qwen3.5 full attention: q carries a sigmoid output gate (2 x rows), q/k norms."""
    _gqa(m, il, n_embd, n_head, n_kv, head, bias=False, q_rows=2 * n_head * head)
    m.add(f"blk.{il}.attn_q_norm.weight", (head,), "norm")
    m.add(f"blk.{il}.attn_k_norm.weight", (head,), "norm")


def _gated_shexp(m: _Tiny, il: int, n_embd: int, n_ff_sh: int) -> None:
    m.add(f"blk.{il}.ffn_gate_inp_shexp.weight", (n_embd,))
    m.dense_ffn(il, n_embd, n_ff_sh, "_shexp")


def _qwen35moe(m: _Tiny, n_embd: int, n_head: int, n_layer: int, fused: bool = True, mtp: bool = False,
               qtype: QT = QT.Q8_0) -> int:
    # Qwen3.6-35B-A3B layout: 3 of 4 layers gated delta net (recurrent state), every 4th full
    # attention with an output gate and interleaved M-RoPE over a quarter of the head; routed
    # experts with fused or separate gate/up, one sigmoid-gated shared expert; optionally one
    # MTP block after the trunk (nextn_predict_layers = 1; llama.cpp skips it unless asked)
    head, n_kv, n_expert, k, n_ff, n_ff_sh, interval = 32, 2, 16, 4, 32, 32, 4
    for il in range(n_layer + int(mtp)):
        _attn_norms(m, il, n_embd)
        m.add(f"blk.{il}.post_attention_norm.weight", (n_embd,), "norm")
        if il >= n_layer or (il + 1) % interval == 0:
            _gated_attn(m, il, n_embd, n_head, n_kv, head)
        else:
            _gdn_layer(m, il, n_embd, legacy=False)
        m.experts(il, n_embd, n_ff, n_expert, qtype, fused=fused)
        _gated_shexp(m, il, n_embd, n_ff_sh)
        if il >= n_layer:
            m.add(f"blk.{il}.nextn.eh_proj.weight", (2 * n_embd, n_embd))
            m.add(f"blk.{il}.nextn.enorm.weight", (n_embd,), "norm")
            m.add(f"blk.{il}.nextn.hnorm.weight", (n_embd,), "norm")
            m.add(f"blk.{il}.nextn.shared_head_norm.weight", (n_embd,), "norm")
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_kv, head=head, n_ff_dense=n_ff * k)
    m.kv("expert_shared_feed_forward_length", n_ff_sh)
    m.kv("rope.freq_base", 10000000.0)
    m.kv("rope.dimension_count", head // 2)
    m.kv("rope.dimension_sections", [3, 3, 2, 0])  # t, h, w: sums to rope dims / 2
    m.kv("full_attention_interval", interval)
    _gdn_kvs(m)
    if mtp:
        m.kv("nextn_predict_layers", 1)
    return n_layer + int(mtp)


def _qwen3next(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # Qwen3-Next-80B-A3B layout: hybrid like Qwen3.5 but with the legacy fused linear-attention
    # projections (ssm_in = q|k|v|z per K head, ssm_ba), plain partial RoPE, separate gate/up.
    # No full_attention_interval key: llama.cpp's default and models.toml's (4) apply.
    head, n_kv, n_expert, k, n_ff, n_ff_sh, interval = 32, 2, 16, 4, 32, 64, 4
    for il in range(n_layer):
        _attn_norms(m, il, n_embd)
        m.add(f"blk.{il}.post_attention_norm.weight", (n_embd,), "norm")
        if (il + 1) % interval == 0:
            _gated_attn(m, il, n_embd, n_head, n_kv, head)
        else:
            _gdn_layer(m, il, n_embd, legacy=True)
        m.experts(il, n_embd, n_ff, n_expert, QT.Q8_0)
        _gated_shexp(m, il, n_embd, n_ff_sh)
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_kv, head=head, n_ff_dense=n_ff * k)
    m.kv("expert_shared_feed_forward_length", n_ff_sh)
    m.kv("rope.freq_base", 10000000.0)
    m.kv("rope.dimension_count", head // 2)
    _gdn_kvs(m)


# ---------------------------------------------------------------- other attention MoE families

def _laguna(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # Laguna XS.2 layout: one leading dense layer; full attention at layer % 4 == 0 (YaRN over
    # part of the head), sliding-window layers with more heads (per-layer head counts) and
    # plain RoPE; a per-head softplus output gate, q/k norms; sigmoid routing with
    # exp_probs_b, one ungated shared expert
    head, n_kv, n_expert, k, n_ff, n_ff_sh, n_ff_dense, n_dense = 32, 2, 16, 4, 32, 32, 128, 1
    heads = [n_head if il % 4 == 0 else n_head + 2 for il in range(n_layer)]
    for il, nh in enumerate(heads):
        _attn_norms(m, il, n_embd)
        _gqa(m, il, n_embd, nh, n_kv, head, bias=False)
        m.add(f"blk.{il}.attn_q_norm.weight", (head,), "norm")
        m.add(f"blk.{il}.attn_k_norm.weight", (head,), "norm")
        m.add(f"blk.{il}.attn_gate.weight", (n_embd, nh))
        m.add(f"blk.{il}.ffn_norm.weight", (n_embd,), "norm")
        if il < n_dense:
            m.dense_ffn(il, n_embd, n_ff_dense)
            continue
        m.experts(il, n_embd, n_ff, n_expert, QT.Q5_0)
        m.add(f"blk.{il}.exp_probs_b.bias", (n_expert,), "bias")
        m.dense_ffn(il, n_embd, n_ff_sh, "_shexp")
    m.kv("attention.head_count", heads)
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_kv, head=head, n_ff_dense=n_ff_dense)
    m.kv("expert_shared_feed_forward_length", n_ff_sh)
    m.kv("leading_dense_block_count", n_dense)
    m.kv("expert_gating_func", 2)  # sigmoid
    m.kv("expert_weights_norm", True)
    m.kv("expert_weights_scale", 2.5)
    m.kv("attention.sliding_window", 16)  # no sliding_window_pattern: llama.cpp's and models.toml's period 4
    m.kv("rope.freq_base", 500000.0)
    m.kv("rope.dimension_count", head // 2)
    m.kv("rope.scaling.type", "yarn")
    m.kv("rope.scaling.factor", 4.0)
    m.kv("rope.scaling.original_context_length", 512)
    m.kv("rope.freq_base_swa", 10000.0)
    m.kv("rope.dimension_count_swa", head)


def _mixtral(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # Mixtral 8x7B layout on the llama arch: GQA, 8 experts top-2, no shared expert
    head, n_kv, n_expert, k, n_ff = n_embd // n_head, 2, 8, 2, 64
    for il in range(n_layer):
        _attn_norms(m, il, n_embd)
        _gqa(m, il, n_embd, n_head, n_kv, head, bias=False)
        m.add(f"blk.{il}.ffn_norm.weight", (n_embd,), "norm")
        m.experts(il, n_embd, n_ff, n_expert, QT.Q4_0)
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_kv, head=head, n_ff_dense=n_ff)
    m.kv("rope.freq_base", 1000000.0)
    m.kv("rope.dimension_count", head)


def _olmoe(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # OLMoE-1B-7B layout: q/k norms over the whole projection (n_embd), no GQA, routing
    # weights not renormalised, no shared expert
    head, n_expert, k, n_ff = n_embd // n_head, 16, 4, 32
    for il in range(n_layer):
        _attn_norms(m, il, n_embd)
        _gqa(m, il, n_embd, n_head, n_head, head, bias=False)
        m.add(f"blk.{il}.attn_q_norm.weight", (n_embd,), "norm")
        m.add(f"blk.{il}.attn_k_norm.weight", (n_embd,), "norm")
        m.add(f"blk.{il}.ffn_norm.weight", (n_embd,), "norm")
        m.experts(il, n_embd, n_ff, n_expert, QT.Q4_1)
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_head, head=head, n_ff_dense=n_ff)


def _granitemoe(m: _Tiny, n_embd: int, n_head: int, n_layer: int) -> None:
    # Granite 3.x MoE layout (1B-A400M): GQA, embedding / residual / attention / logit scales,
    # experts sized by feed_forward_length, no shared expert
    head, n_kv, n_expert, k, n_ff = n_embd // n_head, 2, 8, 2, 32
    for il in range(n_layer):
        _attn_norms(m, il, n_embd)
        _gqa(m, il, n_embd, n_head, n_kv, head, bias=False)
        m.add(f"blk.{il}.ffn_norm.weight", (n_embd,), "norm")
        m.experts(il, n_embd, n_ff, n_expert, QT.Q8_0)
    _moe_kvs(m, n_expert, k, n_ff, n_head_kv=n_kv, head=head, n_ff_dense=n_ff)
    m.kv("rope.freq_base", 10000.0)
    m.kv("embedding_scale", 12.0)
    m.kv("residual_scale", 0.22)
    m.kv("attention.scale", 1.0 / head)
    m.kv("logit_scale", 6.0)


# name -> (general.architecture, layout builder); a builder may return the block count (MTP blocks)
_TINY: dict[str, tuple[str, Callable[..., int | None]]] = {
    "qwen3moe": ("qwen3moe", _qwen3moe),
    "qwen2moe": ("qwen2moe", _qwen2moe),
    "deepseek2": ("deepseek2", _deepseek2),
    "glm4moe": ("glm4moe", _glm4moe),
    "gpt-oss": ("gpt-oss", _gpt_oss),
    "qwen35moe": ("qwen35moe", _qwen35moe),
    "qwen35moe-split": ("qwen35moe", functools.partial(_qwen35moe, fused=False, qtype=QT.BF16)),
    "qwen35moe-mtp": ("qwen35moe", functools.partial(_qwen35moe, mtp=True, qtype=QT.Q4_0)),
    "qwen3next": ("qwen3next", _qwen3next),
    "laguna": ("laguna", _laguna),
    "llama": ("llama", _mixtral),
    "olmoe": ("olmoe", _olmoe),
    "granitemoe": ("granitemoe", _granitemoe),
}
TINY_MODELS: dict[str, str] = {name: arch for name, (arch, _) in _TINY.items()}
# name -> spark_cli/data/templates/NAME.jinja (the rest keep SmolLM2's ChatML)
TINY_TEMPLATES: dict[str, str] = {"qwen3moe": "qwen3", "qwen35moe": "qwen3.6", "qwen35moe-split": "qwen3.6",
                                  "qwen35moe-mtp": "qwen3.6", "qwen3next": "qwen3.6", "deepseek2": "deepseek",
                                  "glm4moe": "glm45", "gpt-oss": "gpt-oss", "llama": "mistral"}
TINY_ARCHES: tuple[str, ...] = tuple(TINY_MODELS)  # every name `--tiny` takes
# vocab= / `--vocab`: llama.cpp's vendored vocabularies a tiny model can carry instead of SmolLM2's
TINY_VOCABS: dict[str, str] = {name: what for name, (_, what) in VOCABS.items()}
_TINY_LAYOUTS = {name: build for name, (_, build) in _TINY.items()}
