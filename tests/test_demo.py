"""spark demo's last step, the RAM tier's capped comparison (issue 45), and `spark demo-model`'s stdout.
Its plan and bench steps: tests/test_one_planner.py; its closing lines: tests/test_tables.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli_runner
from test_ram_tier import _cgroup_or_skip

from spark_cli.commands import bench_ram
from spark_cli.commands import demo as demo_cmd
from spark_cli.core import units
from spark_cli.core.gguf_info import load_geometry
from spark_cli.runs import ram_bench

MiB = 1 << 20


@pytest.mark.model
def test_the_demo_shows_the_capped_comparison(small_model, monkeypatch, capsys, tmp_path) -> None:
    """spark demo --quick's last step for real on the small model (its other steps, tested elsewhere,
    stubbed): spark bench --ram's comparison under the cap where Spark's RAM tier holds RAM_RESIDENCY of
    the expert bytes, each run in its own memory cgroup; the verdict line (bench_ram.verdict of the runs
    it wrote) shown and closing the demo, its JSON written beside the demo's outputs."""
    from spark_cli.models import demo_model

    _cgroup_or_skip()
    model = tmp_path / Path(small_model).name
    model.symlink_to(small_model)  # NOTE: no profile beside it: nothing else's, none left
    home = tmp_path / "home"
    monkeypatch.setenv("SPARK_HOME", str(home))
    monkeypatch.setattr(demo_model, "build_demo_model", lambda **kw: model)
    monkeypatch.setattr(demo_cmd, "run_argv", lambda root, argv: 0)
    monkeypatch.setattr(demo_cmd, "time_device", lambda *a: "device costs: not timed (a test)")
    rc, out, err = cli_runner(monkeypatch, capsys, "demo", demo_cmd.register)("--rpc", "127.0.0.1:1", "--quick")
    assert rc == 0, err
    d = json.loads((home / "demo" / "demo-ram-bench.json").read_text())
    runs = [ram_bench.RamRun(**r) for r in d["runs"]]
    assert [r.config for r in runs if r.ok] == list(demo_cmd.RAM_CONFIGS), [r.error for r in runs]
    spark = next(r for r in runs if r.config == "spark")
    assert abs(spark.resident_share - demo_cmd.RAM_RESIDENCY) < 0.1, spark.tier  # the cap is the model's
    verdict = bench_ram.verdict(ram_bench.RamBench(d["cap"], runs))
    assert verdict.startswith(f"under {units.fmt_bytes(d['cap'])}: Spark ") and "stock's" in verdict
    q = demo_cmd.QUICK
    line = (f"RAM tier (a short run, {q.ram_reps} of each at -p {q.ram_prompt} -n {q.ram_gen}; the full "
            f"comparison: spark bench {model} --ram {-(-d['cap'] // MiB)}MiB): {verdict}")
    closing = out[out.rindex("done"):].splitlines()
    assert line in closing, out
    assert "demo-ram-bench.json" in next(l for l in closing if l.startswith("outputs in"))


@pytest.mark.parametrize("error,rc,said", [
    ("cgroup", 0, "RAM tier: not compared here: cannot make a memory cgroup under /x (Permission denied) ("),
    ("other", 1, "RAM tier: failed: the uncapped run failed (it did) (rerun it)"),
], ids=["no-cgroup", "another-error"])
def test_the_demos_ram_step_says_why_it_did_not_compare(error, rc, said, small_model, monkeypatch, capsys,
                                                       tmp_path) -> None:
    """No memory cgroup: one line with why and how to get one, and the demo succeeds; another error:
    the closing lines still come, that line ends them, the exit status is the error's. No JSON either way
    (an earlier run's is removed)."""
    from spark_cli.errors import SparkError
    from spark_cli.models import demo_model
    from spark_cli.runs import memcg

    def refuse(*a, **kw):
        if error == "cgroup":
            raise memcg.CgroupError("cannot make a memory cgroup under /x (Permission denied)", hint=memcg.HOW)
        raise SparkError("the uncapped run failed (it did)", hint="rerun it")

    home = tmp_path / "home"
    (home / "demo").mkdir(parents=True)
    (home / "demo" / "demo-ram-bench.json").write_text("{}")
    monkeypatch.setenv("SPARK_HOME", str(home))
    monkeypatch.setattr(demo_model, "build_demo_model", lambda **kw: Path(small_model))
    monkeypatch.setattr(demo_cmd, "run_argv", lambda root, argv: 0)
    monkeypatch.setattr(demo_cmd, "time_device", lambda *a: "device costs: not timed (a test)")
    monkeypatch.setattr(ram_bench, "run", refuse)
    got, out, err = cli_runner(monkeypatch, capsys, "demo", demo_cmd.register)("--rpc", "127.0.0.1:1", "--quick")
    assert got == rc, err
    closing = out[out.rindex("done"):].splitlines()
    assert [l for l in closing if l.startswith("RAM tier")] == [said + (memcg.HOW + ")" if error == "cgroup" else "")]
    assert closing[-1].startswith("outputs in") and "demo-ram-bench.json" not in closing[-1]
    assert not (home / "demo" / "demo-ram-bench.json").exists() and "Traceback" not in err


def test_demo_model_fixture_prints_only_its_path(monkeypatch, capsys, tmp_path) -> None:
    """README: F=$(spark demo-model --fixture NAME) takes stdout whole: the path is its only line (the
    size note goes to stderr)."""
    run = cli_runner(monkeypatch, capsys, "demo-model", demo_cmd.register)
    rc, out, err = run("--fixture", "gpt-oss-20b-mxfp4", "--out-dir", tmp_path)
    assert rc == 0, err
    assert out.splitlines() == [out.strip()] and Path(out.strip()).parent == tmp_path
    assert load_geometry(out.strip()).arch == "gpt-oss" and "on disk" in err
