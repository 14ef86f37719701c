"""`spark bench`: every configuration end to end on the RPC stand-in GPU, the JSON report,
ratios from the medians, "does not fit" instead of a failure, the pure report math."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from conftest import cli_runner

from spark_cli.runs import bench
from spark_cli.core import planner
from spark_cli.commands import bench as bench_cmd
from spark_cli.core.gguf_info import load_geometry
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
def test_every_configuration_end_to_end(spark, model_link, corpus, rpc_server, tmp_path) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc, stdout, stderr = spark(model_link, "--rpc", rpc_server.endpoint, "--residency", "0.6", "--ceiling",
                               "--corpus", corpus, *SMALL, "-r", "2", "-o", out, "--plot", png)
    assert rc == 0, stderr
    d = json.loads(out.read_text())
    by = {c["name"]: c for c in d["configs"]}
    assert list(by) == list(bench.DEFAULT_CONFIGS)
    for name, c in by.items():
        assert c["status"] == "ok", (name, c["reason"])
        assert len(c["runs"]) == 2 and all(r["tg_tokens"] == 8 and r["pp_tokens"] == 32 for r in c["runs"])
    assert by["resident"]["over_budget"] and by["resident"]["vram_planned_bytes"] > d["budget_bytes"]
    for name in ("cpu-moe", "n-cpu-moe", "spark-step", "spark"):
        assert by[name]["vram_planned_bytes"] <= d["budget_bytes"], name

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
    n_moe = d["model"]["n_moe_layers"]
    assert by["resident"]["cold_hit"] == 0 and by["cpu-moe"]["cold_hit"] == 1
    assert by["n-cpu-moe"]["cold_hit"] == pytest.approx(len(by["n-cpu-moe"]["placement"]["host_layers"]) / n_moe)
    for name in ("spark-step", "spark"):
        c = by[name]
        assert 0 < c["bank_bytes"] and c["decode_tokens"] == 16
        # every miss is uploaded (blocking) or computed on the CPU; admissions are uploads too
        assert c["uploads_per_token"] == pytest.approx(c["uploads"] / 16)
        assert c["cpu_expert_bytes_per_token"] >= 0 and c["syncs_per_token"] >= 1
        assert c["blocking_upload_bytes_per_token"] + c["async_upload_bytes_per_token"] == \
            pytest.approx(c["bytes_per_token"])
        assert c["cold_hit"] == pytest.approx(c["misses"] / (16 * d["model"]["n_expert_used"] * n_moe))
        assert 0.5 < c["placement"]["expert_residency"] <= 0.6 + 1e-9
    # the cache is exact: Spark generates the all-resident run's tokens
    assert by["spark"]["tokens_digest"] == by["resident"]["tokens_digest"]

    # the prompt phase apart: the prompt evals' counters per prompt token (one read-back per eval)
    for name in ("spark-step", "spark"):
        c, p = by[name], by[name]["prompt_cache"]
        assert c["prompt_tokens"] == 64 and set(p) >= {"syncs", "uploads", "staged_uploads"}
        for counter in bench.PROMPT_ACCOUNTING:
            extra = 2 if counter == "syncs" else 0
            assert c[f"{counter}_per_prompt_token"] == pytest.approx((p[counter] + extra) / 64), (name, counter)
        for counter in ("staged_uploads", "staged_upload_bytes"):
            assert c[f"{counter}_per_token"] == pytest.approx(c[counter] / 16)
    assert by["resident"]["syncs_per_prompt_token"] == pytest.approx(2 / 64)
    assert by["resident"]["blocking_upload_bytes_per_prompt_token"] == 0 and by["resident"]["prompt_cache"] is None
    assert by["cpu-moe"]["cpu_expert_bytes_per_prompt_token"] is None  # stock prompt offload: not modelled

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Spark + cache" in stdout and "tg/stock" in stdout
    prof = json.loads(profile_path_for(model_link).read_text())  # bench folded its decode counts
    assert prof["tokens_decode"] > 0 and "spark bench" in prof["sources"]


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
    speeds, acc = bench.to_markdown(rep).split("\n\n")
    assert speeds.count("\n") == 5 and "2.25x" in speeds and "90.0 (1.0-95.0)" in speeds
    assert acc.count("\n") == 1 + 2 * 4  # header, rule, a tg and a pp row per configuration
    assert [line.split(" | ")[1] for line in acc.splitlines()[2:]] == ["tg", "pp"] * 4


class _FakeEngine:
    """Tokens are characters; BOS is 1; a chat renders as 'role: content' lines."""

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

    def res(name: str, label: str, kind: str, pp: list[float], tg: list[float], host: tuple = ()) -> bench.Result:
        runs = [bench.Run(512, 512 / p, 128, 128 / t) for p, t in zip(pp, tg)]
        r = bench.Result(bench.Config(name, label, kind, host_layers=host, planned_bytes=123 << 30), status="ok",
                         runs=runs, decode_tokens=128 * len(runs))
        if kind == "spark":
            r.miss_path = "cpu 10, upload 14"
            r.cache = CacheStats(uploads=800, syncs=3000, blocking_upload_bytes=300 << 22,
                                 async_upload_bytes=500 << 22, cpu_expert_bytes=90 << 22, staged_uploads=40,
                                 staged_upload_bytes=40 << 22)
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


def test_both_tables_fit_120_columns_with_whole_headers(geo) -> None:
    from rich.console import Console

    rep = _wide_report(geo)
    for table, must in ((bench_cmd.speed_table(rep), ("pp tok/s", "tg tok/s", "tg/stock", "tg/ceiling")),
                        (bench_cmd.accounting_table(rep), ("syncs", "blocking", "async", "staged", "CPU", "cold-hit"))):
        con = Console(width=120, record=True, color_system=None)
        con.print(table)
        text = con.export_text()
        assert "…" not in text, text
        lines = [line.rstrip() for line in text.splitlines()]
        assert max(len(line) for line in lines) <= 120, text
        boxed = [line for line in lines if line[:1] in "┏┃┡│├└"]
        assert len(boxed) >= 8 and all(line[-1] in "┓┃┩│┤┘" for line in boxed), text  # not cropped at 120
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
