"""The dry run: a placement's memory bill measured by llama.cpp before anything is loaded.

The engine loads the model with `no_alloc` (metadata only: no tensor data is read, so it works
on the sparse geometry fixtures) on the plan's devices and tensor overrides, creates the context
with the run's n_ctx, ubatch, KV types and flash attention, attaches the expert cache without
allocating its banks, and reads llama.cpp's memory breakdown (core/bill.py). The planner's fit
loop (planner.plan_for's `measure`) and the plan-file check of chat, serve and bench call it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from ..core import planner, units
from ..core.bill import MeasuredBill
from ..core.gguf_info import ModelGeometry
from ..core.options import LoadFlags
from ..errors import PlanError


def measure(model: Path, geometry: ModelGeometry, plan: planner.Plan, flags: LoadFlags, n_ctx: int) -> MeasuredBill:
    """What a run of `plan` with `flags` would allocate, per buffer type (nothing is allocated)."""
    from ..native.engine import Engine
    from . import session

    opts = session.engine_options(model, geometry, plan, flags, n_ctx=n_ctx, learn=False)
    with Engine(dataclasses.replace(opts, dry_run=True)) as engine:
        return engine.cache.memory_breakdown()


def measurer(model: Path, geometry: ModelGeometry, flags: LoadFlags, n_ctx: int) -> Callable[[planner.Plan], MeasuredBill]:
    """planner.plan_for's `measure` for this model and these flags."""
    return lambda plan: measure(model, geometry, plan, flags, n_ctx)


def check_fits(bill: MeasuredBill, devs: list, source: str) -> None:
    """PlanError (exit 4) when the measured bill of a device is over its free memory now."""
    from ..native import devices

    for dev in devs:
        need = bill.device_bytes(dev.name) + planner.unmeasured_overhead()
        free, total = devices.free_memory(dev)
        if total and need > free:
            raise PlanError(f"{source}: needs {units.fmt_bytes(need)} on {dev.name} (measured), which has "
                            f"{units.fmt_bytes(free)} free: short by {units.shortfall(need - free)}",
                            hint="make the plan again with `spark plan` for this device and context")
