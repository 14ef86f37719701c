"""`spark`: the command line. Thin: parse, call the engine or a pure module, render."""

from __future__ import annotations

import sys

import typer

from .commands import bench, chat, demo, plan, profile, serve, system
from .commands.runner import print_error, run_argv
from .native import faults
from .native.version import version_line

CONTEXT = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="spark",
    help="Run Mixture-of-Experts GGUF models larger than VRAM at close to all-GPU speed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=CONTEXT,
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_show_version,
                                 help="show Spark's, llama-cpp-python's and the native build's versions"),
) -> None:
    """Run Mixture-of-Experts GGUF models larger than VRAM at close to all-GPU speed."""


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    system.register(app)
    demo.register(app)
    profile.register(app)
    plan.register(app)
    chat.register(app)
    bench.register(app)
    serve.register(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point: every command registered, then the command line through run_argv's error boundary."""
    _register()
    faults.set_printer(print_error)
    return run_argv(typer.main.get_command(app), list(sys.argv[1:] if argv is None else argv))


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
