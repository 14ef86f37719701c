"""A failed save keeps what was gathered: the same data goes to a recovery file, named in the error.

Recovery files go beside the model (or another folder the caller names) as
`<name>.recovered-<utc>`, else under `$SPARK_HOME/recovery/`.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ..errors import SaveError, SparkError


def _places(path: Path, beside: Path | None) -> list[Callable[[], Path]]:
    from .paths import spark_home

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    stem, suffix = path.stem, path.suffix
    name = f"{stem}.recovered-{stamp}{suffix}"
    out: list[Callable[[], Path]] = []
    if beside is not None:
        out.append(lambda: Path(beside) / name)
    out.append(lambda: spark_home() / "recovery" / name)
    return out


def save_or_recover(write: Callable[[Path], object], path: Path | str, beside: Path | None = None) -> Path:
    """`write(path)`; when that raises SaveError, `write` a recovery file instead and raise a
    SaveError that names it (or says that nothing could be kept). Returns `path` on success."""
    path = Path(path)
    try:
        write(path)
        return path
    except SaveError as e:
        failure = e
    for place in _places(path, beside):
        try:
            target = place()
            target.parent.mkdir(parents=True, exist_ok=True)
            write(target)
        except (SparkError, OSError):
            continue
        raise SaveError(f"{failure.message}; what was gathered is kept in {target}",
                        hint=f"move it to {path} when there is room") from None
    raise SaveError(f"{failure.message}; no recovery file could be written either",
                    hint="free some disk space or write to another folder") from None
