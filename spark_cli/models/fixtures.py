"""Geometry fixtures: real-sized MoE GGUFs without the weights (`spark demo-model --fixture NAME`).

Each fixture is a GGUF whose header is that of a published quantized model: the metadata keys
llama.cpp reads for the architecture, every tensor's name, shape and ggml type, and offsets
into a data section of the real size. No tensor data is written: the file is extended with
`truncate` (a sparse file, a few MB on disk, tens of GB apparent), so `load_geometry` and
`spark plan` see the real bytes per layer while nothing is downloaded. The weights read as zeros.

Where the numbers come from (no model hub is reachable from here; each spec says which are assumed):
- shapes and hyperparameters: the published Hugging Face `config.json` of each model, as
  llama.cpp's converter (`conversion/*.py`) turns them into GGUF keys;
- tensor lists: the vendored llama.cpp loader for the arch (`src/models/<arch>.cpp`
  `load_arch_tensors`), the same layouts as the tiny models (tiny_models.py); deepseek2 (MLA) as
  the converter writes it (`conversion/deepseek.py`): kv_b split into attn_k_b / attn_v_b, the
  MQA view (one KV head of kv_lora_rank + rope dims), and no MTP block (DeepseekV3ForCausalLM's
  `skip_mtp`);
- per-tensor types: `_q4_k_m` follows `llama_tensor_get_type_impl` in `src/llama-quant.cpp`
  for LLAMA_FTYPE_MOSTLY_Q4_K_M (no imatrix, no per-tensor overrides): output Q6_K,
  attn_v / attn_qkv and every ffn_down (experts and shared too) Q6_K in the "more bits"
  layers, the rest of the 2D/3D weights Q4_K, norms/biases/router/ssm_conv1d F32, and the
  256-block fallback (Q4_K -> Q5_0, Q6_K -> Q8_0) for rows not a multiple of 256 (MLA's attn_k_b
  rows of qk_nope_head_dim = 128: Q5_0; attn_k_b / attn_v_b are no attn_v category). Published
  files made with an imatrix or hand-tuned recipes (unsloth's "UD" files) differ by a few
  percent; gpt-oss uses the MXFP4_MOE recipe (experts MXFP4, other matrices Q8_0).
The tokenizer is synthetic (GPT-2 byte tokens + unused fillers up to the real vocab size),
so llama.cpp's loader accepts the header (`check_with_llama` loads it with `no_alloc`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as QT

from ..files.paths import models_dir
from .gguf_write import KeyValue, cached_build, staged_file

# Bump when the header a fixture name writes changes, so stale cached files are not reused.
FIXTURE_FORMAT_VERSION = 1
ALIGNMENT = 32

FTYPE_Q4_K_M = 15  # enum llama_ftype
FTYPE_MXFP4_MOE = 38


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention (deepseek2): q and kv through low ranks; the KV cache holds the
    kv latent and the rope key of one MQA head (kv_lora_rank + qk_rope_head_dim), no V."""

    q_lora_rank: int  # 0: a full-rank attn_q (the "lite" models)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def head_k(self) -> int:
        """A decompressed head's key (llama.cpp's n_embd_head_k_mla)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent(self) -> int:
        """The MQA head the converter writes: key_length (value_length is kv_lora_rank)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class FixtureSpec:
    """One published model's geometry (llama.cpp's names) and where the numbers come from."""

    name: str
    arch: str
    title: str
    source: str  # where the figures come from; which are assumed
    n_layer: int  # trunk layers (MTP blocks come after, n_nextn of them)
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: tuple[int, ...]  # per trunk layer
    n_head_kv: int  # MLA: 1, the converter's MQA view
    head_dim: int  # MLA: a decompressed head's key (Mla.head_k)
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int = 0  # 0: no shared expert
    n_ff_dense: int = 0  # leading dense layers' FFN (also `feed_forward_length`)
    n_dense_lead: int = 0
    n_nextn: int = 0
    n_swa: int = 0
    swa_layers: tuple[bool, ...] = ()  # as llama.cpp derives them (for the tests' formula)
    recurrent: tuple[bool, ...] = ()  # gated delta net layers (no KV cache)
    ssm: dict[str, int] | None = None  # conv_kernel, state_size, group_count, time_step_rank, inner_size
    mla: Mla | None = None  # deepseek2's attention
    qk_norm: bool = False  # q/k norms where the arch has them optional (glm4moe: GLM-4.5/4.6, not Air)
    expert_groups: tuple[int, int] = (0, 0)  # (n_group, topk_group) where the config has them; 0: not written
    routed_scale: float = 1.0  # routed_scaling_factor (glm4moe, deepseek2)
    rope_base: float = 10000.0  # rope_theta (deepseek2; the other archs' are in _kvs)
    yarn_factor: float = 0.0  # YaRN rope_scaling factor over 4096 positions (deepseek2); 0: none
    recipe: str = "Q4_K_M"

    def __post_init__(self) -> None:
        if self.mla and (self.n_head_kv, self.head_dim) != (1, self.mla.head_k):
            raise ValueError(f"{self.name}: an MLA spec has one KV head (the MQA view) and head_dim "
                             f"{self.mla.head_k} (qk_nope + qk_rope), got {self.n_head_kv} x {self.head_dim}")

    @property
    def n_layer_all(self) -> int:
        return self.n_layer + self.n_nextn

    def has_kv(self, il: int) -> bool:
        return il < self.n_layer and not (self.recurrent and self.recurrent[il])


def _pattern(n: int, period: int, dense_first: bool) -> tuple[bool, ...]:
    """llama.cpp's set_swa_pattern(period, dense_first): True = sliding-window layer."""
    return tuple((il % period != 0) if dense_first else (il % period < period - 1) for il in range(n))


_QWEN35_SSM = dict(conv_kernel=4, state_size=128, group_count=16, time_step_rank=32, inner_size=4096)

FIXTURES: dict[str, FixtureSpec] = {s.name: s for s in (
    FixtureSpec(
        "qwen3.6-35b-a3b-q4_k_m", "qwen35moe", "Qwen3.6-35B-A3B Q4_K_M",
        "Qwen3.5-35B-A3B config.json (Qwen3.6-35B-A3B shares it): 40 layers, full attention every 4th "
        "(16 q / 2 kv heads of 256, output gate), gated delta net (16 K heads, 32 V heads of 128, conv 4), "
        "256 experts top-8 of 512 + one gated shared expert of 512, vocab 248320, 262144 ctx. "
        "Separate gate/up expert tensors and no MTP block assumed (newer converters may fuse gate/up: "
        "same bytes).",
        n_layer=40, n_embd=2048, n_vocab=248320, n_ctx_train=262144, n_head=(16,) * 40, n_head_kv=2,
        head_dim=256, n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
        recurrent=tuple((il + 1) % 4 != 0 for il in range(40)), ssm=_QWEN35_SSM),
    FixtureSpec(
        "qwen3-30b-a3b-q4_k_m", "qwen3moe", "Qwen3-30B-A3B Q4_K_M",
        "Qwen3-30B-A3B config.json: 48 layers, 32 q / 4 kv heads of 128, q/k norms, 128 experts top-8 "
        "of 768, no shared expert, vocab 151936, 40960 ctx.",
        n_layer=48, n_embd=2048, n_vocab=151936, n_ctx_train=40960, n_head=(32,) * 48, n_head_kv=4,
        head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768, n_ff_dense=6144),
    FixtureSpec(
        "gpt-oss-20b-mxfp4", "gpt-oss", "gpt-oss-20b MXFP4",
        "gpt-oss-20b config.json: 24 layers, 64 q / 8 kv heads of 64, sliding window 128 on every other "
        "layer, 32 experts top-4 of 2880 with biases, vocab 201088, 131072 ctx; MXFP4_MOE recipe "
        "(experts MXFP4, other matrices Q8_0) like ggml-org's gpt-oss-20b-mxfp4.gguf.",
        n_layer=24, n_embd=2880, n_vocab=201088, n_ctx_train=131072, n_head=(64,) * 24, n_head_kv=8,
        head_dim=64, n_expert=32, n_expert_used=4, n_ff_exp=2880, n_ff_dense=2880, n_swa=128,
        swa_layers=_pattern(24, 2, False), recipe="MXFP4_MOE"),
    FixtureSpec(
        "glm-4.5-air-q4_k_m", "glm4moe", "GLM-4.5-Air Q4_K_M",
        "GLM-4.5-Air config.json: 46 layers (the first dense, ff 10944) + 1 MTP (nextn) block, 96 q / 8 kv "
        "heads of 128 with qkv biases, no q/k norms, half-rotary, 128 experts top-8 of 1408 + 1 shared, "
        "sigmoid router with exp_probs_b, vocab 151552, 131072 ctx. The MTP block's embed_tokens / "
        "shared_head_head are assumed absent (llama.cpp treats them as optional).",
        n_layer=46, n_embd=4096, n_vocab=151552, n_ctx_train=131072, n_head=(96,) * 46, n_head_kv=8,
        head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=1408, n_ff_shexp=1408, n_ff_dense=10944,
        n_dense_lead=1, n_nextn=1),
    FixtureSpec(
        "laguna-xs.2-q4_k_m", "laguna", "Laguna XS.2 Q4_K_M",
        "ASSUMED figures (poolside's config was not reachable; only the layout is from llama.cpp's "
        "laguna loader and converter: 40 layers, one leading dense layer, full attention at il % 4 == 0, "
        "per-layer head counts, per-head output gate, q/k norms, sigmoid router + exp_probs_b, one shared "
        "expert): n_embd 2048, head_dim 128, 32 q heads on full layers and 48 on sliding ones, 8 kv heads, "
        "window 512, 256 experts top-8 of 512 + shared 512, dense ff 8192, vocab 100352, 131072 ctx.",
        n_layer=40, n_embd=2048, n_vocab=100352, n_ctx_train=131072,
        n_head=tuple(32 if il % 4 == 0 else 48 for il in range(40)), n_head_kv=8, head_dim=128,
        n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512, n_ff_dense=8192, n_dense_lead=1,
        n_swa=512, swa_layers=_pattern(40, 4, True)),
    # ---- bigger than common RAM (issue 45)
    FixtureSpec(
        "qwen3-235b-a22b-q4_k_m", "qwen3moe", "Qwen3-235B-A22B Q4_K_M",
        "Qwen3-235B-A22B config.json: 94 layers, 64 q / 4 kv heads of 128, q/k norms, 128 experts top-8 "
        "of 1536, no shared expert, intermediate_size 12288 (no dense layer), vocab 151936, 40960 ctx.",
        n_layer=94, n_embd=4096, n_vocab=151936, n_ctx_train=40960, n_head=(64,) * 94, n_head_kv=4,
        head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=1536, n_ff_dense=12288),
    FixtureSpec(
        "glm-4.6-q4_k_m", "glm4moe", "GLM-4.6 355B-A32B Q4_K_M",
        "GLM-4.6 config.json (GLM-4.5 shares the geometry; GLM-4.5's context is 131072): 92 layers (the "
        "first 3 dense, ff 12288) + 1 MTP (nextn) block, 96 q / 8 kv heads of 128 with qkv biases and q/k "
        "norms (use_qk_norm), half-rotary, 160 experts top-8 of 1536 + 1 shared, sigmoid router with "
        "exp_probs_b, n_group 1, routed_scaling_factor 2.5, vocab 151552, 202752 ctx. The MTP block has no "
        "embed_tokens / shared_head_head: GLM-4.6's checkpoint lacks layer 92's (vLLM issue 25993; "
        "GLM-4.5's has them, ~1 GB more at Q4_K_M; llama.cpp treats them as optional).",
        n_layer=92, n_embd=5120, n_vocab=151552, n_ctx_train=202752, n_head=(96,) * 92, n_head_kv=8,
        head_dim=128, n_expert=160, n_expert_used=8, n_ff_exp=1536, n_ff_shexp=1536, n_ff_dense=12288,
        n_dense_lead=3, n_nextn=1, qk_norm=True, expert_groups=(1, 1), routed_scale=2.5),
    FixtureSpec(
        "deepseek-v3.1-q4_k_m", "deepseek2", "DeepSeek-V3.1 671B Q4_K_M",
        "DeepSeek-V3 config.json (the V3.1 model card: the same structure as V3): 61 layers (the first 3 "
        "dense, ff 18432), MLA with 128 heads (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, "
        "v_head 128), 256 experts top-8 of 2048 + 1 shared, sigmoid router with exp_probs_b, 8 groups top-4, "
        "routed_scaling_factor 2.5, vocab 129280, 163840 ctx (YaRN 40 over 4096, rope_theta 10000). Its "
        "MTP layer (num_nextn_predict_layers 1) is not in the GGUF: llama.cpp's converter drops it for "
        "DeepseekV3ForCausalLM.",
        n_layer=61, n_embd=7168, n_vocab=129280, n_ctx_train=163840, n_head=(128,) * 61, n_head_kv=1,
        head_dim=192, n_expert=256, n_expert_used=8, n_ff_exp=2048, n_ff_shexp=2048, n_ff_dense=18432,
        n_dense_lead=3, mla=Mla(1536, 512, 128, 64, 128), expert_groups=(8, 4), routed_scale=2.5,
        yarn_factor=40.0),
    FixtureSpec(
        "kimi-k2-q4_k_m", "deepseek2", "Kimi-K2-Instruct 1T Q4_K_M",
        "Kimi-K2-Instruct config.json (DeepseekV3ForCausalLM): 61 layers (the first dense, ff 18432), MLA "
        "with 64 heads (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128), 384 "
        "experts top-8 of 2048 + 1 shared, sigmoid router with exp_probs_b, n_group 1, "
        "routed_scaling_factor 2.827, vocab 163840, 131072 ctx (YaRN 32 over 4096, rope_theta 50000), no "
        "MTP layer. Q4_K_M is the usual 4-bit llama.cpp recipe its GGUFs ship in (unsloth's 13-part "
        "Q4_K_M).",
        n_layer=61, n_embd=7168, n_vocab=163840, n_ctx_train=131072, n_head=(64,) * 61, n_head_kv=1,
        head_dim=192, n_expert=384, n_expert_used=8, n_ff_exp=2048, n_ff_shexp=2048, n_ff_dense=18432,
        n_dense_lead=1, mla=Mla(1536, 512, 128, 64, 128), expert_groups=(1, 1), routed_scale=2.827,
        rope_base=50000.0, yarn_factor=32.0),
    FixtureSpec(
        "gpt-oss-120b-mxfp4", "gpt-oss", "gpt-oss-120b MXFP4",
        "gpt-oss-120b config.json: 36 layers, 64 q / 8 kv heads of 64, sliding window 128 on every other "
        "layer, 128 experts top-4 of 2880 with biases, vocab 201088, 131072 ctx; MXFP4_MOE recipe "
        "(experts MXFP4, other matrices Q8_0) like ggml-org's gpt-oss-120b-mxfp4 GGUF.",
        n_layer=36, n_embd=2880, n_vocab=201088, n_ctx_train=131072, n_head=(64,) * 36, n_head_kv=8,
        head_dim=64, n_expert=128, n_expert_used=4, n_ff_exp=2880, n_ff_dense=2880, n_swa=128,
        swa_layers=_pattern(36, 2, False), recipe="MXFP4_MOE"),
)}


def fixture_file_name(name: str) -> str:
    return f"fixture-{name}-v{FIXTURE_FORMAT_VERSION}.gguf"


def build_fixture(name: str, out_dir: Path | str | None = None) -> Path:
    """The sparse geometry fixture `name` (one of FIXTURES); cached like the demo models."""
    if name not in FIXTURES:
        raise ValueError(f"fixture: must be one of {', '.join(FIXTURES)}, got {name!r}")
    out = Path(out_dir) if out_dir is not None else models_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / fixture_file_name(name)
    return cached_build(path, lambda p: _write_sparse(p, FIXTURES[name]))


# ---------------------------------------------------------------- tensor list and types

@dataclass
class _TI:
    name: str
    shape: tuple[int, ...]  # ggml order: ne0, ne1, ...
    qtype: QT = QT.F32


Add = Callable[..., None]  # add(name, *shape): one tensor in ggml order


def _tensors(s: FixtureSpec) -> list[_TI]:
    """Every tensor llama.cpp's loader creates for the arch, in the converter's order."""
    t: list[_TI] = []

    def add(name: str, *shape: int) -> None:
        t.append(_TI(name, tuple(shape)))

    e, v = s.n_embd, s.n_vocab
    add("token_embd.weight", e, v)
    for il in range(s.n_layer_all):
        b = f"blk.{il}"
        nh = s.n_head[min(il, s.n_layer - 1)]
        add(f"{b}.attn_norm.weight", e)
        if s.arch in ("qwen35moe", "glm4moe", "gpt-oss"):
            add(f"{b}.post_attention_norm.weight", e)
        if s.recurrent and il < s.n_layer and s.recurrent[il]:
            _gated_delta_net(add, b, s)
        elif s.mla is not None:
            _mla_attention(add, b, e, nh, s.mla)
        else:
            _gqa_attention(add, b, s, nh)
        if s.arch in ("qwen3moe", "laguna", "deepseek2"):
            add(f"{b}.ffn_norm.weight", e)
        if il < s.n_dense_lead:
            add(f"{b}.ffn_gate.weight", e, s.n_ff_dense)
            add(f"{b}.ffn_up.weight", e, s.n_ff_dense)
            add(f"{b}.ffn_down.weight", s.n_ff_dense, e)
            continue
        add(f"{b}.ffn_gate_inp.weight", e, s.n_expert)
        if s.arch == "gpt-oss":
            add(f"{b}.ffn_gate_inp.bias", s.n_expert)
        if s.arch in ("glm4moe", "laguna", "deepseek2"):
            add(f"{b}.exp_probs_b.bias", s.n_expert)
        for kind, shape in (("gate", (e, s.n_ff_exp)), ("up", (e, s.n_ff_exp)), ("down", (s.n_ff_exp, e))):
            add(f"{b}.ffn_{kind}_exps.weight", *shape, s.n_expert)
            if s.arch == "gpt-oss":
                add(f"{b}.ffn_{kind}_exps.bias", shape[1], s.n_expert)
        if s.n_ff_shexp:
            if s.arch == "qwen35moe":
                add(f"{b}.ffn_gate_inp_shexp.weight", e)
            add(f"{b}.ffn_gate_shexp.weight", e, s.n_ff_shexp)
            add(f"{b}.ffn_up_shexp.weight", e, s.n_ff_shexp)
            add(f"{b}.ffn_down_shexp.weight", s.n_ff_shexp, e)
        if il >= s.n_layer:  # MTP block
            add(f"{b}.nextn.eh_proj.weight", 2 * e, e)
            add(f"{b}.nextn.enorm.weight", e)
            add(f"{b}.nextn.hnorm.weight", e)
            add(f"{b}.nextn.shared_head_norm.weight", e)
    add("output_norm.weight", e)
    add("output.weight", e, v)
    (_mxfp4_moe if s.recipe == "MXFP4_MOE" else _q4_k_m)(s, t)
    return t


def _gated_delta_net(add: Add, b: str, s: FixtureSpec) -> None:
    """A qwen35moe recurrent layer (src/models/qwen35moe.cpp)."""
    ssm, e = s.ssm or {}, s.n_embd
    key_dim = ssm["state_size"] * ssm["group_count"]
    value_dim = ssm["state_size"] * ssm["time_step_rank"]
    conv_dim = 2 * key_dim + value_dim
    add(f"{b}.attn_qkv.weight", e, conv_dim)
    add(f"{b}.attn_gate.weight", e, value_dim)
    add(f"{b}.ssm_conv1d.weight", ssm["conv_kernel"], conv_dim)
    add(f"{b}.ssm_dt.bias", ssm["time_step_rank"])
    add(f"{b}.ssm_a", ssm["time_step_rank"])
    add(f"{b}.ssm_beta.weight", e, ssm["time_step_rank"])
    add(f"{b}.ssm_alpha.weight", e, ssm["time_step_rank"])
    add(f"{b}.ssm_norm.weight", ssm["state_size"])
    add(f"{b}.ssm_out.weight", value_dim, e)


def _gqa_attention(add: Add, b: str, s: FixtureSpec, nh: int) -> None:
    """Grouped-query attention as the GQA archs load it (biases, sinks, norms, gates by arch)."""
    e, hd, kvd = s.n_embd, s.head_dim, s.n_head_kv * s.head_dim
    q_rows = nh * hd * (2 if s.arch == "qwen35moe" else 1)  # qwen35moe: q carries its gate
    bias = s.arch in ("glm4moe", "gpt-oss")
    for proj, rows in (("q", q_rows), ("k", kvd), ("v", kvd)):
        add(f"{b}.attn_{proj}.weight", e, rows)
        if bias:
            add(f"{b}.attn_{proj}.bias", rows)
    add(f"{b}.attn_output.weight", nh * hd, e)
    if s.arch == "gpt-oss":
        add(f"{b}.attn_output.bias", e)
        add(f"{b}.attn_sinks.weight", nh)
    if s.arch in ("qwen3moe", "qwen35moe", "laguna") or s.qk_norm:
        add(f"{b}.attn_q_norm.weight", hd)
        add(f"{b}.attn_k_norm.weight", hd)
    if s.arch == "laguna":
        add(f"{b}.attn_gate.weight", e, nh)  # per-head output gate


def _mla_attention(add: Add, b: str, e: int, nh: int, m: Mla) -> None:
    """deepseek2's MLA (src/models/deepseek2.cpp): low-rank q, the kv latent + rope key in one
    projection, kv_b split by the converter into attn_k_b (transposed) and attn_v_b, per head."""
    if m.q_lora_rank:
        add(f"{b}.attn_q_a_norm.weight", m.q_lora_rank)
    add(f"{b}.attn_kv_a_norm.weight", m.kv_lora_rank)
    if m.q_lora_rank:
        add(f"{b}.attn_q_a.weight", e, m.q_lora_rank)
        add(f"{b}.attn_q_b.weight", m.q_lora_rank, nh * m.head_k)
    else:
        add(f"{b}.attn_q.weight", e, nh * m.head_k)
    add(f"{b}.attn_kv_a_mqa.weight", e, m.latent)
    add(f"{b}.attn_k_b.weight", m.qk_nope_head_dim, m.kv_lora_rank, nh)
    add(f"{b}.attn_v_b.weight", m.kv_lora_rank, m.v_head_dim, nh)
    add(f"{b}.attn_output.weight", nh * m.v_head_dim, e)


_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "attn_sinks")


def _quantizable(ti: _TI) -> bool:
    """llama-quant.cpp's tensor_allows_quantization, for the tensors these archs have."""
    return (len(ti.shape) >= 2 and ti.name.endswith("weight")
            and not any(p in ti.name for p in _NOT_QUANTIZED))


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(ti: _TI, q: QT) -> QT:
    """llama.cpp's tensor_type_fallback: rows not a multiple of the type's block."""
    block = GGML_QUANT_SIZES[q][0]
    if ti.shape[0] % block == 0:
        return q
    q = {QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}.get(q, q)
    return q if ti.shape[0] % GGML_QUANT_SIZES[q][0] == 0 else QT.F16


def _q4_k_m(s: FixtureSpec, tensors: list[_TI]) -> None:
    """Q4_K_M as llama_tensor_get_type_impl picks it (n_expert != 8, no imatrix)."""
    n_attn_v = sum(1 for ti in tensors if "attn_v.weight" in ti.name or "attn_qkv.weight" in ti.name)
    i_attn_v = 0
    for ti in tensors:
        if not _quantizable(ti):
            continue
        q = QT.Q4_K
        if ti.name == "output.weight":
            q = QT.Q6_K if ti.shape[0] % 256 == 0 else QT.Q8_0
        elif "attn_v.weight" in ti.name or "attn_qkv.weight" in ti.name:
            if _more_bits(i_attn_v, n_attn_v):
                q = QT.Q6_K
            i_attn_v += 1
        elif "ffn_down" in ti.name:
            il = int(ti.name.split(".")[1])
            if _more_bits(il, s.n_layer_all):
                q = QT.Q6_K
        ti.qtype = _fallback(ti, q)


def _mxfp4_moe(s: FixtureSpec, tensors: list[_TI]) -> None:
    """LLAMA_FTYPE_MOSTLY_MXFP4_MOE: 3D expert tensors MXFP4, every other matrix Q8_0."""
    for ti in tensors:
        if _quantizable(ti):
            ti.qtype = QT.MXFP4 if len(ti.shape) == 3 else QT.Q8_0


def _nbytes(ti: _TI) -> int:
    block, size = GGML_QUANT_SIZES[ti.qtype]
    n = int(np.prod(ti.shape, dtype=np.int64))
    if n % block:
        raise AssertionError(f"{ti.name}: {ti.shape} is not whole {ti.qtype.name} blocks")
    return n // block * size


# ---------------------------------------------------------------- metadata

def _kvs(s: FixtureSpec) -> list[KeyValue]:
    a = s.arch
    out: list[KeyValue] = []

    def kv(key: str, val: Any, full: bool = False) -> None:
        k = key if full else f"{a}.{key}"
        if isinstance(val, (list, tuple)):
            out.append((k, list(val), GGUFValueType.ARRAY, GGUFValueType.INT32))
        else:
            vt = {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32,
                  str: GGUFValueType.STRING}[type(val)]
            out.append((k, val, vt, None))

    kv("general.name", f"{s.title} (Spark geometry fixture, no weights)", full=True)
    kv("general.file_type", FTYPE_MXFP4_MOE if s.recipe == "MXFP4_MOE" else FTYPE_Q4_K_M, full=True)
    kv("general.quantization_version", 2, full=True)
    kv("general.alignment", ALIGNMENT, full=True)
    kv("block_count", s.n_layer_all)
    kv("context_length", s.n_ctx_train)
    kv("embedding_length", s.n_embd)
    kv("feed_forward_length", s.n_ff_dense or s.n_ff_exp * s.n_expert_used)
    kv("attention.head_count", list(s.n_head) if len(set(s.n_head)) > 1 else s.n_head[0])
    kv("attention.head_count_kv", s.n_head_kv)
    key_length, value_length = (s.mla.latent, s.mla.kv_lora_rank) if s.mla else (s.head_dim, s.head_dim)
    kv("attention.key_length", key_length)
    kv("attention.value_length", value_length)
    kv("attention.layer_norm_rms_epsilon", 1e-5 if a == "gpt-oss" else 1e-6)
    kv("expert_count", s.n_expert)
    kv("expert_used_count", s.n_expert_used)
    kv("expert_feed_forward_length", s.n_ff_exp)
    if s.n_ff_shexp and a != "deepseek2":  # deepseek2: expert_shared_count x the experts' length
        kv("expert_shared_feed_forward_length", s.n_ff_shexp)
    if s.n_dense_lead:
        kv("leading_dense_block_count", s.n_dense_lead)
    if s.n_nextn:
        kv("nextn_predict_layers", s.n_nextn)
    if s.n_swa:
        kv("attention.sliding_window", s.n_swa)
    if s.expert_groups[0]:
        kv("expert_group_count", s.expert_groups[0])
        kv("expert_group_used_count", s.expert_groups[1])
    if a == "qwen3moe":
        kv("rope.freq_base", 1000000.0)
    elif a == "qwen35moe":
        kv("rope.freq_base", 10000000.0)
        kv("rope.dimension_count", s.head_dim // 4)  # partial_rotary_factor 0.25
        kv("rope.dimension_sections", [11, 11, 10, 0])  # mrope_section
        kv("full_attention_interval", 4)
        for k, val in (s.ssm or {}).items():
            kv(f"ssm.{k}", val)
    elif a == "gpt-oss":
        kv("rope.freq_base", 150000.0)
        kv("rope.scaling.type", "yarn")
        kv("rope.scaling.factor", 32.0)
        kv("rope.scaling.original_context_length", 4096)
    elif a == "glm4moe":
        kv("rope.freq_base", 1000000.0)
        kv("rope.dimension_count", s.head_dim // 2)
        kv("expert_shared_count", 1)
        kv("expert_weights_scale", s.routed_scale)
        kv("expert_weights_norm", True)
        kv("expert_gating_func", 2)  # sigmoid
    elif a == "deepseek2":
        _deepseek2_kvs(s, kv)
    elif a == "laguna":
        kv("rope.freq_base", 500000.0)
        kv("rope.dimension_count", s.head_dim // 2)
        kv("rope.freq_base_swa", 10000.0)
        kv("rope.dimension_count_swa", s.head_dim)
        kv("expert_gating_func", 2)
        kv("expert_weights_norm", True)
        kv("expert_weights_scale", 2.5)
        kv("vocab_size", s.n_vocab)
    return out + _tokenizer_kvs(s.n_vocab)


def _deepseek2_kvs(s: FixtureSpec, kv: Callable[..., None]) -> None:
    """What conversion/deepseek.py writes beyond the common keys: MLA ranks and head sizes, the
    shared expert count, the sigmoid router, YaRN (log multiplier 0.1 x mscale_all_dim 1.0)."""
    m = s.mla
    if m is None:
        raise ValueError(f"{s.name}: deepseek2 fixtures need their MLA figures")
    kv("vocab_size", s.n_vocab)
    if m.q_lora_rank:
        kv("attention.q_lora_rank", m.q_lora_rank)
    kv("attention.kv_lora_rank", m.kv_lora_rank)
    kv("attention.key_length_mla", m.head_k)
    kv("attention.value_length_mla", m.v_head_dim)
    kv("rope.dimension_count", m.qk_rope_head_dim)
    kv("rope.freq_base", s.rope_base)
    if s.yarn_factor:
        kv("rope.scaling.type", "yarn")
        kv("rope.scaling.factor", s.yarn_factor)
        kv("rope.scaling.original_context_length", 4096)
        kv("rope.scaling.yarn_log_multiplier", 0.1)
    kv("expert_shared_count", 1)
    kv("expert_weights_scale", s.routed_scale)
    kv("expert_weights_norm", True)
    kv("expert_gating_func", 2)  # sigmoid


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 byte-level BPE tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _tokenizer_kvs(n_vocab: int) -> list[KeyValue]:
    """A synthetic byte-level BPE vocabulary of exactly n_vocab tokens (no merges): bytes, unused
    fillers, and one end-of-text control token last. It tokenizes text byte by byte."""
    tokens = _byte_tokens() + [f"<|fixture_{i}|>" for i in range(256, n_vocab - 1)] + ["<|endoftext|>"]
    types = [1] * 256 + [5] * (n_vocab - 257) + [3]  # normal, unused, control
    eot = n_vocab - 1
    return [
        ("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING, None),
        ("tokenizer.ggml.pre", "default", GGUFValueType.STRING, None),
        ("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        ("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32),
        ("tokenizer.ggml.merges", ["Ġ Ġ"], GGUFValueType.ARRAY, GGUFValueType.STRING),
        ("tokenizer.ggml.bos_token_id", eot, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.eos_token_id", eot, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.padding_token_id", eot, GGUFValueType.UINT32, None),
    ]


# ---------------------------------------------------------------- writing

def _write_sparse(path: Path, s: FixtureSpec) -> None:
    """Header and tensor infos through GGUFWriter, then truncate to the full size: no data bytes."""
    tensors = _tensors(s)
    with staged_file(path, "fixture") as tmp:
        w = GGUFWriter(tmp, s.arch)
        for key, val, vtype, sub in _kvs(s):
            if key == "general.alignment":
                continue  # GGUFWriter writes its own (default 32)
            w.add_key_value(key, val, vtype, sub)
        end = 0
        for ti in tensors:
            nbytes = _nbytes(ti)
            w.add_tensor_info(ti.name, tuple(reversed(ti.shape)), np.dtype(np.float32), nbytes,
                              raw_dtype=ti.qtype)
            end = -(-end // ALIGNMENT) * ALIGNMENT + nbytes
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        header = os.path.getsize(tmp)
        data_start = -(-header // ALIGNMENT) * ALIGNMENT
        os.truncate(tmp, data_start + -(-end // ALIGNMENT) * ALIGNMENT)


def disk_bytes(path: Path) -> int:
    """Bytes a (sparse) file takes on disk."""
    return os.stat(path).st_blocks * 512


def check_with_llama(path: Path) -> str | None:
    """Load the header with llama.cpp (`no_alloc`: shapes checked against the hyperparameters, no
    weights read or allocated); None when it loads, else why not. Needs the native build."""
    from ..native import llama_lib

    return llama_lib.header_check(path)

