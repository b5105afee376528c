"""Who used the fleet's GPUs, how long and how busily: the report of ``nvidia-docker-ctl usage``.

Each node's usage ledger answers ``GET /usage/json?since=S&until=U&by=B&limit=N`` with its
own rows, one per group (docs/fleet.md, "Usage and idle GPUs across the fleet"); this module
checks the operator's ``--since``/``--until``/``--by`` before any node is asked (one line,
exit 2), and sums the nodes' answers into one report:

- ``--by image`` and ``--by label:KEY``: rows with the same key on several nodes are one row,
  their GPU-seconds, busy GPU-seconds, energy and holds added up (energy and holds are null
  only when every part is), with the nodes that contributed;
- ``--by gpu`` and ``--by container``: a GPU or a container belongs to one node, so each row
  keeps its node (a GPU UUID or a container id seen on two nodes is two rows);
- the totals are the sum of the nodes' own totals; the range is the widest of the ranges the
  nodes covered (an agent may round out to whole hours).

Rows are sorted by GPU-seconds, largest first. Only the summed groups are kept while nodes
answer, never the answers. ``UsageReport`` prints them as a table (the range above it, a
``TOTAL`` row below), as CSV (raw seconds and joules, ``TOTAL`` as the last row) or as one
JSON list; ``--jsonl`` is each node's answer as-is (``controller.fleet.report``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from controller.errors import UsageError
from controller.fleet.query import json_int
from controller.fleet.table import Column, Row, render

if TYPE_CHECKING:
    from controller.fleet.query import NodeResult, Query

USAGE_PATH = "/usage/json"
MAX_ROWS = 10000  # the agent's own bound on limit
PER_NODE_KINDS = ("gpu", "container")  # a group of these is one node's: rows keep the node
MAX_NOTES = 1000  # behind or cut answers named on stderr; the rest are counted
MAX_UNIX_S = 1e11  # the agents take Unix seconds below this
MAX_LABEL_KEY = 128  # ... and label keys this long at most
SHORT_ID = 12  # characters of a container id, as docker ps shows it
TOTAL = "TOTAL"
_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_RELATIVE = re.compile(r"-([0-9]+(?:\.[0-9]+)?)([smhd])")
_UNIX = re.compile(r"[0-9]+(?:\.[0-9]+)?")
TIME_GRAMMAR = (
    "give Unix seconds (1764547200), a time relative to now (-30m, -24h, -7d) or an ISO 8601 "
    "time with its zone (2026-12-01T00:00:00Z)"
)
BY_GRAMMAR = (
    "give gpu, container, image or label:KEY (label:team, label:com.docker.compose.project)"
)


# --- the operator's side of the query ---------------------------------------------------------


def time_of(text: str, now: float) -> float | None:
    """The Unix time ``text`` names (``now``: None); ``ValueError`` saying the grammar."""
    value = text.strip()
    if value.lower() == "now":
        return None
    relative = _RELATIVE.fullmatch(value)
    if relative:
        return now - float(relative.group(1)) * _UNITS_S[relative.group(2)]
    if _UNIX.fullmatch(value):
        if float(value) >= MAX_UNIX_S:
            raise ValueError(f"{value} is past the year 5000: {TIME_GRAMMAR}")
        return float(value)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(TIME_GRAMMAR) from None
    if moment.tzinfo is None:
        raise ValueError(
            "an ISO 8601 time needs its zone, or it means another hour on each node: "
            "add Z (UTC) or +HH:MM (2026-12-01T00:00:00Z)"
        )
    return moment.timestamp()


def check_time(text: str) -> str:
    """``--since``/``--until`` as given, once it is known to be one the agents take."""
    time_of(text, time.time())
    return text.strip()


def check_by(text: str) -> str:
    """``--by``: ``gpu``, ``container``, ``image`` or ``label:KEY`` (the KEY as given)."""
    kind, colon, key = text.strip().partition(":")
    kind = kind.lower()
    if not colon and kind in ("gpu", "container", "image"):
        return kind
    if kind != "label" or not colon:
        raise ValueError(BY_GRAMMAR)
    if not key:
        raise ValueError("label:KEY needs the label's key (label:team)")
    if "=" in key:
        raise ValueError(
            "label:KEY groups by the label's values: give the key alone (label:team, "
            "not label:team=ml)"
        )
    if len(key) > MAX_LABEL_KEY:
        raise ValueError(f"a label key is {MAX_LABEL_KEY} characters at most")
    if any(ch.isspace() or not ch.isprintable() for ch in key):
        raise ValueError("a label key has no spaces or control characters (label:team)")
    return f"label:{key}"


@dataclass(frozen=True, slots=True)
class UsageAsk:
    """What ``usage`` asks every node: ``since``/``until`` as the operator typed them (None:
    the agent's default, the last 24 hours up to now), ``by``, and the agent's row ``limit``
    (None: its default, 1000)."""

    by: str = "gpu"
    since: str | None = None
    until: str | None = None
    limit: int | None = None

    def check(self, now: float | None = None) -> None:
        """``UsageError`` when the range is empty (``--since`` not before ``--until``)."""
        moment = time.time() if now is None else now
        start = time_of(self.since, moment) if self.since else moment - 86400
        end = time_of(self.until, moment) if self.until else moment
        if (moment if start is None else start) >= (moment if end is None else end):
            since = self.since or "-24h"
            until = self.until or "now"
            raise UsageError(
                f"--since {since} is not before --until {until}: the range covers nothing "
                "(give an earlier --since or a later --until)"
            )

    @property
    def params(self) -> dict[str, str]:
        """The query string: each value as given; ``now`` is the agent's default, left out."""
        params = {"by": self.by}
        for name, value in (("since", self.since), ("until", self.until)):
            if value and value.strip().lower() != "now":
                params[name] = value
        if self.limit is not None:
            params["limit"] = str(self.limit)
        return params

    @property
    def kind(self) -> str:
        """``gpu``, ``container``, ``image`` or ``label``."""
        return self.by.partition(":")[0]

    @property
    def key_name(self) -> str:
        """The name a row's key has in the agent's rows and in ours: ``gpu``, ``team``..."""
        kind, _, key = self.by.partition(":")
        return key if kind == "label" else kind


def usage_query(ask: UsageAsk) -> Query:
    from controller.fleet.query import Query, Request  # noqa: PLC0415 (the ctl starts fast)

    return Query("usage", (Request("usage", USAGE_PATH, ask.params, must_have="rows"),))


# --- an agent that cannot answer ----------------------------------------------------------------

TOO_OLD = "agent too old for the usage ledger (no {path}): upgrade nvidia-docker-plugin there"


def agent_said(result: NodeResult) -> str:
    """The agent's one line: its JSON ``{"error": ...}`` (or ``"Error"``) read, else its
    first line as sent."""
    text = result.agent_message or ""
    try:
        body = json.loads(text)
    except ValueError:
        return text
    if not isinstance(body, Mapping):
        return text
    said = body.get("error") or body.get("Error")
    return said if isinstance(said, str) else text


def explain_refusal(result: NodeResult, path: str) -> NodeResult:
    """A node whose agent answered 404 or 400 to ``path``, in words: an agent without a ledger
    (older than ledgers, or started with ``--no-usage-ledger``: its own words) or a query it
    refused. Other results are returned as they are."""
    if result.ok or result.http_status not in (400, 404):
        return result
    said = agent_said(result)
    if result.http_status == 400:
        return replace(
            result, error=f"the agent refused the query (400 to GET {path}): {said}",
            agent_message=said,
        )  # fmt: skip
    if any(word in said.lower() for word in ("ledger", "usage")):  # off: the agent says why
        return replace(
            result, error=f"no usage ledger there: {said}", reason="no ledger",
            agent_message=said,
        )  # fmt: skip
    return replace(result, error=TOO_OLD.format(path=path), reason="too old", agent_message=None)


# --- the report ---------------------------------------------------------------------------------


def number(value: Any) -> float | None:
    """A finite JSON number as a float; None for anything else (null, text, true)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _add(total: float | None, part: float | None) -> float | None:
    """Null only when every part is."""
    if part is None:
        return total
    return part if total is None else total + part


@dataclass(slots=True)
class Figures:
    gpu_seconds: float = 0.0
    busy_gpu_seconds: float = 0.0
    energy_joules: float | None = None
    holds: int | None = None

    def add(self, row: Mapping[str, Any]) -> None:
        self.gpu_seconds += number(row.get("gpu_seconds")) or 0.0
        self.busy_gpu_seconds += number(row.get("busy_gpu_seconds")) or 0.0
        self.energy_joules = _add(self.energy_joules, number(row.get("energy_joules")))
        holds = json_int(row.get("holds"))
        if holds is not None:
            self.holds = holds if self.holds is None else self.holds + holds

    def json(self) -> dict[str, Any]:
        return {
            "gpu_seconds": round(self.gpu_seconds, 3),
            "busy_gpu_seconds": round(self.busy_gpu_seconds, 3),
            "energy_joules": None if self.energy_joules is None else round(self.energy_joules, 3),
            "holds": self.holds,
        }


@dataclass(slots=True)
class Group:
    """One row of the report: its key, the nodes that contributed (by their place in the nodes
    as named), what identifies it besides the key (a GPU's index, a container's id)."""

    key: str
    figures: Figures = field(default_factory=Figures)
    nodes: set[int] = field(default_factory=set)
    index: int | None = None
    container_id: str | None = None


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else str(value)


def _rows(body: Any) -> list[Mapping[str, Any]]:
    rows = body.get("rows") if isinstance(body, Mapping) else None
    return [r for r in rows if isinstance(r, Mapping)] if isinstance(rows, list) else []


def gpu_hours(seconds: float) -> str:
    """Seconds as hours, as many decimals as a person reads: ``0.25``, ``12.5``, ``1234``."""
    return readable(seconds / 3600)


def readable(value: float) -> str:
    if abs(value) < 10:
        return f"{value:.2f}"
    if abs(value) < 1000:
        return f"{value:.1f}"
    return f"{value:.0f}"


def busy_percent(figures: Figures) -> str:
    if figures.gpu_seconds <= 0:
        return "-"
    share = 100 * figures.busy_gpu_seconds / figures.gpu_seconds
    return f"{share:.1f}%" if share < 10 else f"{share:.0f}%"


def kwh(joules: float | None) -> str:
    return "-" if joules is None else readable(joules / 3.6e6)


def utc(seconds: float) -> str:
    try:
        return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):
        return f"{seconds:g}"


def _csv_number(value: float | int | None) -> str:
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    return repr(round(value, 3))


class UsageReport:
    """The fleet's rows, summed as nodes answer (``add``), printed once all are done."""

    def __init__(self, ask: UsageAsk, max_rows: int | None = None) -> None:
        self.ask = ask
        self.max_rows = max_rows  # the operator's --max-rows: the report shows no more
        self.groups: dict[tuple[Any, ...], Group] = {}
        self.totals = Figures()
        self.answered: dict[int, str] = {}  # every node that answered, by its place
        self.since: float | None = None
        self.until: float | None = None
        self.ranges_differ = False
        self._notes: list[tuple[int, str]] = []
        self._notes_left_out = 0

    @property
    def per_node(self) -> bool:
        return self.ask.kind in PER_NODE_KINDS

    def add(self, result: NodeResult, order: int) -> None:
        """Take node number ``order`` (its place in the nodes as named)."""
        body = result.answers.get("usage") if result.ok else None
        if not isinstance(body, Mapping):
            return
        name = result.node.name
        self.answered[order] = name
        self._range(number(body.get("since")), number(body.get("until")))
        ledger = body.get("ledger")
        if isinstance(ledger, Mapping) and ledger.get("behind") is True:
            why = ledger.get("reason")
            because = f" ({why})" if isinstance(why, str) and why else ""
            self._note(
                order,
                f"{name}: its usage ledger is behind{because}: its latest figures may be "
                "missing from the report",
            )
        rows = _rows(body)
        if body.get("truncated") is True:
            self._note(
                order,
                f"{name}: its answer was cut to {len(rows)} rows: that node's smaller groups "
                f"are missing from the rows, not from the totals (--max-rows, up to {MAX_ROWS})",
            )
        for row in rows:
            self._group(row, order).figures.add(row)
        totals = body.get("totals")
        if isinstance(totals, Mapping):
            self.totals.add(totals)
        else:  # an answer without totals: its rows are all there is
            for row in rows:
                self.totals.add(row)

    def _range(self, since: float | None, until: float | None) -> None:
        if since is not None:
            if self.since is not None and abs(self.since - since) >= 1:
                self.ranges_differ = True
            self.since = since if self.since is None else min(self.since, since)
        if until is not None:
            if self.until is not None and abs(self.until - until) >= 1:
                self.ranges_differ = True
            self.until = until if self.until is None else max(self.until, until)

    def _note(self, order: int, line: str) -> None:
        if len(self._notes) < MAX_NOTES:
            self._notes.append((order, line))
        else:
            self._notes_left_out += 1

    def _group(self, row: Mapping[str, Any], order: int) -> Group:
        kind = self.ask.kind
        value = _text(row.get(self.ask.key_name))
        key: tuple[Any, ...]
        if kind == "gpu":
            key = (order, value)
        elif kind == "container":
            container_id = _text(row.get("container_id"))
            key = (order, container_id or value)
        else:
            key = (value,)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(value)
            if kind == "gpu":
                group.index = json_int(row.get("index"))
            elif kind == "container":
                group.container_id = _text(row.get("container_id")) or None
        group.nodes.add(order)
        return group

    # --- what it prints

    def ranked(self) -> list[Group]:
        """Largest first; then by key, then the nodes' order (a stable report)."""
        groups = sorted(
            self.groups.values(),
            key=lambda g: (-g.figures.gpu_seconds, g.key, min(g.nodes, default=0)),
        )
        return groups if self.max_rows is None else groups[: self.max_rows]

    def notes(self) -> list[str]:
        """What goes to stderr before the summary: ledgers behind, answers cut, rows left out."""
        lines = [line for _, line in sorted(self._notes)]
        if self._notes_left_out:
            lines.append(f"and {self._notes_left_out} more nodes behind or cut")
        if self.max_rows is not None and len(self.groups) > self.max_rows:
            lines.append(
                f"the {self.max_rows} largest of {len(self.groups)} groups shown (--max-rows); "
                "the totals are of all"
            )
        return lines

    def _names(self, group: Group) -> list[str]:
        return [self.answered[i] for i in sorted(group.nodes) if i in self.answered]

    def range_line(self) -> str:
        """``usage by label:team from 2026-12-01 00:00 to 2026-12-02 00:00 UTC (24 h)``."""
        if self.since is None or self.until is None:
            return f"usage by {self.ask.by} (the nodes did not say which range)"
        differ = "; the widest of the nodes' ranges, which differ" if self.ranges_differ else ""
        return (
            f"usage by {self.ask.by} from {utc(self.since)} to {utc(self.until)} UTC "
            f"({span_text(self.until - self.since)}{differ})"
        )

    def columns(self) -> tuple[Column, ...]:
        kind = self.ask.kind
        head: tuple[Column, ...]
        if kind == "gpu":
            head = (Column("NODE", min_width=8), Column("GPU", right=True), Column("UUID"))
        elif kind == "container":
            head = (Column("NODE", min_width=8), Column("CONTAINER", min_width=10), Column("ID"))
        else:
            head = (Column(self.ask.key_name.upper(), min_width=10), Column("NODES", right=True))
        return (
            *head,
            Column("GPU-H", right=True),
            Column("BUSY %", right=True),
            Column("BUSY GPU-H", right=True),
            Column("ENERGY kWh", right=True),
            Column("HOLDS", right=True),
        )

    def _label(self, value: str) -> str:
        if value:
            return value
        return f"(no {self.ask.key_name})" if self.ask.kind in ("image", "label") else "?"

    def _table_row(self, group: Group) -> Row:
        kind = self.ask.kind
        node = self._names(group)
        head: tuple[str, ...]
        if kind == "gpu":
            uuid = group.key[4:12] if group.key.startswith("GPU-") else group.key or "?"
            index = "-" if group.index is None else str(group.index)
            head = (node[0] if node else "?", index, uuid)
        elif kind == "container":
            short = group.container_id[:SHORT_ID] if group.container_id else "-"
            head = (node[0] if node else "?", group.key or "-", short)
        else:
            head = (self._label(group.key), str(len(node)))
        return (*head, *self._figures_cells(group.figures))

    @staticmethod
    def _figures_cells(figures: Figures) -> tuple[str, ...]:
        holds = "-" if figures.holds is None else str(figures.holds)
        return (
            gpu_hours(figures.gpu_seconds),
            busy_percent(figures),
            gpu_hours(figures.busy_gpu_seconds),
            kwh(figures.energy_joules),
            holds,
        )

    def table(self, width: int | None, ellipsis: str = "…") -> list[str]:
        """The range, the header, a row per group, the ``TOTAL`` row (nothing when no node
        answered)."""
        if not self.answered:
            return []
        rows = [self._table_row(group) for group in self.ranked()]
        total = (TOTAL, "-", "-") if self.per_node else (TOTAL, str(len(self.answered)))
        rows.append((*total, *self._figures_cells(self.totals)))
        return [self.range_line(), *render(self.columns(), rows, width, ellipsis=ellipsis)]

    def csv_header(self) -> list[str]:
        figures = ["gpu_seconds", "busy_gpu_seconds", "energy_joules", "holds"]
        if self.ask.kind == "gpu":
            return ["gpu", "index", "node", *figures]
        if self.ask.kind == "container":
            return ["container", "container_id", "node", *figures]
        return [self.ask.key_name, "nodes", *figures]

    def csv(self) -> str:
        """A header, a row per group in raw seconds and joules, then ``TOTAL`` (the first
        column) with the totals; nothing when no node answered."""
        if not self.answered:
            return ""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(self.csv_header())
        for group in self.ranked():
            names = self._names(group)
            if self.ask.kind == "gpu":
                index = "" if group.index is None else str(group.index)
                head = [group.key, index, names[0] if names else ""]
            elif self.ask.kind == "container":
                head = [group.key, group.container_id or "", names[0] if names else ""]
            else:
                head = [group.key, " ".join(names)]
            writer.writerow([*head, *self._csv_figures(group.figures)])
        blank = ["", ""] if self.per_node else [""]
        writer.writerow([TOTAL, *blank, *self._csv_figures(self.totals)])
        return out.getvalue()

    @staticmethod
    def _csv_figures(figures: Figures) -> list[str]:
        return [
            _csv_number(figures.gpu_seconds),
            _csv_number(figures.busy_gpu_seconds),
            _csv_number(figures.energy_joules),
            _csv_number(figures.holds),
        ]

    def json_rows(self) -> list[dict[str, Any]]:
        """Each group: its key under its own name (``team``, ``gpu``...), then ``index``,
        ``container_id`` and ``node`` where the group is one node's, ``nodes``, the figures."""
        made = []
        for group in self.ranked():
            names = self._names(group)
            row: dict[str, Any] = {self.ask.key_name: group.key}
            if self.ask.kind == "gpu":
                row["index"] = group.index
            if self.ask.kind == "container":
                row["container_id"] = group.container_id
            if self.per_node:
                row["node"] = names[0] if names else None
            row["nodes"] = names
            row.update(group.figures.json())
            made.append(row)
        return made

    def json(self) -> str:
        """One JSON list, a row per line."""
        rows = [json.dumps(row) for row in self.json_rows()]
        return "[" + ",".join(f"\n  {row}" for row in rows) + ("\n]\n" if rows else "]\n")

    def render(self, output: str, width: int | None, ellipsis: str = "…") -> str:
        if output == "csv":
            return self.csv()
        if output == "json":
            return self.json()
        return "".join(line + "\n" for line in self.table(width, ellipsis))


def span_text(seconds: float) -> str:
    """A range's length: ``24 h`` for whole hours, else as ``duration_text`` says it
    (``45 s``, ``30 min``, ``1 h 20 min``)."""
    whole = round(seconds)
    if whole >= 3600 and whole % 3600 == 0:
        return f"{whole // 3600} h"
    return duration_text(whole)


def duration_text(seconds: float) -> str:
    """A time as people say it: ``42 s``, ``17 min``, ``1 h 02 min``, ``3 d 04 h``."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes = whole // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours:02d} h"
