"""llama.cpp's flags as values: LoadFlags, the shared default context, -dev/--rpc selections,
-ot parsing, the hidden old spellings, exit codes per error type (no llama.cpp needed)."""

from __future__ import annotations

import pytest
from _geometry import make_geometry

from spark_cli.native import devices
from spark_cli import errors
from spark_cli.commands.common import unalias
from spark_cli.errors import DeviceError, UsageError
from spark_cli.core.options import DEFAULT_CTX, LoadFlags, context_size
from spark_cli.core.placement import CPU, parse_override_tensor


@pytest.mark.parametrize("requested,trained,plan_ctx,want", [
    (None, 32768, None, DEFAULT_CTX),  # trained context capped
    (None, 2048, None, 2048),  # a short model keeps its own
    (None, 0, None, DEFAULT_CTX),  # unknown trained context
    (None, 32768, 1024, 1024),  # the plan's
    (512, 32768, 1024, 512),  # -c wins
])
def test_one_default_context(requested, trained, plan_ctx, want) -> None:
    assert context_size(requested, trained, plan_ctx) == want


def test_load_flags_from_cli() -> None:
    f = LoadFlags.from_cli(type_k="Q8_0", flash_attn="on", no_mmap=True, mlock=True, override_tensor=["a=CPU"])
    assert (f.type_k, f.type_v, f.flash_attn, f.mmap, f.mlock, f.override_tensor) == \
        ("q8_0", None, "on", False, True, ("a=CPU",))
    with pytest.raises(UsageError, match="--flash-attn maybe"):
        LoadFlags.from_cli(flash_attn="maybe")
    with pytest.raises(UsageError, match="--cache-type-k: unknown KV cache type 'q3_k'"):
        LoadFlags.from_cli(type_k="q3_k")


def test_parallel_and_kv_unified_default_to_the_plans(tmp_path) -> None:
    """-np/--kv-unified not given: 1 and off, or what a --plan was priced for; given: the flags."""
    from dataclasses import replace

    from spark_cli.core.planner import _make_plan
    from spark_cli.runs import session

    g = make_geometry(n_layer=3)
    plan = replace(_make_plan(g, 1 << 40, 4096), n_parallel=4, kv_unified=True)
    model = tmp_path / "m.gguf"
    for flags, with_plan, want in (
            (LoadFlags.from_cli(), None, (1, False)),
            (LoadFlags.from_cli(), plan, (4, True)),
            (LoadFlags.from_cli(parallel=2, kv_unified=False), plan, (2, False)),
            (LoadFlags.from_cli(parallel=3, kv_unified=True), None, (3, True))):
        opts = session.engine_options(model, g, with_plan, flags, n_ctx=4096)
        assert (opts.n_seq, opts.kv_unified) == want
    assert session.kv_settings(LoadFlags.from_cli(parallel=2)) == {
        "type_k": "f16", "type_v": "f16", "n_ubatch": 512, "n_parallel": 2, "kv_unified": False}
    # a --plan run with more sequences than the plan priced is told so (fewer, or -np 4 unified: not)
    warn = session._sequences_warning
    assert warn(g, plan, LoadFlags.from_cli()) is None
    assert warn(g, plan, LoadFlags.from_cli(parallel=2)) is None
    assert warn(g, plan, LoadFlags.from_cli(parallel=8)) is None  # one unified stream of n_ctx either way
    hybrid = make_geometry(n_layer=3, kv_heads=(0, 2, 2), recurrent_state=4096)
    assert warn(hybrid, plan, LoadFlags.from_cli(parallel=8)) == \
        "-np 8 --kv-unified needs more KV cache than the plan's -np 4 --kv-unified: it takes more VRAM than planned"
    swa = make_geometry(n_layer=3, swa=(True, False, False), sliding_window=128)
    assert warn(swa, replace(plan, kv_unified=False), LoadFlags.from_cli(kv_unified=True)) is None
    assert warn(swa, plan, LoadFlags.from_cli(kv_unified=False)) is not None  # 4 rings instead of one


@pytest.mark.parametrize("device,rpc,names,endpoints", [
    (None, None, None, ()),
    ("auto", None, None, ()),
    ("none", None, (), ()),
    ("cpu", None, (), ()),  # the old spelling
    ("CUDA0,CUDA1", None, ("CUDA0", "CUDA1"), ()),
    (None, "127.0.0.1:5000,host:6000", None, ("127.0.0.1:5000", "host:6000")),
])
def test_device_selection_parses_as_llama_cpp(device, rpc, names, endpoints) -> None:
    sel = devices.parse(device, rpc)
    assert (sel.names, sel.rpc) == (names, endpoints)
    assert sel.cpu_only == (names == ())


def test_contradicting_devices_are_refused() -> None:
    with pytest.raises(DeviceError, match="contradict"):
        devices.parse("none", "127.0.0.1:5000")
    with pytest.raises(UsageError, match="not HOST:PORT"):
        devices.parse(None, "nope")
    assert devices.budget_from_free(devices.BUDGET_MARGIN - 1) == 0


def test_override_tensor_parsing_refuses_experts() -> None:
    g = make_geometry(n_layer=3)
    ov = parse_override_tensor([r"token_embd=CPU,output\.weight=CUDA0", r"blk\.0\.attn=CPU"], g)
    assert [(o.pattern, o.target) for o in ov] == [("token_embd", CPU), (r"output\.weight", "CUDA0"),
                                                   (r"blk\.0\.attn", CPU)]
    with pytest.raises(UsageError, match=r"matches the expert tensor blk\.1\.ffn_down_exps\.weight"):
        parse_override_tensor([r"ffn_down=CPU"], g)
    for bad in ("noequals", "=CPU", "x=", "(=CPU"):
        with pytest.raises(UsageError):
            parse_override_tensor([bad], g)


def test_old_spellings_are_hidden_aliases() -> None:
    assert unalias(["plan", "--ctx", "8", "--ctx=9", "--system", "s", "--", "--ctx"]) == \
        ["plan", "--ctx-size", "8", "--ctx-size=9", "--system-prompt", "s", "--", "--ctx"]


def test_every_error_type_has_its_own_exit_code() -> None:
    codes = errors.EXIT_CODES
    assert codes["UsageError"] == 2 and len(set(codes.values())) == len(codes)
    assert all(c not in (0, 130) for c in codes.values())
    assert issubclass(errors.ProfileError, errors.SparkError)
    from spark_cli.files.corpus import CorpusError

    assert CorpusError("x").exit_code == errors.ProfileError.exit_code
