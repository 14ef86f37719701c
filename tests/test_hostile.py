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


# ---------------------------------------------------------------- 6. reads that hang or never end


def test_fifo_and_dev_zero_in_the_corpus_are_skipped_and_named(tmp_path):
    import threading

    from spark_cli.core.profile import RoutingProfile
    from spark_cli.errors import ProfileError
    from spark_cli.files.corpus import read_corpus

    (tmp_path / "good.txt").write_text("some text to profile")
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "zero.md").symlink_to("/dev/zero")
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("c", read_corpus(tmp_path)), daemon=True)
    t.start()
    t.join(20)
    assert "c" in done, "read_corpus blocked (FIFO) or ran without end (/dev/zero)"
    c = done["c"]
    assert [d.text for d in c.documents] == ["some text to profile"]
    why = {p.name: w for p, w in c.unreadable}
    assert "FIFO" in why["pipe.txt"] and "device" in why["zero.md"], why
    os.mkfifo(tmp_path / "m.gguf.spark-profile.json")  # the profile beside the model
    with pytest.raises(ProfileError, match="FIFO"):
        RoutingProfile.load(tmp_path / "m.gguf.spark-profile.json")


# ---------------------------------------------------------------- 7. one line, not a traceback


def _trace(tmp_path, name, **kw):
    import numpy as np

    base = dict(ids=np.zeros((4, 2, 2), np.int16), phase=np.ones(4, np.uint8), step=np.arange(4, dtype=np.int32),
                n_expert=np.int64(4), fingerprint=np.str_("c" * 64), format=np.str_("spark-trace"),
                version=np.int64(1))
    base.update(kw)
    path = tmp_path / f"{name}.npz"
    np.savez(path, **base)
    return path


@pytest.mark.parametrize("case", ["k0", "array-n_expert", "ids-past-int16", "phase-past-uint8", "float-ids"])
def test_malformed_trace_is_one_line_in_simulate(monkeypatch, capsys, tmp_path, case):
    import numpy as np

    from spark_cli.commands import profile

    kw = {"k0": dict(ids=np.zeros((4, 2, 0), np.int16)), "array-n_expert": dict(n_expert=np.array([4, 4])),
          "ids-past-int16": dict(ids=np.full((4, 2, 2), 65536 + 3, np.int64)),  # would wrap to expert 3
          "phase-past-uint8": dict(phase=np.full(4, 257, np.int64)),  # would wrap to decode
          "float-ids": dict(ids=np.full((4, 2, 2), 1.5))}[case]
    run = cli_runner(monkeypatch, capsys, "profile", profile.register)
    rc, out, err = run("simulate", _trace(tmp_path, case, **kw), "--slots", "2")
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 5 and len(lines) == 1 and "Traceback" not in err and "invalid routing trace" in err, err


# ---------------------------------------------------------------- 8. hand-edited plans


def _plan_dict():
    import json

    from spark_cli.core.planner import BREAKDOWN_KEYS

    return {**json.loads(_PLAN), "breakdown": {k: 0 for k in BREAKDOWN_KEYS}}


_PLAN = """{"version": 2, "model": {"arch": "x", "n_layer": 2, "n_expert": 4, "n_expert_used": 2,
 "fingerprint": "%s"}, "budget_bytes": 1000, "n_ctx": 512, "type_k": "f16", "type_v": "f16", "n_ubatch": 512,
 "breakdown": {}, "predicted_cold_hit": null, "policy": "lru", "predicted_miss": null, "miss_path": "auto",
 "stock": {"n_cpu_moe": 0, "fits": true, "device_bytes": 0, "override_patterns": [], "cpu_moe_device_bytes": 0,
           "cpu_moe_fits": true},
 "overrides": [{"pattern": "^blk\\\\.(1)\\\\.(ffn_up_exps\\\\.weight)$", "target": "host"}],
 "layers": [{"index": 0, "mode": "resident", "pinned": [], "slots": 0, "device_bytes": 10, "host_bytes": 0},
            {"index": 1, "mode": "cached", "pinned": [1], "slots": 2, "device_bytes": 10, "host_bytes": 10}]}
""" % ("f" * 64)


@pytest.mark.parametrize("edit,want", [
    (lambda d: d.update(budget_bytes=-1), "budget_bytes: -1 is outside"),
    (lambda d: d["layers"][1].update(slots=4294967304), "layers[1].slots: 4294967304 is outside"),
    (lambda d: d["layers"][1].update(pinned=[2 ** 32 + 15]), "layers[1].pinned.0: 4294967311 is outside"),
    (lambda d: d.update(n_ctx=None), "n_ctx: expected an integer, got null"),
    (lambda d: d["layers"][0].update(slots=None), "layers[0].slots: expected an integer, got null"),
    (lambda d: d["overrides"][0].update(pattern="blk\\.(1"), "overrides[0].pattern: invalid regex"),
])
def test_hand_edited_plan_fields_are_refused_by_name(edit, want):
    import json

    from spark_cli.core import plan_file
    from spark_cli.errors import PlanError

    d = _plan_dict()
    plan_file.from_json(json.dumps(d))  # the unedited plan reads
    edit(d)
    with pytest.raises(PlanError) as e:
        plan_file.from_json(json.dumps(d))
    assert want in e.value.one_line() and e.value.exit_code == 4, e.value.one_line()


@pytest.mark.model
def test_model_tier_plan_trace_and_path_cases(monkeypatch, capsys, tmp_path, small_model):
    import json

    import numpy as np

    from spark_cli.commands import chat, plan

    model = tmp_path / small_model.name
    model.symlink_to(small_model)
    def both(app):
        plan.register(app)
        chat.register(app)
    run_plan = cli_runner(monkeypatch, capsys, "plan", both)
    from test_chat import _min_budget

    from spark_cli.core.gguf_info import load_geometry

    g = load_geometry(model)
    budget = _min_budget(g, 512) + g.total_expert_bytes // 2
    rc, _, err = run_plan(model, "--vram", budget, "-c", "512", "-o", tmp_path / "p.json")
    assert rc == 0, err
    d = json.loads((tmp_path / "p.json").read_text())
    il = next(l["index"] for l in d["layers"] if l["mode"] == "cached")
    for l in d["layers"]:
        if l["index"] == il:
            l["mode"] = "resident"  # the overrides still keep its experts on the host
    (tmp_path / "edited.json").write_text(json.dumps(d))
    run_chat = cli_runner(monkeypatch, capsys, "chat", both)
    rc, _, err = run_chat(model, "--plan", tmp_path / "edited.json", "-dev", "none", "--prompt", "hi")
    assert rc == 4 and f"layer {il} is resident, but overrides" in err, err
    d["overrides"][0]["pattern"] = "blk\\.(1"
    (tmp_path / "regex.json").write_text(json.dumps(d))
    rc, _, err = run_chat(model, "--plan", tmp_path / "regex.json", "-dev", "none", "--prompt", "hi")
    assert rc == 4 and "invalid regex" in err, err
    # 7: a trace with k = 0 in plan --trace; a model path that is not UTF-8
    rc, _, err = run_plan(model, "--vram", "2GiB", "--trace",
                          _trace(tmp_path, "k0", ids=np.zeros((4, 2, 0), np.int16)))
    assert rc == 5 and "k = 0" in err and "Traceback" not in err, err
    odd = os.fsdecode(bytes(tmp_path / "m") + b"\xff.gguf")
    os.symlink(small_model, odd)
    rc, out, err = run_chat(odd, "-dev", "none", "--no-learn", "-n", "1", "--prompt", "hi", "--json")
    assert rc == 0 and json.loads(out)["figures"]["prompt_tokens"] > 0, err


# ---------------------------------------------------------------- 9. exit codes and messages


@pytest.mark.parametrize("args,code,want", [
    (["--vram", "2GiB", "--policy", "bogus"], 2, "--policy bogus"),
    (["--vram", "0"], 2, "--vram: size must be positive"),
    (["--vram", "lots"], 2, "--vram: cannot read"),
    (["--vram", "2GiB", "-ngl", "99", "-o", "M"], 2, "-ngl 99 ignored: Spark places every layer itself"),
])
def test_flag_errors_exit_2(monkeypatch, capsys, tmp_path, args, code, want):
    from spark_cli.commands import plan

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    args = [model if a == "M" else a for a in args]  # -o M: refused after -ngl's note, before any work
    run = cli_runner(monkeypatch, capsys, "plan", plan.register)
    rc, _, err = run(model, *args)
    assert rc == code and want in err and "Traceback" not in err, err


def test_dev_rpc_name_from_the_readme_implies_its_server():
    from spark_cli.native import devices

    sel = devices.parse("RPC0[127.0.0.1:50052]", None)
    assert sel.names == ("RPC0[127.0.0.1:50052]",) and sel.rpc == ("127.0.0.1:50052",)
    assert devices.parse("RPC0[127.0.0.1:50052]", "127.0.0.1:50052").rpc == ("127.0.0.1:50052",)


@pytest.mark.model
def test_dev_rpc_name_selects_the_live_stand_in(monkeypatch, capsys, small_model, rpc_server):
    """`-dev RPC0[HOST:PORT]` alone, as `spark devices` prints it: the command reaches that server."""
    import json

    from spark_cli.commands import chat

    run = cli_runner(monkeypatch, capsys, "chat", chat.register)
    rc, out, err = run(small_model, "-dev", f"RPC0[{rpc_server.endpoint}]", "--vram", "700MiB", "-c", 256,
                       "--temp", "0", "-n", "2", "--no-learn", "--prompt", "hi", "--json")
    assert rc == 0, err
    figures = json.loads(out)["figures"]
    assert figures["cached_layers"] > 0 and figures["hits"] + figures["misses"] > 0, figures


@pytest.mark.model
def test_quantized_v_without_flash_attention_names_the_flag(monkeypatch, capsys, small_model):
    from spark_cli.commands import chat

    run = cli_runner(monkeypatch, capsys, "chat", chat.register)
    rc, _, err = run(small_model, "-dev", "none", "-ctv", "q8_0", "-fa", "off", "--no-learn", "--prompt", "hi")
    assert rc == 2 and "-fa on" in err and "smaller --ctx-size" not in err, err
