"""The auto miss path's calibration arithmetic (runs/miss_path.py): the per-token part of a
missed expert's CPU time from a decode step and a prompt step, and the integer costs a layer gets."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from spark_cli.core.simulator import MissCosts
from spark_cli.runs.miss_path import Calibration, LayerCost, initial_path, per_token_us


@dataclass
class PromptStats:  # the counters per_token_us reads (CacheStats has them among others)
    cpu_us: float
    cpu_experts: int
    cpu_entries: int


def test_per_token_part_solves_both_steps():
    # a = 60 us per expert, b = 40 us per token: decode 100 us; a prompt step of 5 experts with 20
    # tokens takes 5 * 60 + 20 * 40 = 1100 us
    assert per_token_us(100.0, PromptStats(1100.0, 5, 20)) == pytest.approx(40.0)
    # the part is clamped to [0, decode]: a prompt step slower than decode per token says all of it
    assert per_token_us(100.0, PromptStats(5000.0, 5, 20)) == pytest.approx(100.0)
    assert per_token_us(100.0, PromptStats(100.0, 5, 20)) == pytest.approx(0.0)
    # no expert with more than one token, or nothing measured: unknown
    assert per_token_us(100.0, PromptStats(500.0, 5, 5)) is None
    assert per_token_us(None, PromptStats(1100.0, 5, 20)) is None
    assert per_token_us(100.0, None) is None


def test_layer_costs_are_integer_ns():
    c = LayerCost(upload_us=380.0, cpu_us=100.0, cpu_token_us=40.0).costs()
    assert c == MissCosts(cpu_ns=40_000, upload_ns=380_000, cpu_expert_ns=60_000)
    assert c.cpu(1) == 100_000 and c.cpu(10) == 460_000
    # without a prompt step's figure, all of the decode time grows per token
    assert LayerCost(380.0, 100.0).costs() == MissCosts(cpu_ns=100_000, upload_ns=380_000)
    # a side never measured is never chosen: no CPU cost, nothing staged
    assert LayerCost(None, 100.0).costs() == MissCosts() == LayerCost(380.0, None).costs()


def test_calibration_round_trips_and_names_both_rules():
    cal = Calibration("RPC0 stand-in", "f" * 16, {3: LayerCost(380.0, 100.0, 40.0), 5: LayerCost(200.0, 300.0)}, 2)
    again = Calibration.from_dict(cal.to_dict())
    assert again == cal and again.costs()[3].cpu_expert_ns == 60_000
    assert cal.choose() == {3: "cpu", 5: "upload"}  # the per-layer rule
    assert cal.why().startswith("miss path layer:") and cal.why_auto().startswith("miss path auto:")
    assert (initial_path("auto"), initial_path("layer"), initial_path("upload")) == ("cpu", "cpu", "upload")
    with pytest.raises(ValueError):
        Calibration.from_dict({**cal.to_dict(), "version": 2})  # an older calibration is measured again
