"""Options and helpers shared by the commands."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

RPC_HELP = "comma-separated list of RPC servers (HOST:PORT), as llama.cpp's --rpc"


def model_or_demo(model: Path | None) -> Path:
    """The model path given, or the built-in demo model (built and cached on first use)."""
    if model is not None:
        return model
    from ..demo_model import build_demo_model

    with console.status("building the demo model (first run only) ..."):
        return build_demo_model()

