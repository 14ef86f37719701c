"""One run sequence for chat, serve and bench: open the engine for a placement, put each cached
layer on its miss path (miss_path.resolve), keep what was learned if the device is lost
(faults.keeper), and close the engine at the end; folding the counts is the caller's last step
(session.fold_into_profile), inside the keeper's reach."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, ContextManager, Iterator

from ..native import faults
from ..native.engine import Engine, EngineOptions


def open_engine(opts: EngineOptions, miss_path: str, fingerprint: str, *, home: Path | None = None,
                on_why: Callable[[str], None] | None = None,
                loading: ContextManager | None = None) -> Engine:
    """The engine, each cached layer on its miss path (auto: calibrated, then cached under
    SPARK_HOME); `on_why` gets the one line that says what was chosen. Closed again on failure."""
    from . import miss_path as mp
    from ..files.paths import spark_home

    with loading or contextlib.nullcontext():
        engine = Engine(opts)
    try:
        if opts.cache_layers:
            # NOTE: before any generation: an `auto` calibration resets the KV cache and counters
            _, why = mp.resolve(engine, miss_path, fingerprint, home or spark_home())
            if why and on_why:
                on_why(why)
    except BaseException:
        engine.close()
        raise
    return engine


@contextlib.contextmanager
def engine_run(opts: EngineOptions, miss_path: str, fingerprint: str, *,
               keep: Callable[[], str | None] | None = None, home: Path | None = None,
               on_why: Callable[[str], None] | None = None,
               loading: ContextManager | None = None) -> Iterator[Engine]:
    """open_engine, then the body under `keep` (run if the device is lost), then close."""
    engine = open_engine(opts, miss_path, fingerprint, home=home, on_why=on_why, loading=loading)
    try:
        with faults.keeper(keep) if keep is not None else contextlib.nullcontext():
            yield engine
    finally:
        engine.close()
