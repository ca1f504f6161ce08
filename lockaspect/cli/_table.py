"""Tables that fit the terminal: plain text (any width, every line at most ``width``
characters) or rich, from the same columns and rows."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Column", "plain_lines", "rich_table", "shorten"]

_GAP = 2
#: A rich table's columns: a space of padding on each side and the box's separator.
_RICH_GAP = 3
ELLIPSIS = "…"


@dataclass(frozen=True)
class Column:
    """A table column: ``flexible`` columns shrink (their cells shortened with an ellipsis,
    or wrapped when ``wrap``) to fit the width, down to ``min_width``."""

    header: str
    flexible: bool = False
    min_width: int = 6
    right: bool = False
    wrap: bool = False
    style: str | None = None
    #: rich only: a style per cell value, e.g. (("error", "bold red"),).
    value_styles: tuple[tuple[str, str], ...] = ()


def shorten(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, the cut shown by an ellipsis."""
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    return text[: width - 1] + ELLIPSIS


def fit_widths(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, headers: bool = True, gap: int = _GAP
) -> list[int]:
    """Each column's width: its widest cell, the flexible ones shrunk (widest first) until
    the row fits ``width`` with ``gap`` spaces between columns."""
    widths = [len(column.header) if headers else 0 for column in columns]
    for row in rows:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], len(cell))
    excess = sum(widths) + gap * (len(columns) - 1) - width
    while excess > 0:
        shrinkable = [i for i, c in enumerate(columns) if c.flexible and widths[i] > c.min_width]
        if not shrinkable:
            break
        widths[max(shrinkable, key=lambda i: widths[i])] -= 1
        excess -= 1
    return widths


def _cell_lines(column: Column, text: str, width: int) -> list[str]:
    if column.wrap and len(text) > width:
        return textwrap.wrap(text, width, break_on_hyphens=False) or [""]
    return [shorten(text, width)]


def plain_lines(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, *, headers: bool = True
) -> list[str]:
    """The table as lines of text, none longer than ``width`` (a last resort cuts them)."""
    widths = fit_widths(columns, rows, width, headers)
    out: list[str] = []

    def emit(cells: Sequence[str]) -> None:
        split = [
            _cell_lines(column, cell, widths[i]) for i, (column, cell) in enumerate(zip(columns, cells, strict=True))
        ]
        for line_no in range(max(len(lines) for lines in split)):
            parts = []
            for i, column in enumerate(columns):
                text = split[i][line_no] if line_no < len(split[i]) else ""
                parts.append(text.rjust(widths[i]) if column.right else text.ljust(widths[i]))
            out.append(shorten((" " * _GAP).join(parts).rstrip(), width))

    if headers:
        emit([column.header for column in columns])
    for row in rows:
        emit(row)
    return out


def rich_table(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, *, headers: bool = True, title: str = ""
) -> Any:
    """The table as a rich ``Table`` at most ``width`` wide: the column widths are fitted as for
    the plain table (rich's own shrinking would drop whole columns first)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(
        box=box.SIMPLE_HEAD if headers else None,
        show_header=headers,
        show_edge=False,
        pad_edge=False,
        title=title or None,
        title_justify="left",
    )
    widths = fit_widths(columns, rows, width, headers, gap=_RICH_GAP)
    for column, column_width in zip(columns, widths, strict=True):
        table.add_column(
            column.header,
            justify="right" if column.right else "left",
            no_wrap=not column.wrap,
            overflow="fold" if column.wrap else "ellipsis",
            width=column_width,
            style=column.style,
        )
    for row in rows:
        table.add_row(
            *(Text(cell, style=dict(c.value_styles).get(cell, "")) for c, cell in zip(columns, row, strict=True))
        )
    return table
