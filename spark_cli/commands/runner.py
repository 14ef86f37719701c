"""The error boundary every `spark` command line runs through: `cli.main`'s, and `spark demo`'s
for each of its steps. One red line and exit code 2 for a SparkError (SPARK_DEBUG=1: traceback)."""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

from ..errors import SparkError
from .common import unalias


def print_error(line: str) -> None:
    Console(stderr=True, highlight=False).print(Text("error:", style="bold red") + Text(" " + line), soft_wrap=True)


def run_argv(root: TyperGroup, argv: list[str]) -> int:
    """Run one command line (aliases unaliased) on the root command group; its exit code."""
    try:
        rv = root.main(args=unalias(argv), standalone_mode=False)  # typer.Exit(code) comes back as rv
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
