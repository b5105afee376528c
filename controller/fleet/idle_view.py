"""Every idle GPU across a fleet: what ``nvidia-docker-ctl idle`` prints.

Each node's ledger answers ``GET /usage/idle/json`` with the GPUs (and MIG devices) that are
held but have done nothing for longer than its ``--idle-after``, each with its holder (a
lease, a container, or a process outside any container), the policy the agent applies to
it and what it did (``notified``, ``released``, ``stopped``, ``kept: <why>``; null: nothing
yet). One row per idle unit, in the nodes' order and each node's own order: node, unit,
holder (the container's name, else its short id; the lease id, with its container's name
when it has one; ``pid N``), image, idle for (``1 h 02 min``), policy, action.

Idle units are few, so they are kept until every node is done; the answers are not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controller.fleet.query import NodeResult, Query, Request, json_int
from controller.fleet.table import Column, Row, render
from controller.fleet.usage_view import SHORT_ID, duration_text, number

IDLE_PATH = "/usage/idle/json"
IDLE = Query("idle", (Request("idle", IDLE_PATH, must_have="idle"),))

IDLE_COLUMNS = (
    Column("NODE", min_width=8),
    Column("UNIT"),
    Column("HOLDER", min_width=10),
    Column("IMAGE", min_width=10),
    Column("IDLE FOR", right=True),
    Column("POLICY"),
    Column("ACTION", min_width=8),
)


def _nodes(count: int) -> str:
    return f"{count} node{'s' if count != 1 else ''}"


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def holder_text(item: Mapping[str, Any]) -> str:
    """Who holds an idle unit, in a few words (see the module)."""
    holder = item.get("holder")
    container_id = _text(item.get("container_id"))
    container = _text(item.get("container")) or (container_id[:SHORT_ID] if container_id else None)
    lease = _text(item.get("lease_id"))
    pid = item.get("pid")
    if holder == "lease" or (holder is None and lease):
        lease = lease or "lease"
        return f"{lease} ({container})" if container else lease
    if holder == "process" or (holder is None and pid is not None and not container):
        return f"pid {pid}" if json_int(pid) is not None else "process"
    return container or _text(holder) or "?"


@dataclass(frozen=True, slots=True)
class IdleUnit:
    order: int  # the node's place in the nodes as named
    node: str
    item: Mapping[str, Any]  # the agent's entry, as it sent it
    node_policy: str | None
    idle_after_s: float | None

    @property
    def idle_s(self) -> float | None:
        return number(self.item.get("idle_s"))

    def row(self) -> Row:
        item = self.item
        unit = _text(item.get("unit"))
        index = item.get("index")
        if unit is None:
            unit = str(index) if isinstance(index, int) else "?"
        idle = self.idle_s
        return (
            self.node,
            unit,
            holder_text(item),
            _text(item.get("image")) or "-",
            "-" if idle is None else duration_text(idle),
            _text(item.get("policy")) or self.node_policy or "-",
            _text(item.get("action")) or "-",
        )

    def json(self) -> dict[str, Any]:
        """The agent's entry with ``node`` first, and the node's ``idle_after_s`` and
        ``policy`` where the entry has none."""
        made: dict[str, Any] = {"node": self.node, **self.item}
        made.setdefault("idle_after_s", self.idle_after_s)
        if made.get("policy") is None:
            made["policy"] = self.node_policy
        return made


@dataclass
class IdleReport:
    """The idle units of the nodes that answered, gathered as they answer."""

    units: list[IdleUnit] = field(default_factory=list)
    nodes_with_idle: set[int] = field(default_factory=set)
    answered: int = 0

    def add(self, result: NodeResult, order: int) -> None:
        body = result.answers.get("idle") if result.ok else None
        if not isinstance(body, Mapping):
            return
        self.answered += 1
        found = body.get("idle")
        policy = _text(body.get("policy"))
        after = number(body.get("idle_after_s"))
        for item in found if isinstance(found, list) else []:
            if isinstance(item, Mapping):
                self.units.append(IdleUnit(order, result.node.name, item, policy, after))
                self.nodes_with_idle.add(order)

    @property
    def found(self) -> bool:
        return bool(self.units)

    def ordered(self) -> list[IdleUnit]:
        return sorted(self.units, key=lambda u: u.order)  # stable: each node's own order

    def table(self, width: int | None, ellipsis: str = "…") -> list[str]:
        """The header and a row per idle unit; nothing when none is idle."""
        if not self.units:
            return []
        return render(IDLE_COLUMNS, [u.row() for u in self.ordered()], width, ellipsis=ellipsis)

    def notes(self) -> list[str]:
        count = len(self.units)
        if not count:
            return [f"no idle GPU on the {_nodes(self.answered)} that answered"]
        gpus = f"{count} idle GPU{'s' if count != 1 else ''}"
        return [f"{gpus} on {_nodes(len(self.nodes_with_idle))}"]

    def json_rows(self) -> list[dict[str, Any]]:
        return [u.json() for u in self.ordered()]

    def json(self) -> str:
        rows = [json.dumps(row) for row in self.json_rows()]
        return "[" + ",".join(f"\n  {row}" for row in rows) + ("\n]\n" if rows else "]\n")

    def render(self, output: str, width: int | None, ellipsis: str = "…") -> str:
        if output == "json":
            return self.json()
        return "".join(line + "\n" for line in self.table(width, ellipsis))
