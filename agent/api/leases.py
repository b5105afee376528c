"""The lease routes of the REST API: ask (``POST /leases``), list (``GET /leases``,
``/leases/json``), what an ask would get now (``GET /leases/free?count=N``), release
(``DELETE /leases/{id}``), release if unused (``DELETE /leases/{id}/pending``: only a
pending lease that no container carries, the engines asked first). docs/leases.md, "The
REST API", is the contract: JSON bodies and answers, one-line errors, the refusal's kind
for programs.

An ask's body is bounded (``MAX_ASK_BYTES``, 32 levels: ``plugin.json_body``), every field
checked here before the table sees it; an ask that waits holds its request open until the
queue serves it or its time is up (a client that goes away leaves the queue).

Who may change the table: asks and releases made on the node itself (a connection to a
loopback address: the wrapper, launch scripts, an SSH tunnel's end) always may; from afar
only when the REST API authenticates its clients (``--token-file`` or
``--tls-client-ca``), else 403 with one line saying so. Anybody who can read the API may
list the leases, as they may read the node's GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from aiohttp import web

from agent import files
from agent.api import render_json
from agent.edge.loopback import is_loopback
from agent.health.rule import utc_text
from agent.leases.answers import Granted, Hold, Refusal, Refused, Released, Taken
from agent.leases.asks import Ask, InvalidAsk
from agent.leases.holders import Lease
from agent.leases.labels import labels_for
from agent.leases.picking import link_words
from agent.leases.plans import FreeSet
from agent.leases.texts import foreign_holder, short_id
from agent.leases.view import TableView
from agent.leasing.service import LeaseService
from plugin.json_body import BodyError, parse_json

MAX_ASK_BYTES = 64 * 1024
MAX_WAIT_S = 600.0
MAX_OWNER_LABELS = 32
MAX_LABEL_CHARS = 128  # an owner label value (agent.leases.asks); keys have at most 64
MAX_FREE_COUNT = 1024  # GET /leases/free?count=N: more than any node has
MAX_PROFILE_CHARS = 64
SYSFS = Path("/sys")
CPULIST_LIMIT = 64 * 1024  # "0,2,4,...,8190" of a kernel built for 8,192 CPUs is 28 KiB
DISCONNECT_POLL_S = 0.25  # how soon a waiting ask notices that its client hung up

T = TypeVar("T")

LEASES = web.AppKey("leases", LeaseService)


# The usage ledger's idle holders by unit name (agent.api.usage.idle_by_unit), when it runs.
class IdleByUnit(Protocol):
    def __call__(self) -> dict[str, list[dict[str, Any]]]: ...


IDLE_BY_UNIT = web.AppKey("idle_by_unit", IdleByUnit)


def _json(status: int, body: object) -> web.Response:
    return web.Response(
        status=status,
        body=render_json.encode(body),
        content_type="application/json",
        charset="utf-8",
    )


def _error(status: int, text: str, **fields: object) -> web.Response:
    return _json(status, {"Error": text, **fields})


class _BadAsk(Exception):
    def __init__(self, field: str, text: str) -> None:
        super().__init__(text)
        self.field = field


ASK_FIELDS = frozenset(
    {"count", "devices", "mig_profile", "exclusive", "wait_s", "owner", "cpuset"}
)


def _ask_in_query(query: Mapping[str, str]) -> None:
    """``_BadAsk`` for a query parameter that would be taken for part of the ask (an ask
    field, or ``dev``): the ask is the body alone, and such a parameter would be ignored."""
    for name in query:
        if name in ASK_FIELDS or name == "dev":
            field = "devices" if name == "dev" else name
            raise _BadAsk(
                field,
                f"{name} is given in the query; an ask's fields go in the JSON body, "
                f"e.g. {{\"{field}\": ...}} (docs/leases.md, 'The REST API')",
            )


def _ask_of(raw: object) -> Ask:
    """The ``Ask`` of a request body; ``_BadAsk`` naming the field that is wrong."""
    if not isinstance(raw, dict):
        raise _BadAsk("", "the body is not a JSON object (docs/leases.md, 'The REST API')")
    for name in raw:
        if name not in ASK_FIELDS:
            raise _BadAsk(str(name)[:40], f"unknown field {str(name)[:40]!r}")
    count = raw.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int):
        raise _BadAsk("count", "count must be a whole number")
    devices = raw.get("devices")
    if devices is not None and not isinstance(devices, str):
        raise _BadAsk("devices", 'devices must be a string of dev entries, e.g. "0 1"')
    profile = raw.get("mig_profile")
    if profile is not None and not isinstance(profile, str):
        raise _BadAsk("mig_profile", 'mig_profile must be a string, e.g. "1g.18gb"')
    exclusive, cpuset = raw.get("exclusive", True), raw.get("cpuset", True)
    for name, value in (("exclusive", exclusive), ("cpuset", cpuset)):
        if not isinstance(value, bool):
            raise _BadAsk(name, f"{name} must be true or false")
    wait = raw.get("wait_s", 0)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_WAIT_S:
        raise _BadAsk("wait_s", f"wait_s must be a number of seconds from 0 to {MAX_WAIT_S:g}")
    return Ask(
        count=count,
        mig_profile=profile,
        devices=devices,
        owner=_owner(raw.get("owner", {})),
        exclusive=exclusive,
        wait_s=float(wait),
        cpuset=cpuset,
    )


def _owner(raw: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, dict) or len(raw) > MAX_OWNER_LABELS:
        raise _BadAsk("owner", f"owner must be an object of at most {MAX_OWNER_LABELS} labels")
    labels = []
    for key, value in raw.items():
        ok = isinstance(value, str) and all(
            0 < len(text) <= MAX_LABEL_CHARS and text.isprintable() for text in (key, value)
        )
        if not ok:
            raise _BadAsk("owner", f"owner labels are printable strings of 1 to {MAX_LABEL_CHARS}")
        labels.append((key, str(value)))
    return tuple(sorted(labels))


def _free_params(query: Mapping[str, str]) -> tuple[int, str | None]:
    """``count`` and ``mig_profile`` of ``GET /leases/free``; ``_BadAsk`` naming the one that
    is wrong."""
    text = query.get("count", "1")
    if not (text.isascii() and text.isdigit() and len(text) <= 4) or not (
        1 <= int(text) <= MAX_FREE_COUNT
    ):
        raise _BadAsk("count", f"count must be a whole number from 1 to {MAX_FREE_COUNT}")
    profile = query.get("mig_profile")
    if profile is not None and not (
        0 < len(profile) <= MAX_PROFILE_CHARS and profile.isprintable()
    ):
        raise _BadAsk("mig_profile", 'mig_profile must be a MIG profile name, e.g. "1g.18gb"')
    return int(text), profile


def free_json(free: FreeSet, count: int, profile: str | None) -> dict[str, Any]:
    """``GET /leases/free``: what an exclusive ask for ``count`` would get now."""
    return {
        "Count": count,
        "MigProfile": profile,
        "GPUs": free.gpus,
        "Units": free.units,
        "Free": free.free,
        "Set": [
            {"Name": u.name, "UUID": u.uuid, "GPU": u.gpu, "MIG": u.mig, "NumaNode": u.numa_node}
            for u in free.chosen
        ],
        "Link": link_words(free.pairs[0]) if free.pairs else "-",
        "Pairs": [list(score) for score in free.pairs],
    }


def _taken(taken: Taken) -> dict[str, Any]:
    return {
        "Unit": taken.unit,
        "UUID": taken.uuid,
        "Hold": taken.hold.value,
        "Lease": taken.lease_id,
        "Container": taken.container_id,
        "Since": _time(taken.since_s),
        "Until": _time(taken.until_s),
        "Why": taken.why,
    }


def _time(at_s: float | None) -> str | None:
    return utc_text(at_s) if at_s is not None else None


def _refused(refused: Refused) -> web.Response:
    status = 408 if refused.kind is Refusal.TIMED_OUT else 409
    if refused.kind is Refusal.UNKNOWN_LEASE:
        status = 404
    elif refused.kind in (Refusal.UNCHECKED, Refusal.NO_ENGINE_ACCESS):
        status = 503
    return _error(
        status,
        refused.text,
        Refusal=refused.kind.value,
        Taken=[_taken(t) for t in refused.taken],
    )


def _lease(lease: Lease) -> dict[str, Any]:
    return {
        "Lease": lease.id,
        "State": lease.state.value,
        "Units": list(lease.names),
        "Exclusive": lease.exclusive,
        "Owner": dict(lease.owner),
        "Asked": lease.asked,
        "Since": _time(lease.since_s),
        "Until": _time(lease.until_s),
        "Container": lease.container_id,
    }


class Cpusets:
    """The CPUs of NUMA nodes, as ``--cpuset-cpus`` takes them, read once from sysfs."""

    def __init__(self, sysfs: Path = SYSFS) -> None:
        self._sysfs = sysfs
        self._cpus: dict[int, str | None] = {}

    def cpus(self, node: int) -> str | None:
        if node not in self._cpus:
            path = self._sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist"
            try:
                data = files.read_regular(path, limit=CPULIST_LIMIT, what="cpulist", kernel=True)
                text = data.decode().strip()
            except (files.UnusableFile, UnicodeDecodeError):
                text = ""
            self._cpus[node] = text or None
        return self._cpus[node]

    def of(self, numa_nodes: tuple[int, ...] | None) -> tuple[str | None, str | None]:
        """(``--cpuset-cpus``, ``--cpuset-mems``) of ``numa_nodes``; (None, None) when any
        of them is not a NUMA node of this host (a simulated node's, say)."""
        if not numa_nodes:
            return None, None
        cpus = [self.cpus(node) for node in numa_nodes]
        if any(c is None for c in cpus):
            return None, None
        return ",".join(c for c in cpus if c), ",".join(str(n) for n in numa_nodes)


def _granted(grant: Granted, cpusets: Cpusets, pending_s: float | None) -> web.Response:
    cpus, mems = cpusets.of(grant.numa_nodes)
    return _json(
        201,
        {
            "Lease": grant.lease.id,
            "State": grant.lease.state.value,
            "Dev": grant.dev,
            "Devices": [
                {
                    "Name": u.name,
                    "UUID": u.uuid,
                    "GPU": u.gpu,
                    "MIG": u.mig,
                    "Profile": u.profile,
                    "Path": u.path,
                    "Sharing": u.sharing,
                    "Sharers": u.sharers,
                }
                for u in grant.units
            ],
            "NumaNodes": list(grant.numa_nodes) if grant.numa_nodes else None,
            "CpusetCpus": cpus,
            "CpusetMems": mems,
            "Labels": labels_for(grant.lease),
            "Expires": _time(grant.lease.until_s),
            "PendingS": None if pending_s is None else round(pending_s, 3),
            "Text": grant.text,
        },
    )


Handler = Callable[[web.Request], Any]


REMOTE_WRITES_REFUSED = (
    "leases are asked for and released on the node itself (localhost) unless the REST API "
    "authenticates its clients: start the agent with --token-file or --tls-client-ca "
    "(docs/remote-access.md), or ask over SSH (NV_HOST=ssh://...)"
)


def _from_the_node(request: web.Request) -> bool:
    """Whether the request came to one of this node's loopback addresses."""
    transport = request.transport
    local = transport.get_extra_info("sockname") if transport is not None else None
    return isinstance(local, tuple) and bool(local) and is_loopback(str(local[0]))


def _hung_up(request: web.Request) -> bool:
    """Whether the client of ``request`` has closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def _while_connected(request: web.Request, asking: Awaitable[T]) -> T | None:
    """``asking``'s result, or None once the client has hung up (``asking`` is then
    cancelled: a waiting ask leaves the queue). aiohttp does not cancel a handler whose
    client goes away unless the server asks it to, for every route; this watches the one
    route that can wait for minutes, every ``DISCONNECT_POLL_S``. A result that comes
    between a hang-up and the next look is returned: the caller checks ``_hung_up``."""
    task = asyncio.ensure_future(asking)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if _hung_up(request):
                return None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def make_routes(
    cpusets: Cpusets | None = None, *, remote_writes: bool = False
) -> list[tuple[str, str, Handler]]:
    """(method, path, handler) of every lease route; ``remote_writes``: whether clients
    beyond loopback may ask and release (the API authenticates them)."""
    sets = cpusets or Cpusets()

    def refused_from_afar(request: web.Request) -> web.Response | None:
        if remote_writes or _from_the_node(request):
            return None
        return _error(403, REMOTE_WRITES_REFUSED, Refusal="not_local")

    async def ask(request: web.Request) -> web.StreamResponse:
        if (refused := refused_from_afar(request)) is not None:
            return refused
        service = request.app[LEASES]
        body: bytes | None
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:  # past aiohttp's own bound (client_max_size)
            body = None
        if body is None or len(body) > MAX_ASK_BYTES:
            return _error(413, f"the ask is larger than {MAX_ASK_BYTES} bytes", Field="")
        try:
            _ask_in_query(request.query)
            the_ask = _ask_of(parse_json(body) if body.strip() else {})
        except BodyError as err:
            return _error(400, str(err), Field="")
        except _BadAsk as err:
            return _error(400, str(err), Field=err.field)
        try:
            answer = await _while_connected(request, service.ask(the_ask))
        except InvalidAsk as err:
            return _error(400, str(err), Field=err.field)
        if answer is None:  # the client went away while its ask waited: it left the queue
            return web.Response(status=499)
        if isinstance(answer, Granted) and _hung_up(request):
            # Served after its client went away, before the next look: nobody gets the
            # answer, so the lease is given back rather than held until it expires.
            service.release(answer.lease.id)
            return web.Response(status=499)
        if isinstance(answer, Granted):
            return _granted(answer, sets, service.left_s(answer.lease))
        return _refused(answer)

    async def list_json(request: web.Request) -> web.StreamResponse:
        body = view_json(request.app[LEASES].view())
        idle = request.app.get(IDLE_BY_UNIT)
        if idle is not None:  # the usage ledger's idle holders of each unit (docs/usage.md)
            by_unit = idle()
            for unit in body["Units"]:
                unit["Idle"] = by_unit.get(unit["Name"], [])
        return _json(200, body)

    async def free(request: web.Request) -> web.StreamResponse:
        try:
            count, profile = _free_params(request.query)
        except _BadAsk as err:
            return _error(400, str(err), Field=err.field)
        free_set = request.app[LEASES].free_set(count, profile)
        return _json(200, free_json(free_set, count, profile))

    async def list_text(request: web.Request) -> web.StreamResponse:
        return web.Response(text=view_text(request.app[LEASES].view()), content_type="text/plain")

    async def release(request: web.Request) -> web.StreamResponse:
        if (refused := refused_from_afar(request)) is not None:
            return refused
        answer = request.app[LEASES].release(request.match_info["lease"])
        if isinstance(answer, Released):
            return _json(200, {"Released": answer.lease.id, "Text": answer.text})
        return _refused(answer)

    async def release_unused(request: web.Request) -> web.StreamResponse:
        if (refused := refused_from_afar(request)) is not None:
            return refused
        answer = await request.app[LEASES].release_unused(request.match_info["lease"])
        if isinstance(answer, Released):
            return _json(200, {"Released": answer.lease.id, "Text": answer.text})
        return _refused(answer)

    return [
        ("POST", "/leases", ask),
        ("GET", "/leases", list_text),
        ("GET", "/leases/json", list_json),
        ("GET", "/leases/free", free),
        ("DELETE", "/leases/{lease}", release),
        ("DELETE", "/leases/{lease}/pending", release_unused),
    ]


def view_json(view: TableView) -> dict[str, Any]:
    """``GET /leases/json``: every unit, lease, foreign holder and waiting ask."""
    return {
        "Units": [
            {
                "Name": u.name,
                "UUID": u.uuid,
                "GPU": u.gpu,
                "MIG": u.mig,
                "Profile": u.profile,
                "NumaNode": u.numa_node,
                "State": u.state.value,
                "Healthy": u.healthy,
                "HealthReason": u.health_reason,
                "Sharing": u.sharing,
                "Holders": [_taken(t) for t in u.holders],
            }
            for u in view.units
        ],
        "Leases": [_lease(lease) for lease in view.leases],
        "Foreign": [
            {
                "Holder": f.holder,
                "Units": list(f.units),
                "How": f.how,
                "Since": _time(f.since_s),
            }
            for f in view.foreign
        ],
        "Waiting": [
            {
                "Ticket": w.ticket,
                "Owner": dict(w.owner),
                "Since": _time(w.asked_s),
                "Until": _time(w.until_s),
            }
            for w in view.waiting
        ],
    }


def view_text(view: TableView) -> str:
    """``GET /leases``: one line per unit, then the queue."""
    lines = []
    for unit in view.units:
        label = f"MIG {unit.name}" if unit.mig is not None else f"GPU {unit.name}"
        state = unit.state.value if unit.healthy else f"{unit.state.value}, unhealthy"
        holders = "; ".join(_holder_text(t) for t in unit.holders)
        lines.append(
            f"{label:<8} {unit.uuid or '-':<40} {state}" + (f": {holders}" if holders else "")
        )
    for waiting in view.waiting:
        lines.append(f"waiting  {waiting.ticket} since {_time(waiting.asked_s)}")
    return "\n".join(lines) + "\n"


def _holder_text(taken: Taken) -> str:
    """``running lease-1 (container 3f2a1b9c0d4e)``, ``pending lease-2``; a foreign holder:
    ``container 3f2a1b9c0d4e (--device /dev/nvidia1)``, ``pid 4242``."""
    if taken.hold is Hold.FOREIGN:
        return foreign_holder(taken) + (f" ({taken.why})" if taken.why else "")
    who = taken.lease_id or taken.container_id or "?"
    if taken.container_id and taken.lease_id:
        who = f"{taken.lease_id} (container {short_id(taken.container_id)})"
    return f"{taken.hold.value} {who}"
