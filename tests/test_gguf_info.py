"""gguf_info: geometry and byte accounting of tiny GGUFs written with gguf.GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from spark_cli.errors import ModelFileError
from spark_cli.core.gguf_info import load_geometry

N_EMBD, N_FF, N_EXPERT, K, VOCAB, N_HEAD, N_HEAD_KV = 64, 32, 8, 2, 96, 4, 2
Q8 = gguf.GGMLQuantizationType.Q8_0


def _add(w: gguf.GGUFWriter, name: str, shape: tuple[int, ...], rng: np.random.Generator,
         q8: bool = False, sizes: dict[str, int] | None = None) -> None:
    """shape in numpy order (ggml ne reversed)."""
    a = rng.standard_normal(shape).astype(np.float32)
    if q8:
        w.add_tensor(name, gguf.quants.quantize(a, Q8), raw_dtype=Q8)
        n = a.size // 32 * 34
    else:
        w.add_tensor(name, a)
        n = a.nbytes
    if sizes is not None:
        sizes[name] = n


def write_model(path: Path, arch: str = "llama", n_layer: int = 3, moe: bool = True, dense_first: bool = True,
                shared: bool = False, bias: bool = False, seed: int = 0, template: str | None = "{{x}}",
                tied: bool = False) -> dict[str, int]:
    """A tiny llama-like model: layer 0 dense when dense_first, the rest MoE with Q8_0 experts."""
    rng = np.random.default_rng(seed)
    sizes: dict[str, int] = {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(512)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    if moe:
        w.add_expert_count(N_EXPERT)
        w.add_expert_used_count(K)
    if template:
        w.add_chat_template(template)
    _add(w, "token_embd.weight", (VOCAB, N_EMBD), rng, sizes=sizes)
    _add(w, "output_norm.weight", (N_EMBD,), rng, sizes=sizes)
    if not tied:
        _add(w, "output.weight", (VOCAB, N_EMBD), rng, sizes=sizes)
    for i in range(n_layer):
        b = f"blk.{i}."
        _add(w, b + "attn_norm.weight", (N_EMBD,), rng, sizes=sizes)
        for t in ("attn_q", "attn_output"):
            _add(w, b + t + ".weight", (N_EMBD, N_EMBD), rng, sizes=sizes)
        for t in ("attn_k", "attn_v"):
            _add(w, b + t + ".weight", (N_HEAD_KV * N_EMBD // N_HEAD, N_EMBD), rng, sizes=sizes)
        _add(w, b + "ffn_norm.weight", (N_EMBD,), rng, sizes=sizes)
        if not moe or (dense_first and i == 0):
            _add(w, b + "ffn_gate.weight", (N_FF, N_EMBD), rng, sizes=sizes)
            _add(w, b + "ffn_up.weight", (N_FF, N_EMBD), rng, sizes=sizes)
            _add(w, b + "ffn_down.weight", (N_EMBD, N_FF), rng, sizes=sizes)
            continue
        _add(w, b + "ffn_gate_inp.weight", (N_EXPERT, N_EMBD), rng, sizes=sizes)
        _add(w, b + "ffn_gate_exps.weight", (N_EXPERT, N_FF, N_EMBD), rng, q8=True, sizes=sizes)
        _add(w, b + "ffn_up_exps.weight", (N_EXPERT, N_FF, N_EMBD), rng, q8=True, sizes=sizes)
        _add(w, b + "ffn_down_exps.weight", (N_EXPERT, N_EMBD, N_FF), rng, q8=True, sizes=sizes)
        if bias:
            _add(w, b + "ffn_up_exps.bias", (N_EXPERT, N_FF), rng, sizes=sizes)
        if shared:
            _add(w, b + "ffn_gate_shexp.weight", (N_FF, N_EMBD), rng, sizes=sizes)
            _add(w, b + "ffn_up_shexp.weight", (N_FF, N_EMBD), rng, sizes=sizes)
            _add(w, b + "ffn_down_shexp.weight", (N_EMBD, N_FF), rng, sizes=sizes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sizes


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    p = tmp_path / "tiny-moe.gguf"
    return p, write_model(p, shared=True, bias=True)


def test_geometry_fields(model: tuple[Path, dict[str, int]]) -> None:
    path, _ = model
    g = load_geometry(path)
    assert (g.arch, g.n_layer, g.n_expert, g.n_expert_used) == ("llama", 3, N_EXPERT, K)
    assert (g.n_embd, g.n_head, g.n_head_kv) == (N_EMBD, N_HEAD, N_HEAD_KV)
    assert g.key_length == g.value_length == N_EMBD // N_HEAD
    assert g.context_length == 512 and g.n_vocab == VOCAB and g.n_ff_exp == N_FF
    assert g.chat_template == "{{x}}" and g.known_family
    assert g.moe_layers == (1, 2) and not g.layers[0].is_moe
    assert g.kv_heads == (N_HEAD_KV,) * 3 and not g.is_mla
    assert g.file_size == path.stat().st_size
    assert set(g.identity()) == {"arch", "n_layer", "n_expert", "n_expert_used", "fingerprint", "tensor_layout_hash"}


def test_byte_accounting(model: tuple[Path, dict[str, int]]) -> None:
    path, sizes = model
    g = load_geometry(path)
    per_layer = sum(l.expert_bytes + l.shared_bytes + l.other_bytes for l in g.layers)
    assert g.global_bytes + per_layer == sum(sizes.values())
    assert g.global_bytes == sum(v for k, v in sizes.items() if not k.startswith("blk."))
    assert g.token_embd_bytes == sizes["token_embd.weight"] and not g.output_tied
    assert g.device_global_bytes == g.global_bytes - g.token_embd_bytes
    l1 = g.layers[1]
    assert [e.kind for e in l1.experts] == ["gate", "up", "down"]
    assert all(e.ggml_type == "Q8_0" and e.n_expert == N_EXPERT for e in l1.experts)
    assert l1.expert_bytes == 3 * N_EXPERT * N_FF * N_EMBD // 32 * 34
    assert l1.expert_bytes_per_expert * N_EXPERT == l1.expert_bytes
    assert l1.shared_bytes == sum(v for k, v in sizes.items() if k.startswith("blk.1.") and "shexp" in k)
    assert l1.expert_bias_bytes == sizes["blk.1.ffn_up_exps.bias"]
    assert l1.other_bytes == sum(v for k, v in sizes.items()
                                 if k.startswith("blk.1.") and "shexp" not in k and "exps.weight" not in k)
    assert g.total_expert_bytes == sum(v for k, v in sizes.items() if k.endswith("_exps.weight"))
    assert g.layers[0].other_bytes == sum(v for k, v in sizes.items() if k.startswith("blk.0."))


def test_fingerprint_content_and_layout(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    write_model(a, seed=1)
    write_model(b, seed=2)
    write_model(c, seed=1)
    ga, gb, gc = load_geometry(a), load_geometry(b), load_geometry(c)
    assert ga.tensor_layout_hash == gb.tensor_layout_hash
    assert ga.fingerprint != gb.fingerprint
    assert ga.fingerprint == gc.fingerprint
    d = tmp_path / "d.gguf"
    write_model(d, seed=1, n_layer=4)
    assert load_geometry(d).tensor_layout_hash != ga.tensor_layout_hash


def test_unknown_moe_arch_and_tied_output(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    write_model(p, arch="brandnewmoe", tied=True, template=None)
    g = load_geometry(p)
    assert not g.known_family and g.moe_layers == (1, 2)
    assert g.output_tied and g.device_global_bytes == g.global_bytes and g.chat_template is None


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no such file") as e:
        load_geometry(tmp_path / "nope.gguf")
    assert str(tmp_path / "nope.gguf") in e.value.one_line() and e.value.exit_code == ModelFileError.exit_code == 3


@pytest.mark.parametrize("content", [b"", b"GG", b"hello world, not a model" * 10])
def test_not_gguf(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(content)
    with pytest.raises(ModelFileError, match="not a GGUF file") as e:
        load_geometry(p)
    assert str(p) in e.value.one_line() and "\n" not in e.value.one_line()


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated(model: tuple[Path, dict[str, int]], keep: float) -> None:
    path, _ = model
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError, match="truncated") as e:
        load_geometry(path)
    assert str(path) in e.value.one_line() and "\n" not in e.value.one_line()


def test_truncated_header(model: tuple[Path, dict[str, int]]) -> None:
    path, _ = model
    path.write_bytes(path.read_bytes()[:64])
    with pytest.raises(ModelFileError, match="truncated"):
        load_geometry(path)


def test_no_experts(tmp_path: Path) -> None:
    p = tmp_path / "dense.gguf"
    write_model(p, moe=False)
    with pytest.raises(ModelFileError, match="no expert tensors") as e:
        load_geometry(p)
    assert str(p) in e.value.one_line()
    g = load_geometry(p, require_moe=False)
    assert g.moe_layers == () and g.total_expert_bytes == 0


def test_split_model(tmp_path: Path) -> None:
    whole = tmp_path / "whole.gguf"
    write_model(whole, seed=3)
    g1 = load_geometry(whole)
    r = gguf.GGUFReader(whole)
    base = tmp_path / "split.gguf"
    w = gguf.GGUFWriter(str(base), "llama", split_max_tensors=20)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        val = f.contents()
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, val, vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) > 1
    g2 = load_geometry(shards[0])
    assert g2.tensor_layout_hash == g1.tensor_layout_hash
    assert g2.total_expert_bytes == g1.total_expert_bytes and g2.global_bytes == g1.global_bytes
    assert g2.file_size == sum(s.stat().st_size for s in shards)
    shards[-1].unlink()
    with pytest.raises(ModelFileError, match="no such file"):
        load_geometry(shards[0])


def test_bad_metadata_type(tmp_path: Path) -> None:
    p = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_string("llama.block_count", "three")
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((4, 8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="unexpected GGUF metadata"):
        load_geometry(p)


def test_loaded_geometry_plans(model: tuple[Path, dict[str, int]]) -> None:
    from spark_cli.core.planner import PlanRequest, plan_for

    g = load_geometry(model[0])
    plan = plan_for(g, PlanRequest(1 << 30, 256)).plan
    assert [l.mode for l in plan.layers] == ["dense", "resident", "resident"]
    assert plan.model == g.identity()
