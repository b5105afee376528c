"""The usage ledger's REST routes (docs/usage.md, "The REST API").

- ``GET /usage/json?since=&until=&by=&limit=``: GPU-seconds held and busy, energy and the
  number of holds, grouped by ``gpu``, ``container``, ``image`` or ``label:KEY``, over a
  range (``since``/``until``: Unix seconds, ``-24h``/``-7d``/``-30m``/``-90s`` before now,
  ``now``, or ISO 8601 like ``2026-12-01T00:00:00Z``; by default the last 24 hours), at most
  ``limit`` rows (1000 by default, 10000 at most) with the totals of all of them;
- ``GET /usage/idle/json``: the GPUs idle now, their holders, the policy and what was done.

Each read runs on a thread of asyncio's pool (``agent.usage.queries``: a read-only
connection that never blocks the writer), at most ``MAX_READERS`` at a time: a request
beyond waits its turn. An agent without a ledger answers 404 saying why; 503 while the
ledger is being opened. ``/usage/idle/json`` answers an agent whose ledger file another agent
holds all the same: its idle policies run without the file.
"""

from __future__ import annotations

import asyncio
import math
import re
import socket
import time
from datetime import datetime
from typing import Any

from aiohttp import web

from agent.api import render_json
from agent.health.rule import utc_text
from agent.usage.ledger import UsageLedger, idle_rows
from agent.usage.queries import LedgerUnreadable, UsageAnswer, UsageRow, read_usage
from agent.usage.records import GROUPINGS

USAGE = web.AppKey("usage", UsageLedger)
OFF = web.AppKey("usage_off", str)  # why the agent has no ledger (--no-usage-ledger, busy)

MAX_READERS = 4
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10000
DEFAULT_SINCE = "-24h"
_RELATIVE = re.compile(r"-([0-9]{1,9}(?:\.[0-9]+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# An ISO 8601 time whose "+HH:MM" zone came as " HH:MM": a "+" not written %2B in a URL's
# query is a space (curl 'localhost:3476/usage/json?since=2026-12-01T00:00:00+01:00').
_ZONE_PLUS_AS_SPACE = re.compile(
    r"(.*[T ][0-9]{2}:[0-9]{2}(?::[0-9]{2}(?:\.[0-9]+)?)?) ([0-9]{2}:?[0-9]{2})"
)
_readers = asyncio.Semaphore(MAX_READERS)


class BadQuery(ValueError):
    """A query parameter that is wrong; its message is the one line answered."""


def parse_time(name: str, text: str, now_s: float) -> float:
    """``since``/``until`` as Unix seconds (see the module docstring); an ISO 8601 zone's
    ``+`` may come as a space (a URL's query decodes an unescaped ``+`` so)."""
    value = text.strip()
    if value == "now":
        return now_s
    relative = _RELATIVE.fullmatch(value)
    if relative:
        return now_s - float(relative.group(1)) * _UNIT_S[relative.group(2)]
    try:
        number = float(value)
    except ValueError:
        pass
    else:
        if math.isfinite(number) and 0 <= number < 1e11:
            return number
        raise BadQuery(f"{name}={value[:40]!r}: out of range")
    zone_as_space = _ZONE_PLUS_AS_SPACE.fullmatch(value)
    if zone_as_space:
        value = f"{zone_as_space.group(1)}+{zone_as_space.group(2)}"
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadQuery(
            f"{name}={value[:40]!r}: give Unix seconds, -24h / -7d / -30m before now, "
            "or an ISO 8601 time like 2026-12-01T00:00:00Z"
        ) from None
    if parsed.tzinfo is None:
        raise BadQuery(f"{name}={value[:40]!r}: give a time zone (Z, or +01:00)")
    return parsed.timestamp()


def parse_by(text: str) -> str:
    value = text.strip()
    if value in GROUPINGS:
        return value
    if value.startswith("label:") and 0 < len(value) - 6 <= 128:
        return value
    raise BadQuery(f"by={value[:60]!r}: group by gpu, container, image or label:KEY (label:team)")


def parse_limit(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_LIMIT:
        raise BadQuery(f"limit={text[:20]!r}: a whole number from 1 to {MAX_LIMIT}")
    return int(text)


def _json(status: int, body: object) -> web.Response:
    return web.Response(
        status=status, body=render_json.encode(body), content_type="application/json",
        charset="utf-8",
    )  # fmt: skip


def _off(request: web.Request, ledger: UsageLedger | None = None) -> web.Response:
    """No ledger to read: 503 while it is being opened, else 404 with the reason."""
    if ledger is not None and ledger.opening:
        return _json(503, {"Error": "the usage ledger is being opened; ask again shortly"})
    why = (ledger.off_reason if ledger is not None else None) or request.app.get(OFF)
    return _json(404, {"Error": why or "the usage ledger is off on this node"})


def _key_name(by: str) -> str:
    return by.removeprefix("label:")


def _row(row: UsageRow, by: str) -> dict[str, Any]:
    body: dict[str, Any] = {_key_name(by): row.key}
    body.update(dict(row.extra))
    if by == "gpu":  # null for a GPU that none of the ledger's newest holds was on
        body["index"] = int(body["index"]) if "index" in body else None
    body.update(
        gpu_seconds=round(row.gpu_seconds, 3),
        busy_gpu_seconds=round(row.busy_gpu_seconds, 3),
        energy_joules=None if row.energy_joules is None else round(row.energy_joules, 3),
        holds=row.holds,
    )
    return body


def answer_json(answer: UsageAnswer, ledger: UsageLedger, node: str) -> dict[str, Any]:
    status = ledger.store_status()
    totals = answer.totals
    return {
        "node": node,
        "since": answer.since_s,
        "until": answer.until_s,
        "by": answer.by,
        "rows": [_row(row, answer.by) for row in answer.rows],
        "totals": {
            "gpu_seconds": round(totals.gpu_seconds, 3),
            "busy_gpu_seconds": round(totals.busy_gpu_seconds, 3),
            "energy_joules": None
            if totals.energy_joules is None
            else round(totals.energy_joules, 3),
            "holds": totals.holds,
        },
        "truncated": answer.truncated,
        "ledger": {
            "behind": bool(status and status.behind),
            "reason": status.reason if status else None,
        },
    }


def idle_by_unit(ledger: UsageLedger) -> dict[str, list[dict[str, Any]]]:
    """Each unit's idle holders, as ``GET /leases/json`` shows them (``Idle``)."""
    now_s = time.time()
    found: dict[str, list[dict[str, Any]]] = {}
    for idle, action in idle_rows(ledger):
        found.setdefault(idle.unit, []).append(
            {
                "Holder": idle.holder.lease_id or idle.holder.container_id or idle.holder.ident,
                "Since": utc_text(idle.idle_since_s),
                "Seconds": round(max(0.0, now_s - idle.idle_since_s), 3),
                "Policy": idle.policy.value,
                "Action": action,
            }
        )
    return found


def make_routes(node_name: str | None = None) -> list[tuple[str, str, Any]]:
    """(method, path, handler) of the usage routes."""
    node = node_name or socket.gethostname()

    async def usage_json(request: web.Request) -> web.StreamResponse:
        ledger = request.app.get(USAGE)
        if ledger is None or ledger.store is None:
            return _off(request, ledger)
        query = request.query
        now_s = time.time()
        try:
            since = parse_time("since", query.get("since", DEFAULT_SINCE), now_s)
            until = parse_time("until", query["until"], now_s) if "until" in query else now_s
            by = parse_by(query.get("by", "gpu"))
            limit = parse_limit(query.get("limit", str(DEFAULT_LIMIT)))
            if since >= until:
                raise BadQuery("since must be before until")
        except BadQuery as err:
            return _json(400, {"Error": str(err)})
        # What the accounting holds but has not handed to the store yet is written first.
        await ledger.flush_soon()
        async with _readers:
            try:
                answer = await asyncio.to_thread(
                    read_usage, ledger.path, since_s=since, until_s=until, by=by, limit=limit,
                    now_s=now_s,
                )  # fmt: skip
            except ValueError as err:
                return _json(400, {"Error": str(err)})
            except LedgerUnreadable as err:  # moved aside and replaced at the next write
                return _json(503, {"Error": str(err)})
        return _json(200, answer_json(answer, ledger, node))

    async def idle_json(request: web.Request) -> web.StreamResponse:
        ledger = request.app.get(USAGE)
        # A ledger without its file (another agent holds it) still tracks idle GPUs and
        # applies the idle policies: they are listed all the same.
        if ledger is None or ledger.opening:
            return _off(request, ledger)
        now_s = time.time()
        rows = []
        for found, action in idle_rows(ledger):
            holder = found.holder
            rows.append(
                {
                    "gpu": found.gpu_uuid,
                    "index": found.gpu_index,
                    "unit": found.unit,
                    "mig": found.mig_uuid,
                    "holder": holder.kind.value,
                    "lease_id": holder.lease_id,
                    "container_id": holder.container_id,
                    "container": holder.container_name,
                    "image": holder.image,
                    "pid": holder.pid,
                    "idle_since": round(found.idle_since_s, 3),
                    "idle_s": round(max(0.0, now_s - found.idle_since_s), 3),
                    "policy": found.policy.value,
                    "action": action,
                }
            )
        settings = ledger.settings
        return _json(
            200,
            {
                "node": node,
                "idle_after_s": settings.idle_after_s,
                "policy": settings.idle_policy.value,
                "idle": rows,
            },
        )

    return [("GET", "/usage/json", usage_json), ("GET", "/usage/idle/json", idle_json)]
