"""Geometry fixtures: real-sized sparse GGUFs without weights, their plans and KV/recurrent bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_runner

from spark_cli.commands import demo as demo_cmd
from spark_cli.commands import plan as plan_cmd
from spark_cli.core import vram
from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.planner import PlanRequest, plan_for
from spark_cli.core.units import GiB, MiB
from spark_cli.models.fixtures import FIXTURES, build_fixture, disk_bytes

NAMES = list(FIXTURES)

# The published files the fixtures bigger than common RAM stand for: bytes (as Hugging Face lists them,
# 1 GB = 10^9 B) and where the figure comes from. A fixture's size is within 1% of its file's.
PUBLISHED: dict[str, tuple[int, str]] = {
    "qwen3-235b-a22b-q4_k_m": (142_000_000_000, "Qwen/Qwen3-235B-A22B-GGUF Q4_K_M, 5 parts, ~142 GB "
                               "(unsloth's Q4_K_M: 142 GB as well)"),
    "glm-4.6-q4_k_m": (216_000_000_000, "unsloth/GLM-4.7-GGUF Q4_K_M, 5 parts, 216 GB (GLM-4.7 has "
                       "GLM-4.6's config.json geometry)"),
    "deepseek-v3.1-q4_k_m": (404_430_000_000, "bartowski/deepseek-ai_DeepSeek-V3-0324-GGUF Q4_K_M, "
                             "404.43 GB (V3.1 has V3's structure; unsloth's R1 Q4_K_M: 404 GB)"),
    "kimi-k2-q4_k_m": (621_000_000_000, "unsloth/Kimi-K2-Instruct-GGUF Q4_K_M, 13 parts, 621 GB"),
    "gpt-oss-120b-mxfp4": (int(59.02 * GiB), "ggml-org/gpt-oss-120b-GGUF mxfp4, 3 parts, 59.02 GiB as "
                           "llama-bench prints it"),
}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fixtures")
    for name in NAMES:
        build_fixture(name, out_dir=d)
    return d


def _path(d: Path, name: str) -> Path:
    return build_fixture(name, out_dir=d)


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_full_size_and_sparse(fixture_dir, name) -> None:
    s = FIXTURES[name]
    p = _path(fixture_dir, name)
    assert p.stat().st_size > 10 * GiB  # the real file's size
    assert disk_bytes(p) < 16 * MiB  # a header, no data
    g = load_geometry(p)
    assert (g.arch, g.n_layer, g.n_expert, g.n_expert_used, g.n_embd, g.n_vocab) == (
        s.arch, s.n_layer_all, s.n_expert, s.n_expert_used, s.n_embd, s.n_vocab)
    assert len(g.moe_layers) == s.n_layer - s.n_dense_lead
    assert g.n_ff_exp == s.n_ff_exp
    assert build_fixture(name, out_dir=fixture_dir) == p  # cached


def _llama_kv_bytes(s, n_ctx: int, n_ubatch: int = 512, k_bytes: int = 2, v_bytes: int = 2) -> int:
    """llama.cpp's KV cache (llama-context.cpp, llama-kv-cache*.cpp) and recurrent state
    (llama-memory-recurrent.cpp, llama-hparams.cpp) for one sequence, f16 K/V, from the spec alone:
    n_ctx padded to 256 cells; a sliding-window layer holds GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256)
    (the non-full SWA cache); per cell n_embd_k_gqa + n_embd_v_gqa elements, or with MLA only a K row
    of the kv latent and the rope key (one MQA head of kv_lora_rank + qk_rope_head_dim) and no V
    tensor (is_mla); MTP blocks are not loaded; a recurrent layer keeps f32 r
    (n_embd_r = (d_conv - 1) * (d_inner + 2 n_group d_state)) and s (n_embd_s = d_state * d_inner)
    rows instead."""
    pad = lambda n: -(-n // 256) * 256  # noqa: E731
    size_base = pad(n_ctx)
    size_swa = pad(min(size_base, s.n_swa + n_ubatch))
    if s.mla:
        cell = (s.mla.kv_lora_rank + s.mla.qk_rope_head_dim) * k_bytes
    else:
        cell = s.n_head_kv * s.head_dim * (k_bytes + v_bytes)
    total = 0
    for il in range(s.n_layer):
        if not s.has_kv(il):
            continue
        cells = size_swa if (s.n_swa and s.swa_layers[il]) else size_base
        total += cells * cell
    if s.ssm:
        m = s.ssm
        n_embd_r = (m["conv_kernel"] - 1) * (m["inner_size"] + 2 * m["group_count"] * m["state_size"])
        n_embd_s = m["state_size"] * m["inner_size"]
        total += sum(1 for il in range(s.n_layer) if s.recurrent[il]) * (n_embd_r + n_embd_s) * 4
    return total


@pytest.mark.parametrize("n_ctx", [4096, 8192, 32768])
@pytest.mark.parametrize("name", NAMES)
def test_kv_and_recurrent_bytes_equal_llama_cpp(fixture_dir, name, n_ctx) -> None:
    s = FIXTURES[name]
    g = load_geometry(_path(fixture_dir, name))
    assert vram.kv_cache_bytes(g, n_ctx, "f16", "f16", 512) == _llama_kv_bytes(s, n_ctx)
    if s.ssm:
        assert g.recurrent_state_bytes == _llama_kv_bytes(s, 256) - sum(
            256 * s.n_head_kv * s.head_dim * 4 for il in range(s.n_layer) if s.has_kv(il))
    else:
        assert g.recurrent_state_bytes == 0


def test_recurrent_state_of_qwen36_by_hand(fixture_dir) -> None:
    """30 gated-delta-net layers x (3 x 8192 conv + 128 x 4096 state) f32 = 62.8 MiB."""
    g = load_geometry(_path(fixture_dir, "qwen3.6-35b-a3b-q4_k_m"))
    assert g.recurrent_state_bytes == 30 * (3 * 8192 + 128 * 4096) * 4


def test_kv_cache_of_deepseek_v31_by_hand(fixture_dir) -> None:
    """MLA caches the 512-wide kv latent and the 64-wide rope key, no V: 61 layers x 4096 cells x
    576 x 2 bytes = 274.5 MiB at -c 4096 (K and V of its 128 heads of 192 and 128 would be 71x that)."""
    g = load_geometry(_path(fixture_dir, "deepseek-v3.1-q4_k_m"))
    assert g.is_mla and g.n_layer == 61 and g.n_layer_nextn == 0  # the converter drops the MTP layer
    assert vram.kv_cache_bytes(g, 4096) == 61 * 4096 * (512 + 64) * 2


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_fixture_is_the_published_files_size(fixture_dir, name) -> None:
    size, source = PUBLISHED[name]
    got = _path(fixture_dir, name).stat().st_size
    assert abs(got - size) <= 0.01 * size, f"{name}: {got / 1e9:.2f} GB, published {source}"


@pytest.mark.parametrize("name", NAMES)
def test_plan_at_16gib_fits_and_spends_the_budget(fixture_dir, name) -> None:
    g = load_geometry(_path(fixture_dir, name))
    budget = 16 * GiB
    plan = plan_for(g, PlanRequest(budget_bytes=budget, n_ctx=8192)).plan
    assert plan.breakdown["total"] <= budget
    modes = {l.index: l.mode for l in plan.layers}
    if g.file_size <= 64 * GiB:  # a model that fits common RAM: every MoE layer holds its experts or a
        # cache on the device, none left on the host
        assert all(modes[i] in ("resident", "cached") for i in g.moe_layers), modes
    else:  # bigger ones: the device still caches experts, of as many layers as fit
        assert any(modes[i] in ("resident", "cached") for i in g.moe_layers), modes
    assert all(modes[i] == "skipped" for i in range(g.n_layer) if g.layers[i].is_nextn)
    if plan.stock.fits and plan.stock.n_cpu_moe == 0:  # everything fits: all resident, as stock
        assert all(modes[i] == "resident" for i in g.moe_layers)
    else:  # the budget is spent: what is left could not hold one more expert of any layer
        left = budget - plan.breakdown["total"]
        assert left < max(g.layers[i].expert_bytes_per_expert for i in g.moe_layers) + 64 * MiB


@pytest.mark.parametrize("vram_gib, n_ctx", [(12, 8192), (16, 8192), (24, 8192), (16, 32768)])
def test_spark_plan_prints_placement_and_bill(monkeypatch, capsys, fixture_dir, vram_gib, n_ctx) -> None:
    run = cli_runner(monkeypatch, capsys, "plan", plan_cmd.register)
    for name in ("qwen3.6-35b-a3b-q4_k_m", "gpt-oss-20b-mxfp4"):
        rc, out, err = run(_path(fixture_dir, name), "--vram", f"{vram_gib}GiB", "-c", n_ctx)
        assert rc == 0, err
        assert "VRAM bill" in out and "stock llama.cpp, same budget" in out
        assert f"n_ctx {n_ctx}" in out


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_spark_plan_vram_and_ram_on_models_bigger_than_ram(monkeypatch, capsys, fixture_dir, name) -> None:
    """`spark plan F --vram 16GiB` places and bills; `spark plan F --ram 64GiB` splits the weights
    between RAM and the file (or says they fit)."""
    run = cli_runner(monkeypatch, capsys, "plan", plan_cmd.register)
    path = _path(fixture_dir, name)
    g = load_geometry(path)
    rc, out, err = run(path, "--vram", "16GiB", "-c", 8192)
    assert rc == 0, err
    assert "VRAM bill" in out and "stock llama.cpp, same budget" in out and "n_ctx 8192" in out
    rc, out, err = run(path, "--ram", "64GiB", "--json")
    assert rc == 0, err
    tier = json.loads(out)["ram_tier"]
    assert (tier is None) == (g.file_size < 64 * GiB)
    if tier is not None:
        assert tier["resident_bytes"] + tier["bank_bytes"] <= tier["budget"] == 64 * GiB
        assert 0 < tier["file_bytes"] < g.total_expert_bytes
        assert [l["il"] for l in tier["layers"]] == list(g.moe_layers)
        assert all(l["slots"] >= g.n_expert_used for l in tier["layers"])


def test_demo_model_fixture_list_and_build(monkeypatch, capsys, tmp_path) -> None:
    run = cli_runner(monkeypatch, capsys, "demo-model", demo_cmd.register)
    rc, out, _ = run("--fixture", "list")
    assert rc == 0 and [line.split("\t")[0] for line in out.splitlines()] == NAMES
    rc, out, _ = run("--fixture", "gpt-oss-20b-mxfp4", "--out-dir", tmp_path)
    assert rc == 0
    p = Path(out.strip().splitlines()[-1])
    assert p.parent == tmp_path and load_geometry(p).arch == "gpt-oss"
    rc, _, err = run("--fixture", "nope")
    assert rc == 2 and "unknown fixture" in err


_CHECK = """
import sys
from pathlib import Path
from spark_cli.models.fixtures import check_with_llama
why = check_with_llama(Path(sys.argv[1]))
print("LOADED" if why is None else why)
"""


@pytest.mark.model
@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_accepts_the_header(fixture_dir, name) -> None:
    """llama.cpp's loader (no_alloc: metadata, hparams, every tensor created against the
    hyperparameters' shapes, the tensor count; no weights read) accepts the fixture."""
    pytest.importorskip("llama_cpp")
    r = subprocess.run([sys.executable, "-c", _CHECK, str(_path(fixture_dir, name))], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0 and "LOADED" in r.stdout, (r.stdout + r.stderr)[-2000:]


@pytest.mark.model
@pytest.mark.parametrize("name", NAMES)
def test_planned_kv_and_state_equal_llama_cpp_dry_run(fixture_dir, name) -> None:
    """The planner's KV cache and recurrent state (vram.kv_cache_bytes: GQA, sliding windows, MLA's
    latent, recurrent state, MTP blocks left out) against the context buffers llama.cpp's dry run
    sizes for the fixture (no_alloc, CPU, -c 8192): the same bytes."""
    pytest.importorskip("llama_cpp")
    from spark_cli.native.engine import EngineOptions
    from spark_cli.runs.dry_run import measure

    path = _path(fixture_dir, name)
    bill = measure(EngineOptions(path, n_ctx=8192, device="none", repack=False, n_threads=1))
    allocated = sum(e.context for e in bill.entries)
    assert allocated > 0
    assert vram.kv_cache_bytes(load_geometry(path), 8192) == allocated
