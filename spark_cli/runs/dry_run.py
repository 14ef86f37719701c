"""The dry run: a placement's memory bill measured by llama.cpp before anything is loaded.

The engine loads the model with `no_alloc` (metadata only: no tensor data is read, so it works
on the sparse geometry fixtures) on the plan's devices and tensor overrides, creates the context
with the run's n_ctx, ubatch, KV types and flash attention, attaches the expert cache without
allocating its banks, and reads llama.cpp's memory breakdown (core/bill.py). The planner's fit
loop (planner.plan_for's `measure`: session.measurer) and the plan-file check of chat, serve and bench
call it.
"""

from __future__ import annotations

import dataclasses

from ..core import planner, units
from ..core.bill import MeasuredBill
from ..errors import PlanError
from ..native import devices
from ..native.engine import Engine, EngineOptions


def measure(options: EngineOptions) -> MeasuredBill:
    """What a run with these engine options (session.engine_options: a plan and the run's flags)
    would allocate, per buffer type (nothing is allocated)."""
    with Engine(dataclasses.replace(options, dry_run=True)) as engine:
        return engine.cache.memory_breakdown()


def check_fits(bill: MeasuredBill, devs: list, source: str) -> None:
    """PlanError (exit 4) when the measured bill of a device is over its free memory now."""
    for dev in devs:
        need = bill.device_bytes(dev.name) + planner.unmeasured_overhead()
        free, total = devices.free_memory(dev)
        if total and need > free:
            raise PlanError(f"{source}: needs {units.fmt_bytes(need)} on {dev.name} (measured), which has "
                            f"{units.fmt_bytes(free)} free: short by {units.shortfall(need - free)}",
                            hint="make the plan again with `spark plan` for this device and context")
