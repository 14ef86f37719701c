"""Where Spark keeps its state: one directory, moved with SPARK_HOME."""

from __future__ import annotations

import os
from pathlib import Path

ENV_HOME = "SPARK_HOME"


def spark_home() -> Path:
    """Root of every cache Spark writes (builds, downloads, demo models)."""
    env = os.environ.get(ENV_HOME)
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "spark"
    root.mkdir(parents=True, exist_ok=True)
    return root


def downloads_dir() -> Path:
    d = spark_home() / "downloads"
    d.mkdir(parents=True, exist_ok=True)
    return d


def models_dir() -> Path:
    d = spark_home() / "models"
    d.mkdir(parents=True, exist_ok=True)
    return d

