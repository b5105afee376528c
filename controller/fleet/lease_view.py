"""Who holds what across a fleet: the rows of ``nvidia-docker-ctl leases``.

Each node's ``/leases/json`` (docs/leases.md, "The REST API") becomes one row per unit (a
whole GPU or a MIG device) with its state (``free``, ``pending``, ``leased``, ``foreign``,
``conflict``; ``, unhealthy`` added when the agent says so) and, for a held unit, its
holders: the lease id, the container's short id (12 characters), the owner's labels
(``job=42,user=alice``; a foreign holder: the agent's words for why it holds it) and since
when; several holders of one unit (shared leases, a conflict) are listed in each column
separated by ``,``. Then one summary row per node: ``6 free of 8; 1 lease; queue 0`` (free:
no holder and healthy). An agent older than leases (404 on ``/leases/json``) gets one row
saying so (``TOO_OLD``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controller.fleet.output import failed_row
from controller.fleet.query import NodeResult, Query, Request
from controller.fleet.table import Column, Row, Span

LEASES_REQUEST = Request("leases", "/leases/json", must_have="Units", optional=True)
LEASES = Query("leases", (LEASES_REQUEST,))
TOO_OLD = "agent too old for leases (no /leases/json): upgrade nvidia-docker-plugin there"
SHORT_ID = 12  # characters of a container id, as docker ps shows it

LEASE_COLUMNS = (
    Column("NODE", min_width=8),
    Column("UNIT"),
    Column("STATE"),
    Column("LEASE", min_width=8),
    Column("CONTAINER"),
    Column("OWNER", min_width=8),
    Column("SINCE"),
)


def _mapping(value: Any) -> bool:
    # a JSON object is a dict: the ABC check only for other mappings (10,000 nodes, ~30 each)
    return type(value) is dict or isinstance(value, Mapping)


def _list(value: Any, key: str) -> list[Any]:
    found = value.get(key) if _mapping(value) else None
    return [item for item in found if _mapping(item)] if isinstance(found, list) else []


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def units(body: Any) -> list[Mapping[str, Any]]:
    """The units of a ``/leases/json`` body (an empty list for anything else)."""
    return _list(body, "Units")


def is_free(unit: Mapping[str, Any]) -> bool:
    """No holder and healthy: a unit an ask could get now."""
    return unit.get("State") == "free" and unit.get("Healthy") is True


def owner_text(owner: Any) -> str | None:
    """``{"user": "alice", "job": "42"}`` -> ``job=42,user=alice``."""
    if not _mapping(owner) or not owner:
        return None
    return ",".join(f"{key}={owner[key]}" for key in sorted(owner, key=str))


def node_summary(body: Any) -> str:
    """``6 free of 8 (1 unhealthy); 2 leases; queue 0``."""
    every = units(body)
    free = sum(1 for u in every if is_free(u))
    sick = sum(1 for u in every if u.get("Healthy") is False)
    leases = len(_list(body, "Leases"))
    waiting = len(_list(body, "Waiting"))
    unhealthy = f" ({sick} unhealthy)" if sick else ""
    return (
        f"{free} free of {len(every)}{unhealthy}; "
        f"{leases} lease{'s' if leases != 1 else ''}; queue {waiting}"
    )


def lease_rows(result: NodeResult) -> list[Row]:
    """The rows of one node: a row per unit, then its summary row (see the module)."""
    if not result.ok:
        return [failed_row(result)]
    body = result.answers.get("leases")
    name = result.node.name
    if body is None:
        return [Span((name, "-"), TOO_OLD)]
    owners = {
        _text(lease.get("Lease")): owner_text(lease.get("Owner")) for lease in _list(body, "Leases")
    }
    rows: list[Row] = []
    for unit in units(body):
        state = str(unit.get("State") or "?")
        if unit.get("Healthy") is False:
            state += ", unhealthy"
        leases, containers, who, since = [], [], [], []
        for holder in _list(unit, "Holders"):
            lease = _text(holder.get("Lease"))
            container = _text(holder.get("Container"))
            leases.append(lease or "-")
            containers.append(container[:SHORT_ID] if container else "-")
            who.append((owners.get(lease) if lease else None) or _text(holder.get("Why")) or "-")
            since.append(_text(holder.get("Since")) or "-")
        rows.append(
            (
                name,
                str(unit.get("Name") or "?"),
                state,
                ",".join(leases) or "-",
                ",".join(containers) or "-",
                ",".join(who) or "-",
                ",".join(since) or "-",
            )
        )
    rows.append(Span((name, "-"), node_summary(body)))
    return rows


def too_old(result: NodeResult) -> bool:
    """The node answered, but its agent has no lease routes (an older release)."""
    return result.ok and result.answers.get("leases", {}) is None
