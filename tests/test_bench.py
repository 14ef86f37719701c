"""`spark bench`: every configuration end to end on the RPC stand-in GPU, the JSON report,
ratios from the medians, "does not fit" instead of a failure, the pure report math."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from conftest import cli_runner, keep_device_costs

from spark_cli.runs import bench
from spark_cli.core import planner, settle
from spark_cli.commands import bench as bench_cmd
from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.simulator import ONLINE_POLICIES
from spark_cli.core.profile import profile_path_for

SMALL = ("-p", "32", "-n", "8")


@pytest.fixture
def spark(monkeypatch, capsys):
    return cli_runner(monkeypatch, capsys, "bench", bench_cmd.register)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small corpus: a chat (the generation prompt) and two held-out texts (calibration)."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "chat.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "Name three rivers in Europe."},
        {"role": "assistant", "content": "The Danube, the Rhine and the Loire."}]}) + "\n")
    (d / "code.md").write_text("def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")
    (d / "prose.txt").write_text("The lighthouse keeper climbed the stairs every evening to light the lamp.\n")
    return d


@pytest.fixture(scope="module")
def model_link(small_model, tmp_path_factory) -> Path:
    """The small model under a private name, so the profile bench writes stays in tmp."""
    link = tmp_path_factory.mktemp("model") / Path(small_model).name
    link.symlink_to(small_model)
    return link


@pytest.fixture(scope="module")
def geo(small_model):
    return load_geometry(small_model)


@pytest.mark.model
def test_every_configuration_end_to_end(spark, model_link, corpus, rpc_server, tmp_path, monkeypatch) -> None:
    """On a device whose stops are free (kept costs): Spark caches every layer it does not keep whole."""
    keep_device_costs(monkeypatch, tmp_path / "home", model_link, None, [rpc_server.endpoint], stop_us=0.0)
    monkeypatch.setattr(settle, "SPREAD", 0.0)  # any two timings spread "wide": the further runs are taken
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc, stdout, stderr = spark(model_link, "--rpc", rpc_server.endpoint, "--residency", "0.6", "--ceiling",
                               "--corpus", corpus, *SMALL, "-r", "2", "-o", out, "--plot", png)
    assert rc == 0, stderr
    d = json.loads(out.read_text())
    by = {c["name"]: c for c in d["configs"]}
    assert list(by) == list(bench.DEFAULT_CONFIGS)
    for name, c in by.items():
        assert c["status"] == "ok", (name, c["reason"])
        assert all(r["tg_tokens"] == 8 and r["pp_tokens"] == 32 for r in c["runs"])
    # -r 2 at least; interleaved, every configuration takes further runs alike while any one's timings
    # spread wider than settle.SPREAD (0 here: any spread), up to twice -r
    assert {len(c["runs"]) for c in by.values()} == {bench.MORE * 2}
    assert any(n.startswith("runs added while") for n in d["notes"]) and "median (min-max) of 4" in stdout
    assert by["resident"]["over_budget"] and by["resident"]["vram_planned_bytes"] > d["budget_bytes"]
    for name in ("cpu-moe", "n-cpu-moe", "spark-step", "spark"):
        assert by[name]["vram_planned_bytes"] <= d["budget_bytes"], name

    # interleaved on the stand-in (room for all): every configuration's run i before any one's run i + 1
    assert d["interleaved"] and any(n.startswith("configurations interleaved") for n in d["notes"])
    assert d["cpu_steal"] is None or 0.0 <= d["cpu_steal"] <= 1.0  # Linux counts it; elsewhere null
    own = [c for c in by.values() if not c["same_as"]]
    assert len(own) >= 3
    for i in range(len(own[0]["runs"]) - 1):
        assert max(c["runs"][i]["started"] for c in own) < min(c["runs"][i + 1]["started"] for c in own)

    # medians and spreads from the runs, ratios from the medians
    for c in by.values():
        for what in ("pp", "tg"):
            rates = [r[f"{what}_tok_s"] for r in c["runs"]]
            s = c[f"{what}_tok_s"]
            assert s["median"] == pytest.approx(statistics.median(rates))
            assert (s["min"], s["max"]) == (pytest.approx(min(rates)), pytest.approx(max(rates)))
    best = max(("cpu-moe", "n-cpu-moe"), key=lambda n: by[n]["tg_tok_s"]["median"])
    assert d["baseline"] == best and d["ceiling"] == "resident"
    for c in by.values():
        for what in ("pp", "tg"):
            mine = c[f"{what}_tok_s"]["median"]
            assert c["ratios"][f"{what}_vs_stock"] == pytest.approx(mine / by[best][f"{what}_tok_s"]["median"])
            assert c["ratios"][f"{what}_vs_ceiling"] == pytest.approx(mine / by["resident"][f"{what}_tok_s"]["median"])
    assert d["targets"]["tg_vs_stock"]["value"] == pytest.approx(by["spark"]["ratios"]["tg_vs_stock"])

    # hardware-independent figures: stock offload computes on the CPU, Spark uploads misses
    runs = len(by["resident"]["runs"])  # -r 2, or more where the timings spread wide
    n_tg, n_pp = 8 * runs, 32 * runs
    n_moe = d["model"]["n_moe_layers"]
    assert by["resident"]["cold_hit"] == 0 and by["cpu-moe"]["cold_hit"] == 1
    assert by["n-cpu-moe"]["cold_hit"] == pytest.approx(len(by["n-cpu-moe"]["placement"]["host_layers"]) / n_moe)
    for name in ("spark-step", "spark"):
        c = by[name]
        assert 0 < c["bank_bytes"] and c["decode_tokens"] == n_tg
        # every miss is uploaded (blocking) or computed on the CPU; admissions are uploads too
        assert c["uploads_per_token"] == pytest.approx(c["uploads"] / n_tg)
        assert c["cpu_expert_bytes_per_token"] >= 0 and c["syncs_per_token"] >= 1
        assert c["blocking_upload_bytes_per_token"] + c["async_upload_bytes_per_token"] == \
            pytest.approx(c["bytes_per_token"])
        assert c["cold_hit"] == pytest.approx(c["misses"] / (n_tg * d["model"]["n_expert_used"] * n_moe))
        assert 0.5 < c["placement"]["expert_residency"] <= 0.6 + 1e-9
        assert c["placement"]["policy"] in ONLINE_POLICIES  # the plan's (--policy auto picked it)
    # the cache is exact: Spark generates the all-resident run's tokens
    assert by["spark"]["tokens_digest"] == by["resident"]["tokens_digest"]

    # the prompt phase apart: the prompt evals' counters per prompt token (one read-back per eval)
    for name in ("spark-step", "spark"):
        c, p = by[name], by[name]["prompt_cache"]
        assert c["prompt_tokens"] == n_pp and set(p) >= {"syncs", "uploads", "staged_uploads"}
        for counter in bench.PROMPT_ACCOUNTING:
            extra = runs if counter == "syncs" else 0  # one a run
            assert c[f"{counter}_per_prompt_token"] == pytest.approx((p[counter] + extra) / n_pp), (name, counter)
        for counter in ("staged_uploads", "staged_upload_bytes"):
            assert c[f"{counter}_per_token"] == pytest.approx(c[counter] / n_tg)
    assert by["resident"]["syncs_per_prompt_token"] == pytest.approx(runs / n_pp)
    assert by["resident"]["blocking_upload_bytes_per_prompt_token"] == 0 and by["resident"]["prompt_cache"] is None
    assert by["cpu-moe"]["cpu_expert_bytes_per_prompt_token"] is None  # stock prompt offload: not modelled

    # predicted beside measured, with the kept costs, for every configuration
    assert any(n.startswith("device costs:") and "kept" in n for n in d["notes"])
    for name, c in by.items():
        assert c["predicted"]["tg_tok_s"] > 0 and c["predicted"]["stops"] >= 1, name
        ratio = c["predicted_over_measured"]["tg"]
        assert ratio == pytest.approx(c["predicted"]["tg_tok_s"] / c["tg_tok_s"]["median"]), name
    assert by["spark"]["predicted"]["stops"] == 1 + by["spark"]["placement"]["cached_layers"]
    assert by["cpu-moe"]["predicted"]["stops"] == 1 + n_moe
    assert "predicted and measured" in stdout and "tg pred/meas" in stdout

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Spark + cache" in stdout and "tg/stock" in stdout
    prof = json.loads(profile_path_for(model_link).read_text())  # bench folded its decode counts
    assert prof["tokens_decode"] > 0 and "spark bench" in prof["sources"]


@pytest.mark.model
def test_dear_stops_give_spark_stocks_own_placement(spark, model_link, corpus, rpc_server, tmp_path,
                                                    monkeypatch) -> None:
    """On a device whose stops cost more than any cache saves, Spark's plan is stock's --n-cpu-moe N,
    measured once: never slower than stock."""
    keep_device_costs(monkeypatch, tmp_path / "home", model_link, None, [rpc_server.endpoint], stop_us=1e6)
    out = tmp_path / "b.json"
    rc, stdout, stderr = spark(model_link, "--rpc", rpc_server.endpoint, "--residency", "0.6", "--corpus", corpus,
                               *SMALL, "-r", "1", "--configs", "n-cpu-moe,spark", "-o", out, "--no-learn")
    assert rc == 0, stderr
    by = {c["name"]: c for c in json.loads(out.read_text())["configs"]}
    assert by["spark"]["same_as"] == "n-cpu-moe" and by["spark"]["placement"]["cached_layers"] == 0
    assert by["spark"]["placement"]["host_layers"] == by["n-cpu-moe"]["placement"]["host_layers"]
    assert by["spark"]["predicted"] == by["n-cpu-moe"]["predicted"]
    assert by["spark"]["ratios"]["tg_vs_stock"] == pytest.approx(1.0)


@pytest.mark.model
def test_budget_without_room_for_the_ceiling_says_does_not_fit(spark, model_link, corpus, rpc_server, tmp_path,
                                                                geo) -> None:
    out = tmp_path / "b.json"
    before = profile_path_for(model_link).read_text() if profile_path_for(model_link).exists() else None
    rc, stdout, stderr = spark(model_link, "--rpc", rpc_server.endpoint, "--residency", "0.5", "--corpus", corpus,
                               *SMALL, "-r", "1", "--configs", "resident,n-cpu-moe", "-o", out, "--md",
                               "--no-learn")
    assert rc == 0, stderr
    d = json.loads(out.read_text())
    res, stock = d["configs"]
    assert res["status"] == "does not fit" and res["runs"] == [] and "budget" in res["reason"]
    assert stock["status"] == "ok" and stock["ratios"]["tg_vs_ceiling"] is None
    assert stock["ratios"]["tg_vs_stock"] == pytest.approx(1.0)
    assert "| all resident |" in stdout and "does not fit" in stdout  # --md
    after = profile_path_for(model_link).read_text() if profile_path_for(model_link).exists() else None
    assert after == before  # --no-learn


@pytest.mark.model
def test_no_device_runs_on_the_cpu_with_a_note(spark, small_model, corpus, tmp_path) -> None:
    out = tmp_path / "cpu.json"
    rc, stdout, stderr = spark(small_model, "--corpus", corpus, "-p", "16", "-n", "4", "-r", "1", "-dev", "none",
                               "-nr", "--json", "-o", out)  # -nr: see conftest.NO_REPACK_WHY
    assert rc == 0, stderr
    assert "no GPU-type device" in stderr and "--rpc auto" in stderr
    d = json.loads(stdout)  # --json: the report on stdout, the same as -o writes
    assert d == json.loads(out.read_text())
    assert [c["name"] for c in d["configs"]] == ["cpu"] and d["configs"][0]["status"] == "ok"


def test_unknown_configuration_is_one_line(spark, small_model) -> None:
    rc, stdout, stderr = spark(small_model, "--configs", "resident,turbo")
    assert rc == 2 and "--configs" in stderr and "turbo" in stderr and "Traceback" not in stderr


def test_tiny_budget_marks_what_does_not_fit(geo) -> None:
    budget = planner.fixed_bytes(geo, 4096) + 1  # room for no expert at all
    plan = planner.plan_for(geo, planner.PlanRequest(budget, 4096)).plan
    cfgs = bench.make_configs(geo, budget, 4096, bench.DEFAULT_CONFIGS, plan, plan)
    status = {c.name: c.status for c in cfgs}
    # below the cache floor Spark keeps every MoE layer on the host, as stock --cpu-moe
    assert status == {"resident": "does not fit", "cpu-moe": "ready", "n-cpu-moe": "ready",
                      "spark-step": "ready", "spark": "ready"}
    assert cfgs[1].key() == cfgs[2].key() == cfgs[3].key() == cfgs[4].key()  # N = every layer
    assert cfgs[4].host_layers == tuple(geo.moe_layers) and not cfgs[4].cache_layers
    roomy = bench.make_configs(geo, 64 << 30, 4096, ["resident", "n-cpu-moe"], None, None)
    assert all(c.status == "ready" for c in roomy) and roomy[1].host_layers == ()
    assert roomy[0].key() == roomy[1].key()  # measured once, reported twice


def _result(name: str, kind: str, tg: list[float], pp: list[float] | None = None) -> bench.Result:
    pp = pp or [100.0] * len(tg)
    runs = [bench.Run(10, 10 / p, 5, 5 / t) for p, t in zip(pp, tg)]
    return bench.Result(bench.Config(name, name, kind), status="ok", runs=runs)


def test_ratios_use_medians_and_the_best_stock(geo) -> None:
    rep = bench.Report(Path("m.gguf"), geo, 1 << 30, "test", 4096, 10, 5, 3, "RPC0", "c")
    rep.results = [_result("resident", "ceiling", [100, 110, 90]),
                   _result("cpu-moe", "stock", [10, 12, 11]),
                   _result("n-cpu-moe", "stock", [40, 20, 50]),
                   _result("spark", "spark", [90, 95, 1], pp=[50, 60, 70])]
    rep.finalize()
    spark = rep.result("spark")
    assert rep.baseline == "n-cpu-moe" and rep.ceiling == "resident"
    assert spark.tg == bench.Spread(90, 1, 95)
    assert spark.ratios["tg_vs_stock"] == pytest.approx(90 / 40)
    assert spark.ratios["tg_vs_ceiling"] == pytest.approx(90 / 100)
    assert spark.ratios["pp_vs_stock"] == pytest.approx(60 / 100)
    t = rep.targets()
    assert t["tg_vs_stock"]["met"] is True and t["tg_vs_ceiling"]["met"] is True
    speeds, acc, stops = bench.to_markdown(rep).split("\n\n")
    assert speeds.count("\n") == 5 and "2.25x" in speeds and "90.0 (1.0-95.0)" in speeds
    assert acc.count("\n") == 1 + 2 * 4  # header, rule, a tg and a pp row per configuration
    assert [line.split(" | ")[1] for line in acc.splitlines()[2:]] == ["tg", "pp"] * 4
    assert stops.count("\n") == 1 + 4  # header, rule, a row per configuration


class _FakeEngine:
    """Tokens are characters; BOS is 1; a chat renders as 'role: content' lines."""

    @property
    def vocab(self) -> "_FakeEngine":
        return self

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return ([1] if add_special else []) + [ord(c) for c in text]

    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt else "")


def test_workload_generates_after_a_chat_and_calibrates_on_the_rest(corpus) -> None:
    from spark_cli.files.corpus import read_corpus

    docs = read_corpus(corpus).documents
    w = bench.make_workload(_FakeEngine(), docs, n_prompt=1000)
    assert bytes(w.gen_prompt[1:]).decode() == "user: Name three rivers in Europe.\nassistant:"
    assert len(w.calibration) == 2 and all(p[0] == 1 for p in w.calibration)
    assert not any(p == w.gen_prompt for p in w.calibration)
    assert len(w.pp_tokens) == 1000 and w.pp_tokens[0] == 1 and w.pp_tokens.count(1) == 1  # BOS once
    assert "repeated" in w.note


def _wide_report(geo) -> bench.Report:
    """Every configuration with the longest labels and four-digit rates; Spark with cache counters."""
    from spark_cli.native.expert_cache import CacheStats
    from spark_cli.native.rpc_traffic import Traffic

    def res(name: str, label: str, kind: str, pp: list[float], tg: list[float], host: tuple = ()) -> bench.Result:
        runs = [bench.Run(512, 512 / p, 128, 128 / t) for p, t in zip(pp, tg)]
        r = bench.Result(bench.Config(name, label, kind, host_layers=host, planned_bytes=123 << 30), status="ok",
                         runs=runs, decode_tokens=128 * len(runs))
        n = r.decode_tokens
        # RPC: all-resident's 20 segments out and 4 in per token, plus per stop 9 out and 4 in (stock: 2 replies)
        r.traffic = Traffic(segs_out=(20 + 9 * len(host)) * n, segs_in=(4 + 4 * len(host)) * n,
                            bytes_out=(1 << 20) * n, bytes_in=(1 << 18) * n)
        if kind == "spark":
            r.miss_path = "cpu 10, upload 14"
            r.cache = CacheStats(uploads=800, syncs=3000, blocking_upload_bytes=300 << 22,
                                 async_upload_bytes=500 << 22, cpu_expert_bytes=90 << 22, staged_uploads=40,
                                 staged_upload_bytes=40 << 22, stop_reads=3000, stop_writes=3000, blocking_calls=6)
            # Spark's stops: 6 out and 2 in each (one reply)
            r.traffic = Traffic(segs_out=20 * n + 6 * 3000, segs_in=4 * n + 2 * 3000, bytes_out=(1 << 20) * n,
                                bytes_in=(1 << 18) * n)
            r.prompt_cache = CacheStats(uploads=5000, syncs=90, blocking_upload_bytes=5000 << 22,
                                        staged_uploads=12, staged_upload_bytes=12 << 22)
        return r

    rep = bench.Report(Path("Qwen3-Coder-30B-A3B-Instruct-UD-Q4_K_XL.gguf"), geo, 16 << 30, "test", 4096, 512, 128, 3,
                       "CUDA0", "c")
    rep.results = [res("resident", "all resident (over budget)", "ceiling", [3456.7, 3400.1, 3501.9], [123.4, 120.1, 125.9]),
                   res("cpu-moe", "stock --cpu-moe", "stock", [1234.5, 1200.2, 1300.9], [23.4, 22.1, 25.9],
                       host=tuple(geo.moe_layers)),
                   res("n-cpu-moe", "stock --n-cpu-moe 12", "stock", [2234.5, 2200.2, 2300.9], [43.4, 42.1, 45.9],
                       host=tuple(geo.moe_layers[:1])),
                   res("spark-step", "Spark, step slots", "spark", [2834.5, 2800.2, 2900.9], [83.4, 82.1, 85.9]),
                   res("spark", "Spark + cache", "spark", [2934.5, 2900.2, 2990.9], [1093.4, 1092.1, 1095.9]),
                   bench.Result(bench.Config("cpu", "CPU only (no device)", "cpu"), status="does not fit")]
    rep.finalize()
    return rep


def _whole_at_120(table) -> str:
    """A rich table's text at 120 columns, asserted neither ellipsised nor cropped."""
    from rich.console import Console

    con = Console(width=120, record=True, color_system=None)
    con.print(table)
    text = con.export_text()
    assert "…" not in text, text
    lines = [line.rstrip() for line in text.splitlines()]
    assert max(len(line) for line in lines) <= 120, text
    boxed = [line for line in lines if line[:1] in "┏┃┡│├└"]
    assert len(boxed) >= 8 and all(line[-1] in "┓┃┩│┤┘" for line in boxed), text  # not cropped at 120
    return text


def test_both_tables_fit_120_columns_with_whole_headers(geo) -> None:
    rep = _wide_report(geo)
    for table, must in ((bench_cmd.speed_table(rep), ("pp tok/s", "tg tok/s", "tg/stock", "tg/ceiling")),
                        (bench_cmd.accounting_table(rep), ("syncs", "blocking", "async", "staged", "CPU", "cold-hit")),
                        (bench_cmd.stops_table(rep), ("stops", "replies", "reads", "writes", "blocking"))):
        text = _whole_at_120(table)
        for word in must:
            assert word in text, word


def test_prompt_and_decode_accounting_apart(geo) -> None:
    d = {c["name"]: c for c in _wide_report(geo).to_dict()["configs"]}
    spark = d["spark"]
    n_pp, n_tg = 3 * 512, 3 * 128
    assert spark["prompt_tokens"] == n_pp and spark["decode_tokens"] == n_tg
    assert spark["syncs_per_token"] == pytest.approx(3000 / n_tg + 1)  # + the logits read-back of each step
    assert spark["syncs_per_prompt_token"] == pytest.approx((90 + 3) / n_pp)  # + one read-back per prompt
    assert spark["blocking_upload_bytes_per_prompt_token"] == pytest.approx((5000 << 22) / n_pp)
    assert spark["async_upload_bytes_per_prompt_token"] == 0
    assert spark["uploads_per_prompt_token"] == pytest.approx(5000 / n_pp)
    assert spark["staged_uploads_per_token"] == pytest.approx(40 / n_tg)
    assert spark["staged_upload_bytes_per_token"] == pytest.approx((40 << 22) / n_tg)
    assert spark["staged_uploads_per_prompt_token"] == pytest.approx(12 / n_pp)
    assert spark["staged_upload_bytes_per_prompt_token"] == pytest.approx((12 << 22) / n_pp)
    assert spark["prompt_cache"]["staged_uploads"] == 12 and spark["staged_uploads"] == 40
    # stock: decode modelled; the prompt of host layers not (llama.cpp may offload the batch)
    stock = d["cpu-moe"]
    assert stock["syncs_per_token"] == len(geo.moe_layers) + 1 and stock["staged_uploads_per_token"] == 0
    assert stock["syncs_per_prompt_token"] is None and stock["cpu_expert_bytes_per_prompt_token"] is None
    assert stock["staged_upload_bytes_per_prompt_token"] == 0 and stock["prompt_cache"] is None
    res = d["resident"]
    assert res["syncs_per_prompt_token"] == pytest.approx(3 / n_pp) and res["cpu_expert_bytes_per_prompt_token"] == 0
    assert all(d["cpu"][f"{k}_per_prompt_token"] is None for k in bench.PROMPT_ACCOUNTING)  # did not run


def test_round_trips_per_stop_beside_all_resident(geo) -> None:
    d = {c["name"]: c for c in _wide_report(geo).to_dict()["configs"]}
    spark, stock, res = d["spark"], d["cpu-moe"], d["resident"]
    n_tg = 3 * 128
    assert spark["stops_per_token"] == pytest.approx(3000 / n_tg) and stock["stops_per_token"] == len(geo.moe_layers)
    assert spark["rpc_replies_per_stop"] == pytest.approx(1.0) and stock["rpc_replies_per_stop"] == pytest.approx(2.0)
    assert spark["rpc_segs_out_per_stop"] == pytest.approx(6.0) and stock["rpc_segs_out_per_stop"] == pytest.approx(9.0)
    assert spark["stop_reads_per_stop"] == 1.0 and spark["stop_writes_per_stop"] == 1.0
    assert stock["stop_reads_per_stop"] is None  # the cache counts only its own stops
    assert spark["blocking_calls_per_token"] == pytest.approx(6 / n_tg) and stock["blocking_calls_per_token"] == 0
    assert res["stops_per_token"] == 0 and res["rpc_replies_per_stop"] is None
    assert res["rpc_segs_in_per_token"] == pytest.approx(4.0) and res["rpc_bytes_out_per_token"] == 1 << 20


def test_plot_shows_prompt_and_generation_side_by_side(geo, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rep = _wide_report(geo)
    fig = bench_cmd.speed_figure(rep)
    try:
        axes = fig.get_axes()
        assert len(axes) == 2
        assert "prompt" in axes[0].get_xlabel() and "generation" in axes[1].get_xlabel()
        measured = [r for r in rep.results if r.runs]
        for ax, what in zip(axes, ("pp", "tg")):
            widths = [bar.get_width() for bar in ax.patches]
            assert widths == pytest.approx([getattr(r, what).median for r in measured])
        labels = [t.get_text() for t in axes[0].get_yticklabels()]
        assert labels == [r.config.label for r in measured]
    finally:
        plt.close(fig)
    png = tmp_path / "b.png"
    bench_cmd._plot(rep, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.model
def test_parallel_sequences_together_and_one_after_another(spark, model_link, corpus, rpc_server, tmp_path,
                                                           monkeypatch) -> None:
    """-np 2: every configuration opened with 2 sequences decodes 2 corpus prompts together and
    one after another; the same greedy tokens either way, and through the cache as all resident."""
    keep_device_costs(monkeypatch, tmp_path / "home", model_link, None, [rpc_server.endpoint], stop_us=0.0)
    out, png = tmp_path / "np.json", tmp_path / "np.png"
    n_seq, n_gen = 2, 4
    rc, stdout, stderr = spark(model_link, "--rpc", rpc_server.endpoint, "--residency", "0.6", "--ceiling",
                               "--corpus", corpus, "-p", "32", "-n", n_gen, "-r", "1", "--parallel", n_seq,
                               "--configs", "resident,spark", "-o", out, "--plot", png,
                               "--no-learn")
    assert rc == 0, stderr
    d = json.loads(out.read_text())
    assert d["n_parallel"] == n_seq
    by = {c["name"]: c for c in d["configs"]}
    assert list(by) == ["resident", "spark"]  # a stock and a cached configuration (the others: stock's path)
    for name, c in by.items():
        assert c["status"] == "ok", (name, c["reason"])
        assert len(c["runs"]) == 1 and c["runs"][0]["tg_tokens"] == n_gen  # the single-sequence runs as before
        p = c["parallel"]
        assert p is not None and p["n_seq"] == n_seq, name
        assert len(p["prompt_lengths"]) == n_seq and all(n >= 2 for n in p["prompt_lengths"])
        for phase in ("serial", "together"):
            f = p[phase]
            assert [r["tokens"] for r in f["runs"]] == [n_seq * n_gen] and f["decode_tokens"] == n_seq * n_gen
            assert all(r["seconds"] > 0 and r["tok_s"] > 0 for r in f["runs"]), (name, phase)
            assert f["tok_s"]["median"] > 0
            if c["kind"] == "spark":
                assert 0 <= f["hit_rate"] <= 1 and f["hits"] + f["misses"] > 0, (name, phase)
                assert f["uploads_per_token"] == pytest.approx(f["uploads"] / (n_seq * n_gen))
            else:
                assert f["hit_rate"] is None and f["uploads_per_token"] == 0
        assert p["serial"]["runs"][0]["steps"] == n_seq * n_gen  # one token a step, each alone
        assert p["together"]["runs"][0]["steps"] == n_gen  # n_seq tokens a step
        assert p["ratio"] == pytest.approx(p["together"]["tok_s"]["median"] / p["serial"]["tok_s"]["median"])
    # the cache's contract, with the same batching: the all-resident run's tokens, together and alone
    spark_p, res_p = by["spark"]["parallel"], by["resident"]["parallel"]
    assert spark_p["together_digest"] == res_p["together_digest"]
    assert spark_p["serial_digest"] == res_p["serial_digest"]
    # together against alone: llama.cpp's batched CPU kernels are not bit-identical to single steps
    # (whether a near-tie flips depends on the CPU's kernels), so Spark matches exactly when stock does
    assert spark_p["tokens_match"] is res_p["tokens_match"]
    assert (spark_p["together_digest"] == spark_p["serial_digest"]) is spark_p["tokens_match"]
    assert "2 sequences: together against one after another" in stdout and "hit rate 2 seq" in stdout
    if spark_p["tokens_match"]:
        assert "tokens decoded together equal those decoded alone" in stdout
    else:
        assert "differ from those decoded alone, as all resident (over budget)'s do" in stdout, stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _parallel_report(geo, n_seq: int = 4) -> bench.Report:
    """The wide report with -np figures on every measured configuration."""
    from spark_cli.native.expert_cache import CacheStats

    rep = _wide_report(geo)
    rep.n_parallel = n_seq
    for r in rep.results:
        if not r.runs:
            continue
        cache = CacheStats(hits=900, misses=100, uploads=60) if r.config.kind == "spark" else CacheStats()
        r.parallel = bench.ParallelResult(n_seq, [40] * n_seq,
                                          serial=[bench.BatchRun(n_seq * 128, 4.5, n_seq * 128, cache)] * 2,
                                          together=[bench.BatchRun(n_seq * 128, t, 128, cache) for t in (1.5, 1.0)],
                                          tokens_match=True)
    return rep


def test_parallel_table_fits_120_columns(geo) -> None:
    rep = _parallel_report(geo)
    text = _whole_at_120(bench_cmd.parallel_table(rep))
    assert "all resident (over budget)" in text and "stock --n-cpu-moe 12" in text  # labels whole
    for word in ("together", "serial", "ratio", "seq", "uploads/tok"):
        assert word in text, word
    rows = bench.parallel_rows(rep)
    spark = next(r for r in rows if r["configuration"] == "Spark + cache")
    # medians of the runs' rates: together 512 tokens in 1.5 s and 1.0 s, serial in 4.5 s
    together = (512 / 1.5 + 512 / 1.0) / 2
    assert spark["tg together"] == f"{together:.1f}" and spark["tg serial"] == f"{512 / 4.5:.1f}"
    assert spark["ratio"] == f"{together / (512 / 4.5):.2f}x" and spark["hit rate 4 seq"] == "90.0%"
    assert spark["uploads/tok 4"] == bench._num(60 * 2 / (2 * 512))
    stock = next(r for r in rows if r["configuration"] == "stock --cpu-moe")
    assert stock["hit rate 1 seq"] == "-" and stock["uploads/tok 1"] == "0.00"
    d = rep.to_dict()
    assert d["n_parallel"] == 4 and d["configs"][-1]["parallel"] is None  # did not run
    p = d["configs"][-2]["parallel"]
    assert p["together"]["decode_tokens"] == 2 * 512 and p["together"]["hit_rate"] == pytest.approx(0.9)
    assert len(bench.to_markdown(rep).split("\n\n")) == 4  # speeds, accounting, stops, -np
    assert bench_cmd._parallel_lines(rep) == ["Spark, step slots: each sequence's tokens decoded together equal "
                                              "those decoded alone",
                                              "Spark + cache: each sequence's tokens decoded together equal "
                                              "those decoded alone"]
    # tokens that differ batched as stock's do: llama.cpp's batches, not the cache
    for r in rep.results:
        if r.parallel is not None:
            r.parallel.tokens_match, r.parallel.serial_digest, r.parallel.together_digest = False, "a", "b"
    lines = bench_cmd._parallel_lines(rep)
    assert len(lines) == 2 and all("as all resident (over budget)'s do" in line for line in lines)
    rep.result("resident").parallel.together_digest = "c"
    rep.result("cpu-moe").parallel.together_digest = "c"
    rep.result("n-cpu-moe").parallel.together_digest = "c"
    assert all("[yellow]" in line for line in bench_cmd._parallel_lines(rep))


def test_plot_adds_a_parallel_panel(geo) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rep = _parallel_report(geo)
    fig = bench_cmd.speed_figure(rep)
    try:
        axes = fig.get_axes()
        assert len(axes) == 3 and "4 sequences" in axes[2].get_xlabel()
        measured = [r for r in rep.results if r.runs]
        widths = [bar.get_width() for bar in axes[2].patches]
        together = (512 / 1.5 + 512 / 1.0) / 2  # the median of the runs' rates
        assert widths == pytest.approx([together] * len(measured) + [512 / 4.5] * len(measured))
        assert axes[2].get_ylim() == pytest.approx(axes[0].get_ylim())  # rows level with the others
    finally:
        plt.close(fig)


def test_parallel_prompts_are_distinct() -> None:
    w = bench.Workload([1, 2, 3], [1, 5, 6, 7], [[1, 8, 9]], prompts=[[1, 5, 6, 7], [1, 8, 9]])
    ps = w.parallel_prompts(5, max_len=3)
    assert ps[0] == [1, 5, 6] and ps[1] == [1, 8, 9]
    assert len({tuple(p) for p in ps}) == 5 and all(2 <= len(p) <= 3 for p in ps[:4])


def test_configurations_take_turns_only_when_they_fit_the_device_together(monkeypatch) -> None:
    """Interleaving keeps every configuration open: only when their planned bytes fit one device."""
    from spark_cli.native.engine import EngineOptions

    jobs = [bench.Result(bench.Config(n, n, "stock", planned_bytes=3 << 30)) for n in ("a", "b")]
    base = EngineOptions(Path("m.gguf"), rpc=["127.0.0.1:1"])
    monkeypatch.setattr(bench, "device_memory", lambda opts: ("RPC0", 8 << 30, 16 << 30))
    together, why = bench.take_turns(jobs, base)
    assert together and "interleaved" in why and "RPC0" in why
    monkeypatch.setattr(bench, "device_memory", lambda opts: ("CUDA0", 6 << 30, 16 << 30))
    together, why = bench.take_turns(jobs, base)  # 6 GiB + the margin > 6 GiB free
    assert not together and "one after another" in why and "CUDA0" in why
    assert bench.take_turns(jobs[:1], base)[0] is False


def test_an_interrupt_in_one_turn_closes_every_engine_and_marks_the_open_ones() -> None:
    """Interleaved: a KeyboardInterrupt in one configuration's repetition closes the others' engines
    (their generators) and marks them interrupted; a configuration that had finished keeps ok."""
    closed: list[str] = []

    def steps(r: bench.Result, reps: int, fail_at: int | None = None):
        r.status = "running"
        try:
            yield  # open and warm
            for i in range(reps):
                if i == fail_at:
                    r.status = "interrupted"
                    raise KeyboardInterrupt
                r.runs.append(bench.Run(8, 1.0, 4, 1.0))
                yield
            r.status = "ok"
        finally:
            closed.append(r.config.name)

    jobs = [bench.Result(bench.Config(n, n, "stock")) for n in ("done", "open", "fails")]
    gens = [steps(jobs[0], 1), steps(jobs[1], 3), steps(jobs[2], 3, fail_at=1)]
    with pytest.raises(KeyboardInterrupt):
        bench.drive(gens, jobs, interleaved=True, repetitions=3)
    assert sorted(closed) == ["done", "fails", "open"]
    assert [r.status for r in jobs] == ["ok", "interrupted", "interrupted"]
    assert jobs[1].reason == "after 2 of 3 runs" and len(jobs[2].runs) == 1  # its turn came before the failing one


def test_runs_are_added_alike_while_generation_timings_spread_wide() -> None:
    def job(*tg_seconds: float) -> bench.Result:
        r = bench.Result(bench.Config("x", "x", "stock"))
        r.runs = [bench.Run(32, 1.0, 4, t) for t in tg_seconds]
        return r

    quiet = job(1.00, 1.10, 1.05, 1.00, 1.02, 1.01)
    noisy = job(1.00, 2.00, 1.50, 1.00, 1.05, 1.00)  # its first three spread wide, its first four too
    both = bench.Turns(3, [quiet, noisy])  # interleaved: each asks with the runs it has
    assert both.more(0) and both.more(2)  # -r 3 first
    assert both.more(3) and both.more(4)  # noisy's first three, then four, spread wider than 25% of their median
    assert not bench.Turns(3, [quiet]).more(3)  # one after another: the quiet one alone stops at -r
    assert not both.more(bench.MORE * 3)  # at most twice -r, however they spread
    assert not bench.Turns(3, [quiet, job(1.0, 2.0)]).more(3)  # a configuration stopped early is not waited for
    assert bench.more_runs_note([quiet], 3).startswith("runs added while generation timings spread wider than 25%")
    assert bench.more_runs_note([job(1.0, 1.0, 1.0)], 3) == ""


# ---------------------------------------------------------------- --infill


@pytest.fixture(scope="module")
def tiny_links(tmp_path_factory) -> dict[str, Path]:
    """The tiny llama with StarCoder's FIM tokens and with SmolLM2's tokenizer (none), under private names."""
    from spark_cli.models.tiny_models import build_tiny_model

    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, vocab in (("fim", "starcoder"), ("plain", None)):
        out[name] = d / f"{name}.gguf"
        out[name].symlink_to(build_tiny_model("llama", vocab=vocab))
    return out


def _infill_bench(spark, model, corpus, *more):
    return spark(model, "--corpus", corpus, "-p", "16", "-n", "4", "-r", "2", "-dev", "none", "-nr", "-t", "1",
                 "--no-learn", "--infill", *more)


@pytest.mark.model
def test_infill_times_the_first_token_of_a_2k_prefix(spark, tiny_links, corpus) -> None:
    rc, stdout, stderr = _infill_bench(spark, tiny_links["fim"], corpus, "--json")
    assert rc == 0, stderr
    d = json.loads(stdout)
    inf, cfg = d["infill"], d["configs"][0]
    kept = 3 * (inf["n_batch"] // 4)  # core/fim.py: the prefix keeps 3/4 of a batch
    assert inf["missing"] is None and inf["note"] is None and inf["prefix_tokens"] == bench.INFILL_PREFIX > kept
    assert kept < inf["prompt_tokens"] <= kept + inf["suffix_tokens"] + 3  # + the three FIM tokens
    assert set(cfg["infill_ttft_ms"]) == {"median", "min", "max"} and len(cfg["infill_seconds"]) == 2
    assert cfg["infill_ttft_ms"]["min"] <= cfg["infill_ttft_ms"]["median"] <= cfg["infill_ttft_ms"]["max"]
    rc, stdout, stderr = _infill_bench(spark, tiny_links["fim"], corpus, "--md")
    line = next(x for x in stdout.splitlines() if x.startswith("infill:"))
    assert f"{inf['prompt_tokens']}-token prompt" in line and "CPU only" in line and " ms" in line


@pytest.mark.model
def test_infill_on_a_model_without_fim_tokens_is_one_line(spark, tiny_links, corpus) -> None:
    rc, stdout, stderr = _infill_bench(spark, tiny_links["plain"], corpus, "--json")
    assert rc == 0, stderr
    d = json.loads(stdout)
    assert d["infill"]["missing"] == ["prefix", "suffix", "middle"] and d["infill"]["prompt_tokens"] is None
    assert d["configs"][0]["status"] == "ok" and d["configs"][0]["infill_ttft_ms"] is None
    rc, stdout, stderr = _infill_bench(spark, tiny_links["plain"], corpus, "--md")
    lines = [x for x in stdout.splitlines() if x.startswith("infill:")]
    assert rc == 0 and len(lines) == 1 and lines[0] == d["infill"]["note"]
    assert "prefix token is missing. suffix token is missing. middle token is missing." in lines[0]


@pytest.mark.model
def test_without_infill_the_report_has_none(spark, tiny_links, corpus) -> None:
    rc, stdout, stderr = spark(tiny_links["fim"], "--corpus", corpus, "-p", "16", "-n", "4", "-r", "1", "-dev", "none",
                               "-nr", "-t", "1", "--no-learn", "--json")
    d = json.loads(stdout)
    assert rc == 0 and d["infill"] is None and d["configs"][0]["infill_ttft_ms"] is None
    assert d["configs"][0]["infill_seconds"] is None


def test_infill_with_the_ram_tier_is_refused(spark, small_model) -> None:
    rc, stdout, stderr = spark(small_model, "--infill", "--ram", "1GiB")
    assert rc == 2 and "--infill with --ram" in stderr
