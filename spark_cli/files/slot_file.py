"""Slot files of `spark serve --slot-save-path DIR` (llama-server's /slots/N?action=save|restore):
a slot's tokens and KV state, named by the client, written atomically, read back only into the
model that wrote them.

A name is one plain file name in DIR (no separators, no `..`, not absolute, no control
characters, at most 255 bytes); a path that is a symlink out of DIR is refused. The file:

    b"SPARKSLOT1\\n", model id (UTF-8) + b"\\n", n_tokens (u32 LE), tokens (i32 LE each), state bytes
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Sequence

from ..errors import SparkError
from .atomic import atomic_write_bytes
from .regular import read_regular

MAGIC = b"SPARKSLOT1\n"
NAME_MAX = 255
MAX_SLOT_FILE_BYTES = 1 << 36  # 64 GiB: a KV cache is large, but not unbounded


class SlotFileError(SparkError):
    """A slot file name or file that cannot be used (the request's 400)."""


def slot_path(folder: Path, name: str) -> Path:
    """The file `name` names in `folder`. SlotFileError for a name that is not one plain file
    name, or a path that leads out of `folder` (a symlink)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or len(name.encode("utf-8")) > NAME_MAX
            or any(c in name for c in "/\\") or any(ord(c) < 32 or ord(c) == 127 for c in name)
            or name != name.strip()):
        raise SlotFileError("Invalid filename")
    path = Path(folder) / name
    real = Path(os.path.realpath(path))
    if real.parent != Path(os.path.realpath(folder)):
        raise SlotFileError(f"Invalid filename: {name} leads out of the slot folder (a symlink)")
    return path


def encode(model_id: str, tokens: Sequence[int], state: bytes) -> bytes:
    head = MAGIC + model_id.encode("utf-8") + b"\n" + struct.pack("<I", len(tokens))
    return head + struct.pack(f"<{len(tokens)}i", *tokens) + state


def decode(data: bytes, model_id: str, name: str = "the file") -> tuple[list[int], bytes]:
    """(tokens, state). SlotFileError for a file Spark did not write, or another model's."""
    if not data.startswith(MAGIC):
        raise SlotFileError(f"{name}: not a Spark slot file")
    end = data.find(b"\n", len(MAGIC))
    if end < 0 or end + 5 > len(data):
        raise SlotFileError(f"{name}: the slot file is cut short")
    owner = data[len(MAGIC):end].decode("utf-8", errors="replace")
    if owner != model_id:
        raise SlotFileError(f"{name}: saved from another model (its id {owner[:16]}, this model's "
                            f"{model_id[:16]}); restore it into the model that saved it")
    (n,) = struct.unpack_from("<I", data, end + 1)
    start = end + 5
    if start + 4 * n > len(data):
        raise SlotFileError(f"{name}: the slot file is cut short")
    tokens = list(struct.unpack_from(f"<{n}i", data, start))
    return tokens, data[start + 4 * n:]


def save(folder: Path, name: str, model_id: str, tokens: Sequence[int], state: bytes) -> int:
    """Write the slot file atomically; the bytes written."""
    data = encode(model_id, tokens, state)
    atomic_write_bytes(slot_path(folder, name), data, make_parent=False)
    return len(data)


def load(folder: Path, name: str, model_id: str) -> tuple[list[int], bytes, int]:
    """(tokens, state, bytes read) of a slot file this model wrote."""
    path = slot_path(folder, name)
    try:
        size = os.stat(path).st_size
        if size > MAX_SLOT_FILE_BYTES:
            raise SlotFileError(f"{name}: {size} bytes, over the {MAX_SLOT_FILE_BYTES}-byte limit of a slot file")
        data = read_regular(path, size)  # NOTE: the file's size, not the bound: read() allocates what it is given
    except FileNotFoundError:
        raise SlotFileError(f"{name}: no such slot file") from None
    except OSError as e:
        raise SlotFileError(f"{name}: {e.strerror or e}") from None
    tokens, state = decode(data, model_id, name)
    return tokens, state, len(data)
