"""Tables off a terminal: bench's and profile's tables rendered into a pipe at 80 columns (a log,
tee, CI) come out whole: no cell ellipsised or cropped, every cell's text on the page, wider
tables continued in a second one that repeats the label columns."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from _geometry import make_geometry
from rich.console import Console
from rich.table import Table
from rich.text import Text
from test_bench import _parallel_report, _wide_report

from spark_cli.commands import bench as bench_cmd
from spark_cli.commands import profile as profile_cmd
from spark_cli.commands.tables import Whole
from spark_cli.core.cost_model import Prediction
from spark_cli.core.profile import RoutingProfile
from spark_cli.core.simulator import simulate_rows
from spark_cli.core.trace import RoutingTrace

WIDTH = 80


@pytest.fixture
def pipe(monkeypatch):
    """A console on a file (not a terminal, as a pipe) with COLUMNS=80; read() -> its text so far."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    buf = io.StringIO()
    con = Console(file=buf, color_system=None)
    assert not con.is_terminal and con.width == WIDTH
    con.read = buf.getvalue  # type: ignore[attr-defined]
    return con


def _cells(table: Table) -> list[str]:
    """Each cell's text as printed (str cells are rich markup)."""
    return [Text.from_markup(c).plain if isinstance(c, str) else c.plain for col in table.columns for c in col.cells]


def _assert_whole(text: str, *tables: Table) -> None:
    assert "…" not in text, text
    boxed = [line for line in text.splitlines() if line[:1] in "┏┃┡│├└"]  # the summary lines soft-wrap
    assert boxed and max(len(line) for line in boxed) <= WIDTH, text
    for table in tables:
        for cell in _cells(table):
            assert cell in text, f"{cell!r} not whole in:\n{text}"


@pytest.fixture
def geo():
    """Qwen3-30B-A3B's shape: 48 MoE layers x 128 experts, top-8."""
    return make_geometry(n_layer=48, n_expert=128, k=8, dense=())


def test_bench_report_whole_in_a_pipe(geo, pipe) -> None:
    rep = _parallel_report(geo)
    for i, r in enumerate(rep.results):  # the cost model's predictions beside the measured rates
        r.config.predicted = Prediction(tg_us=1e6 / (40.0 + 10 * i), pp_us=1e6 / (1500.0 + 100 * i), stops=1 + 12 * i)
    bench_cmd.print_report(rep, pipe)
    text = pipe.read()
    tables = (bench_cmd.speed_table(rep), bench_cmd.prediction_table(rep), bench_cmd.accounting_table(rep),
              bench_cmd.parallel_table(rep))
    _assert_whole(text, *tables)
    assert "(continued)" in text  # too wide for 80 columns in one piece: continued, not cut
    for header in ("tg/ceiling", "tg pred/meas", "CPU MiB", "uploads/tok 4"):  # the right-hand columns are there
        assert header in text


def test_a_table_that_fits_stays_one_table(pipe) -> None:
    t = Table("configuration", "tg tok/s")
    t.add_row("Spark + cache", "1093.4 (1092.1-1095.9)")
    pipe.print(Whole(t))
    assert "(continued)" not in pipe.read() and pipe.read().count("┏") == 1


def test_continuations_repeat_the_label_columns(geo, pipe) -> None:
    rep = _wide_report(geo)
    pipe.print(Whole(bench_cmd.accounting_table(rep), keys=2))
    parts = pipe.read().split("per-token accounting")[1:]
    assert len(parts) >= 2
    for part in parts:
        header = next(line for line in part.splitlines() if line.startswith("┃"))
        assert header.split("┃")[1:3] == [" configuration              ", " phase "], header


def _trace(geo, n_rows: int = 600, seed: int = 0) -> RoutingTrace:
    """Skewed routing: each layer favours a few experts, half the rows decode."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(geo.n_expert, 0.3))
    ids = np.stack([np.stack([rng.choice(geo.n_expert, geo.n_expert_used, replace=False, p=p)
                              for _ in range(geo.n_layer)]) for _ in range(n_rows)]).astype(np.int16)
    phase = (np.arange(n_rows) >= n_rows // 2).astype(np.uint8)
    return RoutingTrace(ids, phase, np.arange(n_rows, dtype=np.int32), geo.n_expert, geo.fingerprint)


def test_profile_tables_whole_in_a_pipe(geo, pipe) -> None:
    trace = _trace(geo)
    train, test = trace.split(0.5)
    prof = RoutingProfile.empty(geo.identity()).add_trace(train, "test")
    profile_cmd._print_skew(prof.prefill, prof.decode, geo.n_expert_used, to=pipe)
    skew, _ = profile_cmd.skew_report(prof.decode, geo.n_expert_used, "routing skew per layer, decode routing")
    held = profile_cmd.held_out_report(train, test, geo, [0.25, 0.5, 0.75])
    pipe.print(Whole(held))
    real = profile_cmd.realism(prof, geo, {"/tmp/held-out.npz": test}, 0.5)
    realism = profile_cmd.realism_table(real, geo.n_expert_used)
    pipe.print(Whole(realism))
    bpe = {l.index: l.expert_bytes_per_expert for l in geo.layers if l.is_moe}
    rows = simulate_rows(trace, [8, 16, 32], ["lru", "lfu-aged", "belady"], pinned_from=None, bytes_per_expert=bpe,
                         k=geo.n_expert_used, miss_paths=["auto"])
    sim = profile_cmd.simulate_table(rows, "cache simulation of t.npz", staged=True)
    pipe.print(Whole(sim, keys=3))
    text = pipe.read()
    _assert_whole(text, skew, held, realism, sim)
    for header in ("entropy/max", "top-64 cov.", "cold-hit (oracle)", "staged/token"):
        assert header in text


def test_the_demos_closing_lines_say_what_it_showed(geo, tmp_path) -> None:
    """spark demo's last lines, from the files its steps wrote: the plan, the answer, the placement bench
    ran and its verdict, the RAM tier's line."""
    from spark_cli.commands import demo as demo_cmd
    from spark_cli.core import plan_file
    from spark_cli.core.planner import PlanRequest, plan_for

    plan_path = tmp_path / "demo-plan.json"
    budget = int(0.6 * geo.total_expert_bytes) + (2 << 30)
    made = plan_for(geo, PlanRequest(budget, 2048)).plan
    plan_file.save(made, plan_path)
    rep = _wide_report(geo)
    bench_path = tmp_path / "demo-bench.json"
    bench_path.write_text(json.dumps(rep.to_dict()), encoding="utf-8")
    lines = demo_cmd.closing_lines(plan_path, 0.6, "The capital city of France is Paris.\n", bench_path,
                                   "RAM tier: not compared here: why")
    assert len(lines) == 4
    plan, answer, verdict, ram = lines
    where = demo_cmd.Placement.of_plan(made)
    assert where.n_cached and where.n_moe == 48  # placed by hits: cached layers
    cold = "" if made.predicted_cold_hit is None else f", predicted cold-hit {100 * made.predicted_cold_hit:.1f}%"
    assert plan == f"plan: 60% of the expert bytes on the device, placed by hits (no device costs): {where.words()}{cold}"
    assert answer == "answer: 'The capital city of France is Paris.'"
    spark, stock = (next(r for r in rep.results if r.config.name == n) for n in ("spark", rep.baseline))
    ran = demo_cmd.Placement(48, (), 0)  # the report's Spark: every layer resident
    assert verdict.startswith(f"bench: Spark ran another placement than the plan above ({ran.words()}): "
                              f"{spark.tg.median:.1f} tok/s, {spark.ratios['tg_vs_stock']:.2f}x the best stock "
                              f"offload ({stock.config.label}, "), verdict
    target = rep.targets()["tg_vs_stock"]
    assert verdict.endswith(f"the {target['target']:g}x target {'met' if target['met'] else 'not met'}")
    assert ram == "RAM tier: not compared here: why"
    # a step that wrote nothing: said so, no traceback
    assert demo_cmd.closing_lines(tmp_path / "none.json", 0.6, None, tmp_path / "none.json") == \
        ["plan: not written", "answer: none"]
