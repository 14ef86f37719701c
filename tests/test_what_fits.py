"""scripts/what_fits.py's three-tier table (issue 45): per fixture, VRAM and RAM, the shares of the expert
bytes served from the device, RAM and the file add up to the whole, the RAM the weights take stays within
what they may use, a RAM too small is the planner's one line, and docs/what-fits.md's tables are what the
script prints (the three-tier table's command line read from the doc), one fixture each."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from spark_cli.core.gguf_info import load_geometry
from spark_cli.core.planner import plan_for
from spark_cli.core.units import GiB
from spark_cli.errors import PlanError
from spark_cli.models.fixtures import FIXTURES, build_fixture

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "what-fits.md"
FIXTURE = "gpt-oss-120b-mxfp4"  # bigger than 32 GiB of RAM, not than 64: both kinds of cell, and quick to plan


@pytest.fixture(scope="module")
def wf():
    spec = importlib.util.spec_from_file_location("what_fits", REPO / "scripts" / "what_fits.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # NOTE: its dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fixtures")
    build_fixture(FIXTURE, out_dir=d)
    return d


def _doc_command() -> list[str]:
    """The arguments of the doc's command line for the three-tier table (the one with --ram)."""
    found = re.findall(r"scripts/what_fits\.py ([^`\n]*--ram [^`\n]*)", DOC.read_text(encoding="utf-8"))
    assert len(found) == 1, f"docs/what-fits.md names the three-tier table's command once: {found}"
    return shlex.split(found[0])


def _sizes(args: list[str], flag: str) -> list[int]:
    return [int(float(x) * GiB) for x in args[args.index(flag) + 1].split(",")]


def test_shares_add_up_and_ram_stays_within_the_ram(wf, fixture_dir) -> None:
    args = _doc_command()
    g = load_geometry(build_fixture(FIXTURE, out_dir=fixture_dir))
    a = wf.main_parser().parse_args(args)
    predict, assume = wf.predict_settings(a), wf.assumptions(a)
    cells = [wf.ram_cell(g, vram, ram, a.ctx, assume, predict)
             for vram in _sizes(args, "--vram") for ram in _sizes(args, "--ram")]
    for c in cells:
        assert c.error is None, c.error
        assert c.device + c.in_ram + c.in_file == pytest.approx(1.0, abs=1e-9)
        assert min(c.device, c.in_ram, c.in_file) >= 0
        assert c.budget == c.ram - assume.os_ram
        assert 0 < c.ram_used <= c.budget
        assert (c.in_file > 0) == (c.tier is not None) == (c.misses > 0)
        if c.tier is not None:  # the file's share is what the RAM tier's slots leave of its layers
            held = sum(l.n_slots * l.expert_bytes for l in c.tier.layers)
            assert c.in_file * g.total_expert_bytes == pytest.approx(c.tier.total_expert_bytes - held)
            assert c.ram_used > c.budget - sum(l.expert_bytes for l in c.tier.layers)  # the banks are counted
            assert c.tg < c.plan.predicted["tg_tok_s"]  # the file reads cost time
        else:
            assert c.tg == c.plan.predicted["tg_tok_s"]
    assert any(c.tier is not None for c in cells) and any(c.tier is None for c in cells)


def test_a_ram_too_small_is_the_planners_one_line(wf, fixture_dir) -> None:
    g = load_geometry(build_fixture(FIXTURE, out_dir=fixture_dir))
    assume = wf.RamAssumptions(os_ram=4 * GiB, disk_gb_s=3.0)
    ram = 6 * GiB  # 2 GiB for the weights: not the embeddings, staging and k slots a host layer
    with pytest.raises(PlanError) as e:
        plan_for(g, wf.request(g, 16 * GiB, wf.DEFAULT_CTX, None, ram_bytes=assume.weights_budget(ram)))
    c = wf.ram_cell(g, 16 * GiB, ram, wf.DEFAULT_CTX, assume)
    assert c.error == e.value.message and "\n" not in c.error
    row = wf.ram_row(g, "x", 16 * GiB, [c], predict=False)
    assert row.startswith(f"| x | 16 GiB | 6 GiB | does not fit: {e.value.message} |")
    assert row.count("|") == wf.ram_table_header(False)[0].count("|")


def _assert_rows_in_doc(printed: list[str], title: str) -> None:
    """The table the script printed (one fixture's rows) stands in docs/what-fits.md under the same header."""
    doc = DOC.read_text(encoding="utf-8").splitlines()
    table = [line for line in printed if line.startswith("|")]
    header, rule, rows = table[0], table[1], table[2:]
    assert rows and rows[0].startswith(f"| {title} (")
    start = doc.index(header)  # the table's header and rule, then this fixture's rows in order
    assert doc[start + 1] == rule
    at = doc.index(rows[0], start)
    assert doc[at:at + len(rows)] == rows, "docs/what-fits.md's rows differ from the script's: regenerate it"
    assert not (doc + [""])[at + len(rows)].startswith("|  |")  # and it has no more of them


def test_the_docs_three_tier_table_is_what_the_script_prints(wf, fixture_dir, capsys) -> None:
    """The doc's assumption lines and this fixture's rows, as the doc's command prints them now."""
    assert wf.main([*_doc_command(), "--fixtures", FIXTURE, "--out-dir", str(fixture_dir)]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    doc = DOC.read_text(encoding="utf-8").splitlines()
    for line in printed:
        if not line.startswith("|"):  # the assumptions: the table's first lines
            assert line in doc, f"docs/what-fits.md lacks the script's line:\n{line}"
    _assert_rows_in_doc(printed, FIXTURES[FIXTURE].title)


def test_the_docs_first_table_is_what_the_script_prints(wf, tmp_path, capsys) -> None:
    """The one-tier table (the script without --ram): one of its fixtures, at the script's default budgets."""
    name = "gpt-oss-20b-mxfp4"
    assert wf.main(["--fixtures", name, "--out-dir", str(tmp_path)]) == 0
    _assert_rows_in_doc(capsys.readouterr().out.splitlines(), FIXTURES[name].title)


def test_pcie_gives_the_card_its_slots_link_and_a_bad_one_is_one_line(wf) -> None:
    a = wf.main_parser().parse_args(["--predict-for", "rtx-4060-ti-16gb", "--pcie", "3x8"])
    card = wf.predict_settings(a)["card"]
    assert card.link_gb_s == pytest.approx(8 * 0.985) and card.link_given == "--pcie 3x8"
    assert wf.predict_settings(wf.main_parser().parse_args(["--predict-for", "rtx-4060-ti-16gb"]))["card"].link_gb_s \
        == pytest.approx(8 * 1.969)
    with pytest.raises(SystemExit, match="--pcie '4x3': 3 lanes is not one of"):
        wf.predict_settings(wf.main_parser().parse_args(["--predict-for", "rtx-4060-ti-16gb", "--pcie", "4x3"]))
