"""The disk under a model file, measured once and kept: what the file tier's reads cost.

Reads of one expert slice's size at random offsets in the file, `depth` in flight (the file
tier's readers), the file's page cache dropped first and after, so each read comes from the disk:
bytes per second at that depth, and the latency of one read alone. Kept per disk (the file's
st_dev), read size and depth under SPARK_HOME/calibration, like the device costs.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from ..core.cost_model import DiskCosts
from ..files.atomic import atomic_write_text
from . import memcg

N_READS = 48
READERS = 4  # the file tier's reads in flight (EngineOptions.file_readers), the depth its disk is measured at


def cache_file(home: Path, model: Path, read_bytes: int, depth: int) -> Path:
    dev = os.stat(model).st_dev
    return home / "calibration" / f"disk-costs-{dev:x}-{read_bytes}-{depth}.json"


def measure(model: Path, read_bytes: int, depth: int, n: int = N_READS, seed: int = 0) -> DiskCosts:
    """Time n reads of read_bytes at random offsets, depth in flight, then n // 4 alone."""
    size = os.path.getsize(model)
    rng = random.Random(seed)
    offs = [rng.randrange(0, max(1, size - read_bytes)) // 4096 * 4096 for _ in range(n + n // 4)]
    fd = os.open(model, os.O_RDONLY)
    try:
        memcg.drop_page_cache(model)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as pool:
            got = sum(pool.map(lambda o: len(os.pread(fd, read_bytes, o)), offs[:n]))
        t1 = time.perf_counter()
        lone = offs[n:]
        for o in lone:
            os.pread(fd, read_bytes, o)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        memcg.drop_page_cache(model)
    return DiskCosts(read_bytes, depth, got / (t1 - t0), (t2 - t1) / max(1, len(lone)))


def kept(model: Path, read_bytes: int, depth: int, home: Path) -> DiskCosts | None:
    """The kept figure for this disk, read size and depth (None: not measured yet)."""
    try:
        return DiskCosts(**json.loads(cache_file(home, model, read_bytes, depth).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def read_size(g) -> int:
    """One read of the file tier: one expert's slice of one expert tensor (the largest)."""
    return max(t.bytes_per_expert for il in g.moe_layers for t in g.layers[il].experts)


def ensure(model: Path, read_bytes: int, depth: int, home: Path) -> DiskCosts:
    """The kept figure for this disk, read size and depth, else measured now and kept."""
    path = cache_file(home, model, read_bytes, depth)
    got = kept(model, read_bytes, depth, home)
    if got is not None:
        return got
    costs = measure(model, read_bytes, depth)
    try:
        atomic_write_text(path, json.dumps(asdict(costs)) + "\n")
    except OSError:
        pass  # NOTE: measured again next time
    return costs
