"""Hostile input, round two (issue 22): outputs that would replace inputs, reads that hang,
tracebacks, hand-edited plans and traces, exit codes. Fast tier; the server's cases are in
test_serve_hostile.py, the prompt-between-contexts case in test_chat.py."""

from __future__ import annotations

import os

import pytest

from conftest import cli_runner


# ---------------------------------------------------------------- 2. an output never replaces an input


@pytest.mark.parametrize("spelling", ["same", "relative", "symlink", "hardlink", "profile"])
def test_plan_output_that_is_an_input_is_refused(monkeypatch, capsys, tmp_path, spelling):
    from spark_cli.commands import plan

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF not really a model")
    if spelling == "same":
        out = model
    elif spelling == "relative":
        monkeypatch.chdir(tmp_path)
        out = "./sub/../m.gguf"
        (tmp_path / "sub").mkdir()
    elif spelling == "symlink":
        out = tmp_path / "link.json"
        out.symlink_to(model)
    elif spelling == "hardlink":
        out = tmp_path / "hard.json"
        os.link(model, out)
    else:  # the profile beside the model
        out = tmp_path / "m.gguf.spark-profile.json"
        out.write_text("{}")
    before = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    run = cli_runner(monkeypatch, capsys, "plan", plan.register)
    rc, stdout, err = run(model, "--vram", "2GiB", "-o", out)
    assert rc == 2 and "this run reads" in err and "Traceback" not in err, err
    assert {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


# ---------------------------------------------------------------- 1. an internal abort is not a device loss


def test_internal_abort_is_not_blamed_on_a_live_server_or_the_device(monkeypatch):
    import socket

    from spark_cli.errors import DeviceLostError
    from spark_cli.native import faults

    msg = "/x/llama-context.cpp:1021: GGML_ASSERT(n_tokens_all <= cparams.n_batch) failed"
    monkeypatch.setattr(faults, "_endpoints", [])
    e = faults.describe(msg)  # -dev none: no device error in the message
    assert not isinstance(e, DeviceLostError) and "nvidia-smi" not in e.one_line()
    assert e.one_line().startswith("internal error: llama.cpp aborted: GGML_ASSERT(n_tokens_all <= "
                                   "cparams.n_batch) failed at llama-context.cpp")
    with socket.socket() as live:  # an RPC server that still answers
        live.bind(("127.0.0.1", 0))
        live.listen()
        monkeypatch.setattr(faults, "_endpoints", [f"127.0.0.1:{live.getsockname()[1]}"])
        e = faults.describe(msg)
        assert not isinstance(e, DeviceLostError) and "lost" not in e.one_line() and "GGML_ASSERT" in e.message
    monkeypatch.setattr(faults, "_endpoints", [])
    assert isinstance(faults.describe("/x/ggml-cuda.cu:88: CUDA error"), DeviceLostError)
