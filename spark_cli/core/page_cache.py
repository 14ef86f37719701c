"""Stock under a RAM cap: the kernel's page cache over the mapped model file, simulated.

Stock reads a routed expert through llama.cpp's mapping: the compute threads touch its slices and
each page that is not cached faults. A fault reads the kernel's read-around window (the disk's
`read_ahead_kb`, centred on the faulting page), so one miss brings in its neighbours too: other
experts of the same tensor, most of which the step does not need, and which push out pages that
later steps would have hit. The cache keeps what was touched last.

The simulation replays a routing trace's decode steps through the kernel's two lists of file
pages, in fixed-size chunks of the file, `capacity` bytes in all: each routed expert's slices are
touched in order; a missing chunk faults and reads the window's missing chunks onto the inactive
list; a chunk touched again while inactive moves to the active list; the active list is kept no
longer than the inactive one (the kernel's ratio below 1 GiB), its oldest moving down; the oldest
inactive chunk is dropped first. It counts the bytes read per decode token in the steady state
(the trace replayed twice, the second pass counted). It is the kernel's structure, not its exact
policy (reference bits, async read-ahead, reclaim batches): the bench reports the bytes it measured
beside the ones replayed here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .trace import DECODE

CHUNK = 64 << 10  # the simulation's page (the kernel's is 4 KiB; its read-around windows are multiples of this)
KERNEL_DEFAULT_WINDOW = 128 << 10  # VM_READAHEAD_PAGES: a device's read_ahead_kb unless it set its own


@dataclass(frozen=True)
class ExpertSlices:
    """Where one MoE layer's experts lie in the file: per expert tensor, its first byte and the bytes
    of one expert's slice (expert e's slice starts at offset + e * stride)."""

    il: int
    tensors: tuple[tuple[int, int], ...]  # (offset, stride)


def bytes_read_per_token(trace, layers: list[ExpertSlices], capacity: int, window: int, file_size: int,
                         chunk: int = CHUNK) -> float | None:
    """Bytes stock reads from the file per decode token (see the module's text). None without decode steps."""
    rows = [i for i in range(trace.ids.shape[0]) if trace.phase[i] == DECODE]
    if not rows:
        return None
    lists = _Lists(max(1, capacity // chunk))
    n_chunks = max(1, -(-file_size // chunk))
    half = max(1, window // chunk) // 2
    read = 0
    for counting in (False, True):
        for i in rows:
            for L in layers:
                for e in dict.fromkeys(int(x) for x in trace.ids[i, L.il] if x >= 0):
                    for off, stride in L.tensors:
                        a = off + e * stride
                        for c in range(a // chunk, (a + stride - 1) // chunk + 1):
                            if lists.touch(c):
                                continue
                            lo = max(0, c - half)
                            new = lists.read(range(lo, min(n_chunks, lo + 2 * half)), c)
                            read += new * chunk * counting
    return read / len(rows)


class _Lists:
    """The active and inactive lists, oldest first, of at most `cap` chunks in all."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.active: OrderedDict[int, None] = OrderedDict()
        self.inactive: OrderedDict[int, None] = OrderedDict()

    def touch(self, c: int) -> bool:
        """A hit (True) refreshes the chunk, or moves it up from the inactive list."""
        if c in self.active:
            self.active.move_to_end(c)
            return True
        if c in self.inactive:
            del self.inactive[c]
            self.active[c] = None
            self._balance()
            return True
        return False

    def read(self, window: range, c: int) -> int:
        """A fault at c: the window's missing chunks join the inactive list (c among them); how many."""
        new = 0
        for x in window:
            if x not in self.active and x not in self.inactive:
                self.inactive[x] = None
                new += 1
        if c not in self.inactive and c not in self.active:
            self.inactive[c] = None
            new += 1
        self._balance()
        return new

    def _balance(self) -> None:
        while len(self.active) + len(self.inactive) > self.cap:
            if not self.inactive:
                k, _ = self.active.popitem(last=False)
                self.inactive[k] = None
            self.inactive.popitem(last=False)
        while len(self.active) > len(self.inactive):
            k, _ = self.active.popitem(last=False)
            self.inactive[k] = None


def read_ahead_window(st_dev: int) -> tuple[int, str]:
    """(bytes, where from): the read-around window of the block device behind st_dev, from sysfs
    (a partition's is its disk's); the kernel's default where there is no block device."""
    import os
    from pathlib import Path

    node = Path(f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}")
    for d in (node, node / ".."):
        f = d / "queue" / "read_ahead_kb"
        try:
            return int(f.read_text().strip()) << 10, str(f.resolve())
        except (OSError, ValueError):
            continue
    return KERNEL_DEFAULT_WINDOW, "the kernel's default (no block device's read_ahead_kb found)"
