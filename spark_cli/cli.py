"""`spark`: the command line. Thin: parse, call the engine or a pure module, render."""

from __future__ import annotations

import os
import sys

import typer

from .errors import SparkError

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
        from .native.version import version_line

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
    from .commands import bench, chat, demo, plan, profile, serve, system

    system.register(app)
    demo.register(app)
    profile.register(app)
    plan.register(app)
    chat.register(app)
    bench.register(app)
    serve.register(app)


def print_error(line: str) -> None:
    from rich.console import Console
    from rich.text import Text

    Console(stderr=True, highlight=False).print(Text("error:", style="bold red") + Text(" " + line), soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point: one red line and exit code 2 for a SparkError (SPARK_DEBUG=1: traceback)."""
    _register()
    from .native import faults

    faults.set_printer(print_error)
    from .commands.common import unalias

    argv = unalias(list(sys.argv[1:] if argv is None else argv))
    try:
        rv = app(args=argv, standalone_mode=False)  # typer.Exit(code) comes back as rv
    except SparkError as e:
        if os.environ.get("SPARK_DEBUG"):
            raise
        print_error(e.one_line())
        return e.exit_code
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # usage errors arrive here in standalone_mode=False
        # NOTE: typer >= 0.20 vendors click (typer._click): duck-type its exceptions
        show, code = getattr(e, "show", None), getattr(e, "exit_code", None)
        if callable(show) and isinstance(code, int):
            show()
            return code
        raise
    return rv if isinstance(rv, int) else 0


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
