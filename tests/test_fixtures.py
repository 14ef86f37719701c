"""Geometry fixtures: real-sized sparse GGUFs without weights, their plans and KV/recurrent bytes."""

from __future__ import annotations

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
    (the non-full SWA cache); per cell n_embd_k_gqa + n_embd_v_gqa elements; MTP blocks are not
    loaded; a recurrent layer keeps f32 r (n_embd_r = (d_conv - 1) * (d_inner + 2 n_group d_state))
    and s (n_embd_s = d_state * d_inner) rows instead."""
    pad = lambda n: -(-n // 256) * 256  # noqa: E731
    size_base = pad(n_ctx)
    size_swa = pad(min(size_base, s.n_swa + n_ubatch))
    total = 0
    for il in range(s.n_layer):
        if not s.has_kv(il):
            continue
        cells = size_swa if (s.n_swa and s.swa_layers[il]) else size_base
        n_embd_gqa = s.n_head_kv * s.head_dim
        total += cells * n_embd_gqa * (k_bytes + v_bytes)
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


@pytest.mark.parametrize("name", NAMES)
def test_plan_at_16gib_fits_and_caches_every_moe_layer(fixture_dir, name) -> None:
    g = load_geometry(_path(fixture_dir, name))
    budget = 16 * GiB
    plan = plan_for(g, PlanRequest(budget_bytes=budget, n_ctx=8192)).plan
    assert plan.breakdown["total"] <= budget
    modes = {l.index: l.mode for l in plan.layers}
    # every MoE layer holds its experts or a cache on the device: none left on the host
    assert all(modes[i] in ("resident", "cached") for i in g.moe_layers), modes
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
