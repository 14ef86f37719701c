"""The cost model (core/cost_model.py) and plans priced in time (planner.plan_for with costs):
stock's placement predicts stock's time, dear stops cache fewer layers, free stops cache every
layer, a dear link admits fewer slots, the fit recovers the figures it was made from, and the
published-figures table (core/device_table.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from _geometry import MiB, make_geometry

from spark_cli.core import device_table, plan_file, planner
from spark_cli.core.cost_model import DeviceCosts, LayerLoad, Sample, fit, predict
from spark_cli.errors import PlanError, UsageError

N_LAYER = 13  # layer 0 dense, 12 MoE layers


def costs(**kw) -> DeviceCosts:
    base = dict(device="test", source="synthetic", threads=2, base_tg_us=10_000.0, base_pp_us=5_000.0,
                stop_us=300.0, host_tg_us=1_500.0, host_pp_us=400.0, cached_pp_us=150.0, miss_cpu_us=250.0,
                miss_upload_us=400.0, concurrent=True)
    return DeviceCosts(**{**base, **kw})


@pytest.fixture(scope="module")
def geo():
    return make_geometry(n_layer=N_LAYER, n_expert=16, k=4, bpe=4 * MiB, dense=(0,))


@pytest.fixture(scope="module")
def counts(geo):
    rng = np.random.default_rng(7)
    return rng.zipf(1.6, size=(geo.n_layer, geo.n_expert)).astype(np.float64)


def budget(g, share: float) -> int:
    return planner.fixed_bytes(g, 4096) + int(share * g.total_expert_bytes)


def request(g, counts, c: DeviceCosts | None, share: float = 0.6, **kw) -> planner.PlanRequest:
    return planner.PlanRequest(budget(g, share), 4096, profile_counts=counts, costs=c, **kw)


def modes(plan) -> dict[str, int]:
    out = {"resident": 0, "cached": 0, "host": 0}
    for l in plan.layers:
        if l.mode in out:
            out[l.mode] += 1
    return out


# ---------------------------------------------------------------- the model


def test_time_adds_up_per_layer() -> None:
    c = costs(concurrent=False)
    layers = [LayerLoad("resident"), LayerLoad("host"), LayerLoad("cached", misses=2.0, admissions=1.0, off_mass=0.5)]
    p = predict(layers, c, "cpu")
    assert p.tg_us == pytest.approx(10_000 + 1_500 + 300 + 2 * 250 + 1 * 400)
    assert p.pp_us == pytest.approx(5_000 + 400 + 0.5 * 150)
    assert p.stops == 3  # the host layer, the cached layer, the logits read-back
    assert predict(layers, c, "upload").tg_us == pytest.approx(p.tg_us + 2 * (400 - 250))
    assert predict(layers, c, "auto").tg_us == pytest.approx(p.tg_us)  # the cheaper side of each miss


def test_a_second_queue_hides_admissions_until_it_is_the_bottleneck() -> None:
    layers = [LayerLoad("cached", misses=0.0, admissions=1.0)]
    c = costs(concurrent=True)
    assert predict(layers, c).tg_us == pytest.approx(10_000 + 300)
    slow = costs(concurrent=True, miss_upload_us=50_000.0)
    assert predict(layers, slow).tg_us == pytest.approx(50_000)


def test_the_fit_recovers_the_figures_it_was_made_from() -> None:
    truth = costs(base_tg_us=20_000.0, stop_us=2_000.0, host_tg_us=1_600.0, base_pp_us=8_000.0, host_pp_us=300.0,
                  cached_pp_us=120.0)
    n = 30
    samples = []
    for name, h, c in (("cpu-moe", n, 0), ("n-cpu-moe 15", 15, 0), ("resident", 0, 0), ("cached", 0, n)):
        layers = [LayerLoad("host")] * h + [LayerLoad("cached", misses=0.5)] * c + [LayerLoad("resident")] * (n - h - c)
        p = predict(layers, truth, "cpu")
        samples.append(Sample(name, h, c, p.tg_us, p.pp_us, c * 0.5 * truth.miss_cpu_us, 1.0 if c else 0.0))
    got = fit(samples, 4, truth.miss_cpu_us, truth.miss_upload_us, device="d", source="s", threads=2, concurrent=True)
    for f in ("base_tg_us", "stop_us", "host_tg_us", "base_pp_us", "host_pp_us", "cached_pp_us"):
        assert getattr(got, f) == pytest.approx(getattr(truth, f), rel=1e-6), f


def test_stock_timings_are_the_stock_part_and_placements_between_them_interpolate() -> None:
    """A host layer dearer the more there are (the stand-in in most runs): each timed stock placement
    is predicted as measured, one between two timed counts lies on the segment between them (not
    on one line through all three), and the cached placement's stop is what it adds to resident."""
    n, miss = 30, 3_000.0
    samples = [Sample("cpu-moe", n, 0, 81_000.0, 24_000.0), Sample("n-cpu-moe 15", 15, 0, 51_000.0, 23_500.0),
               Sample("resident", 0, 0, 31_000.0, 19_500.0), Sample("cached", 0, n, 88_000.0, 28_000.0, miss, 1.0)]
    got = fit(samples, 4, 250.0, 700.0, device="d", source="s", threads=1, concurrent=False)
    assert got.stock_points == ((0, 31_000.0, 19_500.0), (15, 51_000.0, 23_500.0), (n, 81_000.0, 24_000.0))

    def stock(h: int):
        return predict([LayerLoad("host")] * h + [LayerLoad("resident")] * (n - h), got)

    for s in samples[:3]:
        assert stock(s.n_host).tg_us == pytest.approx(s.tg_us) and stock(s.n_host).pp_us == pytest.approx(s.pp_us)
    assert stock(12).tg_us == pytest.approx(31_000 + 12 / 15 * 20_000)  # a straight line would say 55,000
    assert stock(18).tg_us == pytest.approx(51_000 + 3 / 15 * 30_000)
    assert got.base_tg_us == 31_000.0 and got.host_tg_us == pytest.approx(50_000 / n)
    assert got.stop_us == pytest.approx((88_000 - miss - 31_000) / n)
    assert got.cached_pp_us == pytest.approx((28_000 - 19_500) / n)
    cached = predict([LayerLoad("cached", misses=miss / 250.0 / n)] * n, got, "cpu")
    assert cached.tg_us == pytest.approx(88_000.0)
    assert DeviceCosts.from_dict(json.loads(json.dumps(got.to_dict()))) == got
    # without all resident timed: the nearest segment carries on below the fewest host layers
    two = fit([samples[0], samples[1], samples[3]], 4, 250.0, 700.0, device="d", source="s", threads=1,
              concurrent=False)
    assert two.base_tg_us == pytest.approx(51_000 - 15 * 2_000)
    for bad in ([[15, 1.0, 1.0], [0, 1.0, 1.0]], [[0, 1.0, 1.0], [0, 2.0, 2.0]], [[0, float("nan"), 1.0]],
                [[-1, 1.0, 1.0]], [[0, 0.0, 1.0]]):
        with pytest.raises(ValueError):
            DeviceCosts.from_dict({**got.to_dict(), "stock_points": bad})


def test_a_fit_without_a_resident_or_second_host_count_still_gives_figures() -> None:
    samples = [Sample("cpu-moe", 30, 0, 60_000.0, 900.0), Sample("cached", 0, 30, 70_000.0, 800.0, 5_000.0, 1.0)]
    got = fit(samples, 4, 300.0, 900.0, device="d", source="s", threads=1, concurrent=False)
    assert got.base_tg_us >= 0 and got.stop_us >= 0 and got.host_tg_us >= got.stop_us


def test_a_device_slower_than_the_cpu_fits_a_negative_host_layer_and_plans_cpu_moe(geo, counts) -> None:
    """lavapipe: all resident is slower than --cpu-moe. The fit keeps a host layer's negative
    figures, they survive the file, and the planner puts every MoE layer on the host."""
    truth = costs(base_tg_us=700_000.0, host_tg_us=-13_000.0, base_pp_us=90_000.0, host_pp_us=-1_000.0)
    n = len(geo.moe_layers)
    samples = []
    for name, h in (("cpu-moe", n), ("n-cpu-moe 6", 6), ("resident", 0)):
        p = predict([LayerLoad("host")] * h + [LayerLoad("resident")] * (n - h), truth)
        samples.append(Sample(name, h, 0, p.tg_us, p.pp_us))
    samples.append(Sample("cached", 0, n, truth.base_tg_us + n * truth.stop_us, truth.base_pp_us + n * 150.0, 0.0, 1.0))
    got = fit(samples, 4, truth.miss_cpu_us, truth.miss_upload_us, device="d", source="s", threads=2, concurrent=True)
    assert got.host_tg_us == pytest.approx(-13_000.0) and got.host_pp_us == pytest.approx(-1_000.0)
    assert DeviceCosts.from_dict(json.loads(json.dumps(got.to_dict()))) == got
    plan = planner.plan_for(geo, request(geo, counts, got)).plan
    assert modes(plan) == {"resident": 0, "cached": 0, "host": n}
    alts = {a.name: a.prediction for a in planner.alternatives(geo, request(geo, counts, got), plan)}
    assert alts["spark"].tg_us == pytest.approx(alts["cpu-moe"].tg_us)
    huge = dataclasses.replace(got, host_tg_us=-1e9, stock_points=())  # never a time below the floor
    assert predict([LayerLoad("host")] * n, huge).tg_us > 0


def test_costs_round_trip_and_refuse_nonsense() -> None:
    c = costs()
    assert DeviceCosts.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError):
        DeviceCosts.from_dict({**c.to_dict(), "stop_us": -1.0})
    with pytest.raises(ValueError):
        DeviceCosts.from_dict({**c.to_dict(), "version": 99})


# ---------------------------------------------------------------- the planner priced in time


def test_stock_placement_predicts_stock_time(geo, counts) -> None:
    """With stops dearer than anything a cache saves, the plan is stock's own --n-cpu-moe N, and
    its predicted time is that of stock's placement."""
    r = request(geo, counts, costs(stop_us=50_000.0))
    res = planner.plan_for(geo, r)
    stock = res.plan.stock
    host = [l.index for l in res.plan.layers if l.mode == "host"]
    assert modes(res.plan)["cached"] == 0
    assert host == [i for i in geo.moe_layers if i < stock.n_cpu_moe]
    own = planner.price(geo, r, None, host)
    assert res.plan.predicted["tg_tok_s"] == pytest.approx(own.tg_tok_s, rel=1e-3)
    alts = {a.name: a for a in res.alternatives}
    assert alts["spark"].prediction.tg_us == pytest.approx(alts["n-cpu-moe"].prediction.tg_us)


@pytest.mark.parametrize("share", [0.3, 0.6, 0.9])
def test_never_predicted_slower_than_stock_on_the_same_budget(geo, counts, share) -> None:
    for stop in (0.0, 200.0, 1_000.0, 5_000.0):
        for host in (300.0, 1_500.0, 6_000.0):
            res = planner.plan_for(geo, request(geo, counts, costs(stop_us=stop, host_tg_us=host), share))
            alts = {a.name: a.prediction for a in res.alternatives}
            assert alts["spark"].tg_us <= alts["n-cpu-moe"].tg_us * (1 + 1e-9), (stop, host, share)
            assert alts["spark"].tg_us <= alts["cpu-moe"].tg_us * (1 + 1e-9), (stop, host, share)
            assert res.plan.breakdown["total"] <= res.plan.budget_bytes


def test_dearer_stops_cache_fewer_layers(geo, counts) -> None:
    cached = [modes(planner.plan_for(geo, request(geo, counts, costs(stop_us=s))).plan)["cached"]
              for s in (0.0, 100.0, 500.0, 1_000.0, 2_000.0, 10_000.0)]
    assert cached == sorted(cached, reverse=True) and cached[0] > cached[-1] == 0


def test_free_stops_cache_every_layer_that_is_not_resident(geo, counts) -> None:
    plan = planner.plan_for(geo, request(geo, counts, costs(stop_us=0.0))).plan
    m = modes(plan)
    assert m["host"] == 0 and m["cached"] > 0 and m["cached"] + m["resident"] == len(geo.moe_layers)


def test_a_dearer_link_admits_fewer_slots(geo) -> None:
    """Without a second queue admissions wait: dearer uploads make LRU slots (which admit) dearer."""
    slots = []
    for upload in (10.0, 2_000.0, 20_000.0):
        c = costs(concurrent=False, miss_upload_us=upload, miss_cpu_us=250.0, stop_us=50.0)
        plan = planner.plan_for(geo, request(geo, None, c, assumed_cold_hit=0.3)).plan
        slots.append(sum(l.lru_slots for l in plan.layers if l.mode == "cached"))
    assert slots == sorted(slots, reverse=True) and slots[0] > slots[-1]


def test_cheap_stops_choose_the_cached_shape_and_dear_ones_stock_or_better(geo, counts) -> None:
    cheap = planner.plan_for(geo, request(geo, counts, costs(stop_us=20.0, host_tg_us=3_000.0))).plan
    assert modes(cheap)["cached"] > 0 and modes(cheap)["host"] == 0
    dear = planner.plan_for(geo, request(geo, counts, costs(stop_us=4_000.0, host_tg_us=1_500.0)))
    alts = {a.name: a.prediction for a in dear.alternatives}
    assert modes(dear.plan)["cached"] == 0 and alts["spark"].tg_us <= alts["n-cpu-moe"].tg_us


def test_objective_prompt_minimises_prompt_time(geo, counts) -> None:
    c = costs(stop_us=100.0, host_tg_us=3_000.0, host_pp_us=50.0, cached_pp_us=5_000.0)
    dec = planner.plan_for(geo, request(geo, counts, c)).plan
    pp = planner.plan_for(geo, request(geo, counts, c, objective="prompt")).plan
    assert pp.predicted["pp_tok_s"] >= dec.predicted["pp_tok_s"]
    assert dec.predicted["tg_tok_s"] >= pp.predicted["tg_tok_s"]
    with pytest.raises(PlanError, match="objective"):
        planner.plan_for(geo, request(geo, counts, c, objective="fastest"))


def test_the_prediction_rides_in_the_plan_file(geo, counts, tmp_path) -> None:
    plan = planner.plan_for(geo, request(geo, counts, costs())).plan
    assert plan.predicted is not None and {a["name"] for a in plan.predicted["alternatives"]} == \
        {"spark", "n-cpu-moe", "cpu-moe", "resident"}
    back = plan_file.load(plan_file.save(plan, tmp_path / "p.json"))
    assert back.predicted == plan.predicted
    bad = json.loads((tmp_path / "p.json").read_text())
    bad["predicted"]["stops"] = "many"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(PlanError, match="predicted"):
        plan_file.load(tmp_path / "bad.json")


def test_without_costs_the_plan_is_placed_by_hits_as_before(geo, counts) -> None:
    a = planner.plan_for(geo, request(geo, counts, None)).plan
    assert a.predicted is None and modes(a)["cached"] > 0


# ---------------------------------------------------------------- published figures


def test_every_card_gives_positive_figures(geo) -> None:
    for name, card in device_table.cards().items():
        c = device_table.predicted_costs(card, geo, 60.0, 8)
        assert c.predicted and c.base_tg_us > 0 and c.miss_cpu_us > 0 and c.miss_upload_us > 0, name
        assert c.base_pp_us > 0 and c.host_pp_us > 0, name  # prompt speed is predicted too
        assert c.host_tg_us >= c.stop_us or c.host_tg_us >= 0, name


def test_a_slower_link_or_host_predicts_slower_offload(geo) -> None:
    card = device_table.card("rtx-4060-ti-16gb")
    fast = device_table.predicted_costs(card, geo, 90.0, 16)
    slow_host = device_table.predicted_costs(card, geo, 30.0, 16)
    assert slow_host.miss_cpu_us > fast.miss_cpu_us and slow_host.host_tg_us > fast.host_tg_us
    narrow = device_table.predicted_costs(dataclasses.replace(card, link_gb_s=card.link_gb_s / 4), geo, 90.0, 16)
    assert narrow.miss_upload_us == pytest.approx(4 * fast.miss_upload_us)


def test_an_unknown_card_lists_the_names() -> None:
    with pytest.raises(UsageError) as e:
        device_table.card("rtx-9999")
    assert "rtx-4060-ti-16gb" in (e.value.hint or "")
