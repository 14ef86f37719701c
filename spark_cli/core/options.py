"""llama.cpp's model and context flags as one value, and the defaults every command shares.

The CLI (commands/common.py) parses the flags into LoadFlags; session.engine_options turns
them, with a plan, into EngineOptions. Pure: no typer, rich or llama_cpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import UsageError

DEFAULT_CTX = 4096  # the context when -c is not given: the model's trained context, capped here
DEFAULT_UBATCH = 512  # llama.cpp's -ub default
FLASH_ATTN_VALUES = ("on", "off", "auto")


@dataclass(frozen=True)
class LoadFlags:
    """What -c, -t/-tb, -ctk/-ctv, -fa, -b/-ub, --no-mmap, --mlock, -nr, -dev, --rpc, -ts/-sm/-mg and -ot asked for
    (None: the default, or the plan's)."""

    ctx_size: int | None = None
    threads: int | None = None
    type_k: str | None = None
    type_v: str | None = None
    flash_attn: str = "auto"
    batch_size: int = 2048
    ubatch_size: int | None = None
    mmap: bool = True
    mlock: bool = False
    repack: bool = True
    device: str | None = None
    rpc: str | None = None
    override_tensor: tuple[str, ...] = ()
    threads_batch: int | None = None  # -tb: threads for multi-token steps (default: -t)
    parallel: int | None = None  # -np: sequences (server slots) the context holds at once (None: 1, or the plan's)
    kv_unified: bool | None = None  # -kvu: one KV buffer shared by every sequence, else -c is split between
    # them (None: not given, so false, or the plan's)
    tensor_split: tuple[float, ...] | None = None  # -ts: layer proportions per device (None: the budgets, or the plan's)
    split_mode: str | None = None  # -sm: layer | none (None: layer, or the plan's)
    main_gpu: int | None = None  # -mg: the device -sm none keeps (None: 0, or the plan's)
    ram: int | None = None  # --ram: bytes of RAM the run's weights may use (None: what the host, or its cgroup, has)

    @classmethod
    def from_cli(cls, *, ctx_size: int | None = None, threads: int | None = None, type_k: str | None = None,
                 type_v: str | None = None, flash_attn: str = "auto", batch_size: int = 2048,
                 ubatch_size: int | None = None, no_mmap: bool = False, mlock: bool = False,
                 no_repack: bool = False, device: str | None = None, rpc: str | None = None,
                 override_tensor: Sequence[str] | None = None, threads_batch: int | None = None,
                 parallel: int | None = None, kv_unified: bool | None = None, tensor_split: str | None = None,
                 split_mode: str | None = None, main_gpu: int | None = None, ram: str | None = None) -> "LoadFlags":
        from . import split, units, vram

        fa = flash_attn.lower()
        if fa in ("1", "true", "enabled"):
            fa = "on"
        if fa in ("0", "false", "disabled"):
            fa = "off"
        if fa not in FLASH_ATTN_VALUES:
            raise UsageError(f"--flash-attn {flash_attn}: expected on, off or auto")
        for value, flag in ((type_k, "--cache-type-k"), (type_v, "--cache-type-v")):
            if value is not None:
                vram.kv_type(value, flag)  # UsageError naming the flag
        type_k, type_v = (t.lower() if t is not None else None for t in (type_k, type_v))
        mode = split.parse_split_mode(split_mode) if split_mode is not None else None
        if main_gpu is not None and main_gpu < 0:
            raise UsageError(f"--main-gpu {main_gpu}: expected a device index >= 0 (-dev none for the CPU only)")
        return cls(ctx_size, threads, type_k, type_v, fa, batch_size, ubatch_size, not no_mmap, mlock,
                   not no_repack, device, rpc, tuple(override_tensor or ()), threads_batch, parallel,
                   kv_unified, split.parse_tensor_split(tensor_split), mode, main_gpu,
                   units.parse_size(ram, flag="--ram") if ram is not None else None)


def context_size(requested: int | None, trained: int, plan_ctx: int | None = None) -> int:
    """-c if given; else the plan's context; else the model's trained context capped at DEFAULT_CTX."""
    if requested:
        return requested
    if plan_ctx:
        return plan_ctx
    return min(trained, DEFAULT_CTX) if trained > 0 else DEFAULT_CTX
