"""The self-check (runs/self_check.py): the cache path against all-resident on the demo model, before
the first cached run on a device; kept per device, driver and build; a failure runs stock's placement.

The suite turns the check off (conftest: SPARK_SELF_CHECK=0); these tests turn it on."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from spark_cli.core import planner
from spark_cli.core.gguf_info import load_geometry
from spark_cli.runs import self_check


@pytest.fixture
def checked(monkeypatch, tmp_path, small_model):
    """The check on, SPARK_HOME in tmp, the check's model the tests' demo model (built once per session),
    and a count of the checks run."""
    monkeypatch.setenv("SPARK_SELF_CHECK", "1")
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(self_check, "check_model", lambda: small_model)
    runs: list[self_check.Result] = []
    real = self_check.run

    def counted(*a, **kw):
        runs.append(real(*a, **kw))
        return runs[-1]

    monkeypatch.setattr(self_check, "run", counted)
    return runs


def _stand_in(rpc_server):
    from spark_cli.native import devices

    return devices.select(devices.parse(None, [rpc_server.endpoint]))[0]


def _chat(monkeypatch, capsys, model: Path, rpc_server, tmp_path) -> tuple[int, str, str]:
    """spark chat on the stand-in with every MoE layer cached (the slot floor's budget), one answer."""
    from conftest import cli_runner
    from spark_cli.commands import chat as chat_cmd
    from test_chat import _min_budget

    link = tmp_path / model.name  # a private name: nothing is written beside the shared model
    if not link.exists():
        link.symlink_to(model)
    chat = cli_runner(monkeypatch, capsys, "chat", chat_cmd.register)
    return chat(link, "--rpc", rpc_server.endpoint, "-c", "512", "--vram", _min_budget(load_geometry(link), 512),
                "-p", "Hello there", "-n", "4", "--temp", "0", "--json", "--no-learn")


def _devices(monkeypatch, capsys, rpc_server, *args) -> tuple[int, str, str]:
    from conftest import cli_runner
    from spark_cli.commands import system

    return cli_runner(monkeypatch, capsys, "devices", system.register)("--rpc", rpc_server.endpoint, *args)


def _stand_in_json(out: str) -> dict:
    return next(d for d in json.loads(out) if d["name"].startswith("RPC"))


# ---------------------------------------------------------------- on the stand-in


@pytest.mark.model
def test_passes_on_the_stand_in_is_kept_and_shown(checked, monkeypatch, capsys, rpc_server, tmp_path):
    home = tmp_path / "home"
    rc, out, err = _devices(monkeypatch, capsys, rpc_server, "--json")
    assert rc == 0, err
    assert _stand_in_json(out)["self_check"] == {"status": "not run"}

    # the first cached run checks the device, then runs cached
    rc, out, err = _chat(monkeypatch, capsys, self_check.check_model(), rpc_server, tmp_path)
    assert rc == 0, err
    assert json.loads(out)["figures"]["cached_layers"] > 0
    assert "self-check" not in err
    assert len(checked) == 1
    res = checked[0]
    with capsys.disabled():
        print(f"\nself-check on the stand-in: {res.seconds:.1f} s, {res.paths}")
    assert res.passed and res.diff == 0.0 and res.bound is None  # the same kernels: bit-identical
    assert all(n > 0 for n in res.paths.values()), res.paths  # pinned/LRU hits, CPU misses, uploads, RAM reads
    kept = self_check.cache_file(home, res.key)
    assert kept.parent == home / "calibration"
    before = (kept.stat().st_mtime_ns, kept.read_bytes())

    # kept: not run again, by the next run nor by `spark devices`
    rc, out, err = _chat(monkeypatch, capsys, self_check.check_model(), rpc_server, tmp_path)
    assert rc == 0, err
    assert json.loads(out)["figures"]["cached_layers"] > 0
    got, ran = self_check.ensure(_stand_in(rpc_server), [rpc_server.endpoint], home)
    assert not ran and got == res
    assert len(checked) == 1
    assert (kept.stat().st_mtime_ns, kept.read_bytes()) == before

    rc, out, err = _devices(monkeypatch, capsys, rpc_server, "--json")
    assert rc == 0, err
    shown = _stand_in_json(out)["self_check"]
    assert shown["status"] == "passed" and shown["diff"] == 0.0 and shown["when"] == res.when
    rc, out, err = _devices(monkeypatch, capsys, rpc_server)
    assert rc == 0, err
    assert "passed: max |d logit| 0 against all-resident, bit-identical required" in " ".join(out.split())
    assert len(checked) == 1


def _routed_expert(model: Path, il: int, pinned: tuple[int, ...]) -> int:
    """The expert layer `il` routes most on the check's prompts (CPU run, captured): not a pinned one."""
    from spark_cli.native.engine import Engine, EngineOptions
    from spark_cli.runs import exactness

    with Engine(EngineOptions(model, n_ctx=256, device="none", repack=False, capture_topk=True)) as eng:
        for p in exactness.prompts(eng, self_check.LENGTHS):
            eng.reset()
            eng.eval(p, logits="outputs")
        ids = np.concatenate([r.ids.ravel() for r in eng.records if r.il == il])
    counts = np.bincount(ids, minlength=load_geometry(model).n_expert)
    counts[list(pinned)] = -1
    return int(np.argmax(counts))


def _wrong_expert_copy(model: Path, il: int, expert: int, out: Path) -> Path:
    """A copy of the model whose expert `expert` of layer `il` has another expert's gate bytes: what a
    slot read from the wrong place computes (finite, and wrong)."""
    import gguf

    shutil.copyfile(model, out)
    t = next(t for t in gguf.GGUFReader(model).tensors if t.name == f"blk.{il}.ffn_gate_exps.weight")
    per = int(t.n_bytes) // int(t.shape[-1])
    other = (expert + 1) % int(t.shape[-1])
    with open(out, "r+b") as f:
        f.seek(int(t.data_offset))
        assert f.read(int(t.n_bytes)) == bytes(np.asarray(t.data).tobytes()), "not the tensor's bytes"
        f.seek(int(t.data_offset) + other * per)
        wrong = f.read(per)
        f.seek(int(t.data_offset) + expert * per)
        f.write(wrong)
    return out


@pytest.mark.model
def test_a_planted_wrong_slot_fails_and_runs_stock(checked, monkeypatch, capsys, rpc_server, tmp_path, small_model):
    from spark_cli.native import expert_cache

    g = load_geometry(small_model)
    ram = next(c for c in self_check.check_layers(list(g.moe_layers), g.n_expert_used) if c.in_ram)
    bad = _wrong_expert_copy(small_model, ram.il, _routed_expert(small_model, ram.il, ram.pinned),
                             tmp_path / "wrong.gguf")
    real_init = expert_cache.ExpertCache.init
    plant = [bad]

    def planted(self, layers, **kw):  # the check's RAM-tier slots read the wrong copy
        if plant and kw.get("file_path") == str(small_model):
            kw["file_path"] = str(plant[0])
        return real_init(self, layers, **kw)

    monkeypatch.setattr(expert_cache.ExpertCache, "init", planted)
    rc, out, err = _chat(monkeypatch, capsys, small_model, rpc_server, tmp_path)
    assert rc == 0, err
    assert json.loads(out)["figures"]["cached_layers"] == 0  # stock's placement: no cache
    lines = [l for l in err.splitlines() if "self-check" in l]
    assert len(lines) == 1, err
    name = self_check.key_of(_stand_in(rpc_server)).device  # RPC0 127.0.0.1, the first server this process met
    assert f"self-check failed on {name} (" in lines[0] and "running stock's placement (--n-cpu-moe" in lines[0]
    assert lines[0].endswith("instead (spark devices --self-check runs it again)")
    assert len(checked) == 1
    res = checked[0]
    with capsys.disabled():
        print(f"\nplanted: {lines[0]} ({res.seconds:.1f} s, {res.paths})")
    assert not res.passed and res.diff > 0 and res.bound is None and f"{res.diff:.3g}" in lines[0]

    # kept: the next run falls back without checking again; `spark devices` says failed
    rc, out, err = _chat(monkeypatch, capsys, small_model, rpc_server, tmp_path)
    assert rc == 0 and json.loads(out)["figures"]["cached_layers"] == 0
    assert len(checked) == 1
    rc, out, err = _devices(monkeypatch, capsys, rpc_server, "--json")
    assert _stand_in_json(out)["self_check"]["status"] == "failed"

    # the defect gone, `spark devices --self-check` runs it again: kept, and runs cache again
    plant.clear()
    rc, out, err = _devices(monkeypatch, capsys, rpc_server, "--self-check", "--json")
    assert rc == 0, err
    assert _stand_in_json(out)["self_check"]["status"] == "passed" and len(checked) == 2
    rc, out, err = _chat(monkeypatch, capsys, small_model, rpc_server, tmp_path)
    assert rc == 0 and json.loads(out)["figures"]["cached_layers"] > 0 and "self-check" not in err
    assert len(checked) == 2


@pytest.mark.model
def test_comparison_up_to_routing_ties_runs_on_the_stand_in(rpc_server, small_model):
    """The mixed-kernel rescue (a routing tie flipped) on the stand-in, whose kernels do not mix: the cache's
    trace and the captured routing agree everywhere, so every row is compared and nothing differs."""
    from spark_cli.runs.exactness import reference

    g = load_geometry(small_model)
    moe = list(g.moe_layers)
    base = self_check._base(small_model, _stand_in(rpc_server), [rpc_server.endpoint])
    cached = self_check.cached_options(base, self_check.check_layers(moe, g.n_expert_used))
    ref = reference(base, self_check.N_DECODE, self_check.LENGTHS)
    diff, bound, rows, why = self_check.up_to_ties(base, cached, moe, ref)
    assert (diff, bound, why) == (0.0, 0.0, "")
    assert rows == sum(len(r) for r in ref.logits)


# ---------------------------------------------------------------- without a model


def _plan(n_moe: int = 6, n_cpu_moe: int = 2) -> planner.Plan:
    modes = ["cached", "resident", "cached", "host", "resident", "cached"][:n_moe]
    layers = tuple(planner.LayerPlan(i, m, (0,) if m == "cached" else (), 3 if m == "cached" else 0, 1, 1)
                   for i, m in enumerate(modes))
    stock = planner.StockBaseline(n_cpu_moe, True, 0, (), 0, True)
    return planner.Plan({}, 1 << 30, 512, "f16", "f16", 512, layers, {}, None, stock, stage_slices=4)


def test_stock_plan_is_stocks_n_cpu_moe_without_a_cache():
    p = self_check.stock_plan(_plan())
    assert [l.mode for l in p.layers] == ["host", "host", "resident", "resident", "resident", "resident"]
    assert p.stage_slices == 0 and all(l.slots == 0 and l.pinned == () for l in p.layers)
    assert p.measured is None
    assert [o.target for o in p.overrides] == ["CPU", "CPU"]
    assert all(o.pattern.startswith((r"blk\.0", r"blk\.1")) for o in p.overrides)


def test_kept_result_belongs_to_its_device_driver_and_build(tmp_path):
    key = self_check.Key("RPC0 127.0.0.1", "", "build-a")
    res = self_check.Result(key, True, 0.0, None, 21, 7.5, "2026-12-06 03:00 UTC", {"hits": 1})
    self_check.save(tmp_path, res)
    assert self_check.load(tmp_path, key) == res
    for other in (self_check.Key("RPC0 127.0.0.1", "", "build-b"), self_check.Key("CUDA0 X", "", "build-a"),
                  self_check.Key("RPC0 127.0.0.1", "NVIDIA 550.1", "build-a")):
        assert self_check.load(tmp_path, other) is None
    self_check.cache_file(tmp_path, key).write_text("{not json")
    assert self_check.load(tmp_path, key) is None  # unreadable: run again


def test_a_logit_that_is_not_finite_is_an_infinite_difference(monkeypatch):
    """A NaN from wrong bytes is an infinite difference (max() would drop it and call the run exact)."""
    from spark_cli.runs import exactness

    ref = self_check.Reference([[1]], [np.zeros((2, 3), np.float32)], [[5]], None, "RPC0")
    got = np.zeros((2, 3), np.float32)
    got[1, 2] = np.nan
    monkeypatch.setattr(exactness, "logits", lambda eng, p, fed, n: (got, fed))
    diff, exact = exactness.max_diff(None, ref)
    assert math.isinf(diff) and not exact
    assert math.isinf(exactness.largest_diff(np.array([np.nan, 0.0]), np.zeros(2)))
    assert exactness.largest_diff(np.array([1.0, -2.0]), np.zeros(2)) == 2.0


def test_the_check_is_off_for_the_suite_and_skips(monkeypatch):
    from spark_cli.runs.session import Placement

    assert not self_check.enabled()  # conftest
    where = Placement([object()], _plan(), 512)
    self_check.guard(where, None, where.devices)  # off: untouched, nothing run
    assert any(l.mode == "cached" for l in where.plan.layers) and where.warnings == []


def test_a_check_that_cannot_run_falls_back_and_is_not_kept(monkeypatch, tmp_path):
    """No model to check with (say, offline without the wheel): stock's placement, one line, nothing kept."""
    from types import SimpleNamespace

    from spark_cli.errors import ModelFileError
    from spark_cli.runs.session import Placement

    monkeypatch.setenv("SPARK_SELF_CHECK", "1")
    dev = SimpleNamespace(name="CUDA0", description="a card")

    def no_model():
        raise ModelFileError("demo model: cannot build it", hint="check the network")

    monkeypatch.setattr(self_check, "check_model", no_model)
    where = Placement([dev], _plan(), 512)
    flags = SimpleNamespace(rpc=None)
    monkeypatch.setattr("spark_cli.runs.host_ram.check", lambda plan, flags: None)
    self_check.guard(where, flags, [dev], home=tmp_path)
    assert not any(l.mode == "cached" for l in where.plan.layers) and where.ram is None
    assert where.warnings == ["self-check could not run on CUDA0 (demo model: cannot build it (check the network)): "
                              "running stock's placement (--n-cpu-moe 2) instead"]
    assert not (tmp_path / "calibration").exists()
    line = self_check.bench_line(dev, [], tmp_path)
    assert line.startswith("self-check could not run on CUDA0")


@pytest.mark.model
def test_bench_prints_the_kept_check(checked, monkeypatch, capsys, rpc_server, tmp_path, small_model):
    """spark bench says the device's check before it times Spark's configurations (a kept one: not run)."""
    from conftest import cli_runner, keep_device_costs
    from spark_cli.commands import bench as bench_cmd

    link = tmp_path / small_model.name  # a private name: the profile stays in tmp
    link.symlink_to(small_model)
    home = tmp_path / "home"
    keep_device_costs(monkeypatch, home, link, None, [rpc_server.endpoint], stop_us=0.0)
    key = self_check.key_of(_stand_in(rpc_server))
    self_check.save(home, self_check.Result(key, False, 3.5, None, 21, 9.0, "2026-12-06 03:00 UTC", {"hits": 1}))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The lighthouse keeper climbed the stairs every evening to light the lamp.\n" * 8)
    out = tmp_path / "bench.json"
    bench = cli_runner(monkeypatch, capsys, "bench", bench_cmd.register)
    rc, stdout, err = bench(link, "--rpc", rpc_server.endpoint, "--residency", "0.6", "--corpus", corpus,
                            "-p", "8", "-n", "4", "-r", "1", "--configs", "spark", "-o", out, "--no-learn")
    assert rc == 0, err
    line = (f"self-check failed on {key.device} (max |d logit| 3.5 against all-resident, bit-identical required; "
            "2026-12-06 03:00 UTC, kept): Spark's configurations are timed anyway; "
            "chat and serve run stock's placement")
    assert line in " ".join(err.split())
    assert line in json.loads(out.read_text())["notes"]
    assert checked == []
