"""The disk under a model file, measured once and kept: what the file tier's reads cost.

Reads of one expert slice's size at random offsets in the file, `depth` in flight (the file
tier's readers), the file's page cache dropped first and after, so each read comes from the disk:
bytes per second at that depth, and the latency of one read alone. Kept per disk (the file's
st_dev), read size and depth under SPARK_HOME/calibration, like the device costs.

`faults=True` measures what stock pays instead: single faults at the same random offsets through a
mapping of the file, `depth` threads (the compute threads fault), each reading the kernel's
read-around window: the bytes the kernel read per second. Stock's misses are scattered pages of
experts partly cached, so each costs one such fault; touching whole slices in order instead lets
the kernel read ahead asynchronously and measures close to the disk's rate, which at a 128 KiB
window is about twice what stock's faults get.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from ..core import page_cache
from ..core.cost_model import DiskCosts
from ..files.atomic import atomic_write_text
from . import memcg

N_READS = 48
READERS = 4  # the file tier's reads in flight (EngineOptions.file_readers), the depth its disk is measured at


def cache_file(home: Path, model: Path, read_bytes: int, depth: int, faults: bool = False) -> Path:
    dev = os.stat(model).st_dev
    if not faults:
        return home / "calibration" / f"disk-costs-{dev:x}-{read_bytes}-{depth}.json"
    window = page_cache.read_ahead_window(dev)[0]  # NOTE: the faults' reads are the read-around windows
    return home / "calibration" / f"fault-costs-{dev:x}-{read_bytes}-{depth}-ra{window >> 10}.json"


def process_io() -> tuple[int, int]:
    """(bytes this process read from storage, its major faults) so far."""
    rb = 0
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                rb = int(line.split()[1])
    return rb, resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _fault_reader(view: mmap.mmap) -> Callable[[int], int]:
    """One fault at `off` through the mapping: a byte of that page read by a numpy reduction, which runs
    outside the GIL, so that `depth` threads fault at once as compute threads do."""
    pages = np.frombuffer(view, dtype=np.uint8)

    def read(off: int) -> int:
        np.bitwise_or.reduce(pages[off:off + 1])
        return mmap.PAGESIZE
    return read


def measure(model: Path, read_bytes: int, depth: int, n: int = N_READS, seed: int = 0, faults: bool = False) -> DiskCosts:
    """Time n reads of read_bytes at random offsets, depth in flight, then n // 4 alone (faults: each
    read is one fault at that offset through a mapping, and the rate is of the bytes the kernel read
    from the disk for them: its read-around windows)."""
    size = os.path.getsize(model)
    rng = random.Random(seed)
    offs = [rng.randrange(0, max(1, size - read_bytes)) // 4096 * 4096 for _ in range(n + n // 4)]
    fd = os.open(model, os.O_RDONLY)
    view = mmap.mmap(fd, size, prot=mmap.PROT_READ) if faults else None
    read = _fault_reader(view) if view is not None else (lambda o: len(os.pread(fd, read_bytes, o)))
    try:
        memcg.drop_page_cache(model)
        io0 = process_io()[0]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(depth) as pool:
            got = sum(pool.map(read, offs[:n]))
        t1 = time.perf_counter()
        if view is not None:
            got = process_io()[0] - io0 or got
        lone = offs[n:]
        for o in lone:
            read(o)
        t2 = time.perf_counter()
    finally:
        read = None  # NOTE: the numpy view over the mapping goes first, or the mapping cannot close
        if view is not None:
            view.close()
        os.close(fd)
        memcg.drop_page_cache(model)
    return DiskCosts(read_bytes, depth, got / (t1 - t0), (t2 - t1) / max(1, len(lone)))


def kept(model: Path, read_bytes: int, depth: int, home: Path, faults: bool = False) -> DiskCosts | None:
    """The kept figure for this disk, read size and depth (None: not measured yet)."""
    try:
        return DiskCosts(**json.loads(cache_file(home, model, read_bytes, depth, faults).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def read_size(g) -> int:
    """One read of the file tier: one expert's slice of one expert tensor (the largest)."""
    return max(t.bytes_per_expert for il in g.moe_layers for t in g.layers[il].experts)


def remeasure(model: Path, read_bytes: int, depth: int, home: Path, faults: bool = False) -> DiskCosts:
    """Measured now, and kept in place of the figure kept before (a shared virtual disk's speed drifts:
    spark bench --ram measures it each time, so that its predictions and later runs' decisions use today's)."""
    costs = measure(model, read_bytes, depth, faults=faults)
    try:
        atomic_write_text(cache_file(home, model, read_bytes, depth, faults), json.dumps(asdict(costs)) + "\n")
    except OSError:
        pass  # NOTE: measured again next time
    return costs
