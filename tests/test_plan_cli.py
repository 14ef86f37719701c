"""`spark plan`: budgets, profiles, the VRAM bill, the stock baseline, refusals."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import cli_runner

from spark_cli.native import devices
from spark_cli.core import plan_file, planner, vram
from spark_cli.commands import plan as plan_cmd
from spark_cli.models.tiny_models import TINY_ARCHES, build_tiny_model
from spark_cli.errors import DeviceError, OutputError, PlanError, ProfileError, UsageError
from spark_cli.core.options import DEFAULT_CTX
from spark_cli.core.gguf_info import _open, load_geometry
from spark_cli.core.profile import RoutingProfile, profile_path_for
from spark_cli.core.simulator import DEFAULT_POLICY
from spark_cli.core.trace import RoutingTrace

MiB = 1 << 20


@pytest.fixture
def spark(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, "plan", plan_cmd.register)


@pytest.fixture(scope="module")
def geo(small_model):
    return load_geometry(small_model)


def fixed_bytes(g, n_ctx: int = DEFAULT_CTX, type_k: str = "f16", type_v: str = "f16") -> int:
    return planner.fixed_bytes(g, n_ctx, type_k, type_v, 512)


def floor_bytes(g, stage: int | None = None) -> int:
    """k slots and a guard per MoE layer, and the staging slices the default miss path holds
    (stage: their count)."""
    stage = planner.staging_bytes(g, planner.stage_slices(g.n_expert, g.n_expert_used, "auto") if stage is None
                                  else stage)
    return stage + sum((g.n_expert_used + 1) * g.layers[i].expert_bytes_per_expert for i in g.moe_layers)


def partial_budget(g, share: float = 0.5) -> int:
    return fixed_bytes(g) + int(share * g.total_expert_bytes)


def test_writes_plan_that_loads_and_fits(spark, small_model, geo, tmp_path) -> None:
    out = tmp_path / "plan.json"
    budget = partial_budget(geo)
    rc, stdout, stderr = spark(small_model, "--vram", budget, "-o", out)
    assert rc == 0, stderr
    p = plan_file.load(out, expect_identity=geo.identity())
    assert p.budget_bytes == budget and p.n_ctx == min(geo.context_length, DEFAULT_CTX)
    assert p.breakdown["total"] <= budget
    modes = {l.mode for l in p.layers}
    assert modes == {"resident", "cached"}, modes  # half the experts: some layers of each
    staged = planner.staging_bytes(geo, p.stage_slices)  # shared by the cached layers, in expert_banks
    assert sum(l.device_bytes for l in p.layers) + staged + p.breakdown["weights_global"] + p.breakdown["kv_cache"] \
        + p.breakdown["compute"] + p.breakdown["overhead"] == p.breakdown["total"]
    for text in ("placement per layer", "host + cache", "resident", "VRAM bill", "KV cache", "K f16 / V f16",
                 "expert banks", "free", "uniform prior", f"wrote {out}"):
        assert text in stdout, text


def test_table_shows_stock_baseline(spark, small_model, geo) -> None:
    rc, stdout, stderr = spark(small_model, "--vram", partial_budget(geo), "--json")
    assert rc == 0, stderr
    stock = json.loads(stdout)["stock"]
    assert stock["fits"] and 0 < stock["n_cpu_moe"] <= geo.n_layer
    assert len(stock["override_patterns"]) == stock["n_cpu_moe"]
    rc, stdout, _ = spark(small_model, "--vram", partial_budget(geo))
    assert f"--n-cpu-moe {stock['n_cpu_moe']}" in stdout
    assert "-ot 'blk\\.(0|1|" in stdout and "exps=CPU'" in stdout
    assert "--cpu-moe (all experts on the CPU)" in stdout and "fits" in stdout


def test_stock_baseline_when_everything_fits(spark, small_model) -> None:
    rc, stdout, _ = spark(small_model, "--vram", "64GiB")
    assert rc == 0
    assert "every expert fits on the device" in stdout and "--n-cpu-moe" not in stdout


def test_too_small_budget_names_the_shortfall(spark, small_model) -> None:
    rc, stdout, stderr = spark(small_model, "--vram", "100MiB")
    assert rc == PlanError.exit_code and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error:") and "the model without experts needs" in lines[0] and "over by" in lines[0]


def test_below_the_cache_floor_keeps_layers_on_the_host(spark, small_model, geo) -> None:
    rc, stdout, stderr = spark(small_model, "--vram", str(fixed_bytes(geo) + floor_bytes(geo) // 2), "--json")
    assert rc == 0, stderr
    modes = [l["mode"] for l in json.loads(stdout)["layers"]]
    n_host = modes.count("host")
    assert 0 < n_host < len(modes) and modes[:n_host] == ["host"] * n_host  # the first layers, as --n-cpu-moe
    assert set(modes[n_host:]) == {"cached"}


def test_no_gpu_and_no_vram_is_refused(spark, small_model) -> None:
    rc, stdout, stderr = spark(small_model)
    assert rc == PlanError.exit_code and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and "--vram is required for a dry run" in stderr


def test_budget_from_the_selected_device(spark, small_model, rpc_server) -> None:
    """Without --vram the budget is the selected device's free memory (devices.py) less the margin."""
    rc, stdout, stderr = spark(small_model, "--rpc", rpc_server.endpoint, "--json")
    assert rc == 0, stderr
    (dev,) = devices.select(devices.parse(None, rpc_server.endpoint))
    free, _ = devices.free_memory(dev)
    # the stand-in reports its host's free RAM, which moves a little between the two readings
    assert json.loads(stdout)["budget_bytes"] == pytest.approx(free - devices.BUDGET_MARGIN, rel=0.05)
    rc, _, stderr = spark(small_model, "-dev", "NOPE0", "--json")
    assert rc == DeviceError.exit_code and "-dev NOPE0: no device named NOPE0" in stderr


def test_device_none_is_a_dry_run_without_a_device(spark, small_model) -> None:
    rc, _, stderr = spark(small_model, "-dev", "none")
    assert rc == PlanError.exit_code and "--vram is required" in stderr


def test_plan_of_another_model_is_refused(spark, small_model, tmp_path) -> None:
    out = tmp_path / "tiny.plan.json"
    rc, _, stderr = spark(build_tiny_model("qwen3moe"), "--vram", "1GiB", "-o", out)
    assert rc == 0, stderr
    with pytest.raises(PlanError, match="plan is for another model"):
        plan_file.load(out, expect_identity=load_geometry(small_model).identity())


def _beside(model: Path, folder: Path) -> Path:
    """The model in `folder` (a symlink where possible: the file is 400+ MiB)."""
    dst = folder / model.name
    try:
        os.symlink(model, dst)
    except OSError:
        shutil.copyfile(model, dst)
    return dst


def test_skewed_profile_pins_exactly_the_hot_experts(spark, small_model, geo, tmp_path) -> None:
    model = _beside(Path(small_model), tmp_path)
    hot = (5, 2)  # hottest first
    decode = np.zeros((geo.n_layer, geo.n_expert))
    for il in geo.moe_layers:
        decode[il, :] = 1.0
        decode[il, hot[0]], decode[il, hot[1]] = 60.0, 50.0
    RoutingProfile.empty(geo.identity()).add(None, decode, 0.0, 1000.0, "test").save(profile_path_for(model))
    bpe = geo.layers[geo.moe_layers[0]].expert_bytes_per_expert
    budget = fixed_bytes(geo) + floor_bytes(geo, stage=0) + len(hot) * len(geo.moe_layers) * bpe
    rc, stdout, stderr = spark(model, "--vram", budget, "--json", "--miss-path", "cpu")  # the floor alone
    assert rc == 0, stderr
    p = plan_file.from_json(stdout)
    cached = [l for l in p.layers if l.mode == "cached"]
    assert len(cached) == len(geo.moe_layers)
    assert all(l.pinned == hot and l.lru_slots == geo.n_expert_used for l in cached)
    assert p.predicted_cold_hit == pytest.approx(6 / 116)
    rc, stdout, _ = spark(model, "--vram", budget, "--miss-path", "cpu")
    assert f"profile {profile_path_for(model).name}" in stdout and "2 each: 5 2" in stdout
    assert "predicted cold-hit rate: 5.2%" in stdout


def test_missing_profile_flag_is_refused(spark, small_model, tmp_path) -> None:
    rc, _, stderr = spark(small_model, "--vram", "2GiB", "--profile", tmp_path / "none.json")
    assert rc == ProfileError.exit_code and "no such file" in stderr


def test_output_to_a_directory_is_refused(spark, small_model, tmp_path) -> None:
    rc, _, stderr = spark(small_model, "--vram", "2GiB", "-o", tmp_path)
    assert rc == OutputError.exit_code and "is a directory" in stderr


def test_quantized_kv_cache_costs_less(spark, small_model) -> None:
    kv = {}
    for t in ("f16", "q8_0", "q4_0"):
        rc, stdout, stderr = spark(small_model, "--vram", "4GiB", "--cache-type-k", t, "--cache-type-v", t, "--json")
        assert rc == 0, stderr
        d = json.loads(stdout)
        assert d["type_k"] == d["type_v"] == t
        kv[t] = d["breakdown"]["kv_cache"]
    assert kv["q4_0"] < kv["q8_0"] < kv["f16"]
    assert kv["q8_0"] == pytest.approx(kv["f16"] * 34 / 64, rel=1e-6)  # 34 bytes per 32 values vs 64
    rc, _, stderr = spark(small_model, "--vram", "4GiB", "-ctk", "q3_k")
    assert rc == 2 and "--cache-type-k: unknown KV cache type" in stderr  # a usage error


def test_trace_sizes_lru_slots(spark, small_model, geo, tmp_path) -> None:
    rng = np.random.default_rng(0)
    n, k = 300, geo.n_expert_used
    p = np.array([2.0 ** -i for i in range(geo.n_expert)])
    ids = np.stack([np.stack([rng.choice(geo.n_expert, k, replace=False, p=p / p.sum())
                              for _ in range(geo.n_layer)]) for _ in range(n)])
    path = tmp_path / "t.npz"
    RoutingTrace(ids, np.ones(n), np.arange(n), geo.n_expert, geo.fingerprint).save(path)
    budget = partial_budget(geo, 0.4)
    rc, stdout, stderr = spark(small_model, "--vram", budget, "--trace", path)
    assert rc == 0, stderr
    assert "routing counts from the trace" in stdout and "on the trace (300 decode rows" in stdout
    assert f"priced by replaying 300 decode steps of the trace t.npz through {DEFAULT_POLICY}" in stdout
    assert "held-out check: planned on the first 210 decode steps" in stdout and "Belady" in stdout
    rc, stdout, stderr = spark(small_model, "--vram", partial_budget(geo, 0.4), "--trace", path,
                               "--policy", "lru", "--no-check", "--json")
    assert rc == 0, stderr
    d = json.loads(stdout)
    assert d["policy"] == "lru" and 0.0 <= d["predicted_miss"] <= 1.0
    rc, _, stderr = spark(small_model, "--vram", "2GiB", "--policy", "belady")
    assert rc == UsageError.exit_code and "a cache cannot run it" in stderr

    # the same routing counts with and without the steps: the trace's plan is priced by replaying them,
    # a profile of counts alone (no ring of recent steps) plans from the counts with k slots per layer
    with_trace = plan_file.from_json(spark(small_model, "--vram", budget, "--trace", path, "--json")[1])
    prof = tmp_path / "p.json"
    t = RoutingTrace.load(path)
    RoutingProfile.empty(geo.identity()).add(t.counts("prefill"), t.counts("decode"), t.n_rows - t.n_decode,
                                             t.n_decode, "t").save(prof)
    without = plan_file.from_json(spark(small_model, "--vram", budget, "--profile", prof, "--json")[1])
    cached_without = [l for l in without.layers if l.mode == "cached"]
    cached_with = [l for l in with_trace.layers if l.mode == "cached"]
    assert cached_without and all(l.lru_slots == k for l in cached_without)
    assert cached_with and with_trace.predicted_miss is not None and without.predicted_miss is None
    assert with_trace.breakdown["total"] <= budget and without.breakdown["total"] <= budget

    other = tmp_path / "other.npz"
    RoutingTrace(ids, np.ones(n), np.arange(n), geo.n_expert, "0" * 64).save(other)
    rc, _, stderr = spark(small_model, "--vram", "2GiB", "--trace", other)
    assert rc == ProfileError.exit_code and "another model" in stderr


def test_unknown_family_warns(spark, monkeypatch) -> None:
    from spark_cli.core import gguf_info

    monkeypatch.setattr(gguf_info, "family_for", lambda arch: None)
    rc, stdout, stderr = spark(build_tiny_model("qwen3moe"), "--vram", "1GiB")
    assert rc == 0, stderr
    assert "warning: architecture 'qwen3moe' is not in models.toml" in stdout


def test_long_models_compress_identical_rows(spark, small_model, geo) -> None:
    rc, stdout, _ = spark(small_model, "--vram", "64GiB")
    rows = [l for l in stdout.splitlines() if "resident (8 experts)" in l]
    assert len(rows) == 1 and f"0-{geo.n_layer - 1}" in rows[0]


def _tensor_bytes(path) -> int:
    return sum(t.n_bytes for t in _open(Path(path)).tensors)


def _accounted(p: planner.Plan, g) -> int:
    """Every tensor byte the plan places: device weights, layers (banks replaced by the
    experts they cache), plus the input embeddings llama.cpp keeps on the CPU."""
    banks = p.breakdown["expert_banks"] - planner.staging_bytes(g, p.stage_slices)  # the layers' own banks
    layers = sum(l.device_bytes + l.host_bytes for l in p.layers) - banks
    untied = 0 if g.output_tied else g.token_embd_bytes
    nextn = sum(l.expert_bytes + l.nonexpert_bytes for l in g.layers if l.is_nextn)
    return p.breakdown["weights_global"] + untied + layers + nextn


def test_byte_accounting_equals_gguf_tensor_sizes(spark, small_model, geo) -> None:
    import gguf

    total = sum(int(t.n_bytes) for t in gguf.GGUFReader(small_model).tensors)  # an independent reader
    assert total == _tensor_bytes(small_model)
    rc, stdout, _ = spark(small_model, "--vram", "64GiB", "--json")
    p = plan_file.from_json(stdout)
    assert all(l.mode == "resident" for l in p.layers)
    b = p.breakdown
    assert geo.output_tied  # SmolLM2: tok_embd is the output matrix, on the device
    assert b["weights_global"] + b["weights_layers_nonexpert"] + b["experts_resident"] == total
    rc, stdout, _ = spark(small_model, "--vram", partial_budget(geo), "--json")
    assert _accounted(plan_file.from_json(stdout), geo) == total


@pytest.mark.parametrize("arch", TINY_ARCHES)
def test_byte_accounting_tiny_archs(spark, arch) -> None:
    path = build_tiny_model(arch)
    g = load_geometry(path)
    total = _tensor_bytes(path)
    for share in (1.0, 0.5):
        budget = fixed_bytes(g, 512) + int(share * g.total_expert_bytes) + floor_bytes(g)
        rc, stdout, stderr = spark(path, "--vram", budget, "-c", 512, "--json")
        assert rc == 0, stderr
        p = plan_file.from_json(stdout)
        assert p.breakdown["total"] <= budget
        assert _accounted(p, g) == total
        assert p.stock.device_bytes <= budget or not p.stock.fits
        assert vram.kv_cache_bytes(g, 512) == p.breakdown["kv_cache"]


def test_plan_replays_the_profiles_recent_steps(spark, small_model, geo, tmp_path) -> None:
    rng = np.random.default_rng(1)
    n, k = 120, geo.n_expert_used
    p = np.array([2.0 ** -i for i in range(geo.n_expert)])
    ids = np.stack([np.stack([rng.choice(geo.n_expert, k, replace=False, p=p / p.sum())
                              for _ in range(geo.n_layer)]) for _ in range(n)])
    prof = RoutingProfile.empty(geo.identity()).add_trace(
        RoutingTrace(ids, np.ones(n), np.arange(n), geo.n_expert, geo.fingerprint), "test")
    path = tmp_path / "p.json"
    prof.save(path)
    rc, stdout, stderr = spark(small_model, "--vram", partial_budget(geo, 0.4), "--profile", path,
                               "--policy", "lfu-aged", "--no-check")
    assert rc == 0, stderr
    assert "priced by replaying 120 decode steps of the profile's recent decode steps through lfu-aged" in stdout
    assert "held-out check" not in stdout


@pytest.mark.parametrize("argv", [["-c", "512"], ["--ctx-size", "512"], ["--ctx", "512"], ["--ctx=512"]])
def test_context_flag_spellings(spark, small_model, argv) -> None:
    rc, stdout, stderr = spark(small_model, "--vram", "64GiB", *argv, "--json")
    assert rc == 0, stderr
    assert json.loads(stdout)["n_ctx"] == 512


def test_help_shows_llama_cpp_spellings(spark) -> None:
    rc, stdout, _ = spark("-h")
    assert rc == 0
    for flag in ("--ctx-size", "-c", "-ctk", "-ctv", "--flash-attn", "-fa", "--batch-size", "-ub", "--no-mmap",
                 "--mlock", "-dev", "--rpc", "-ot", "--threads", "--json", "--output", "--policy", "--check",
                 "--parallel", "-np", "--kv-unified", "-kvu"):
        assert flag in stdout, flag
    assert "--ctx," not in stdout and "--ctx " not in stdout  # the old spelling works but is not shown


def test_plan_prices_parallel_sequences(spark) -> None:
    """`spark plan -np 4` prices four sequences' KV cache and recurrent state (a hybrid tiny model:
    the same 4096 attention cells in 4 streams or one unified, the state 4 times) and records them."""
    from spark_cli.models.tiny_models import build_tiny_model as build_family_model

    path = build_family_model("qwen35moe")
    g = load_geometry(path)
    assert g.recurrent_state_bytes
    kv = {}
    for argv, n, unified in (([], 1, False), (["-np", "4"], 4, False), (["--parallel", "4", "-kvu"], 4, True),
                             (["-np", "3", "--no-kv-unified"], 3, False)):
        rc, stdout, stderr = spark(path, "--vram", "64GiB", "-c", 4096, *argv, "--json")
        assert rc == 0, stderr
        p = plan_file.from_json(stdout)
        assert (p.n_parallel, p.kv_unified) == (n, unified)
        assert p.breakdown["kv_cache"] == vram.kv_cache_bytes(g, 4096, n_seq=n, unified=unified)
        kv[n, unified] = p.breakdown["kv_cache"]
    assert kv[4, False] - kv[1, False] == kv[4, True] - kv[1, False] == 3 * g.recurrent_state_bytes
    rc, stdout, stderr = spark(path, "--vram", "64GiB", "-c", 4096, "-np", "4")
    assert rc == 0, stderr
    assert "n_ctx 4096, 4 sequences" in stdout
