"""One run sequence for chat, serve, bench and profile: open the engine for a placement, put each cached
layer on its miss path (miss_path.resolve), keep what was learned if the device is lost
(faults.keeper), and close the engine at the end; folding the counts is the caller's last step
(session.fold_into_profile), inside the keeper's reach."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, ContextManager, Iterator

from ..native import faults
from ..native.engine import Engine, EngineOptions


def open_engine(opts: EngineOptions, miss_path: str, fingerprint: str, *, home: Path | None = None,
                on_why: Callable[[str], None] | None = None, loading: ContextManager | None = None,
                host_layers: list[int] | None = None) -> Engine:
    """The engine, each cached layer on its miss path (auto: calibrated, then cached under
    SPARK_HOME); `on_why` gets the one line that says what was chosen. Closed again on failure.
    `host_layers`: if the model does not load on the device, load again with these layers'
    experts in host RAM (and say so)."""
    from . import miss_path as mp
    from ..files.paths import spark_home

    with loading or contextlib.nullcontext():
        engine = _load(opts, host_layers, on_why)
    try:
        if opts.cache_layers and not opts.file_tier:  # NOTE: the file tier reads every miss into a slot
            # NOTE: before any generation: an `auto` calibration resets the KV cache and counters
            _, why = mp.resolve(engine, miss_path, fingerprint, home or spark_home())
            if why and on_why:
                on_why(why)
    except BaseException:
        engine.close()
        raise
    return engine


def _load(opts: EngineOptions, host_layers: list[int] | None, on_why: Callable[[str], None] | None) -> Engine:
    from ..errors import DeviceError, NativeError, SparkError, UsageError
    from ..native import devices

    try:
        return Engine(opts)
    except (NativeError, UsageError, DeviceError):
        raise
    except SparkError:
        if host_layers is None or not devices.select(devices.parse(opts.device, opts.rpc)):
            raise
        engine = Engine(dataclasses.replace(opts, host_layers=host_layers))
        if on_why:
            on_why("the model does not fit the device whole: expert weights stay in host RAM")
        return engine


@contextlib.contextmanager
def engine_run(opts: EngineOptions, miss_path: str, fingerprint: str, *,
               keep: Callable[[], str | None] | None = None, home: Path | None = None,
               on_why: Callable[[str], None] | None = None, loading: ContextManager | None = None,
               host_layers: list[int] | None = None) -> Iterator[Engine]:
    """open_engine, then the body under `keep` (run if the device is lost), then close."""
    engine = open_engine(opts, miss_path, fingerprint, home=home, on_why=on_why, loading=loading,
                         host_layers=host_layers)
    try:
        with faults.keeper(keep) if keep is not None else contextlib.nullcontext():
            yield engine
    finally:
        engine.close()
