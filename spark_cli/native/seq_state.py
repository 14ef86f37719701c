"""One sequence's KV state as bytes and back (llama_state_seq_get_data / set_data): what a slot
file (files/slot_file.py) holds beside its tokens."""

from __future__ import annotations

import ctypes
from typing import Any

from ..errors import SparkError


def get(engine: Any, seq: int) -> bytes:
    lc, ctx = engine.lib.lc, engine.ctx
    size = int(lc.llama_state_seq_get_size(ctx, seq))
    buf = (ctypes.c_uint8 * max(size, 1))()
    n = int(lc.llama_state_seq_get_data(ctx, buf, size, seq))
    if n != size:
        raise SparkError(f"llama.cpp wrote {n} of the {size} bytes of sequence {seq}'s state")
    return bytes(buf[:n])


def put(engine: Any, seq: int, state: bytes) -> bool:
    """Replace the sequence's state; False when llama.cpp refused it (another shape, a short file)."""
    lc, ctx = engine.lib.lc, engine.ctx
    buf = (ctypes.c_uint8 * max(len(state), 1)).from_buffer_copy(state or b"\0")
    return int(lc.llama_state_seq_set_data(ctx, buf, len(state), seq)) > 0
