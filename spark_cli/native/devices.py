"""Which ggml devices a run uses, and how much memory they have free: the one place that decides.

Spelled as llama.cpp spells it: `-dev/--device` is a comma-separated list of device names
(`spark devices` lists them) or `none` (CPU only); `--rpc HOST:PORT[,...]` registers RPC
servers, whose devices are used when no -dev is given. Without either: the first GPU-type
device that is not an RPC endpoint, or none. Several devices split the layers as llama.cpp does
(core/split.py): each layer's expert bank lives on that layer's device, and each device has its
own budget (--vram per device). Plan, chat, bench, profile and the engine all select through here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
from dataclasses import dataclass
from typing import Sequence

from ..errors import DeviceError

NONE = "none"
BUDGET_MARGIN = 512 << 20  # left free on the device when the budget comes from its free memory


@dataclass(frozen=True)
class Selection:
    """What -dev/--rpc asked for: device names (None: the default), or `none`."""

    names: tuple[str, ...] | None = None
    rpc: tuple[str, ...] = ()

    @property
    def cpu_only(self) -> bool:
        return self.names == ()

    def describe(self) -> str:
        if self.cpu_only:
            return "-dev none"
        if self.names:
            return "-dev " + ",".join(self.names)
        return "--rpc " + ",".join(self.rpc) if self.rpc else "the first GPU"


RPC_NAME = re.compile(r"RPC\d*\[(.+:\d+)\]")  # a device of an RPC server, as ggml names it


def parse(device: str | None, rpc: str | Sequence[str] | None = None) -> Selection:
    """-dev and --rpc values as typed -> a Selection (DeviceError for contradictions)."""
    from .rpc import parse_endpoints

    endpoints = tuple(parse_endpoints(rpc) if isinstance(rpc, str) or rpc is None else rpc)
    if device is None or device.strip() in ("", "auto"):
        return Selection(None, endpoints)
    names = tuple(n.strip() for n in device.split(",") if n.strip())
    if device.strip().lower() in (NONE, "cpu"):
        if endpoints:
            raise DeviceError(f"--rpc and -dev {device} contradict each other", hint="drop one of them")
        return Selection((), ())
    if not names:
        raise DeviceError(f"-dev {device!r}: no device name", hint="run `spark devices` to list them")
    # NOTE: -dev RPC0[HOST:PORT] (the name `spark devices` lists) implies --rpc HOST:PORT
    implied = tuple(m.group(1) for n in names if (m := RPC_NAME.fullmatch(n)) and m.group(1) not in endpoints)
    return Selection(names, endpoints + tuple(parse_endpoints(",".join(implied))) if implied else endpoints)


def local_gpus() -> list:
    """GPU-type devices of this machine (RPC endpoints excluded)."""
    from . import llama_lib

    return [d for d in llama_lib.devices() if d.is_gpu and not d.name.startswith("RPC")]


def no_gpu_reason() -> str:
    """Why a run without -dev/--rpc runs on the CPU: no GPU, and which backend of this build found none."""
    from . import llama_lib

    idle = llama_lib.idle_backends()
    if not idle:
        return "no GPU found"
    return (f"no GPU found (this build's {', '.join(idle)} backend found no device: is the driver installed and "
            "the GPU visible?)")


def select(sel: Selection) -> list:
    """The llama_lib.Device list a run with this selection uses ([]: the CPU only)."""
    from . import llama_lib, rpc

    if sel.cpu_only:
        return []
    remote = rpc.connect(list(sel.rpc)) if sel.rpc else []
    if sel.names is None:
        return remote if sel.rpc else local_gpus()[:1]
    every = {d.name: d for d in llama_lib.devices()}
    for n in sel.names:  # RPC0[h:p]: the RPC device of that server, whatever ggml numbered it
        m = RPC_NAME.fullmatch(n)
        if m and n not in every:
            ep = m.group(1)
            hit = next((d for name, d in every.items() if name.startswith("RPC")
                        and (name.endswith(f"[{ep}]") or d.description == ep)), None)
            if hit is not None:
                every[n] = hit
    missing = [n for n in sel.names if n not in every]
    if missing:
        raise DeviceError(f"-dev {','.join(sel.names)}: no device named {missing[0]}",
                          hint="available: " + ", ".join(every) + " (or none)")
    picked = [every[n] for n in sel.names]
    not_gpu = [d.name for d in picked if not d.is_gpu]
    if not_gpu:
        raise DeviceError(f"-dev {not_gpu[0]}: not a GPU-type device", hint="use -dev none for the CPU only")
    return picked


def free_memory(dev) -> tuple[int, int]:
    """(free, total) bytes of one device, read now (an RPC endpoint asks its server)."""
    from . import llama_lib

    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    llama_lib.load().dev_memory(dev.handle, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def listed(rpc_devices: Sequence) -> list:
    """The devices `spark devices` lists, their memory read now: this machine's, and `rpc_devices` (those
    of this run's --rpc servers, rpc.connect's). An RPC server registered earlier in this process and
    gone since is not asked: ggml aborts on a server it cannot reach."""
    from . import llama_lib

    ours = {d.name for d in rpc_devices}
    return [dataclasses.replace(d, free=f, total=t) for d in llama_lib.devices()
            if not d.name.startswith("RPC") or d.name in ours for f, t in [free_memory(d)]]


def budget_from_free(free: int) -> int:
    """The device budget when none is given: free memory less BUDGET_MARGIN."""
    return max(0, free - BUDGET_MARGIN)
