"""The CPU time other guests took while bench measured (runs/cpu_steal.py)."""

from __future__ import annotations

from collections import namedtuple

import pytest

from spark_cli.runs import cpu_steal
from spark_cli.runs.cpu_steal import CpuClock, steal_note, steal_share

Times = namedtuple("Times", "user nice system idle iowait irq softirq steal guest guest_nice")
NoSteal = namedtuple("NoSteal", "user system idle")


def test_the_share_is_stolen_over_all_cpu_time_between_two_readings(monkeypatch) -> None:
    readings = iter([Times(100.0, 0.0, 10.0, 80.0, 0.0, 0.0, 0.0, 10.0, 30.0, 0.0),
                     Times(150.0, 0.0, 20.0, 100.0, 0.0, 0.0, 0.0, 30.0, 60.0, 0.0)])
    monkeypatch.setattr(cpu_steal.psutil, "cpu_times", lambda: next(readings))
    a, b = CpuClock.now(), CpuClock.now()
    assert a == CpuClock(10.0, 200.0)  # guest time is inside user: counted once
    assert steal_share(a, b) == pytest.approx(20.0 / 100.0)
    assert "20%" in steal_note(steal_share(a, b)) and "steal" in steal_note(0.2)


def test_quiet_or_uncounted_machines_say_nothing(monkeypatch) -> None:
    assert steal_note(0.01) is None and steal_note(None) is None
    assert steal_share(CpuClock(5.0, 100.0), CpuClock(5.0, 100.0)) is None  # no time went by
    monkeypatch.setattr(cpu_steal.psutil, "cpu_times", lambda: NoSteal(1.0, 1.0, 1.0))
    assert CpuClock.now() is None and steal_share(None, CpuClock(1.0, 2.0)) is None
