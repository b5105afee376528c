"""The usage ledger's SQLite file: its tables, its version, and how an older file is brought
up to date.

The file is ``usage.db`` in the state directory (``agent.usage.store`` writes it,
``agent.usage.queries`` reads it). It is a plain SQLite 3 database: ``sqlite3 usage.db``
opens it, ``.schema`` shows what follows. It says what it is in its header:
``PRAGMA application_id`` is ``APPLICATION_ID`` (0x4E44554C, "NDUL": nvidia-docker usage
ledger), so another program's SQLite file is recognised, and ``PRAGMA user_version`` is the
schema version, ``SCHEMA_VERSION``.

Schema version 1, its tables:

- ``holds``: one row per hold (``agent.usage.records.Hold``): ``id`` (an integer of the
  file's own), ``key`` (unique: a later write of a key replaces the row's figures), the unit
  (``gpu_uuid``, ``gpu_index``, ``unit``, ``mig_uuid``), the holder (``holder``: ``lease``,
  ``container`` or ``process``; ``lease_id``, ``container_id``, ``container_name``,
  ``image``, ``pid``), the times (``started_s``, ``last_seen_s``, ``ended_s``: Unix seconds,
  ``ended_s`` NULL while the hold lasts) and the figures (``held_s``, ``busy_s``,
  ``peak_memory_mib``, ``energy_j``: NULL without a counter). Indexes: ``holds_started``
  (``started_s``: the holds of a time range; ``meta.longest_hold_s`` bounds how far before
  the range one can start) and ``holds_ended`` (``ended_s``: the holds still open, those
  past retention, the oldest first). Nothing else: a report by container reads the holds of
  its range and groups them, which no index of names would shorten, and on a busy node an
  index of container names and ids would take a seventh of the file.
- ``hold_labels``: the owner labels a hold recorded, one row per label (``hold_id``,
  ``key``, ``value``; the primary key is (``hold_id``, ``key``)), deleted with their hold; so
  a plain SQL join groups a range's holds by a label's value. No index by (``key``,
  ``value``): no report looks holds up by a label's value, and it would take another seventh.
- ``hourly``: the figures added up per UTC hour and per group: ``hour_s`` (the hour's first
  second), ``dim`` (``gpu``, ``image`` or ``label:KEY``), ``value`` (a GPU UUID, an image,
  a label's value; ``""`` for none), ``held_s``, ``busy_s``, ``energy_j`` (NULL while no
  energy counter added to it). The primary key is (``dim``, ``value``, ``hour_s``), in that
  order: a report over a range reads each group's hours in a row (a year of one label's
  totals is one pass over its rows, no sort), and a day is a short range in each group.
  ``WITHOUT ROWID``: the key is the row.
- ``meta``: (``key``, ``value``) facts about the file: ``created_s`` (when it was created),
  ``created_by`` (the agent version that created it), ``migrated_s`` (the last migration),
  ``longest_hold_s`` (the longest span, ``ended_s - started_s``, of any ended hold written:
  what bounds the range a time query scans).

The file is kept in WAL mode (readers read while the writer writes), with
``synchronous=NORMAL`` (a commit survives a crash of the process; a power cut may lose the
commits since the last checkpoint, never the file's consistency) and
``auto_vacuum=INCREMENTAL`` (set when the file is created: deleted rows give their pages
back to the file system at the next ``PRAGMA incremental_vacuum``).

``MIGRATIONS[n]`` is the list of statements that takes a file from version ``n`` to
``n + 1``; version 0 is a new, empty file. ``migrate`` applies every step a file needs in
one transaction, with the version and the application id set in that same transaction: a
file is at one version or the next, never halfway.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence

from agent import __version__
from agent.usage.records import Hold, HolderKind

APPLICATION_ID = 0x4E44554C  # "NDUL", the nvidia-docker usage ledger
SCHEMA_VERSION = 1
TABLES = ("holds", "hold_labels", "hourly", "meta")  # every table of the current version

_VERSION_1 = [
    """CREATE TABLE meta (
        key TEXT PRIMARY KEY,
        value
    ) WITHOUT ROWID""",
    """CREATE TABLE holds (
        id INTEGER PRIMARY KEY,
        key TEXT NOT NULL UNIQUE,
        gpu_uuid TEXT NOT NULL,
        gpu_index INTEGER NOT NULL,
        unit TEXT NOT NULL,
        mig_uuid TEXT,
        holder TEXT NOT NULL CHECK (holder IN ('lease', 'container', 'process')),
        lease_id TEXT,
        container_id TEXT,
        container_name TEXT,
        image TEXT,
        pid INTEGER,
        started_s REAL NOT NULL,
        last_seen_s REAL NOT NULL,
        ended_s REAL,
        held_s REAL NOT NULL,
        busy_s REAL NOT NULL,
        peak_memory_mib INTEGER,
        energy_j REAL
    )""",
    "CREATE INDEX holds_started ON holds (started_s)",
    "CREATE INDEX holds_ended ON holds (ended_s)",
    """CREATE TABLE hold_labels (
        hold_id INTEGER NOT NULL REFERENCES holds (id) ON DELETE CASCADE,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (hold_id, key)
    ) WITHOUT ROWID""",
    """CREATE TABLE hourly (
        hour_s INTEGER NOT NULL,
        dim TEXT NOT NULL,
        value TEXT NOT NULL,
        held_s REAL NOT NULL,
        busy_s REAL NOT NULL,
        energy_j REAL,
        PRIMARY KEY (dim, value, hour_s)
    ) WITHOUT ROWID""",
]

MIGRATIONS: tuple[Sequence[str], ...] = (_VERSION_1,)  # MIGRATIONS[n]: version n to n + 1

# The columns of a hold, in the order ``hold_from_row`` reads them (labels apart).
HOLD_COLUMNS = (
    "id, key, gpu_uuid, gpu_index, unit, mig_uuid, holder, lease_id, container_id, "
    "container_name, image, pid, started_s, last_seen_s, ended_s, held_s, busy_s, "
    "peak_memory_mib, energy_j"
)


class SchemaError(Exception):
    """A migration that failed (the file stays at the version it had); one line."""


def prepare_new_file(conn: sqlite3.Connection) -> None:
    """What must be set on a file without tables before its first one: incremental
    auto-vacuum (a ``VACUUM`` makes it stick when the file has a first page already, which
    costs nothing on an empty file), then the WAL journal."""
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
        conn.execute("VACUUM")
    conn.execute("PRAGMA journal_mode = WAL")


def versions(conn: sqlite3.Connection) -> tuple[int, int]:
    """The file's (application id, schema version), as its header says."""
    app = conn.execute("PRAGMA application_id").fetchone()[0]
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    return int(app), int(version)


def table_names(conn: sqlite3.Connection) -> set[str]:
    """The file's tables, SQLite's own (``sqlite_*``) apart."""
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' "
        "ESCAPE '\\'"
    )
    return {str(row[0]) for row in rows}


def migrate(
    conn: sqlite3.Connection,
    *,
    now_s: float | None = None,
    migrations: Sequence[Sequence[str]] = MIGRATIONS,
) -> int:
    """Bring the file to the newest version ``migrations`` know, in one transaction; the
    version it was at is returned (the newest: nothing done). ``conn`` is in autocommit mode
    (``isolation_level=None``); the caller has checked that the file is ours, or new, and not
    newer. ``SchemaError`` when a statement fails: the transaction is rolled back."""
    _app, version = versions(conn)
    target = len(migrations)
    if version >= target:
        return version
    stamp = time.time() if now_s is None else now_s
    conn.execute("BEGIN IMMEDIATE")
    try:
        for step in range(version, target):
            for statement in migrations[step]:
                conn.execute(statement)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute(f"PRAGMA user_version = {target}")
        facts: list[tuple[str, float | str]] = [("migrated_s", stamp)]
        if version == 0:
            facts += [("created_s", stamp), ("created_by", f"nvidia-docker-plugin {__version__}")]
        conn.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            facts,
        )
        conn.execute("COMMIT")
    except sqlite3.Error as err:
        conn.execute("ROLLBACK")
        raise SchemaError(
            f"migrating the usage ledger from schema version {version} to {target} failed: {err}"
        ) from err
    return version


def hold_from_row(row: Sequence[object], labels: tuple[tuple[str, str], ...]) -> Hold:
    """The ``Hold`` of a row read with ``HOLD_COLUMNS`` (its ``id`` first, not kept)."""
    (
        _id,
        key,
        gpu_uuid,
        gpu_index,
        unit,
        mig_uuid,
        holder,
        lease_id,
        container_id,
        container_name,
        image,
        pid,
        started_s,
        last_seen_s,
        ended_s,
        held_s,
        busy_s,
        peak_memory_mib,
        energy_j,
    ) = row
    return Hold(
        key=str(key),
        gpu_uuid=str(gpu_uuid),
        gpu_index=_int(gpu_index),
        unit=str(unit),
        mig_uuid=_str_or_none(mig_uuid),
        holder=HolderKind(str(holder)),
        lease_id=_str_or_none(lease_id),
        container_id=_str_or_none(container_id),
        container_name=_str_or_none(container_name),
        image=_str_or_none(image),
        pid=None if pid is None else _int(pid),
        labels=labels,
        started_s=_float(started_s),
        last_seen_s=_float(last_seen_s),
        ended_s=None if ended_s is None else _float(ended_s),
        held_s=_float(held_s),
        busy_s=_float(busy_s),
        peak_memory_mib=None if peak_memory_mib is None else _int(peak_memory_mib),
        energy_j=None if energy_j is None else _float(energy_j),
    )


def labels_by_hold(
    conn: sqlite3.Connection, hold_ids: Sequence[int]
) -> dict[int, tuple[tuple[str, str], ...]]:
    """The labels of each of ``hold_ids``, sorted by key (a hold without labels is absent)."""
    found: dict[int, list[tuple[str, str]]] = {}
    for start in range(0, len(hold_ids), 500):  # well under SQLite's bound on parameters
        chunk = hold_ids[start : start + 500]
        marks = ", ".join("?" * len(chunk))
        rows = conn.execute(
            f"SELECT hold_id, key, value FROM hold_labels WHERE hold_id IN ({marks}) "  # noqa: S608 - marks only
            "ORDER BY hold_id, key",
            chunk,
        )
        for hold_id, key, value in rows:
            found.setdefault(int(hold_id), []).append((str(key), str(value)))
    return {hold_id: tuple(labels) for hold_id, labels in found.items()}


def _int(value: object) -> int:
    assert isinstance(value, int | float), value
    return int(value)


def _float(value: object) -> float:
    assert isinstance(value, int | float), value
    return float(value)


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)
