"""When a repeated timing has been taken often enough. On a machine whose speed comes and goes
(another guest on the host, a power mode) the median of a few widely spread timings moves by a
fifth with each further timing, so a timing is taken again, up to a cap, while its timings spread
wide. One rule for the device-cost probes (runs/device_costs.py) and bench's runs (runs/bench.py)."""

from __future__ import annotations

import statistics
from typing import Sequence

SPREAD = 0.25  # (slowest - fastest) / median at most: the median holds


def settled(values: Sequence[float], least: int, most: int) -> bool:
    """Whether `values` are enough: at least `least` of them within SPREAD of their median, or
    `most` of them however they spread."""
    if len(values) < least:
        return False
    return len(values) >= most or max(values) - min(values) <= SPREAD * statistics.median(values)
