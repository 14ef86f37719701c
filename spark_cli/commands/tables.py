"""Tables that are never cut: wider than the console (80 columns in a pipe), they continue in a
second table that repeats the label columns, instead of rich's ellipsised cells."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Iterator

from rich.console import Console, ConsoleOptions
from rich.measure import Measurement
from rich.table import Column, Table


def _needs(console: Console, options: ConsoleOptions, table: Table, column: Column) -> int:
    """Columns one column takes with its cells and its header on one line (as rich lays out a table that fits)."""
    header = Measurement.get(console, options, column.header).maximum if column.header else 0
    cells = [Measurement.get(console, options, cell).maximum for cell in column.cells]
    _, right, _, left = table.padding
    return max(column.min_width or 0, header, *cells) + left + right + (1 if table.box else 0)


def column_groups(console: Console, options: ConsoleOptions, table: Table, keys: int = 1) -> list[list[int]]:
    """The columns of each part: all of them when they fit the width, else the `keys` label
    columns plus as many of the next as fit, part after part (a column too wide goes alone)."""
    needs = [_needs(console, options, table, c) for c in table.columns]
    edge = 1 if table.box else 0
    if edge + sum(needs) <= options.max_width or len(needs) <= keys:
        return [list(range(len(needs)))]
    labels = list(range(keys))
    groups: list[list[int]] = []
    for i in range(keys, len(needs)):
        if groups and edge + sum(needs[j] for j in groups[-1]) + needs[i] <= options.max_width:
            groups[-1].append(i)
        else:
            groups.append([*labels, i])
    return groups


def _part(table: Table, columns: list[int], first: bool, last: bool) -> Table:
    part = copy.copy(table)
    # NOTE: a column's _index decides its edge padding; the rows' styles are shared
    part.columns = [dataclasses.replace(table.columns[i], _index=n) for n, i in enumerate(columns)]
    part.title = table.title if first or not table.title else f"{table.title} (continued)"
    part.caption = table.caption if last else None
    return part


@dataclass
class Whole:
    """A rich renderable: `table` in one piece or in parts, each within the console's width; every
    part repeats the first `keys` columns (what a row is)."""

    table: Table
    keys: int = 1

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Table]:
        groups = column_groups(console, options, self.table, self.keys)
        for n, columns in enumerate(groups):
            yield _part(self.table, columns, n == 0, n == len(groups) - 1)
