"""Planned bytes are placed bytes: the plan's tensor overrides move exactly the expert weights of
its cached layers (biases stay), -ot passes through, and the planned VRAM bill matches what
llama.cpp allocates on the RPC stand-in."""

from __future__ import annotations

import re

import pytest

from spark_cli.core import planner
from spark_cli.runs import session
from spark_cli.models.tiny_models import TINY_ARCHES, build_tiny_model
from spark_cli.native.engine import Engine
from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.options import LoadFlags

pytestmark = pytest.mark.model
MiB = 1 << 20


def _fixed(g, n_ctx: int) -> int:
    return planner.fixed_bytes(g, n_ctx, "f16", "f16", 512)


def _floor(g) -> int:
    """k slots and a guard per MoE layer, and the staging slices of the default miss path."""
    stage = planner.staging_bytes(g, planner.stage_slices(g.n_expert, g.n_expert_used, "auto"))
    return stage + sum((g.n_expert_used + 1) * g.layers[i].expert_bytes_per_expert for i in g.moe_layers)


def _open(path, g, plan, endpoint, n_ctx, **flags) -> Engine:
    f = LoadFlags(rpc=endpoint, batch_size=512, **flags)
    return Engine(session.engine_options(path, g, plan, f, n_ctx=n_ctx, learn=False))


@pytest.mark.parametrize("arch", TINY_ARCHES)
def test_overrides_move_exactly_the_planned_host_bytes(arch, rpc_server):
    path = build_tiny_model(arch)
    g = load_geometry(path)
    plan = planner.plan_for(g, planner.PlanRequest(_fixed(g, 256) + _floor(g), 256)).plan
    cached = [l.index for l in plan.layers if l.mode == "cached"]
    assert cached, f"tiny {arch}: the floor budget caches no layer"
    with _open(path, g, plan, rpc_server.endpoint, 256) as eng:
        moved = eng.overridden_tensors()
        banks = eng.cache.bank_bytes()
    want = {t.name for il in cached for t in g.layers[il].experts}
    assert set(moved) == want  # expert weights only: biases (gpt-oss) stay with the layer on the device
    sizes = {t.name: t.n_bytes for l in g.layers for t in l.experts}
    assert sum(sizes[n] for n in moved) == sum(l.host_bytes for l in plan.layers)
    assert all(not b.startswith("RPC") for b in moved.values())  # host memory, not the device
    assert banks >= plan.breakdown["expert_banks"]


def test_override_tensor_passes_through(small_model, rpc_server):
    g = load_geometry(small_model)
    with _open(small_model, g, None, rpc_server.endpoint, 256, override_tensor=(r"blk\.1\.attn_norm=CPU",)) as eng:
        moved = eng.overridden_tensors()
    assert moved == {"blk.1.attn_norm.weight": "CPU"}


def test_planned_vram_matches_llama_cpp(small_model, rpc_server):
    """The plan's bill against the buffers llama.cpp reports on the stand-in (log lines in MiB
    with two decimals): weights within 64 KiB (alignment, rounding), KV cache within 16 KiB,
    banks at least the planned bytes plus per-tensor padding, the compute estimate between 0.9x
    and 1.5x the real compute buffer, and the whole planned bill (overhead aside) at least what
    was allocated and at most 1.25x it."""
    g = load_geometry(small_model)
    n_ctx = 512
    plan = planner.plan_for(g, planner.PlanRequest(_fixed(g, n_ctx) + int(0.5 * g.total_expert_bytes), n_ctx)).plan
    assert {l.mode for l in plan.layers} >= {"resident", "cached"}
    with _open(small_model, g, plan, rpc_server.endpoint, n_ctx) as eng:
        got = eng.allocated_bytes()
        banks = eng.cache.bank_bytes()
    b = plan.breakdown

    def on_device(kind: str) -> int:  # the stand-in's buffers: RPC0[host:port]
        return sum(v for k, v in got.items() if k.startswith(f"{kind} RPC"))

    weights = b["weights_global"] + b["weights_layers_nonexpert"] + b["experts_resident"]
    assert abs(on_device("model") - weights) <= 64 * 1024, (got, weights)
    assert abs(on_device("KV") - b["kv_cache"]) <= 16 * 1024, (got, b["kv_cache"])
    n_cached = sum(l.mode == "cached" for l in plan.layers)
    assert b["expert_banks"] <= banks <= b["expert_banks"] + 3 * 512 * n_cached  # per-tensor alignment
    compute = on_device("compute")
    assert 0.9 * compute <= b["compute"] <= 1.5 * compute, (compute, b["compute"])
    allocated = on_device("model") + on_device("KV") + compute + banks
    planned = b["total"] - b["overhead"]
    assert allocated <= planned <= 1.25 * allocated, (allocated, planned)


def test_llama_cpp_flags_reach_the_context(small_model, rpc_server):
    """--no-mmap, -fa, -ctk and -ub as llama.cpp reports them while loading (a quantized V cache
    needs flash attention, so only K is quantized here)."""
    g = load_geometry(small_model)
    with _open(small_model, g, None, rpc_server.endpoint, 256, mmap=False, flash_attn="off", type_k="q8_0",
               ubatch_size=64, threads=1) as eng:
        log = "\n".join(eng.load_log())
        buffers = eng.allocated_bytes()
        n_ubatch = eng.lib.lc.llama_n_ubatch(eng.ctx)
    assert "model CPU" in buffers and "model CPU_Mapped" not in buffers  # read, not mapped
    assert re.search(r"flash_attn\s*=\s*(disabled|0)", log), log[-2000:]
    assert re.search(r"type_k = 'q8_0'", log) or re.search(r"K \(q8_0\)", log), log[-2000:]
    assert n_ubatch == 64
