"""llama-server's slot actions (`POST /slots/N?action=save|restore|erase`, with --slot-save-path):
what each does to a free slot's sequence and files, run on the engine thread (worker.Job.slot_action)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import slot_file
from ..files.slot_file import SlotFileError
from .slots import Slot

ACTIONS = ("save", "restore", "erase")


@dataclass(frozen=True)
class SlotAction:
    """The action, the folder (--slot-save-path), the file's name in it, and the id of the model
    (a slot file restores only into the model that saved it)."""

    kind: str  # save | restore | erase
    folder: Path | None = None
    filename: str = ""
    model_id: str = ""


def run(engine: Any, slot: Slot, a: SlotAction) -> dict[str, Any]:
    """llama-server's body of the action. SlotFileError: a bad name, file, or another model's."""
    t0 = time.perf_counter()

    def ms() -> float:
        return round((time.perf_counter() - t0) * 1000, 3)

    if a.kind == "erase":
        n = len(slot.kv)
        engine.seq_clear(slot.id)
        slot.kv = []
        return {"id_slot": slot.id, "n_erased": n}
    assert a.folder is not None
    if a.kind == "save":
        tokens = list(slot.kv)
        n = slot_file.save(a.folder, a.filename, a.model_id, tokens, engine.seq_state(slot.id))
        return {"id_slot": slot.id, "filename": a.filename, "n_saved": len(tokens), "n_written": n,
                "timings": {"save_ms": ms()}}
    tokens, state, n = slot_file.load(a.folder, a.filename, a.model_id)
    slot.kv = []
    if not engine.seq_restore(slot.id, state, len(tokens)):
        raise SlotFileError(f"{a.filename}: llama.cpp could not restore it into this context (saved with another "
                            "-c, -np or cache type?)")
    slot.kv = tokens
    return {"id_slot": slot.id, "filename": a.filename, "n_restored": len(tokens), "n_read": n,
            "timings": {"restore_ms": ms()}}
