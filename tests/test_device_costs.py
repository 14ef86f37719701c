"""Device costs: measured on the RPC stand-in and kept (runs/device_costs.py), then used by
`spark plan`; `spark plan --predict-for` from published figures; its flags' errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from _geometry import MiB, make_geometry

from conftest import cli_runner

from spark_cli.commands import plan as plan_cmd
from spark_cli.core import planner
from spark_cli.core.cost_model import Sample
from spark_cli.core.gguf_info import load_geometry
from spark_cli.native.engine import EngineOptions
from spark_cli.runs import device_costs


@pytest.fixture
def plan(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, "plan", plan_cmd.register)


def _alts(d: dict) -> dict[str, dict]:
    return {a["name"]: a for a in d["predicted"]["alternatives"]}


@pytest.mark.model
def test_measured_on_the_stand_in_kept_and_used_by_plan(small_model, rpc_server, tmp_path, monkeypatch, plan) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("SPARK_HOME", str(home))
    g = load_geometry(small_model)
    base = EngineOptions(small_model, n_ctx=512, rpc=[rpc_server.endpoint])
    costs, why = device_costs.ensure(base, g, list(range(200, 264)), home)
    assert costs is not None and "measured" in why and costs.device.startswith("RPC") and not costs.predicted
    for f in ("base_tg_us", "base_pp_us", "stop_us", "cached_pp_us", "miss_cpu_us", "miss_upload_us"):
        assert getattr(costs, f) >= 0, f
    assert "interleaved" in costs.source  # the stand-in holds every probe at once
    assert costs.base_tg_us > 0 and costs.host_tg_us > 0 and costs.miss_cpu_us > 0
    kept = json.loads(device_costs.cache_file(home, costs.device, g.fingerprint, base.threads).read_text())
    assert {s["name"].split()[0] for s in kept["samples"]} >= {"cpu-moe", "n-cpu-moe", "cached"}
    seen: set[str] = set()
    monkeypatch.setattr(device_costs, "DRIFT", 100.0)  # whatever the machine does now, the kept figures hold
    again, why = device_costs.ensure(base, g, list(range(200, 264)), home, lambda name, *_: seen.add(name))
    assert again == costs and "kept, its stock placements timed again within" in why, why
    assert seen == {"device costs (check)"}  # the stock placements were timed again; nothing measured anew

    # a stock placement that no longer holds: every probe is measured again, and kept
    later = dataclasses.replace(costs, source="measured later")
    monkeypatch.setattr(device_costs, "check", lambda *a, **kw: "cpu-moe decodes 1.30x as fast as when kept")
    monkeypatch.setattr(device_costs, "measure", lambda *a, **kw: (later, []))
    again, why = device_costs.ensure(base, g, list(range(200, 264)), home)
    assert again == later and "measured again: cpu-moe decodes 1.30x as fast as when kept" in why, why
    assert device_costs.load(home, costs.device, g.fingerprint, base.threads) == later

    budget = f"{(g.total_expert_bytes * 0.6 + 600 * 2**20) / 2**30:.2f}GiB"
    rc, out, err = plan(small_model, "--rpc", rpc_server.endpoint, "--vram", budget, "-c", 512, "--no-measure",
                        "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["predicted"]["measured"] is True and costs.device in d["predicted"]["costs"]
    alts = _alts(d)
    assert alts["spark"]["tg_tok_s"] >= alts["n-cpu-moe"]["tg_tok_s"] * (1 - 1e-9)
    assert alts["spark"]["tg_tok_s"] >= alts["cpu-moe"]["tg_tok_s"] * (1 - 1e-9)
    assert d["predicted"]["stops"] == 1 + sum(1 for l in d["layers"] if l["mode"] in ("cached", "host"))


def test_a_probe_is_timed_again_while_its_timings_spread_wide() -> None:
    assert not device_costs.settled([20.0, 20.5])  # fewer than REPEATS
    assert device_costs.settled([20.0, 20.5, 21.0])  # within a quarter of their median: the median holds
    assert not device_costs.settled([54.0, 78.0, 100.0])  # the stand-in's --cpu-moe at -t 2: not yet
    assert not device_costs.settled([54.0, 78.0, 100.0, 72.0, 66.0, 99.0])
    assert device_costs.settled([54.0, 78.0, 100.0, 72.0, 66.0, 99.0, 57.0])  # MAX_REPEATS: enough


def test_kept_timings_hold_while_the_stock_placements_time_alike() -> None:
    def sample(name: str, n_host: int, tg: float, pp: float, n_cached: int = 0) -> Sample:
        return Sample(name, n_host, n_cached, tg, pp)

    kept = [sample("cpu-moe", 30, 60_000.0, 9_000.0), sample("n-cpu-moe 15", 15, 40_000.0, 8_000.0),
            sample("cached", 0, 50_000.0, 8_500.0, n_cached=30)]
    same = [sample("cpu-moe", 30, 66_000.0, 8_200.0), sample("n-cpu-moe 15", 15, 36_000.0, 8_800.0)]
    assert device_costs.drift(kept, same) is None  # within 15% both ways
    faster = [sample("cpu-moe", 30, 60_000.0, 9_000.0), sample("n-cpu-moe 15", 15, 32_000.0, 8_000.0)]
    assert device_costs.drift(kept, faster) == "n-cpu-moe 15 decodes 1.25x as fast as when kept"
    slower = [sample("cpu-moe", 30, 60_000.0, 12_000.0)]
    assert device_costs.drift(kept, slower) == "cpu-moe prompts 0.75x as fast as when kept"
    assert device_costs.drift(kept, [sample("n-cpu-moe 9", 9, 1.0, 1.0)]) is None  # not timed before: no judge

    g = make_geometry(n_layer=9, n_expert=16, k=4, bpe=4 * MiB, dense=(0,))
    moe = [l.index for l in g.layers if l.is_moe]
    kept = [sample("cpu-moe", len(moe), 1.0, 1.0), sample("n-cpu-moe 4", 4, 1.0, 1.0),
            sample("resident", 0, 1.0, 1.0), sample("cached", 0, 1.0, 1.0, n_cached=len(moe))]
    again = device_costs.stock_probes(g, kept)  # as probes() placed them; the cached one is not timed again
    assert [(p.name, p.host, p.cached) for p in again] == [
        ("cpu-moe", tuple(moe), ()), ("n-cpu-moe 4", tuple(moe[:4]), ()), ("resident", (), ())]
    assert device_costs.stock_probes(g, [sample("n-cpu-moe 12", 12, 1.0, 1.0)]) == []  # another geometry's


def test_predict_for_a_card_not_at_hand(small_model, plan) -> None:
    rc, out, err = plan(small_model, "--predict-for", "rtx-4060-ti-16gb", "--vram", "1GiB", "--cold-hit", "0.1",
                        "--host-bandwidth", "80", "--host-cores", "8", "--json")
    assert rc == 0, err
    d = json.loads(out)
    p = d["predicted"]
    assert p["measured"] is False and "published figures" in p["costs"] and "RTX 4060 Ti" in p["costs"]
    assert p["pp_tok_s"] > 0  # prompt speed: the card's compute, fitted to public measurements (device_table)
    alts = _alts(d)
    assert alts["spark"]["tg_tok_s"] >= alts["n-cpu-moe"]["tg_tok_s"] * (1 - 1e-9)
    rc, out, err = plan(small_model, "--predict-for", "rtx-4060-ti-16gb", "--vram", "1GiB")
    assert rc == 0, err
    assert "predicted from published figures, not measured" in out and "stops/tok" in out


@pytest.mark.parametrize("args, want", [
    (("--predict-for", "rtx-9999"), "--predict-for: unknown card 'rtx-9999'"),
    (("--objective", "fastest"), "--objective: unknown objective 'fastest'"),
    (("--host-cores", "8"), "--host-cores: only with --predict-for"),
    (("--cold-hit", "1.5"), "--cold-hit: 1.5 is not a share"),
])
def test_bad_prediction_flags_are_one_line(small_model, plan, args, want) -> None:
    rc, out, err = plan(small_model, "--vram", "1GiB", *args)
    assert rc == 2 and want in err and "Traceback" not in err, err


def test_probe_bytes_agree_with_stock_sizes() -> None:
    """A probe's device bytes are the planner's for the same stock placement (and a cached
    probe's sit between --cpu-moe's and all resident's), which decides whether they all fit
    at once and run interleaved."""
    g = make_geometry(n_layer=9, n_expert=16, k=4, bpe=4 * MiB, dense=(0,))
    fixed = planner.fixed_bytes(g, 4096)
    stock = planner.stock_baseline(g, 1 << 62, fixed)
    by_name = {p.name: p for p in device_costs.probes(g, 1 << 62, fixed)}
    assert set(by_name) >= {"cpu-moe", "resident", "cached"}
    assert device_costs.probe_bytes(g, fixed, by_name["resident"]) == stock.device_bytes
    assert device_costs.probe_bytes(g, fixed, by_name["cpu-moe"]) == stock.cpu_moe_device_bytes
    cached = device_costs.probe_bytes(g, fixed, by_name["cached"])
    assert stock.cpu_moe_device_bytes < cached < stock.device_bytes
