"""Issue 26: the dry run (llama.cpp no_alloc + the cache's banks), planned vs measured, the fit
loop, stale plan files, host RAM, on the demo model, the tiny families and the fixtures."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import cli_runner
from spark_cli.commands import chat as chat_cmd
from spark_cli.commands import plan as plan_cmd
from spark_cli.core import plan_file, planner, vram
from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.options import LoadFlags
from spark_cli.errors import PlanError
from spark_cli.runs import host_ram, session
from spark_cli.models.tiny_models import TINY_MODELS

MiB = 1 << 20
N_CTX = 2048


def _close(planned: int, measured: int) -> bool:
    """Within 2% or 16 MiB, the larger."""
    return abs(planned - measured) <= max(0.02 * measured, 16 * MiB)


def _budget(g, share: float = 0.5) -> int:
    # NOTE: a margin over the estimate's floor, as the estimate may be under the measurement
    return planner.fixed_bytes(g, N_CTX) + int(share * g.total_expert_bytes) + 8 * MiB


def _fit_and_load(path, rpc_server):
    """The fit loop's plan, then a real load of it: (plan, the dry run's bill, the real load's bill)."""
    from spark_cli.native.engine import Engine

    g = load_geometry(path)
    flags = LoadFlags(rpc=rpc_server.endpoint, repack=False)
    plan = planner.plan_for(g, planner.PlanRequest(_budget(g), N_CTX), session.measurer(path, g, flags, N_CTX)).plan
    with Engine(session.engine_options(path, g, plan, flags, n_ctx=N_CTX, learn=False)) as engine:
        real = engine.cache.memory_breakdown()
    return plan, plan.measured_bill(), real


def _check_planned_vs_measured(plan, dry, real) -> None:
    (dev,) = dry.device_names()
    d, r = dry.device(dev), real.device(dev)
    planned = plan.breakdown["total"] - plan.breakdown["overhead"]
    assert plan.fit_rounds >= 1 and plan.measured_device_bytes == d["total"]
    assert _close(planned, d["total"]), (planned, d)
    assert d["total"] <= plan.budget_bytes - planner.unmeasured_overhead()
    # the banks are the cache's own: planned (S + 1) slices per expert tensor, measured by the native sizing
    assert _close(plan.breakdown["expert_banks"], d["banks"])
    n_cached = sum(l.mode == "cached" for l in plan.layers)
    assert (d["banks"] > 0) == (n_cached > 0)
    # the dry run allocates what the real load allocates on the device
    for kind in ("model", "context", "banks"):
        assert d[kind] == r[kind], (kind, d, r)
    # NOTE: since a cached layer's stop packs its copies (device-side cast, concat and cont nodes), the
    # dry run's compute buffer can be a few percent over the real load's (3.3% on the demo model): over
    # is the safe side for a fit, under would not be
    assert r["compute"] - MiB <= d["compute"] <= max(1.05 * r["compute"], r["compute"] + MiB), (d, r)


@pytest.mark.model
def test_demo_model_planned_is_measured_is_real(small_model, rpc_server):
    _check_planned_vs_measured(*_fit_and_load(small_model, rpc_server))


@pytest.mark.model
@pytest.mark.parametrize("name", [n for n in TINY_MODELS])
def test_tiny_families_planned_is_measured_is_real(name, rpc_server):
    from spark_cli.models.tiny_models import build_tiny_model

    _check_planned_vs_measured(*_fit_and_load(build_tiny_model(name), rpc_server))


@pytest.mark.model
@pytest.mark.parametrize("name", ["gpt-oss", "qwen35moe"])  # sliding-window, hybrid
def test_dry_run_measures_the_plans_sequences(name, rpc_server):
    """-np 3: the fit loop's dry runs allocate 3 sequences' KV cache and state, what the plan bills;
    a --plan run without -np measures the plan's 3 (session.engine_options), -np 1 fewer."""
    from spark_cli.models.tiny_models import build_tiny_model

    path = build_tiny_model(name)
    g = load_geometry(path)
    flags = LoadFlags(rpc=rpc_server.endpoint, repack=False, parallel=3)
    req = planner.PlanRequest(_budget(g), N_CTX, n_parallel=3)
    plan = planner.plan_for(g, req, session.measurer(path, g, flags, N_CTX)).plan
    (dev,) = plan.measured_bill().device_names()
    context = plan.measured_bill().device(dev)["context"]
    assert plan.n_parallel == 3 and plan.breakdown["kv_cache"] == vram.kv_cache_bytes(g, N_CTX, n_seq=3)
    assert context == plan.breakdown["kv_cache"]
    plain = LoadFlags(rpc=rpc_server.endpoint, repack=False)
    assert session.measurer(path, g, plain, N_CTX)(plan).device(dev)["context"] == context
    one = session.measurer(path, g, dataclasses.replace(plain, parallel=1), N_CTX)(plan).device(dev)["context"]
    assert one == vram.kv_cache_bytes(g, N_CTX) < context


@pytest.mark.model
def test_estimate_fits_but_measurement_does_not_fit_loop_shrinks(small_model, rpc_server, monkeypatch):
    """A compute estimate far under llama.cpp's: the estimate's plan measures over the budget,
    the fit loop gives up slots and pins until the measurement fits, and the result loads."""
    from spark_cli.native.engine import Engine

    g = load_geometry(small_model)
    flags = LoadFlags(rpc=rpc_server.endpoint, repack=False)
    budget = _budget(g, 0.4)
    monkeypatch.setattr(vram, "compute_buffer_bytes", lambda *a, **k: MiB)  # the guess says 1 MiB
    req = planner.PlanRequest(budget, N_CTX)
    estimated = planner.plan_for(g, req).plan
    over = session.measurer(small_model, g, flags, N_CTX)(estimated).device_bytes()
    target = budget - planner.unmeasured_overhead()
    assert estimated.breakdown["total"] <= budget and over > target  # the estimate fits, the measurement not
    fit = planner.plan_for(g, req, session.measurer(small_model, g, flags, N_CTX)).plan
    assert fit.measured_device_bytes <= target < over
    assert fit.breakdown["expert_banks"] + fit.breakdown["experts_resident"] < \
        estimated.breakdown["expert_banks"] + estimated.breakdown["experts_resident"]
    with Engine(session.engine_options(small_model, g, fit, flags, n_ctx=N_CTX, learn=False)) as engine:
        assert engine.cache.memory_breakdown().device_bytes() <= target


@pytest.mark.model
def test_under_budget_spends_the_difference(small_model, rpc_server):
    """The estimate over-prices the demo's compute buffer: measured, the plan buys more experts."""
    g = load_geometry(small_model)
    flags = LoadFlags(rpc=rpc_server.endpoint, repack=False)
    req = planner.PlanRequest(_budget(g, 0.3), N_CTX)
    estimated = planner.plan_for(g, req).plan
    under = session.measurer(small_model, g, flags, N_CTX)(estimated).device_bytes()
    fit = planner.plan_for(g, req, session.measurer(small_model, g, flags, N_CTX)).plan
    assert under < fit.measured_device_bytes <= req.budget_bytes - planner.unmeasured_overhead()
    step = min(l.expert_bytes_per_expert for l in g.layers if l.is_moe)
    assert req.budget_bytes - planner.unmeasured_overhead() - fit.measured_device_bytes < 2 * step


@pytest.fixture
def plan_cli(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, "plan", plan_cmd.register)


@pytest.mark.model
def test_plan_json_has_the_measured_bill(plan_cli, small_model, rpc_server, tmp_path):
    g = load_geometry(small_model)
    rc, out, err = plan_cli(small_model, "--rpc", rpc_server.endpoint, "--vram", _budget(g), "-c", N_CTX,
                            "--json", "-o", tmp_path / "p.json")
    assert rc == 0, err
    d = json.loads(out)
    dev = d["measured"]["devices"]
    (name,) = dev
    assert d["measured_device_bytes"] == dev[name]["total"] > 0
    assert set(dev[name]) == {"model", "context", "compute", "banks", "total"}
    assert d["breakdown"]["compute"] == dev[name]["compute"]  # the measurement replaced the guess
    back = plan_file.load(tmp_path / "p.json")
    assert back.measured_device_bytes == d["measured_device_bytes"]
    rc, out, err = plan_cli(small_model, "--rpc", rpc_server.endpoint, "--vram", _budget(g), "-c", N_CTX)
    assert rc == 0, err
    assert "measured" in out and "planned" in out and f"VRAM bill ({name}" in out
    rc, out, err = plan_cli(small_model, "--vram", _budget(g), "-c", N_CTX)  # no device: the estimate alone
    assert rc == 0, err and "not measured" in out


@pytest.mark.model
@pytest.mark.slow
def test_plan_on_the_qwen36_fixture_at_16gib_prints_a_measured_bill(plan_cli, rpc_server):
    from spark_cli.models.fixtures import build_fixture

    path = build_fixture("qwen3.6-35b-a3b-q4_k_m")
    rc, out, err = plan_cli(path, "--rpc", rpc_server.endpoint, "--vram", "16GiB", "--json", "--no-check")
    assert rc == 0, err
    d = json.loads(out)
    (name,) = d["measured"]["devices"]
    m = d["measured"]["devices"][name]
    assert m["banks"] > 0 and m["context"] > 0 and m["compute"] > 0
    assert d["measured_device_bytes"] + planner.unmeasured_overhead() <= 16 << 30
    planned = d["breakdown"]["total"] - d["breakdown"]["overhead"]
    assert _close(planned, m["total"])


@pytest.fixture
def chat_cli(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, "chat", chat_cmd.register)


@pytest.mark.model
def test_stale_plan_file_is_refused_naming_device_and_shortfall(chat_cli, small_model, rpc_server, tmp_path,
                                                               monkeypatch):
    """A plan measured at -c 2048, run at -c 16384 on a device with room for the first only."""
    from spark_cli.native import devices

    g = load_geometry(small_model)
    flags = LoadFlags(rpc=rpc_server.endpoint, repack=False)
    plan = planner.plan_for(g, planner.PlanRequest(_budget(g), N_CTX), session.measurer(small_model, g, flags, N_CTX)).plan
    plan_file.save(plan, tmp_path / "plan.json")
    free = plan.measured_device_bytes + planner.unmeasured_overhead() + 4 * MiB
    monkeypatch.setattr(devices, "free_memory", lambda dev: (free, 64 << 30))
    ok = session.resolve_placement(small_model, g, session.ProfileInfo(tmp_path / "none.json", None),
                                   dataclasses.replace(flags, ctx_size=N_CTX), plan_path=tmp_path / "plan.json",
                                   vram_text=None)
    assert ok.plan.measured_device_bytes == plan.measured_device_bytes
    rc, out, err = chat_cli(small_model, "--rpc", rpc_server.endpoint, "--plan", tmp_path / "plan.json",
                            "-c", 16384, "-nr", "--prompt", "hi", "--no-learn")
    assert rc == PlanError.exit_code == 4
    line = err.strip().splitlines()
    assert len([l for l in line if l.strip()]) <= 2, err  # the error and its hint, no traceback
    assert "RPC" in err and "short by" in err and "plan.json" in err


@pytest.mark.model
def test_no_mmap_with_a_tiny_ram_limit_is_refused_before_load(chat_cli, small_model, rpc_server, monkeypatch):
    from spark_cli.native import engine as engine_mod

    loads = []
    real_load = engine_mod.Engine._load
    monkeypatch.setattr(engine_mod.Engine, "_load",
                        lambda self, *a, **k: loads.append(self.opts.dry_run) or real_load(self, *a, **k))
    monkeypatch.setenv(host_ram.RAM_LIMIT_ENV, str(64 * MiB))
    g = load_geometry(small_model)
    budget = str(_budget(g, 0.3))  # most experts in host RAM
    rc, out, err = chat_cli(small_model, "--rpc", rpc_server.endpoint, "--vram", budget, "--no-mmap", "-nr",
                            "-n", 1, "--prompt", "hi", "--no-learn")
    assert rc == PlanError.exit_code, err
    assert "--no-mmap" in err and "host RAM" in err and "short by" in err and "SPARK_RAM_LIMIT" in err
    assert loads and all(loads), "only dry runs before the refusal"
    # with mmap: a warning naming the page-ins, and the plan is kept
    where = session.resolve_placement(small_model, g, session.ProfileInfo(small_model.with_suffix(".none"), None),
                                      LoadFlags(rpc=rpc_server.endpoint, repack=False), plan_path=None,
                                      vram_text=budget)
    assert any("page-ins" in w for w in where.warnings)


def test_ram_limit_env_and_refusal_without_a_model(monkeypatch):
    """host_ram.check on a hand-made plan: refused without mmap and with mlock, warned with mmap."""
    from spark_cli.core.bill import BufferBill, MeasuredBill

    bill = MeasuredBill((BufferBill("CPU", "", True, model=300 * MiB), BufferBill("RPC0", "RPC0", False, model=MiB)))
    plan = dataclasses.replace(_hand_plan(), measured=bill.to_dict())
    monkeypatch.setenv(host_ram.RAM_LIMIT_ENV, "256MiB")
    assert host_ram.host_ram(plan).need == 300 * MiB and host_ram.host_ram(plan).available == 256 * MiB
    for flags in (LoadFlags(mmap=False), LoadFlags(mlock=True)):
        with pytest.raises(PlanError, match="short by 44.0 MiB"):
            host_ram.check(plan, flags)
    assert "page-ins" in host_ram.check(plan, LoadFlags())
    monkeypatch.setenv(host_ram.RAM_LIMIT_ENV, "1GiB")
    assert host_ram.check(plan, LoadFlags(mmap=False)) is None


def _hand_plan() -> planner.Plan:
    from _geometry import make_geometry

    return planner.plan_for(make_geometry(), planner.PlanRequest(4 << 30, 512)).plan
