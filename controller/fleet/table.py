"""A plain text table that fits a terminal: shrink what may shrink, wrap nothing.

``render(columns, rows, width)`` lays out the columns two spaces apart at their natural
width; when that is too wide, the columns that have a ``min_width`` give up characters
(the widest first) down to it, cut text ending in ``…``. A ``Span`` row fills its first
cells and lets one text run across all the rest (a node that failed: its reason), cut to the
width. ``width`` None (output that is not a terminal: a pipe, a file) cuts nothing: every
value is whole, for grep and awk. Lines never carry trailing spaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GAP = "  "


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    right: bool = False  # right-aligned (numbers)
    min_width: int | None = None  # may shrink to this; None: never shrinks


@dataclass(frozen=True, slots=True)
class Span:
    """A row whose ``cells`` fill the first columns and whose ``text`` spans the others."""

    cells: tuple[str, ...]
    text: str


Row = tuple[str, ...] | Span


def cut(text: str, width: int, ellipsis: str = "…") -> str:
    """``text`` in at most ``width`` characters, ending in ``ellipsis`` when cut."""
    if len(text) <= width:
        return text
    if width <= len(ellipsis):
        return text[:width]
    return text[: width - len(ellipsis)] + ellipsis


def _cell(text: str, width: int, column: Column, ellipsis: str | None) -> str:
    # Only a column that may shrink is cut; another keeps a longer value whole (a streamed
    # table's widths come from its first rows: a misaligned number beats a wrong one).
    # ellipsis None: nothing is cut (not a terminal).
    if column.min_width is not None and ellipsis is not None:
        text = cut(text, width, ellipsis)
    return text.rjust(width) if column.right else text.ljust(width)


def fit_widths(columns: Sequence[Column], rows: Sequence[Row], width: int | None) -> list[int]:
    """Each column's width: natural, then shrunk (widest shrinkable first) to fit ``width``
    (None: natural)."""
    widths = [len(c.header) for c in columns]
    for row in rows:
        cells = row.cells if isinstance(row, Span) else row
        for index, text in enumerate(cells):
            widths[index] = max(widths[index], len(text))
    if width is None:
        return widths
    excess = sum(widths) + len(GAP) * (len(columns) - 1) - width
    while excess > 0:
        shrinkable = [
            i
            for i, c in enumerate(columns)
            if c.min_width is not None and widths[i] > max(c.min_width, len(c.header))
        ]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1
    return widths


def render(
    columns: Sequence[Column], rows: Sequence[Row], width: int | None, *, ellipsis: str = "…"
) -> list[str]:
    """The table's lines (header first); ``width`` None: nothing cut."""
    widths = fit_widths(columns, rows, width)
    cutting = None if width is None else ellipsis
    lines = [_line(columns, [c.header for c in columns], widths, cutting)]
    lines += [render_row(columns, row, widths, width, ellipsis) for row in rows]
    return lines


def render_row(
    columns: Sequence[Column],
    row: Row,
    widths: Sequence[int],
    width: int | None,
    ellipsis: str = "…",
) -> str:
    """One line of a table whose column ``widths`` are already fitted (a streamed table);
    ``width`` None: nothing cut."""
    cutting = None if width is None else ellipsis
    if isinstance(row, Span):
        head = "".join(
            _cell(text, widths[i], columns[i], cutting) + GAP for i, text in enumerate(row.cells)
        )
        if width is None:
            return (head + row.text).rstrip()
        room = max(width - len(head), 8)
        return (head + cut(row.text, room, ellipsis)).rstrip()
    return _line(columns, list(row), widths, cutting)


def row_format(columns: Sequence[Column], widths: Sequence[int]) -> str:
    """``{:<8}  {:>3}  ...``: what ``render_row`` makes of a row of plain cells when nothing
    is cut (``width`` None), as one ``str.format`` (then ``rstrip``): a streamed table's rows
    in one call each rather than one per cell."""
    return GAP.join(
        "{:" + (">" if column.right else "<") + str(size) + "}"
        for column, size in zip(columns, widths, strict=True)
    )


def _line(
    columns: Sequence[Column], cells: list[str], widths: Sequence[int], ellipsis: str | None
) -> str:
    parts = [_cell(text, widths[i], columns[i], ellipsis) for i, text in enumerate(cells)]
    return GAP.join(parts).rstrip()
