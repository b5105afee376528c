"""The ledger's writer when things go wrong, for real: truncated, garbage and foreign files, a
newer schema, a file that turns corrupt while written, a full file system, a database locked
by somebody else, and a ``kill -9`` in the middle of the writes."""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.usage import schema
from tests.support.prerequisites import unavailable
from tests.support.services import mounted_tmpfs
from tests.unit.usage import (
    DAY,
    GPUS,
    LOGGER,
    ROOT,
    T0,
    Clock,
    batch,
    delta,
    hold,
    open_store,
    read_line,
    sql,
    wait_for,
)

STAMP = "20260102T000000"  # Clock()'s time, T0 + 1 day, as the moved-aside names give it


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "state" / "usage.db"


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= 30]


def written_ledger(path: Path) -> bytes:
    """A ledger with a few holds, closed; its bytes."""
    store = open_store(path)
    store.submit(batch(*(hold(f"lease-{n}", ended=T0 + n) for n in range(200))))
    assert store.flush(5)
    store.close()
    return path.read_bytes()


def assert_new_ledger_works(path: Path) -> None:
    store = open_store(path)
    try:
        store.submit(batch(hold("lease-new", ended=T0 + 5)))
        assert store.flush(5)
    finally:
        store.close()
    assert sql(path, "SELECT key FROM holds") == [(hold("lease-new").key,)]


# -- unusable files at open ----------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["half", "header"])
def test_a_truncated_file_is_moved_aside_with_its_wal_and_a_new_ledger_started(
    ledger: Path, caplog: pytest.LogCaptureFixture, cut: str
) -> None:
    data = written_ledger(ledger)
    kept = data[: len(data) // 2] if cut == "half" else data[:60]
    ledger.write_bytes(kept)
    (ledger.parent / "usage.db-wal").write_bytes(b"w" * 100)  # whatever is beside it goes too
    assert_new_ledger_works(ledger)
    aside = ledger.parent / f"usage.db.corrupt-{STAMP}"
    assert aside.read_bytes() == kept
    assert (ledger.parent / f"usage.db.corrupt-{STAMP}-wal").read_bytes() == b"w" * 100
    (line,) = warnings(caplog)
    assert line == (
        f"Usage ledger: {ledger} is not a readable SQLite database (database disk image is "
        f"malformed): moved it aside to {aside.name} and started a new ledger"
    )


def test_a_garbage_file_is_moved_aside_and_a_second_one_gets_its_own_name(
    ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ledger.parent.mkdir()
    garbage = bytes(range(256)) * 64
    for _ in range(2):
        ledger.write_bytes(garbage)
        store = open_store(ledger)
        store.close()
    assert (ledger.parent / f"usage.db.corrupt-{STAMP}").read_bytes() == garbage
    assert (ledger.parent / f"usage.db.corrupt-{STAMP}.1").read_bytes() == garbage
    assert [re.sub(r"\S*usage\.db\S*", "F", line) for line in warnings(caplog)] == [
        "Usage ledger: F is not a readable SQLite database (file is not a database): moved "
        "it aside to F and started a new ledger"
    ] * 2
    assert_new_ledger_works(ledger)


def test_a_file_whose_pages_fail_quick_check_is_moved_aside(
    ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    written_ledger(ledger)
    overwrite_root_pages(ledger, "holds")
    assert_new_ledger_works(ledger)
    (line,) = warnings(caplog)
    assert line.startswith(f"Usage ledger: {ledger} fails SQLite's quick_check (")
    assert line.endswith(f"): moved it aside to usage.db.corrupt-{STAMP} and started a new ledger")


@pytest.mark.parametrize("kind", ["application id", "tables"])
def test_another_programs_database_is_moved_aside_untouched(
    ledger: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    ledger.parent.mkdir()
    conn = sqlite3.connect(ledger)
    if kind == "application id":
        conn.execute("PRAGMA application_id = 1234")
    conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO photos (name) VALUES ('cat')")
    conn.commit()
    conn.close()
    data = ledger.read_bytes()
    assert_new_ledger_works(ledger)
    aside = ledger.parent / f"usage.db.foreign-{STAMP}"
    assert aside.read_bytes() == data
    what = "application_id 0x4d2" if kind == "application id" else "photos"
    assert warnings(caplog) == [
        f"Usage ledger: {ledger} is another program's SQLite database ({what}): moved it "
        f"aside to {aside.name} and started a new ledger"
    ]


def test_the_schema_of_a_moved_aside_file_is_left_as_it_was(ledger: Path) -> None:
    """A file that is not ours is only read, then renamed: it keeps its journal mode, its
    header, and gets no WAL."""
    ledger.parent.mkdir()
    conn = sqlite3.connect(ledger)
    conn.execute("CREATE TABLE photos (id INTEGER)")
    conn.close()
    store = open_store(ledger)
    store.close()
    aside = ledger.parent / f"usage.db.foreign-{STAMP}"
    conn = sqlite3.connect(aside)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        assert schema.versions(conn) == (0, 0)
    finally:
        conn.close()
    assert sorted(p.name for p in ledger.parent.iterdir() if "foreign" in p.name) == [aside.name]


def test_a_ledger_of_a_newer_schema_is_moved_aside_for_the_newer_agent(
    ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    written_ledger(ledger)
    conn = sqlite3.connect(ledger)
    conn.execute("PRAGMA user_version = 7")
    conn.close()
    assert_new_ledger_works(ledger)
    aside = ledger.parent / f"usage.db.newer-{STAMP}"
    assert len(sql(aside, "SELECT * FROM holds")) == 200
    assert warnings(caplog) == [
        f"Usage ledger: {ledger} is at schema version 7, newer than the 1 this agent knows (a "
        f"newer agent wrote it): moved it aside to {aside.name} and started a new ledger"
    ]


# -- faults while running ------------------------------------------------------------------------


def test_a_ledger_that_turns_corrupt_while_written_is_replaced_and_nothing_waiting_is_lost(
    ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(ledger)
    try:
        store.submit(batch(*(hold(f"lease-{n}", ended=T0 + n) for n in range(200))))
        assert store.flush(5)
        other = sqlite3.connect(ledger, isolation_level=None)
        try:
            other.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the pages into the file
            overwrite_root_pages(ledger, "holds")
            other.execute("UPDATE meta SET value = value WHERE key = 'created_s'")  # a commit:
        finally:  # the writer's cached pages are stale now, it reads the file again
            other.close()
        store.submit(
            batch(hold("lease-7", ended=T0 + 7, busy=3), deltas=(delta(T0, "gpu", GPUS[0], 7),))
        )
        assert store.flush(5)
        status = store.status()
        assert (status.behind, status.lost) == (False, 0)
    finally:
        store.close()
    assert sql(ledger, "SELECT key, busy_s FROM holds") == [(hold("lease-7").key, 3.0)]
    assert sql(ledger, "SELECT value, held_s FROM hourly") == [(GPUS[0], 7.0)]
    assert (ledger.parent / f"usage.db.corrupt-{STAMP}").exists()
    (line,) = warnings(caplog)
    assert line.startswith(f"Usage ledger: {ledger} turned corrupt while written (")
    assert line.endswith(
        f"): moved it aside to usage.db.corrupt-{STAMP} and started a new ledger, where what "
        "waits is written"
    )


def test_a_locked_database_puts_the_ledger_behind_within_its_bounds_until_it_catches_up(
    ledger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    store = open_store(ledger, max_pending_holds=100, max_pending_deltas=50)
    other = sqlite3.connect(ledger, isolation_level=None)
    try:
        store.submit(batch())
        assert store.flush(5)
        other.execute("BEGIN IMMEDIATE")  # somebody's sqlite3 session, writing
        running = hold("running", started=T0, last_seen=T0 + 10)
        first = [hold(f"early-{n}", started=T0 + n, ended=T0 + n + 1) for n in range(80)]
        store.submit(batch(running, *first, deltas=(delta(T0, "gpu", "g", 1),)))
        wait_for(lambda: store.status().behind, "the ledger to fall behind")
        assert store.status().reason == "database is locked"
        started = time.monotonic()
        later = [hold(f"late-{n}", started=T0 + 100 + n, ended=T0 + 101 + n) for n in range(60)]
        store.submit(
            batch(*later, deltas=tuple(delta(T0 + n * 3600, "gpu", "g", 1) for n in range(60)))
        )
        store.submit(batch(hold("running", started=T0, last_seen=T0 + 20)))
        assert time.monotonic() - started < 0.5  # submit never waits for the writer
        # (a retry under way merges them back when it fails: the same bound then)
        wait_for(lambda: store.status().pending_holds == 90, "the pending holds to be bounded")
        status = store.status()
        assert (status.pending_holds, status.pending_deltas) == (90, 45)
        assert status.lost == 51 + 15  # the 51 holds that ended first, the 15 oldest hours
        assert not store.flush(0.2)
        other.execute("ROLLBACK")
        assert store.flush(40)
        status = store.status()
        assert (status.behind, status.reason, status.pending_holds, status.lost) == (
            False,
            None,
            0,
            66,
        )
    finally:
        other.close()
        store.close()
    kept = sql(ledger, "SELECT key, last_seen_s FROM holds ORDER BY started_s, key")
    assert kept[0] == (running.key, T0 + 20)  # an open hold is never dropped
    assert [key.split("|")[0] for key, _ in kept[1:]] == [f"early-{n}" for n in range(51, 80)] + [
        f"late-{n}" for n in range(60)
    ]
    assert sql(ledger, "SELECT min(hour_s), count(*) FROM hourly") == [(T0 + 15 * 3600, 45)]
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines[0] == (
        f"Usage ledger: cannot write {ledger} (database is locked): keeping what is to be "
        "written in memory (up to 100 holds and 50 hourly totals) and trying again in 1 s, then "
        "at most every 30 s"
    )
    assert lines[1] == (
        f"Usage ledger: too much waits to be written to {ledger} (database is locked): dropped "
        "51 ended holds and 15 hourly totals, the oldest (66 lost so far)"
    )
    assert re.fullmatch(
        rf"Usage ledger: {re.escape(str(ledger))} caught up: 3 batches written \(\d+ s behind: "
        r"database is locked, 66 rows dropped so far\)",
        lines[2],
    )
    assert len(lines) == 3


@pytest.fixture
def small_file_system(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, mounted for the test and unmounted after it."""
    if os.geteuid() != 0:
        unavailable("needs root to mount a small tmpfs (a full file system)")
    with mounted_tmpfs(tmp_path / "small", "size=2m,mode=0700") as mount:
        yield mount


def test_a_full_file_system_puts_the_ledger_behind_and_freeing_space_catches_it_up(
    small_file_system: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    ledger = small_file_system / "state" / "usage.db"
    store = open_store(ledger)
    filler = small_file_system / "filler"
    try:
        store.submit(batch(hold("lease-0", ended=T0 + 1)))
        assert store.flush(5)
        fill(filler)
        labels = (("com.docker.compose.project", "p" * 40), ("team", "t" * 40))
        many = [
            hold(f"lease-{n}", ended=T0 + n, name="x" * 60, labels=labels) for n in range(1, 501)
        ]
        store.submit(batch(*many, deltas=(delta(T0, "gpu", GPUS[0], 500),)))
        wait_for(lambda: store.status().behind, "the ledger to fall behind")
        status = store.status()
        assert status.reason == "database or disk is full"
        assert (status.pending_holds, status.pending_deltas, status.lost) == (500, 1, 0)
        filler.unlink()
        assert store.flush(40)
        assert not store.status().behind
    finally:
        store.close()
    assert sql(ledger, "SELECT count(*), sum(held_s) FROM holds") == [(501, sum(range(1, 501)) + 1)]
    assert sql(ledger, "SELECT held_s FROM hourly") == [(500.0,)]
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines[0].startswith(f"Usage ledger: cannot write {ledger} (database or disk is full)")
    assert re.match(
        rf"Usage ledger: {re.escape(str(ledger))} caught up: 1 batches written ", lines[1]
    )


# -- kill -9 -------------------------------------------------------------------------------------

_WRITER = """
import sys
from pathlib import Path
from agent.usage.records import Batch, HourDelta
from agent.usage.store import LedgerStore
from tests.unit.usage import T0, hold
store = LedgerStore.open(Path(sys.argv[1]), retention_s=1e9, max_bytes=1 << 30)
n = 0
while True:
    holds = tuple(hold(f"lease-{n}-{j}", gpu=j, started=T0 + n, last_seen=T0 + n + 1)
                  for j in range(4))
    store.submit(Batch(holds, (HourDelta(T0, "gpu", "all", 1.0, 0.5, 0.0),)))
    if n % 5 == 4 and store.flush(10):
        print(n, flush=True)
    n += 1
"""


def test_a_kill_9_in_the_middle_of_the_writes_loses_no_batch_reported_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for round_ in range(3):  # three kills, each at another point of a write
        ledger = tmp_path / f"round-{round_}" / "usage.db"
        ledger.parent.mkdir()
        reported = killed_while_writing(ledger, after=300 + 100 * round_)
        store = open_store(ledger, Clock(T0 + DAY))  # checks the file: no WARNING below
        store.close()
        assert warnings(caplog) == []
        assert sql(ledger, "PRAGMA integrity_check") == [("ok",)]
        keys = {key.split("|")[0] for (key,) in sql(ledger, "SELECT key FROM holds")}
        batches = {int(key.split("-")[1]) for key in keys}
        assert batches == set(range(len(batches)))  # every batch up to the last one written
        assert len(batches) > reported  # the batches reported written, at least
        assert len(keys) == 4 * len(batches)  # each batch whole, or not at all
        assert sql(ledger, "SELECT held_s FROM hourly") == [(float(len(batches)),)]


def killed_while_writing(ledger: Path, *, after: int) -> int:
    """Run ``_WRITER`` on ``ledger`` until it reports batch ``after`` written, then SIGKILL it
    (it goes on submitting: a write is under way); the last batch it reported."""
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(ledger)], cwd=ROOT, stdout=subprocess.PIPE
    )
    reported = -1
    try:
        while reported < after:
            line = read_line(child, 30)
            assert line, f"the writer exited with {child.wait()}"
            reported = int(line)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdout is not None
        child.stdout.close()
    return reported


# -- helpers -------------------------------------------------------------------------------------


def overwrite_root_pages(path: Path, table: str) -> None:
    """Garbage over the root pages of ``table`` and its indexes, in the file itself."""
    conn = sqlite3.connect(path)
    try:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        roots = [
            row[0]
            for row in conn.execute(
                "SELECT rootpage FROM sqlite_master WHERE tbl_name = ?", (table,)
            )
        ]
    finally:
        conn.close()
    assert roots
    with path.open("r+b") as out:
        for root in roots:
            out.seek((root - 1) * page_size)
            out.write(b"\xa5" * page_size)


def fill(path: Path) -> None:
    """Write ``path`` until the file system is full."""
    with path.open("wb", buffering=0) as out:
        while True:
            try:
                out.write(b"\0" * 4096)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                return
