"""`--help` of every command: rich's panels, with each flag's names whole at any width.

Typer's panels give long names, short names, negations and types a column each and cut what
does not fit (`--chat-template-f…` at 80 columns). Here a flag's names are one cell, as
llama.cpp's `--help` prints them (`-c, --ctx-size <int range>`); the help text wraps beside
them, or below them when the names are wider than the column.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

NAME_STYLES = [(r"(?:^|(?<=[\s,/]))-{1,2}[\w][\w-]*", "bold cyan"), (r"<[^>]*>", "bold yellow")]
EXTRA = re.compile(r"\s{2}(\[[^\]]*\])$")  # click's trailing "[default: ...; x>=1]"
GAP = 2
NAMES_SHARE = 0.5  # the names column takes at most this share; wider names get their help below them


def _names(record: str) -> Text:
    text = Text(record)
    for pattern, style in NAME_STYLES:
        text.highlight_regex(pattern, style=style)
    return text


def _help(record: str) -> Text:
    m = EXTRA.search(record)
    text = Text(record[:m.start()] if m else record, overflow="fold")
    if m:
        text.append("  " + m.group(1), style="dim")
    return text


def _names_column(records: list[tuple[str, str]], inner: int) -> int:
    """Width of the names column: the widest names within NAMES_SHARE of the panel."""
    fitting = [len(n) for n, _ in records if len(n) + GAP <= inner * NAMES_SHARE]
    return max(fitting, default=0)


def _row(names: str, help_: str, column: int) -> RenderableType:
    if column and len(names) <= column:
        grid = Table.grid(padding=(0, GAP, 0, 0))
        grid.add_column(width=column, no_wrap=True)
        grid.add_column(ratio=1)
        grid.add_row(_names(names), _help(help_))
        return grid
    return Group(_names(names), Padding(_help(help_), (0, 0, 0, column + GAP if column else 4)))


def options_panel(title: str, records: list[tuple[str, str]], width: int) -> Panel:
    """One panel of (names, help) records at a console `width`: names whole, help wrapped."""
    column = _names_column(records, width - 4)
    return Panel(Group(*(_row(n, h, column) for n, h in records)), title=title, title_align="left",
                 border_style="dim")


def _paragraphs(help_: str) -> Text:
    paras = [" ".join(p.split()) for p in help_.strip().split("\n\n")]
    return Text("\n\n".join(p for p in paras if p))


def _panels(command: Any, ctx: Any) -> dict[str, list[tuple[str, str]]]:
    """(names, help) per panel: the arguments' panels first, then the options', as typer orders them."""
    arguments: dict[str, list[tuple[str, str]]] = defaultdict(list)
    options: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        is_arg = param.param_type_name == "argument"
        panel = getattr(param, "rich_help_panel", None) or ("Arguments" if is_arg else "Options")
        (arguments if is_arg else options)[panel].append((record[0], record[1] or ""))
    return {**arguments, **options}


def render_help(command: Any, ctx: Any, console: Console) -> None:
    console.print(Padding(Text(command.get_usage(ctx), style="yellow"), 1))
    if command.help:
        console.print(Padding(_paragraphs(command.help), (0, 1, 1, 1)))
    for title, records in _panels(command, ctx).items():
        console.print(options_panel(title, records, console.width))


class SparkCommand(TyperCommand):
    """A typer command whose --help keeps every flag name whole (render_help)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        render_help(self, ctx, Console(highlight=False))
