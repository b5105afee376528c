"""Fleet output that streams: rows and JSON printed as nodes answer, in bounded memory.

A query over ten thousand nodes must not hold ten thousand answers (a parsed ``status`` of an
8-GPU node is tens of kilobytes of Python objects). Each sink turns a node's answer into what
it prints as soon as the node is done, and drops the answer:

- ``JsonLinesSink``: one line per node, in the order nodes finish. Output is flushed at most
  every 50 ms rather than per node (one write system call per node is a tenth of a
  10,000-node query's time).
- ``TableSink`` and ``JsonDocumentSink``: in the order the nodes were named, through a
  reorder window (``OrderedWindow``): a node that finished before an earlier one waits as a
  few rendered lines; the query does not start node ``i`` until node ``i - window`` is
  printed, so what waits is bounded by the window whatever the fleet's size.
- The table's column widths are fitted to the first ``TABLE_LOOKAHEAD`` nodes (and the
  longest node name of all), then kept: on a terminal a later value that is longer is cut
  with ``…`` where its column may shrink; without a width (not a terminal) it is kept
  whole. Up to that many nodes the table is exactly ``table.render``'s of all its rows.
- ``CountingSink``: only the summary, for ``free``, whose table is sorted and so printed
  once every node is done (``free_view.FreeTally`` keeps the qualifying nodes' few facts);
  ``JsonDocumentSink`` takes its list (a ``Digest``) to end the document with.
- ``Summary`` counts nodes, answers, GPUs and failures by reason as they come (and how many
  of the failed nodes' agents answered, with an error); the whole messages of the first
  ``MAX_ERROR_LINES`` failures are kept for standard error, the rest counted by reason.
- Output is any ``Output`` (a text stream; ``output.ProgressAware`` when a progress line
  shares the terminal). The table's ``width`` is None when stdout is not a terminal: no
  value is cut.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from controller.fleet.health_view import problem_lines, problems
from controller.fleet.lease_view import LEASE_COLUMNS, lease_rows
from controller.fleet.output import (
    DOCKER_COLUMNS,
    INFO_COLUMNS,
    STATUS_COLUMNS,
    STATUS_PROCESS_COLUMNS,
    docker_rows,
    gpu_count,
    info_rows,
    json_line,
    node_entry,
    status_process_rows,
    status_rows,
)
from controller.fleet.query import FleetNode, NodeResult, Query
from controller.fleet.table import Column, Row, Span, fit_widths, render_row, row_format

TABLE_LOOKAHEAD = 256  # nodes whose rows decide the table's column widths
FLUSH_INTERVAL_S = 0.05  # a reader sees new lines this soon; no write system call per node
MAX_ERROR_LINES = 1000  # whole failure messages kept for standard error
DEFAULT_WINDOW = 1024  # nodes that may finish ahead of the first one not yet printed


class Output(Protocol):
    """Where a sink writes: a text stream."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


@dataclass
class Summary:
    """What the last lines say: nodes, answered, failed (by reason), GPUs."""

    nodes: int = 0
    answered: int = 0
    refused: int = 0  # failed, though their agent answered (an HTTP error: 400, 409, 503...)
    gpus: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (node, message), the first
    errors_left_out: int = 0

    @property
    def failed(self) -> int:
        return self.nodes - self.answered

    @property
    def reached(self) -> int:
        """Nodes whose agent answered at all (with the answers or with an error)."""
        return self.answered + self.refused

    def add(self, result: NodeResult) -> None:
        self.nodes += 1
        if result.ok:
            self.answered += 1
            self.gpus += gpu_count(result)
            return
        if result.reached:
            self.refused += 1
        self.reasons[result.reason or "error"] += 1
        if len(self.errors) < MAX_ERROR_LINES:
            self.errors.append((result.node.name, result.error or ""))
        else:
            self.errors_left_out += 1

    def as_dict(self) -> dict[str, int]:
        return {
            "nodes": self.nodes,
            "answered": self.answered,
            "failed": self.failed,
            "gpus": self.gpus,
        }


class OrderedWindow:
    """Hands results on in the nodes' order; at most ``window`` may wait for an earlier one.

    ``admit(index)`` is awaited by the query before it starts node ``index``; ``put(index,
    result)`` takes each finished node and calls ``emit`` for every node that is next in line.
    """

    def __init__(self, emit: Callable[[NodeResult], None], window: int = DEFAULT_WINDOW) -> None:
        self.emit = emit
        self.window = max(1, window)
        self.next = 0  # the first node not yet emitted
        self._waiting: dict[int, NodeResult] = {}
        self._moved = asyncio.Event()

    async def admit(self, index: int) -> None:
        while index >= self.next + self.window:
            self._moved.clear()
            await self._moved.wait()

    def put(self, index: int, result: NodeResult) -> None:
        self._waiting[index] = result
        moved = False
        while self.next in self._waiting:
            self.emit(self._waiting.pop(self.next))
            self.next += 1
            moved = True
        if moved:
            self._moved.set()

    @property
    def waiting(self) -> int:
        return len(self._waiting)


class _Flusher:
    """Flushes ``out`` at most every ``FLUSH_INTERVAL_S`` (and at the end)."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self._flushed_at = 0.0

    def maybe(self) -> None:
        now = time.monotonic()
        if now - self._flushed_at >= FLUSH_INTERVAL_S:
            self.out.flush()
            self._flushed_at = now


class JsonLinesSink:
    """``--jsonl``: one compact line per node, as it is done (flushed within 50 ms)."""

    ordered = False

    def __init__(self, out: Output) -> None:
        self.out = out
        self.summary = Summary()
        self._flush = _Flusher(out)

    def add(self, result: NodeResult) -> None:
        self.summary.add(result)
        self.out.write(json_line(result) + "\n")
        self._flush.maybe()

    def close(self) -> None:
        self.out.flush()


class Digest(Protocol):
    """What a command adds to its ``--json`` document after the nodes (``free``: the
    qualifying nodes, best first): a list under ``key``, fed by the command as nodes answer."""

    key: str

    def json(self) -> list[dict[str, Any]]: ...


class JsonDocumentSink:
    """``--json``: one document, each node's entry on one line of it, written node by node.

    The top level is indented (``command``, ``nodes``, ``summary``); a node's entry is one
    line (the C encoder: pretty-printing ten thousand entries would take seconds).
    """

    ordered = True

    def __init__(self, query: Query, out: Output, digest: Digest | None = None) -> None:
        self.out = out
        self.summary = Summary()
        self._digest = digest
        self._first = True
        # health: the document lists the problems too (only they are kept, not the answers)
        self._problems: list[dict[str, object]] | None = [] if query.name == "health" else None
        out.write("{\n" + f'  "command": {json.dumps(query.name)},\n' + '  "nodes": {')

    def add(self, result: NodeResult) -> None:
        self.summary.add(result)
        if self._problems is not None:
            self._problems += [problem.json() for problem in problems([result])]
        name = json.dumps(result.node.name)
        entry = json.dumps(node_entry(result))
        self.out.write(("\n" if self._first else ",\n") + f"    {name}: {entry}")
        self._first = False

    def close(self) -> None:
        summary = json.dumps(self.summary.as_dict())
        self.out.write("}" if self._first else "\n  }")
        if self._problems is not None:
            self.out.write(',\n  "problems": [')
            self.out.write(",".join(f"\n    {json.dumps(p)}" for p in self._problems))
            self.out.write("\n  ]" if self._problems else "]")
        if self._digest is not None:
            items = self._digest.json()
            self.out.write(f",\n  {json.dumps(self._digest.key)}: [")
            self.out.write(",".join(f"\n    {json.dumps(item)}" for item in items))
            self.out.write("\n  ]" if items else "]")
        self.out.write(f',\n  "summary": {summary}\n}}\n')
        self.out.flush()


class CountingSink:
    """Only the summary: for a command that prints its rows once every node is done
    (``free``, sorted best first)."""

    ordered = False

    def __init__(self) -> None:
        self.summary = Summary()

    def add(self, result: NodeResult) -> None:
        self.summary.add(result)

    def close(self) -> None:
        pass


class ProblemSink:
    """``health`` without ``--json``: only the problems, one whole line each (never cut to
    the terminal: the reason is the point), in the nodes' order as they answer."""

    ordered = True

    def __init__(self, out: Output) -> None:
        self.out = out
        self.summary = Summary()
        self._flush = _Flusher(out)

    def add(self, result: NodeResult) -> None:
        self.summary.add(result)
        lines = problem_lines([result])
        if lines:
            self.out.write("".join(line + "\n" for line in lines))
            self._flush.maybe()

    def close(self) -> None:
        self.out.flush()


def table_layout(query: Query) -> tuple[tuple[Column, ...], Callable[[NodeResult], list[Row]]]:
    if query.name == "leases":
        return LEASE_COLUMNS, lease_rows
    if query.name == "status" and any(r.key == "processes" for r in query.requests):
        return STATUS_PROCESS_COLUMNS, status_process_rows
    if query.name == "status":
        return STATUS_COLUMNS, status_rows
    if query.name == "info":
        return INFO_COLUMNS, info_rows
    return DOCKER_COLUMNS, docker_rows


class TableSink:
    """The table, header first, rows in the nodes' order, streamed after the first nodes."""

    ordered = True

    def __init__(
        self,
        query: Query,
        nodes: Sequence[FleetNode],
        out: Output,
        width: int | None,
        ellipsis: str = "…",
        lookahead: int = TABLE_LOOKAHEAD,
    ) -> None:
        self.columns, self.make_rows = table_layout(query)
        self.out = out
        self.width = width
        self.ellipsis = ellipsis
        self.summary = Summary()
        self._lookahead = max(1, min(lookahead, len(nodes)))
        self._longest_name = max((n.name for n in nodes), key=len, default="")
        self._held: list[Row] = []  # rows of the first nodes, until the widths are known
        self._held_nodes = 0
        self._widths: list[int] | None = None
        self._format = ""  # table.row_format once the widths are known, when nothing is cut
        self._flush = _Flusher(out)

    def add(self, result: NodeResult) -> None:
        self.summary.add(result)
        rows = self.make_rows(result)
        if self._widths is not None:
            self._write(rows)
            return
        self._held += rows
        self._held_nodes += 1
        if self._held_nodes >= self._lookahead:
            self._start()

    def _start(self) -> None:
        sizing: list[Row] = [*self._held, Span((self._longest_name,), "")]
        self._widths = fit_widths(self.columns, sizing, self.width)
        if self.width is None:  # nothing cut: a plain row is one format call
            self._format = row_format(self.columns, self._widths)
        header = tuple(c.header for c in self.columns)
        self._write([header, *self._held])
        self._held = []

    def _write(self, rows: list[Row]) -> None:
        widths = self._widths
        assert widths is not None
        plain, count = self._format, len(self.columns)
        lines = [
            plain.format(*row).rstrip()
            if plain and not isinstance(row, Span) and len(row) == count
            else render_row(self.columns, row, widths, self.width, self.ellipsis)
            for row in rows
        ]
        self.out.write("".join(line + "\n" for line in lines))
        self._flush.maybe()

    def close(self) -> None:
        if self._widths is None:
            self._start()
        self.out.flush()
