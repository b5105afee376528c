"""A fleet command's results and output as ``nvidia-docker-ctl`` makes them, for tests that
hold the results in a list: each function hands them, in order, to the part the ctl uses
(``controller.ctl.fleet.run_fleet_command``): ``ask_fleet`` for the answers, the sinks of
``controller.fleet.report`` for what is printed, ``StatusNotes`` for what ``status`` says
after its table.

``whole_table`` is the test's own reference: the table rendered at once from every row, its
columns fitted to all of them, which the streaming table must equal up to its lookahead.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from typing import Any

from controller.fleet.health_view import StatusNotes
from controller.fleet.query import DEFAULT_PARALLEL, FleetNode, NodeResult, Query, ask_fleet
from controller.fleet.report import JsonDocumentSink, ProblemSink, TableSink, table_layout
from controller.fleet.table import render


async def ask_all(
    nodes: Sequence[FleetNode],
    query: Query,
    *,
    timeout_s: float,
    parallel: int = DEFAULT_PARALLEL,
    on_result: Callable[[NodeResult], None] | None = None,
) -> list[NodeResult]:
    """Every node's result, in the order of ``nodes``; ``on_result`` as each one finishes."""
    results: list[NodeResult | None] = [None] * len(nodes)

    def keep(index: int, result: NodeResult) -> None:
        results[index] = result
        if on_result is not None:
            on_result(result)

    await ask_fleet(nodes, query, keep, parallel=parallel, timeout_s=timeout_s)
    return [r for r in results if r is not None]


def table(
    query: Query, results: Sequence[NodeResult], width: int | None, ellipsis: str = "…"
) -> list[str]:
    """The table's lines (``TableSink``), header first; ``width`` None: not a terminal."""
    out = io.StringIO()
    sink = TableSink(query, [r.node for r in results], out, width, ellipsis)
    for result in results:
        sink.add(result)
    sink.close()
    return out.getvalue().splitlines()


def problem_lines(results: Sequence[NodeResult]) -> list[str]:
    """What ``health`` prints without ``--json`` (``ProblemSink``)."""
    out = io.StringIO()
    sink = ProblemSink(out)
    for result in results:
        sink.add(result)
    sink.close()
    return out.getvalue().splitlines()


def json_document(query: Query, results: Sequence[NodeResult]) -> dict[str, Any]:
    """The ``--json`` document (``JsonDocumentSink``), parsed."""
    out = io.StringIO()
    sink = JsonDocumentSink(query, out)
    for result in results:
        sink.add(result)
    sink.close()
    document: dict[str, Any] = json.loads(out.getvalue())
    return document


def status_notes(results: Sequence[NodeResult]) -> list[str]:
    """What ``status`` says on standard error after its table (without the ``PROG:``)."""
    notes = StatusNotes()
    for result in results:
        notes.add(result)
    return notes.lines()


def whole_table(
    query: Query, results: Sequence[NodeResult], width: int | None, ellipsis: str = "…"
) -> list[str]:
    """The reference table: every row at once, the columns fitted to all of them."""
    columns, make_rows = table_layout(query)
    rows = [row for result in results for row in make_rows(result)]
    return render(columns, rows, width, ellipsis=ellipsis)
