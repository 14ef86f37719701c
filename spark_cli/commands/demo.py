"""`spark demo-model` (build the demo/tiny GGUFs) and `spark demo` (the main job on the demo model)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import SparkError
from .common import console


def register(app: typer.Typer) -> None:
    @app.command("demo-model")
    def demo_model(
        n_expert: int = typer.Option(16, "--experts", "-E", help="experts per layer"),
        n_used: int = typer.Option(4, "--experts-used", "-k", help="experts used per token"),
        seed: int = typer.Option(0, "--seed", help="router seed"),
        tiny: str = typer.Option(None, "--tiny", help="build a tiny random model of this architecture instead"),
        out_dir: Path = typer.Option(None, "--out-dir", help="folder (default: $SPARK_HOME/models)"),
    ) -> None:
        """Build (or reuse) the upcycled SmolLM2 MoE demo model; prints its path on the last line."""
        from ..demo_model import TINY_ARCHES, build_demo_model, build_tiny_model

        if tiny:
            if tiny not in TINY_ARCHES:
                raise SparkError(f"--tiny {tiny}: unknown architecture", hint="one of " + ", ".join(TINY_ARCHES))
            with console.status(f"building tiny {tiny} model ..."):
                path = build_tiny_model(tiny, seed=seed, out_dir=out_dir)
        else:
            if not (1 <= n_used <= n_expert <= 256):
                raise SparkError(f"--experts {n_expert} --experts-used {n_used}: need 1 <= k <= E <= 256")
            with console.status(f"building demo model E={n_expert} k={n_used} ..."):
                path = build_demo_model(n_expert=n_expert, n_expert_used=n_used, seed=seed, out_dir=out_dir)
        console.print(f"{path.stat().st_size / 2**20:.0f} MiB", style="dim")
        print(path)
