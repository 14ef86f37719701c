"""Where Spark keeps its state: one directory, moved with SPARK_HOME."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import UsageError

ENV_HOME = "SPARK_HOME"


def _folder(d: Path) -> Path:
    """`d`, created if missing; a path that is a file or cannot be created is one error line."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UsageError(f"{ENV_HOME} {d}: is a file, not a folder",
                         hint=f"point {ENV_HOME} at a folder, or unset it") from None
    except OSError as e:
        raise UsageError(f"{ENV_HOME}: cannot create folder {d} ({e.strerror or e})",
                         hint=f"point {ENV_HOME} at a folder you can write, or unset it") from None
    return d


def spark_home() -> Path:
    """Root of every cache Spark writes (builds, downloads, demo models)."""
    env = os.environ.get(ENV_HOME)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "spark"
    return _folder(root)


def downloads_dir() -> Path:
    return _folder(spark_home() / "downloads")


def models_dir() -> Path:
    return _folder(spark_home() / "models")


def pending_dir() -> Path:
    """Routing counts that could not join their profile (see profile_store)."""
    return _folder(spark_home() / "pending")
