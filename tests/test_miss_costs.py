"""The auto miss path's calibration arithmetic (runs/miss_path.py): the per-token part of a
missed expert's CPU time from a decode step and a prompt step, and the integer costs a layer gets."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from spark_cli.core.simulator import MissCosts
from spark_cli.native.expert_cache import CacheStats
from spark_cli.native.llama_lib import Device
from spark_cli.runs.miss_path import (Calibration, LayerCost, LayerSample, device_key, initial_path, per_token_us,
                                      pooled_costs)


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
        Calibration.from_dict({**cal.to_dict(), "version": 3})  # an older calibration is measured again


def _sample(nb: int, up: tuple[int, int] | None, dec: tuple[int, int] | None,
            prompt: tuple[int, int, int] | None) -> LayerSample:
    """A layer's counters: upload (us, misses), cpu decode (us, experts), cpu prompt (us, experts, entries)."""
    u = CacheStats(upload_us=up[0], misses=up[1], blocking_upload_bytes=nb * up[1]) if up else None
    c = CacheStats(cpu_us=dec[0], cpu_experts=dec[1], cpu_expert_bytes=nb * dec[1]) if dec else None
    p = CacheStats(cpu_us=prompt[0], cpu_experts=prompt[1], cpu_entries=prompt[2],
                   cpu_expert_bytes=nb * prompt[1]) if prompt else None
    return LayerSample(u, c, p)


def test_costs_are_pooled_per_expert_shape():
    big, small = 6 << 20, 2 << 20
    costs = pooled_costs({
        # one shape, three layers: alone, layer 0's prompt step says 0 per token and layer 1's decode
        # says 500 us; summed, the shape costs (400 + 100 * 3) / 4 = 175 us at decode
        0: _sample(big, (800, 1), (400, 1), (300, 3, 3 * 1)),  # 3 experts, one token each
        1: _sample(big, (1000, 2), (100, 1), (2000, 2, 20)),
        2: _sample(big, (900, 3), (300, 2), None),
        # another shape: priced from its own layers only
        3: _sample(small, (200, 2), (100, 2), (500, 2, 10)),
        # a layer that saw no miss on any path: no costs (the cpu side)
        4: LayerSample(None, None, None),
    })
    assert costs[0] == costs[1] == costs[2]
    c = costs[0]
    assert c.upload_us == pytest.approx(2700 / 6) and c.cpu_us == pytest.approx(800 / 4)
    # the prompt steps summed: 5 experts, 23 tokens, 2300 us; d = 200 = a + b, 5 a + 23 b = 2300
    assert c.cpu_token_us == pytest.approx((2300 - 5 * 200) / (23 - 5))
    assert c.costs().cpu_ns > 0  # layer 0 alone would never stage a prompt's expert
    assert per_token_us(400.0, PromptStats(300.0, 3, 3)) is None
    s = costs[3]
    assert (s.upload_us, s.cpu_us) == (100.0, 50.0) and s.cpu_token_us == pytest.approx((500 - 2 * 50) / 8)
    assert costs[4] == LayerCost(None, None) and costs[4].costs() == MissCosts()


def test_a_stand_in_calibration_is_reused_on_another_port():
    rpc = Device(0, "RPC0", "127.0.0.1:40001", "GPU", 1 << 30, 1 << 30, 0)
    again = Device(0, "RPC0", "127.0.0.1:40002", "GPU", 1 << 30, 1 << 30, 0)
    assert device_key(rpc) == device_key(again) == "RPC0 127.0.0.1"
    vk = Device(0, "Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "GPU", 1 << 30, 1 << 30, 0)
    assert device_key(vk) == "Vulkan0 llvmpipe (LLVM 15.0.6, 256 bits)"
