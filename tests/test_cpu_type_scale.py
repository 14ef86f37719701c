"""A CPU calibration carried over to another model's expert types (native/cpu_matmul.py,
runs/host_calibration.py): ggml's CPU mul_mat_id is timed by type, a type it cannot quantize
without an importance matrix is not timed, and `--predict-for` on a model other than the
calibrated one scales the kept rate by the two models' type rates and says so."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_runner

from spark_cli.commands import plan as plan_cmd
from spark_cli.core.gguf_info import load_geometry
from spark_cli.errors import NativeError
from spark_cli.models.fixtures import build_fixture
from spark_cli.native import cpu_matmul
from spark_cli.runs import host_calibration


def test_ggml_times_a_type_and_refuses_what_it_cannot_quantize() -> None:
    r = cpu_matmul.expert_rate("Q4_K", 600_000, 1)
    assert r is not None and r.ggml_type == "Q4_K" and r.threads == 1 and r.gb_s > 0
    assert abs(r.expert_bytes - 600_000) <= 2048 / 256 * 144  # whole rows of 2048 weights
    assert cpu_matmul.expert_rate("IQ2_XXS", 600_000, 1) is None  # needs an importance matrix
    for t in ("Q8_K", "I8", "F64"):  # types gguf names that ggml_quantize_chunk does not make
        assert cpu_matmul.expert_rate(t, 600_000, 1) is None, t
    with pytest.raises(NativeError, match="'Q4_9' is not one gguf knows"):
        cpu_matmul.type_id("Q4_9")


def test_tiny_and_huge_experts_are_timed_without_outgrowing_the_context() -> None:
    """A tiny model's 6 KB experts once needed more work buffers than the context had (ggml_new_object
    returned NULL: a segfault); a 16 MB expert is a pool of a few dozen. Run apart: a crash is a
    failure here, not the end of the test session."""
    code = ("from spark_cli.native import cpu_matmul as c\n"
            "for t, n in (('Q4_K', 6000), ('MXFP4', 6500), ('Q4_K', 16 * 2**20)):\n"
            "    r = c.expert_rate(t, n, 1)\n"
            "    assert r is not None and r.gb_s > 0, (t, n, r)\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_mix_is_its_bytes_over_each_types_time() -> None:
    rates = {"Q4_K": 20.0, "Q6_K": 10.0}

    def rate(t, nbytes, threads):
        return cpu_matmul.TypeRate(t, nbytes, threads, rates[t])

    # 2 MB at 20 GB/s (100 us) and 1 MB at 10 GB/s (100 us): 3 MB in 200 us
    assert cpu_matmul.mix_rate({"Q4_K": 2e6, "Q6_K": 1e6}, 4, rate) == pytest.approx(15.0)
    assert cpu_matmul.mix_rate({"Q4_K": 2e6, "IQ1_S": 1e6}, 4,
                               lambda t, n, th: None if t == "IQ1_S" else rate(t, n, th)) is None


def _keep(home: Path, model: Path, cpu_us: float, threads: int) -> None:
    g = load_geometry(model)
    (home / "calibration").mkdir(parents=True, exist_ok=True)
    body = {"fingerprint": g.fingerprint, "costs": {"threads": threads, "miss_cpu_us": cpu_us}, "samples": []}
    (home / "calibration" / "device-costs-00000000000000aa.json").write_text(json.dumps(body))


def test_a_calibration_is_carried_to_another_models_expert_types(tmp_path, monkeypatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("SPARK_HOME", str(home))
    calibrated = build_fixture("gpt-oss-20b-mxfp4", out_dir=home / "models")
    target = load_geometry(build_fixture("qwen3.6-35b-a3b-q4_k_m", out_dir=tmp_path / "other"))
    _keep(home, calibrated, 1000.0, 2)
    same = host_calibration.measured_host(home)
    mix = host_calibration.expert_mix(target)
    assert set(mix) == {"Q4_K", "Q6_K"} and set(host_calibration.expert_mix(load_geometry(calibrated))) == {"MXFP4"}
    planted = {"MXFP4": 10.0, "Q4_K": 20.0, "Q6_K": 20.0}  # every Q4_K_M byte twice an MXFP4 one's speed
    rate = lambda t, n, th: cpu_matmul.TypeRate(t, n, th, planted[t])  # noqa: E731
    h = host_calibration.measured_host(home, target, rate=rate)
    assert h.cores == 2 and h.measured_gb_s == pytest.approx(same.measured_gb_s * 2.0)
    assert "x2.00 for this model's Q4_K/Q6_K experts over its MXFP4" in h.measured_source
    assert host_calibration.measured_host(home, load_geometry(calibrated), rate=rate) == same  # its own model
    assert host_calibration.same_types({"Q4_K": 2.0, "Q6_K": 1.0}, {"Q4_K": 4.01, "Q6_K": 2.0})
    assert not host_calibration.same_types({"Q4_K": 2.0, "Q6_K": 1.0}, {"Q4_K": 3.0, "Q6_K": 1.0})

    def must_not_time(t, n, th):
        raise AssertionError("timed experts of the calibrated types")

    twin = dataclasses.replace(load_geometry(calibrated), fingerprint="another file of the same types")
    assert host_calibration.measured_host(home, twin, rate=must_not_time) == same
    untimed = host_calibration.measured_host(home, target, rate=lambda t, n, th: None)
    assert untimed.measured_gb_s == same.measured_gb_s and "not scaled" in untimed.measured_source


def test_predict_for_says_the_calibration_was_carried_over(tmp_path, monkeypatch, capsys) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("SPARK_HOME", str(home))
    plan = cli_runner(monkeypatch, capsys, "plan", plan_cmd.register)
    _keep(home, build_fixture("gpt-oss-20b-mxfp4", out_dir=home / "models"), 1000.0, 1)
    model = build_fixture("qwen3.6-35b-a3b-q4_k_m", out_dir=tmp_path / "other")
    rc, out, err = plan(model, "--predict-for", "rtx-5060-ti-16gb", "-c", "4096")
    assert rc == 0, err
    line = next(l for l in out.splitlines() if l.strip().startswith("measured: this CPU's experts at"))
    assert "for this model's Q4_K/Q6_K experts over its MXFP4 (this CPU's ggml mul_mat_id by type)" in line
