"""Last words before ggml aborts: a dead RPC server or GPU makes ggml call its abort callback,
then abort(). The server uses that moment to answer 503, fold what it learned and exit 1.

NOTE: a stopgap at the server's edge until the engine reports device loss as an exception
(the engine then raises, and the worker's ordinary fatal path answers 503 and exits 1).
"""

from __future__ import annotations

import ctypes
import re
from typing import Callable

_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_installed: list[object] = []  # keeps the ctypes callback alive
_FILE_LINE = re.compile(r"^\S+:\d+: ")


def install(handler: Callable[[str], None]) -> bool:
    """Call `handler(message)` when ggml aborts (the handler should not return). False if the
    library has no abort callback."""
    from .. import llama_lib

    base = ctypes.CDLL(str(llama_lib._soname(llama_lib.load().libdir, "libggml-base")))
    setter = getattr(base, "ggml_set_abort_callback", None)
    if setter is None:
        return False
    setter.restype = ctypes.c_void_p
    setter.argtypes = [_ABORT_CB]

    def on_abort(raw: bytes | None) -> None:
        text = (raw or b"").decode(errors="replace").strip()
        handler(_FILE_LINE.sub("", text) or "ggml aborted")

    cb = _ABORT_CB(on_abort)
    _installed.append(cb)
    setter(cb)
    return True
