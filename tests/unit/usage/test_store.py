"""The ledger's writer (agent.usage.store) on real files: the schema and its migrations, the
upserts, merged batches, open holds, retention, the size bound, the lock, flush and close."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent.usage import schema
from agent.usage.records import HolderKind
from agent.usage.store import LedgerBusy, LedgerStore, lock_path
from tests.unit.usage import (
    DAY,
    GPUS,
    HOUR,
    LOGGER,
    ROOT,
    T0,
    Clock,
    batch,
    delta,
    hold,
    on_disk,
    open_store,
    read_line,
    sql,
    wait_for,
)


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "state" / "usage.db"


# -- the file and its schema -------------------------------------------------------------------


def test_a_new_ledger_is_a_wal_file_of_ours_only_root_can_read(ledger: Path) -> None:
    store = open_store(ledger)
    try:
        assert store.flush(5)
        assert stat.S_IMODE(ledger.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(ledger.stat().st_mode) == 0o600
        assert stat.S_IMODE((ledger.parent / "usage.db-wal").stat().st_mode) == 0o600
        assert lock_path(ledger).read_text() == f"{os.getpid()}\n"
    finally:
        store.close()
    conn = sqlite3.connect(ledger)
    try:
        assert schema.versions(conn) == (schema.APPLICATION_ID, schema.SCHEMA_VERSION)
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("PRAGMA auto_vacuum").fetchone() == (2,)  # incremental
        assert schema.table_names(conn) == set(schema.TABLES)
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        assert meta["created_by"] == "nvidia-docker-plugin 2.0.0"
        assert meta["created_s"] == Clock().now
    finally:
        conn.close()


def test_a_file_of_ours_at_version_0_is_migrated_and_gets_incremental_vacuum(
    ledger: Path,
) -> None:
    ledger.parent.mkdir()
    conn = sqlite3.connect(ledger)
    conn.execute(f"PRAGMA application_id = {schema.APPLICATION_ID}")  # a header, no tables
    conn.close()
    store = open_store(ledger)
    store.close()
    conn = sqlite3.connect(ledger)
    try:
        assert schema.versions(conn) == (schema.APPLICATION_ID, 1)
        assert conn.execute("PRAGMA auto_vacuum").fetchone() == (2,)
        assert schema.table_names(conn) == set(schema.TABLES)
    finally:
        conn.close()


def test_a_migration_applies_every_step_in_one_transaction_and_a_failing_one_changes_nothing(
    ledger: Path,
) -> None:
    store = open_store(ledger)
    store.submit(batch(hold("lease-1", ended=T0 + 60)))
    assert store.flush(5)
    store.close()
    version_2 = ["ALTER TABLE holds ADD COLUMN note TEXT", "CREATE TABLE extra (x INTEGER)"]
    broken = ["CREATE TABLE half (x INTEGER)", "INSERT INTO nowhere VALUES (1)"]
    conn = sqlite3.connect(ledger, isolation_level=None)
    try:
        assert schema.migrate(conn, migrations=[*schema.MIGRATIONS, version_2]) == 1
        assert schema.versions(conn) == (schema.APPLICATION_ID, 2)
        assert conn.execute("SELECT key, note FROM holds").fetchall() == [
            (f"lease-1|{GPUS[0]}|{T0:.3f}", None)
        ]
        with pytest.raises(schema.SchemaError, match="from schema version 2 to 4 failed"):
            schema.migrate(conn, migrations=[*schema.MIGRATIONS, version_2, [], broken])
        assert schema.versions(conn)[1] == 2
        assert "half" not in schema.table_names(conn)
    finally:
        conn.close()


# -- writing -------------------------------------------------------------------------------------


def test_a_later_write_of_a_key_replaces_its_figures_and_labels(ledger: Path) -> None:
    store = open_store(ledger)
    try:
        first = hold(
            "lease-1",
            last_seen=T0 + 10,
            busy=5,
            name=None,
            labels=(("project", "a"), ("team", "ml")),
            peak=100,
        )
        store.submit(batch(first))
        assert store.flush(5)
        later = hold(
            "lease-1",
            last_seen=T0 + 70,
            ended=T0 + 70,
            busy=35,
            energy=1234.5,
            container_id="c" * 64,
            name="train",
            image="pytorch:2",
            labels=(("team", "vision"),),
            peak=900,
        )
        store.submit(batch(later))
        assert store.flush(5)
    finally:
        store.close()
    rows = sql(
        ledger,
        "SELECT key, holder, lease_id, container_id, container_name, image, started_s, "
        "last_seen_s, ended_s, held_s, busy_s, peak_memory_mib, energy_j FROM holds",
    )
    identity = (later.key, "lease", "lease-1", "c" * 64, "train", "pytorch:2")
    assert rows == [(*identity, T0, T0 + 70, T0 + 70, 70.0, 35.0, 900, 1234.5)]
    assert sql(ledger, "SELECT key, value FROM hold_labels") == [("team", "vision")]


def test_hourly_deltas_add_up_and_energy_stays_unknown_until_a_counter_adds(
    ledger: Path,
) -> None:
    store = open_store(ledger)
    try:
        store.submit(batch(deltas=(delta(T0, "gpu", GPUS[0], 10, 5), delta(T0, "image", "", 10))))
        store.submit(batch(deltas=(delta(T0, "gpu", GPUS[0], 20, 5, 300.0),)))
        store.submit(batch(deltas=(delta(T0 + HOUR, "gpu", GPUS[0], 30, 30),)))
        assert store.flush(5)
    finally:
        store.close()
    rows = sql(ledger, "SELECT hour_s, dim, value, held_s, busy_s, energy_j FROM hourly")
    assert sorted(rows) == [
        (T0, "gpu", GPUS[0], 30.0, 10.0, 300.0),
        (T0, "image", "", 10.0, 0.0, None),
        (T0 + HOUR, "gpu", GPUS[0], 30.0, 30.0, None),
    ]


def test_batches_that_wait_together_are_written_in_one_transaction(ledger: Path) -> None:
    store = open_store(ledger)
    other = sqlite3.connect(ledger, isolation_level=None)
    try:
        store.submit(batch())  # the first turn (and its retention) done
        assert store.flush(5)
        commits: list[str] = []
        assert store._conn is not None
        store._conn.set_trace_callback(
            lambda statement: commits.append(statement) if statement == "COMMIT" else None
        )
        other.execute("BEGIN IMMEDIATE")  # the writer waits, then falls behind
        store.submit(batch(hold("lease-1", last_seen=T0 + 10), deltas=(delta(T0, "gpu", "a", 10),)))
        wait_for(lambda: store.status().behind, "the store to fall behind")
        store.submit(batch(hold("lease-1", last_seen=T0 + 20), deltas=(delta(T0, "gpu", "a", 10),)))
        store.submit(batch(hold("lease-2"), deltas=(delta(T0, "gpu", "b", 1),)))
        other.execute("ROLLBACK")
        assert store.flush(20)
        assert commits == ["COMMIT"]
    finally:
        other.close()
        store.close()
    assert sql(ledger, "SELECT key, last_seen_s FROM holds ORDER BY key") == [
        (hold("lease-1").key, T0 + 20),
        (hold("lease-2").key, T0),
    ]
    assert sql(ledger, "SELECT value, held_s FROM hourly ORDER BY value") == [
        ("a", 20.0),
        ("b", 1.0),
    ]


def test_the_holds_left_open_are_read_back_at_the_next_open(ledger: Path) -> None:
    store = open_store(ledger)
    running = hold(
        "c1",
        holder=HolderKind.CONTAINER,
        container_id="c1",
        name="jupyter",
        last_seen=T0 + 600,
        busy=12.5,
        labels=(("team", "ml"),),
        peak=2048,
    )
    store.submit(batch(running, hold("lease-2", ended=T0 + 60)))
    assert store.flush(5)
    assert store.open_holds() == []
    store.close()
    store = open_store(ledger)
    try:
        assert store.open_holds() == [running]
    finally:
        store.close()


def test_status_says_what_was_written_and_close_releases_the_file(
    ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    store = open_store(ledger, clock)
    first = store.status()
    assert (first.behind, first.reason, first.lost) == (False, None, 0)
    store.submit(batch(hold(), deltas=(delta(T0, "gpu", "a", 1),)))
    assert store.flush(5)
    status = store.status()
    assert (status.pending_holds, status.pending_deltas) == (0, 0)
    store.close()
    store.close()  # idempotent
    store.submit(batch(hold("late")))
    assert store.status().lost == 1
    assert not (ledger.parent / "usage.db-wal").exists()  # the last connection checkpointed
    again = open_store(ledger)  # the lock is free
    again.close()
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# -- retention and the size bound --------------------------------------------------------------


def test_retention_deletes_the_holds_and_hours_older_than_it_at_most_once_an_hour(
    ledger: Path,
) -> None:
    clock = Clock(T0 + 10 * DAY)
    store = open_store(ledger, clock, retention_s=5 * DAY)
    try:
        store.submit(batch())
        assert store.flush(5)  # the retention at open is done
        store.submit(
            batch(
                hold("old", ended=T0 + 60, labels=(("team", "ml"),)),
                hold("edge", started=T0 + 5 * DAY, ended=T0 + 5 * DAY + 2 * HOUR),
                hold("open", started=T0),  # never ended: kept, however old
                deltas=(
                    delta(T0, "gpu", "a", 60),
                    delta(T0 + 5 * DAY, "gpu", "a", 3600),
                    delta(T0 + 5 * DAY + 2 * HOUR, "label:team", "ml", 10),
                ),
            )
        )
        assert store.flush(5)
        clock.now += HOUR / 2
        store.submit(batch())
        assert store.flush(5)
        assert len(sql(ledger, "SELECT * FROM holds")) == 3  # not again within the hour
        clock.now += HOUR / 2  # now T0 + 10 days + 1 hour: what is before T0 + 5 days + 1 hour goes
        store.submit(batch())
        assert store.flush(5)
        assert sql(ledger, "SELECT key FROM holds ORDER BY key") == [
            (hold("edge", started=T0 + 5 * DAY).key,),
            (hold("open").key,),
        ]
        assert sql(ledger, "SELECT count(*) FROM hold_labels") == [(0,)]
        assert sql(ledger, "SELECT hour_s FROM hourly") == [(T0 + 5 * DAY + 2 * HOUR,)]
    finally:
        store.close()


def test_past_its_size_the_ledger_deletes_the_oldest_ended_holds_and_shrinks(
    ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock(T0 + 30 * DAY)
    max_bytes = 256 * 1024
    store = open_store(ledger, clock, max_bytes=max_bytes)
    labels = (("project", "p" * 20), ("service", "s" * 20), ("team", "t" * 20))
    try:
        for day in range(20):
            holds = [
                hold(
                    f"lease-{day}-{n}",
                    gpu=n % 8,
                    started=T0 + day * DAY + n * 60,
                    ended=T0 + day * DAY + n * 60 + 50,
                    container_id=f"{day:04d}{n:04d}" * 8,
                    name=f"job-{day}-{n}",
                    labels=labels,
                )
                for n in range(100)
            ]
            deltas = tuple(delta(T0 + day * DAY + h * HOUR, "gpu", GPUS[0], 50) for h in range(24))
            store.submit(batch(*holds, deltas=deltas))
        store.submit(batch(hold("still-open", started=T0)))
        assert store.flush(10)
        assert on_disk(ledger) > max_bytes
        clock.now += HOUR
        store.submit(batch())
        assert store.flush(10)
        assert on_disk(ledger) <= max_bytes
    finally:
        store.close()
    kept = sql(
        ledger,
        "SELECT min(started_s), max(started_s), count(*) FROM holds WHERE ended_s IS NOT NULL",
    )
    oldest, newest, count = kept[0]
    assert 0 < count < 2000
    assert newest == T0 + 19 * DAY + 99 * 60  # the newest stay
    assert sql(ledger, "SELECT count(*) FROM holds WHERE ended_s IS NULL") == [(1,)]
    hours = sql(ledger, "SELECT min(hour_s) FROM hourly")[0][0]
    assert hours >= oldest - HOUR  # the hours before the oldest hold kept went with them
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Usage ledger: {ledger} took ")
    assert ", more than its 256 KiB: deleted the " in lines[0]


# -- two agents, one file ----------------------------------------------------------------------

_HOLDER = """
import sys
from pathlib import Path
from agent.usage.store import LedgerStore
store = LedgerStore.open(Path(sys.argv[1]), retention_s=1e9, max_bytes=1 << 30)
print("open", flush=True)
sys.stdin.read()
store.close()
print("closed", flush=True)
"""


def test_a_second_agent_on_the_same_file_is_refused_with_one_line(ledger: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(ledger)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert read_line(child, 30) == "open"
        with pytest.raises(LedgerBusy) as err:
            LedgerStore.open(ledger, retention_s=DAY, max_bytes=1 << 30)
        text = str(err.value)
        assert "\n" not in text
        assert text == (
            f"usage ledger {ledger} is in use by process {child.pid} (it holds "
            f"{ledger}.lock): each agent on a machine needs its own --state-dir; this one "
            "runs without a usage ledger"
        )
        assert child.stdin is not None
        child.stdin.close()
        assert read_line(child, 30) == "closed"
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
    store = LedgerStore.open(ledger, retention_s=DAY, max_bytes=1 << 30)  # free again
    store.close()
