"""The usage ledger's readers: who used which GPU over a time range, grouped as asked.

Each call opens ``usage.db`` read-only (``mode=ro``) for itself, reads in one read
transaction (one snapshot of the file, whatever the writer commits meanwhile) and closes it.
The file is in WAL mode, so a reader neither waits for the writer nor holds it up; the short
``BUSY_TIMEOUT_S`` covers the moments SQLite itself locks the file (a WAL being recovered
after a crash). The functions are synchronous: the agent calls them in a thread. A file that
does not exist yet, or that the writer has not set up yet, is an empty answer; one that is
not a ledger of ours, or that cannot be read, is a ``LedgerUnreadable`` (one line).

``read_usage(path, since_s=..., until_s=..., by=...)`` answers one grouping:

- ``gpu``, ``image``, ``label:KEY``: from the ``hourly`` table, whole UTC hours: the hours
  that overlap [since, until), so the answer's ``since_s`` and ``until_s`` are the range
  rounded out to hours. A group with at most ``SEEK_GROUPS`` values is read value by value,
  each value's hours found by one seek of the table's key (``dim``, ``value``, ``hour_s``):
  the rows in the range and no others; a grouping with more values is read in one pass over
  its rows. A ``gpu`` row's ``extra`` has the GPU's ``index``, as the newest of the
  ledger's ``NEWEST_HOLDS`` newest holds on it recorded it (none when none of them is on it).
- ``container``: from the ``holds`` that overlap [since, until) (exactly, no rounding): each
  hold's ``held_s``, ``busy_s`` and ``energy_j`` count by the fraction of its span
  (``started_s`` to ``ended_s``, or to ``last_seen_s`` while it lasts) that lies in the
  range, and holds are grouped by container name; the container id where there is no name,
  the lease id (``lease-N``) for a lease not bound to a container yet, ``pid N`` for a
  process. A row's ``extra`` has the ``container_id`` (of its newest hold that has one).

Rows come sorted by GPU-seconds, most first, then by key; at most ``limit`` of them
(``truncated`` says there were more); ``totals`` adds up every row, those cut off too.

``newest_lease_number(path)`` is the highest lease number the newest holds name (the agent's
start numbers new leases above it).
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from agent.leases.holders import lease_number
from agent.usage import schema
from agent.usage.records import hour_of

BUSY_TIMEOUT_S = 0.5
SEEK_GROUPS = 512  # up to this many values, a grouping is read value by value
NEWEST_HOLDS = 10_000  # how many of the newest holds newest_lease_number and gpu indexes read
TOTAL_KEY = "total"


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One group's figures over the range: GPU-seconds held, of them busy, and the energy
    (None when no hold of the group had an energy counter); ``holds``: how many holds it
    counts, where the grouping reads holds (None for the hourly groupings)."""

    key: str
    gpu_seconds: float
    busy_gpu_seconds: float
    energy_joules: float | None
    holds: int | None
    extra: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class UsageAnswer:
    """What ``read_usage`` found: the range it covers, the grouping, the rows (sorted, at
    most the limit), whether rows were cut off, and the totals over every row."""

    since_s: float
    until_s: float
    by: str
    rows: tuple[UsageRow, ...]
    truncated: bool
    totals: UsageRow


class LedgerUnreadable(Exception):
    """The ledger file exists but cannot be read as one; the message is one line."""


def read_usage(
    path: Path,
    *,
    since_s: float,
    until_s: float,
    by: str,
    limit: int = 1000,
    now_s: float | None = None,
) -> UsageAnswer:
    """The usage of [since_s, until_s) grouped ``by`` ``gpu``, ``container``, ``image`` or
    ``label:KEY`` (see the module docstring). With ``now_s``, a range that reaches past it
    ends there. ``ValueError`` (one line) for another grouping, a range that does not go
    forward, a limit under 1."""
    dim = _dimension(by)
    _check_range(since_s, until_s)
    if limit < 1:
        raise ValueError(f"limit must be 1 or more, not {limit}")
    if now_s is not None:
        until_s = max(since_s, min(until_s, now_s))
    if dim is not None:
        since_s, until_s = float(hour_of(since_s)), float(_hour_after(until_s))
    if until_s <= since_s:
        return _answer(since_s, until_s, by, [], limit, holds=dim is None)
    rows: list[UsageRow] = []
    with _reading(path) as conn:
        if conn is not None:
            if dim is None:
                rows = list(_by_container(conn, since_s, until_s))
            else:
                rows = list(_by_hour(conn, dim, int(since_s), int(until_s)))
                if dim == "gpu":
                    rows = _with_gpu_indexes(conn, rows)
    return _answer(since_s, until_s, by, rows, limit, holds=dim is None)


# -- the groupings ----------------------------------------------------------------------------


def newest_lease_number(path: Path) -> int:
    """The highest ``N`` of the ``lease-N`` ids among the ledger's ``NEWEST_HOLDS`` newest
    holds; 0 when none names a lease (or there is no ledger yet). An agent started without
    its lease state file numbers new leases above it, so a lease id the ledger names is not
    given to another lease. One read of at most ``NEWEST_HOLDS`` rows, newest first by the
    table's key; ``LedgerUnreadable`` as the other readers."""
    with _reading(path) as conn:
        if conn is None:
            return 0
        rows = conn.execute(
            "SELECT lease_id FROM (SELECT lease_id FROM holds ORDER BY id DESC LIMIT ?) "
            "WHERE lease_id IS NOT NULL",
            (NEWEST_HOLDS,),
        ).fetchall()
    return max((lease_number(str(row[0])) or 0 for row in rows), default=0)


def _dimension(by: str) -> str | None:
    """The hourly ``dim`` of grouping ``by``; None for ``container`` (read from holds)."""
    if by == "container":
        return None
    if by in ("gpu", "image") or (by.startswith("label:") and len(by) > len("label:")):
        return by
    raise ValueError(f"by must be gpu, container, image or label:KEY, not {by!r}")


def _check_range(since_s: float, until_s: float) -> None:
    if not (math.isfinite(since_s) and math.isfinite(until_s)):
        raise ValueError(f"since and until must be finite times, not {since_s} and {until_s}")
    if since_s >= until_s:
        raise ValueError(f"since ({since_s:.0f}) must be before until ({until_s:.0f})")


def _hour_after(t_s: float) -> int:
    """The first hour boundary at or after ``t_s``."""
    start = hour_of(t_s)
    return start if start >= t_s else start + 3600


def _by_hour(conn: sqlite3.Connection, dim: str, low: int, high: int) -> Iterator[UsageRow]:
    values = _values_of(conn, dim, SEEK_GROUPS + 1)
    if len(values) > SEEK_GROUPS:
        rows = conn.execute(
            "SELECT value, sum(held_s), sum(busy_s), sum(energy_j) FROM hourly "
            "WHERE dim = ? AND hour_s >= ? AND hour_s < ? GROUP BY value",
            (dim, low, high),
        )
        for value, held, busy, energy in rows:
            yield UsageRow(str(value), held, busy, energy, None)
        return
    for value in values:
        held, busy, energy, count = conn.execute(
            "SELECT sum(held_s), sum(busy_s), sum(energy_j), count(*) FROM hourly "
            "WHERE dim = ? AND value = ? AND hour_s >= ? AND hour_s < ?",
            (dim, value, low, high),
        ).fetchone()
        if count:
            yield UsageRow(value, held, busy, energy, None)


def _with_gpu_indexes(conn: sqlite3.Connection, rows: list[UsageRow]) -> list[UsageRow]:
    """``rows`` of the ``gpu`` grouping, each with its GPU's index in ``extra`` where one of
    the ``NEWEST_HOLDS`` newest holds is on that GPU (the newest of them says it)."""
    found: dict[str, int] = {}
    for uuid, index in conn.execute(
        "SELECT gpu_uuid, gpu_index FROM holds ORDER BY id DESC LIMIT ?", (NEWEST_HOLDS,)
    ):
        found.setdefault(str(uuid), int(index))
    return [
        replace(row, extra=(("index", str(found[row.key])),)) if row.key in found else row
        for row in rows
    ]


def _values_of(conn: sqlite3.Connection, dim: str, most: int) -> list[str]:
    """The first ``most`` values of ``dim`` in the hourly table, one key seek each."""
    values: list[str] = []
    row = conn.execute("SELECT min(value) FROM hourly WHERE dim = ?", (dim,)).fetchone()
    while row is not None and row[0] is not None and len(values) < most:
        values.append(str(row[0]))
        row = conn.execute(
            "SELECT value FROM hourly WHERE dim = ? AND value > ? ORDER BY value LIMIT 1",
            (dim, row[0]),
        ).fetchone()
    return values


# The holds of the range, grouped: the ended ones (those that started at most the longest
# span before the range) and the open ones (few) apart, each branch one GROUP BY; {holds} is
# the table, NOT INDEXED for the ended ones when the range (from the longest span before it)
# covers more than _SCAN_SHARE of the ledger's time (a plain scan of the table reads it
# faster than the started_s index and a lookup per row).
_GROUPED = """
SELECT grp, sum(held_s * f), sum(busy_s * f), sum(energy_j * f), count(*),
    max(CASE WHEN container_id IS NOT NULL THEN s END), container_id
FROM (
    SELECT coalesce(container_name, container_id,
            CASE holder WHEN 'lease' THEN lease_id WHEN 'process' THEN 'pid ' || pid END,
            key) AS grp,
        container_id, s, held_s, busy_s, energy_j,
        CASE WHEN e > s THEN (min(e, :until) - max(s, :since)) / (e - s) ELSE 1.0 END AS f
    FROM (SELECT *, started_s AS s, coalesce(ended_s, last_seen_s) AS e FROM {holds} WHERE {which})
)
GROUP BY grp
"""
_ENDED = (
    "ended_s IS NOT NULL AND started_s >= :low AND started_s < :until "
    "AND (ended_s > :since OR (ended_s <= started_s AND started_s >= :since))"
)
_OPEN = (
    "ended_s IS NULL AND started_s < :until "
    "AND (last_seen_s > :since OR (last_seen_s <= started_s AND started_s >= :since))"
)
_SCAN_SHARE = 0.25  # a range over more than this share of the ledger's time reads it all


def _by_container(conn: sqlite3.Connection, since_s: float, until_s: float) -> Iterator[UsageRow]:
    low = since_s - _longest_s(conn)
    params = {"low": low, "since": since_s, "until": until_s}
    first = conn.execute("SELECT min(started_s) FROM holds").fetchone()[0]  # one seek each
    last = conn.execute("SELECT max(started_s) FROM holds").fetchone()[0]
    if first is None or last is None:
        return
    whole = max(1.0, float(last) - float(first))
    table = "holds NOT INDEXED" if until_s - low > _SCAN_SHARE * whole else "holds"
    groups: dict[str, list[object]] = {}
    for which, holds in ((_ENDED, table), (_OPEN, "holds")):
        query = _GROUPED.format(holds=holds, which=which)
        for key, held, busy, energy, count, newest, container_id in conn.execute(query, params):
            found = groups.get(key)
            if found is None:
                groups[key] = [held, busy, energy, count, newest, container_id]
                continue
            found[0] = _plus(found[0], held)
            found[1] = _plus(found[1], busy)
            found[2] = _plus(found[2], energy)
            found[3] = _plus(found[3], count)
            if newest is not None and (found[4] is None or _num(newest) > _num(found[4])):
                found[4], found[5] = newest, container_id
    for key, (held, busy, energy, count, _newest, container_id) in groups.items():
        extra = () if container_id is None else (("container_id", str(container_id)),)
        yield UsageRow(
            str(key),
            _num(held),
            _num(busy),
            None if energy is None else _num(energy),
            int(_num(count)),
            extra,
        )


def _plus(a: object, b: object) -> object:
    """``a + b``, where None is nothing (SQL's sum of no values)."""
    if a is None:
        return b
    if b is None:
        return a
    return _num(a) + _num(b)


def _num(value: object) -> float:
    assert isinstance(value, int | float), value
    return float(value)


def _longest_s(conn: sqlite3.Connection) -> float:
    """The longest span of an ended hold, and a second more (what float sums round off)."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'longest_hold_s'").fetchone()
    longest = row[0] if row is not None and isinstance(row[0], int | float) else 0.0
    return float(longest) + 1.0


def _answer(
    since_s: float, until_s: float, by: str, rows: list[UsageRow], limit: int, *, holds: bool
) -> UsageAnswer:
    rows.sort(key=lambda row: (-row.gpu_seconds, row.key))
    energies = [row.energy_joules for row in rows if row.energy_joules is not None]
    totals = UsageRow(
        TOTAL_KEY,
        sum(row.gpu_seconds for row in rows),
        sum(row.busy_gpu_seconds for row in rows),
        sum(energies) if energies else None,
        sum(row.holds or 0 for row in rows) if holds else None,
    )
    return UsageAnswer(
        since_s, until_s, by, tuple(rows[:limit]), truncated=len(rows) > limit, totals=totals
    )


# -- the file ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[sqlite3.Connection | None]:
    """A read-only connection to ``path`` in a read transaction; None when there is no
    ledger to read yet (no file, or no tables)."""
    if not path.exists():
        yield None
        return
    uri = Path(path).absolute().as_uri() + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as err:
        raise LedgerUnreadable(f"usage ledger {path} cannot be opened: {err}") from None
    try:
        try:
            conn.execute("BEGIN")
            usable = _usable(conn, path)
        except sqlite3.Error as err:
            raise LedgerUnreadable(f"usage ledger {path} cannot be read: {err}") from None
        try:
            yield conn if usable else None
        except sqlite3.Error as err:
            raise LedgerUnreadable(f"usage ledger {path} cannot be read: {err}") from None
    finally:
        conn.close()


def _usable(conn: sqlite3.Connection, path: Path) -> bool:
    """Whether the file has the ledger's tables; ``LedgerUnreadable`` when it is not ours."""
    app, version = schema.versions(conn)
    tables = schema.table_names(conn)
    if app == 0 and not tables:
        return False  # new: the writer has not set it up yet
    if app != schema.APPLICATION_ID:
        raise LedgerUnreadable(f"usage ledger {path} is another program's SQLite database")
    if version > schema.SCHEMA_VERSION:
        raise LedgerUnreadable(
            f"usage ledger {path} is at schema version {version}, newer than the "
            f"{schema.SCHEMA_VERSION} this agent reads"
        )
    return set(schema.TABLES) <= tables
