"""The table's state as a snapshot, and the snapshot as JSON and back.

A snapshot holds the leases (pending, running, stopped), the foreign holders, the next lease
number and the table's clock: what a restarted agent needs, together with the live
containers' labels, to know again who holds what (``LeaseTable.restore``, then
``resync``). The queue is not in it: the asks that waited were connections of the process
that ended, and nobody would take what it handed them. The integrator writes the JSON to a
file (atomically) and reads it back within bounds; ``snapshot_from_json`` checks every field
and refuses what is not a snapshot with one line (``SnapshotError``). ``snapshot_to_json``
keeps to the same bounds, so that what it writes always reads back: at most ``MAX_ENTRIES``
leases and as many foreign holders (beyond that it leaves out first what a resync or the next
status sweep finds again, and logs one warning line saying how many), and an ``asked`` text
shortened to ``_MAX_TEXT`` characters.

Each bound lease, and each running container's foreign hold, names its container's engine
(``engine``; the agent's feed names an engine by its socket path), and such a hold of an
unknown engine says until when it is kept (``until_s``). A snapshot without these fields (an
older agent's) still reads: its bound leases and container holds are of an unknown engine,
which the table keeps until an engine lists their containers (``LeaseTable.resync``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from agent.leases.asks import owner_is_valid
from agent.leases.containers import check_engine
from agent.leases.holders import (
    CONTAINER_ID,
    ForeignHold,
    ForeignSource,
    Lease,
    LeaseState,
    lease_number,
)

SCHEMA = "nvidia-docker-leases/1"
MAX_ENTRIES = 4096  # leases or foreign holders in one snapshot
_MAX_TEXT = 512
E = TypeVar("E")

log = logging.getLogger(__name__)

# Which leases a snapshot over the bound keeps first: a pending lease and a stopped
# container's are known from the snapshot alone; a running container's lease is rebuilt from
# its labels by the resync after a restart.
_LEASE_KEPT_FIRST = {LeaseState.PENDING: 0, LeaseState.STOPPED: 1, LeaseState.RUNNING: 2}


class SnapshotError(ValueError):
    """A value that is not a lease table snapshot; the message names the field."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    saved_s: float  # the table's clock when it was taken (Unix s)
    next_lease: int  # the number the next new lease id gets
    leases: tuple[Lease, ...]
    foreign: tuple[ForeignHold, ...]


def _bounded(snapshot: Snapshot) -> Snapshot:
    """``snapshot`` within what ``snapshot_from_json`` reads: at most ``MAX_ENTRIES`` leases
    (pending ones kept first, then stopped containers', then running containers', whose
    labels rebuild them at a resync) and ``MAX_ENTRIES`` foreign holders (containers' kept
    before processes', which the next status sweep sees again); one warning line when any is
    left out."""
    leases, foreign = snapshot.leases, snapshot.foreign
    if len(leases) > MAX_ENTRIES:
        ranked = sorted(leases, key=lambda x: (_LEASE_KEPT_FIRST[x.state], x.number))
        leases = tuple(ranked[:MAX_ENTRIES])
    if len(foreign) > MAX_ENTRIES:
        ranked_holds = sorted(foreign, key=lambda h: h.source is not ForeignSource.CONTAINER)
        foreign = tuple(ranked_holds[:MAX_ENTRIES])
    dropped_leases = len(snapshot.leases) - len(leases)
    dropped_holds = len(snapshot.foreign) - len(foreign)
    if dropped_leases or dropped_holds:
        log.warning(
            "Leases: the snapshot holds at most %d leases and %d foreign holders: %d leases "
            "(of running containers first; a resync rebuilds them from their labels) and %d "
            "foreign holders (GPU processes first; seen again by the next sweep) are left "
            "out of the state file",
            MAX_ENTRIES,
            MAX_ENTRIES,
            dropped_leases,
            dropped_holds,
        )
    return Snapshot(snapshot.saved_s, snapshot.next_lease, leases, foreign)


def _short(text: str) -> str:
    """``text`` cut to ``_MAX_TEXT`` characters (an ``asked`` of many named devices)."""
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 1] + "\u2026"


def snapshot_to_json(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as a JSON-ready dict (``json.dumps`` it), within the bounds that
    ``snapshot_from_json`` reads (``_bounded``; ``asked`` shortened to ``_MAX_TEXT``)."""
    snapshot = _bounded(snapshot)
    return {
        "schema": SCHEMA,
        "saved_s": snapshot.saved_s,
        "next_lease": snapshot.next_lease,
        "leases": [
            {
                "id": lease.id,
                "units": list(lease.units),
                "names": list(lease.names),
                "exclusive": lease.exclusive,
                "owner": dict(lease.owner),
                "asked": _short(lease.asked),
                "since_s": lease.since_s,
                "state": lease.state.value,
                "container_id": lease.container_id,
                "until_s": lease.until_s,
                "engine": lease.engine,
            }
            for lease in snapshot.leases
        ],
        "foreign": [
            {
                "holder": hold.holder,
                "source": hold.source.value,
                "units": list(hold.units),
                "how": hold.how,
                "since_s": hold.since_s,
                "container": hold.container,
                "engine": hold.engine,
                "until_s": hold.until_s,
            }
            for hold in snapshot.foreign
        ],
    }


def snapshot_from_json(raw: object) -> Snapshot:
    """The snapshot a ``snapshot_to_json`` dict (after a JSON round trip) holds."""
    top = _object(raw, "snapshot")
    if top.get("schema") != SCHEMA:
        raise SnapshotError(f"schema: not {SCHEMA}: {_shown(top.get('schema'))}")
    leases = _entries(top, "leases", _lease)
    ids = [lease.id for lease in leases]
    if len(set(ids)) != len(ids):
        raise SnapshotError("leases: a lease id is given twice")
    next_lease = _int(top.get("next_lease"), "next_lease")
    return Snapshot(
        _time(top.get("saved_s"), "saved_s"),
        max([next_lease, *(lease.number + 1 for lease in leases)]),
        leases,
        _entries(top, "foreign", _foreign),
    )


def _lease(raw: Mapping[str, object], at: str) -> Lease:
    lease_id = _text(raw.get("id"), f"{at}.id")
    if lease_number(lease_id) is None:
        raise SnapshotError(f"{at}.id: not a lease id: {_shown(lease_id)}")
    units = _texts(raw.get("units"), f"{at}.units")
    names = _texts(raw.get("names"), f"{at}.names")
    if not units or len(names) != len(units):
        raise SnapshotError(f"{at}.units: one or more, and a name for each")
    owner_raw = _object(raw.get("owner"), f"{at}.owner")
    owner = tuple((k, _text(v, f"{at}.owner.{k}")) for k, v in owner_raw.items())
    if not owner_is_valid(owner):
        raise SnapshotError(f"{at}.owner: not owner labels")
    state_text = _text(raw.get("state"), f"{at}.state")
    try:
        state = LeaseState(state_text)
    except ValueError:
        raise SnapshotError(f"{at}.state: not a lease state: {_shown(state_text)}") from None
    container_id = raw.get("container_id")
    if container_id is not None:
        container_id = _container(container_id, f"{at}.container_id")
    until = raw.get("until_s")
    engine = _engine(raw.get("engine"), f"{at}.engine")
    lease = Lease(
        lease_id,
        units,
        names,
        _bool(raw.get("exclusive"), f"{at}.exclusive"),
        owner,
        _text(raw.get("asked"), f"{at}.asked"),
        _time(raw.get("since_s"), f"{at}.since_s"),
        state,
        container_id,
        None if until is None else _time(until, f"{at}.until_s"),
        engine,
    )
    if (lease.state is LeaseState.PENDING) != (lease.container_id is None):
        raise SnapshotError(f"{at}: a pending lease has no container, a bound one has one")
    if lease.state is LeaseState.PENDING and lease.engine is not None:
        raise SnapshotError(f"{at}.engine: a pending lease has none")
    running = lease.state is LeaseState.RUNNING
    if not running and lease.until_s is None:
        raise SnapshotError(f"{at}.until_s: set unless its container runs")
    if running and lease.until_s is not None and lease.engine is not None:
        raise SnapshotError(
            f"{at}.until_s: set unless its container runs (and is its engine's: the engine "
            "is unknown)"
        )
    return lease


def _foreign(raw: Mapping[str, object], at: str) -> ForeignHold:
    source_text = _text(raw.get("source"), f"{at}.source")
    try:
        source = ForeignSource(source_text)
    except ValueError:
        raise SnapshotError(f"{at}.source: not a source: {_shown(source_text)}") from None
    container = _bool(raw.get("container"), f"{at}.container")
    holder = _text(raw.get("holder"), f"{at}.holder")
    if container:
        _container(holder, f"{at}.holder")
    elif not (holder.startswith("pid ") and holder[4:].isdigit() and holder[4:].isascii()):
        raise SnapshotError(f"{at}.holder: not a container id or pid: {_shown(holder)}")
    engine = _engine(raw.get("engine"), f"{at}.engine")
    until = raw.get("until_s")
    until_s = None if until is None else _time(until, f"{at}.until_s")
    held_by_container = container and source is ForeignSource.CONTAINER
    if engine is not None and not held_by_container:
        raise SnapshotError(f"{at}.engine: only a running container's hold has one")
    if until_s is not None and (engine is not None or not held_by_container):
        raise SnapshotError(f"{at}.until_s: only a container's hold of an unknown engine has one")
    return ForeignHold(
        holder,
        source,
        _texts(raw.get("units"), f"{at}.units"),
        _text(raw.get("how"), f"{at}.how"),
        _time(raw.get("since_s"), f"{at}.since_s"),
        container,
        engine,
        until_s,
    )


def _entries(
    top: Mapping[str, object], key: str, read: Callable[[Mapping[str, object], str], E]
) -> tuple[E, ...]:
    raw = top.get(key)
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        raise SnapshotError(f"{key}: not a list of at most {MAX_ENTRIES}")
    return tuple(read(_object(item, f"{key}[{i}]"), f"{key}[{i}]") for i, item in enumerate(raw))


def _object(raw: object, at: str) -> Mapping[str, object]:
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise SnapshotError(f"{at}: not an object")
    return raw


def _text(raw: object, at: str) -> str:
    if not isinstance(raw, str) or len(raw) > _MAX_TEXT or not raw.isprintable():
        raise SnapshotError(f"{at}: not a printable string of at most {_MAX_TEXT}")
    return raw


def _texts(raw: object, at: str) -> tuple[str, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        raise SnapshotError(f"{at}: not a list of strings")
    return tuple(_text(item, f"{at}[{i}]") for i, item in enumerate(raw))


def _container(raw: object, at: str) -> str:
    text = _text(raw, at)
    if not CONTAINER_ID.fullmatch(text):
        raise SnapshotError(f"{at}: not a container id: {_shown(text)}")
    return text


def _engine(raw: object, at: str) -> str | None:
    """An engine's name; None (unknown) when absent or null (an older agent's snapshot)."""
    if raw is None:
        return None
    text = _text(raw, at)
    try:
        return check_engine(text)
    except ValueError:
        raise SnapshotError(f"{at}: not an engine name: {_shown(text)}") from None


def _bool(raw: object, at: str) -> bool:
    if not isinstance(raw, bool):
        raise SnapshotError(f"{at}: not true or false")
    return raw


def _int(raw: object, at: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw < 10**12:
        raise SnapshotError(f"{at}: not a whole number from 1")
    return raw


def _time(raw: object, at: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise SnapshotError(f"{at}: not a time in seconds")
    return float(raw)


def _shown(raw: object) -> str:
    return repr(raw)[:60]
