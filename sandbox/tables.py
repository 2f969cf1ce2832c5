"""Tables that stay readable at any width, in a terminal or a pipe.

Numbers are never wrapped or cut: where the width is short, text cells wrap, and then whole
columns are left out, the least needed first, with a caption naming them (`--json` has them all).
`plain_table` is the same idea without rich: fixed-width text lines for the benchmarks' reports
and `akv conformance`, one table printer for everything that prints text.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Sequence

from rich import box
from rich.table import Table

TEXT_MIN = 10  # a text column wraps down to this many characters before columns are left out
PLAIN_WRAP_MIN = 20  # a plain table's wrapped last column keeps at least this many characters a line


@dataclass(frozen=True)
class Column:
    header: str
    number: bool = False  # a figure (or a timestamp): shown whole or not at all
    keep: int = 0         # columns with a lower value are left out first


def fitted_table(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int,
                 title: str | None = None, compact: bool = False, complete: str = "--json has every field") -> Table:
    """A rich Table of `rows` that fits `width` characters without cutting a number.

    A cell may hold several lines; `compact` draws only the rule under the header, one space
    between columns, so more columns fit. `complete` says where the left-out columns are found.
    """
    shown = list(range(len(columns)))
    for drop in sorted(shown, key=lambda i: columns[i].keep):
        if _least_width(columns, rows, shown, compact) <= width or len(shown) == 1:
            break
        shown.remove(drop)
    left_out = [columns[i].header.replace("\n", " ") for i in range(len(columns)) if i not in shown]
    caption = f"left out at {width} columns: {', '.join(left_out)} ({complete})" if left_out else None
    style = {"box": box.SIMPLE_HEAD, "pad_edge": False, "collapse_padding": True} if compact else {}
    table = Table(title=title, caption=caption, caption_justify="left", **style)
    for i in shown:
        c = columns[i]
        table.add_column(c.header, no_wrap=c.number, overflow="fold", justify="right" if c.number else "left",
                         min_width=_natural(c, rows, i) if c.number else None)
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table


def _natural(column: Column, rows: Sequence[Sequence[str]], i: int) -> int:
    """The widest line of the column's cells, its header included."""
    return max(len(line) for cell in [column.header, *(r[i] for r in rows)] for line in cell.splitlines() or [""])


def _least_width(columns: Sequence[Column], rows: Sequence[Sequence[str]], shown: Sequence[int],
                 compact: bool = False) -> int:
    """Characters the shown columns need at least: numbers whole, text wrapped to TEXT_MIN, borders."""
    need = 0
    for i in shown:
        natural = _natural(columns[i], rows, i)
        need += natural if columns[i].number else min(natural, TEXT_MIN)
    return need + (2 * len(shown) - 1 if compact else 3 * len(shown) + 1)


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool] | None = None,
                min_widths: Sequence[int] = (), width: int | None = None) -> str:
    """Fixed-width text: the header, a rule of dashes, one line per row, columns two spaces apart.

    A column is as wide as its widest cell (or `min_widths[i]`, when wider); `right` says which columns
    are right-aligned (default: every column but the first). With `width`, the last column is the free
    one: left-aligned and not padded, its cells wrap so that no line passes `width` (keeping at least
    PLAIN_WRAP_MIN characters a line), continued lines start under it, and its rule is as wide as its header.
    """
    right = [i > 0 for i in range(len(header))] if right is None else list(right)
    fixed = len(header) - 1 if width is not None else len(header)
    widths = [max([len(header[i]), *(len(row[i]) for row in rows), *min_widths[i:i + 1]]) for i in range(fixed)]
    if width is not None:
        widths.append(len(header[-1]))
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)

    def line(cells: Sequence[str]) -> list[str]:
        padded = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells[:fixed], widths, right)]
        if width is None:
            return ["  ".join(padded)]
        wrapped = textwrap.wrap(cells[-1], max(width - indent, PLAIN_WRAP_MIN), break_on_hyphens=False) or [""]
        return ["  ".join([*padded, wrapped[0]]), *(" " * indent + more for more in wrapped[1:])]

    lines = [*line(header), "  ".join("-" * w for w in widths)]
    for row in rows:
        lines += line(row)
    return "\n".join(lines)
