"""Several devices (issue 26): --vram per device, -ts/-sm/-mg, llama.cpp's layer split rule, and the
planner's per-device bills and budgets. No llama.cpp here: tests/test_devices.py loads models on
two RPC stand-ins."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _geometry import MiB, make_geometry

from spark_cli.core import plan_file, planner, split, units
from spark_cli.core.bill import BufferBill, MeasuredBill
from spark_cli.core.options import LoadFlags
from spark_cli.errors import PlanError, UsageError

GiB = 1 << 30


# ---------------------------------------------------------------- flags


def test_vram_one_size_per_device():
    assert units.parse_sizes("16GiB,12GiB", 2) == (16 * GiB, 12 * GiB)
    assert units.parse_sizes("16GiB", 2) == (16 * GiB, 16 * GiB)  # one size: each device
    assert units.parse_sizes("16GiB, 900MiB") == (16 * GiB, 900 * MiB)  # no devices: as many as written
    for text, n in (("16GiB,12GiB", 3), ("16GiB,12GiB,8GiB", 2)):
        with pytest.raises(UsageError) as e:
            units.parse_sizes(text, n)
        assert e.value.message.startswith(f"--vram {text}: ") and "\n" not in e.value.message
        assert f"for {n} devices" in e.value.message
    for bad in ("16GiB,", "16GiB,,8GiB", "16GiB,lots"):
        with pytest.raises(UsageError, match="--vram"):
            units.parse_sizes(bad, 2)


def test_tensor_split_and_split_mode_flags():
    assert split.parse_tensor_split("3,1") == (3.0, 1.0)
    assert split.parse_tensor_split("3/1") == (3.0, 1.0)  # llama.cpp takes both separators
    assert split.parse_tensor_split("1", 3) == (1.0, 0.0, 0.0)  # the rest get nothing
    assert split.parse_tensor_split("0,0") is None  # all zero: llama.cpp's default
    assert split.parse_tensor_split(None) is None
    for bad in ("3,-1", "a,b", "nan,1"):
        with pytest.raises(UsageError, match="--tensor-split"):
            split.parse_tensor_split(bad)
    with pytest.raises(UsageError, match="3 proportions for 2 devices"):
        split.parse_tensor_split("1,1,1", 2)
    assert split.parse_split_mode(None) == "layer" and split.parse_split_mode("NONE") == "none"
    for mode in ("row", "tensor"):
        with pytest.raises(UsageError) as e:
            split.parse_split_mode(mode)
        assert "Spark places experts itself" in e.value.message and "\n" not in e.value.message
    f = LoadFlags.from_cli(tensor_split="3,1", split_mode="layer", main_gpu=1)
    assert (f.tensor_split, f.split_mode, f.main_gpu) == ((3.0, 1.0), "layer", 1)
    with pytest.raises(UsageError, match="--split-mode row"):
        LoadFlags.from_cli(split_mode="row")


# ---------------------------------------------------------------- the rule


def _llama_cpp_rule(n_layer: int, ts) -> list[int]:
    """llama_model_base::load_tensors, transcribed: float cumulative split points, upper_bound."""
    splits, acc = [], np.float32(0)
    for v in np.asarray(ts, dtype=np.float32):
        acc = np.float32(acc + v)
        splits.append(acc)
    splits = [np.float32(s / acc) for s in splits]
    out = []
    for il in range(n_layer + 1):
        x = np.float32(np.float32(il) / np.float32(n_layer + 1))
        out.append(next(i for i, s in enumerate(splits) if s > x))
    return out


@pytest.mark.parametrize("n_layer, ts, want", [
    (4, (3, 1), (0, 0, 0, 0, 1)),  # 4 layers and the output over 3:1
    (4, (1, 5), (0, 1, 1, 1, 1)),
    (3, (1, 1), (0, 0, 1, 1)),  # the output layer on the last device
    (5, (1, 0, 1), (0, 0, 0, 2, 2, 2)),  # a device with no share gets no layer
])
def test_layer_devices_known_cases(n_layer, ts, want):
    assert split.layer_devices(n_layer, ts) == want


@pytest.mark.parametrize("n_layer", [1, 2, 7, 24, 30, 48, 61, 94])
@pytest.mark.parametrize("ts", [(1, 1), (3, 1), (16384, 12288), (0.3, 0.7), (1, 2, 3), (24576, 8192, 8192, 1)])
def test_layer_devices_is_llama_cpps_rule(n_layer, ts):
    got = split.layer_devices(n_layer, ts)
    assert list(got) == _llama_cpp_rule(n_layer, ts)
    assert list(got) == sorted(got) and len(got) == n_layer + 1  # contiguous runs, the output last


def test_make_split_defaults_and_modes():
    sp = split.make_split((16 * GiB, 12 * GiB), ("CUDA0", "CUDA1"))
    assert sp.tensor_split == (16384.0, 12288.0) and sp.mode == "layer"  # default: the budgets
    assert split.make_split((16 * GiB, 12 * GiB), ("a", "b"), (3.0, 1.0)).tensor_split == (3.0, 1.0)
    none = split.make_split((16 * GiB, 12 * GiB), ("CUDA0", "CUDA1"), mode="none", main_gpu=1)
    assert (none.budgets, none.names, none.tensor_split, none.main_gpu) == ((12 * GiB,), ("CUDA1",), (), 1)
    assert none.layer_devices(3) == (0, 0, 0, 0)
    with pytest.raises(UsageError, match="--main-gpu 2: 2 devices"):
        split.make_split((GiB, GiB), ("a", "b"), mode="none", main_gpu=2)


# ---------------------------------------------------------------- the planner over two devices


def _two(budgets, ts=None, n_layer=8):
    g = make_geometry(n_layer=n_layer, n_expert=16, k=2, bpe=4 * MiB, dense=(0,))
    return g, split.make_split(budgets, ("D0", "D1"), ts)


def test_each_device_spends_its_own_budget():
    g, sp = _two((480 * MiB, 640 * MiB))
    plan = planner.plan_for(g, planner.PlanRequest(sum(sp.budgets), 2048, split=sp)).plan
    ldev = split.layer_devices(g.n_layer, sp.tensor_split)
    assert [l.device for l in plan.layers] == list(ldev[:-1]) and plan.output_device == ldev[-1] == 1
    assert [d.name for d in plan.devices] == ["D0", "D1"] and plan.tensor_split == sp.tensor_split
    for i, d in enumerate(plan.devices):
        assert d.budget_bytes == sp.budgets[i] and d.breakdown["total"] <= d.budget_bytes
        mine = [l for l in plan.layers if l.device == i]
        b = d.breakdown
        staged = b["weights_layers_nonexpert"] + b["experts_resident"] + b["expert_banks"] - sum(l.device_bytes
                                                                                            for l in mine)
        cached = [g.layers[l.index] for l in mine if l.mode == "cached"]  # the native arenas' shapes
        assert staged == planner.staging_bytes(g, plan.stage_slices, cached)
        assert d.breakdown["overhead"] > 0 and d.breakdown["compute"] > 0
    assert plan.devices[1].breakdown["weights_global"] == g.device_global_bytes  # the output layer's device
    assert plan.devices[0].breakdown["weights_global"] == 0
    assert {k: sum(d.breakdown[k] for d in plan.devices) for k in planner.BREAKDOWN_KEYS} == plan.breakdown
    # the larger budget holds more of its layers' experts
    per_layer = [sum(l.slots if l.mode == "cached" else (16 if l.mode == "resident" else 0)
                     for l in plan.layers if l.device == i) / max(1, sum(1 for l in plan.layers if l.device == i
                                                                          and l.mode != "dense"))
                 for i in range(2)]
    assert per_layer[1] > per_layer[0]
    back = plan_file.from_json(plan_file.to_json(plan))
    assert back == plan and back.split() == dataclasses.replace(sp, budgets=sp.budgets)


def test_one_device_is_the_plan_it_was():
    """A one-device split plans what the request without a split plans."""
    g, _ = _two((480 * MiB, 480 * MiB))
    one = planner.plan_for(g, planner.PlanRequest(480 * MiB, 2048)).plan
    via = planner.plan_for(g, planner.PlanRequest(300 * MiB, 2048, split=split.single(480 * MiB, "D0"))).plan
    assert one.layers == via.layers and one.breakdown == via.breakdown


def test_a_device_below_its_floor_names_it():
    g, sp = _two((300 * MiB, 640 * MiB))
    with pytest.raises(PlanError) as e:
        planner.plan_for(g, planner.PlanRequest(sum(sp.budgets), 2048, split=sp))
    assert " on D0" in e.value.message


def _fake_measure(extra_on: dict[str, int]):
    """A dry run that finds each device's planned bill (less the overhead) plus `extra_on[name]`."""
    calls = []

    def measure(plan):
        calls.append(plan)
        entries = []
        for d in plan.devices:
            b = d.breakdown
            entries.append(BufferBill(d.name, d.name, False,
                                      model=b["weights_global"] + b["weights_layers_nonexpert"] + b["experts_resident"]
                                      + extra_on.get(d.name, 0),
                                      context=b["kv_cache"], compute=b["compute"], banks=b["expert_banks"]))
        return MeasuredBill(tuple(entries))

    return measure, calls


def test_fit_loop_gives_up_slots_on_the_device_that_is_over():
    g, sp = _two((560 * MiB, 560 * MiB))
    req = planner.PlanRequest(sum(sp.budgets), 2048, split=sp)
    est = planner.plan_for(g, req).plan
    measure, calls = _fake_measure({"D1": 40 * MiB})
    fit = planner.plan_for(g, req, measure).plan
    for i, d in enumerate(fit.devices):  # each device's measured bill within its own budget
        assert d.measured is not None and d.measured["total"] + planner.unmeasured_overhead() <= d.budget_bytes
        assert d.budget_bytes == sp.budgets[i]
    on = lambda p, i: [l for l in p.layers if l.device == i]  # noqa: E731
    assert on(fit, 0) == on(est, 0)  # the device that fits keeps its placement
    assert sum(l.device_bytes for l in on(fit, 1)) < sum(l.device_bytes for l in on(est, 1))
    assert fit.measured_device_bytes == sum(d.measured["total"] for d in fit.devices)
    assert fit.fit_rounds >= 2 and len(calls) >= 2


def test_fit_loop_refusal_names_the_device():
    g, sp = _two((560 * MiB, 560 * MiB))
    measure, _ = _fake_measure({"D0": 1 * GiB})
    with pytest.raises(PlanError) as e:
        planner.plan_for(g, planner.PlanRequest(sum(sp.budgets), 2048, split=sp), measure)
    assert " on D0 " in e.value.message and "\n" not in e.value.message
