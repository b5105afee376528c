"""The usage ledger's one writer: ``LedgerStore`` keeps ``usage.db`` (``agent.usage.schema``).

``LedgerStore.open(path, retention_s=..., max_bytes=...)`` runs in a thread of the caller's
(it reads and may check the whole file). It:

- creates the directory (0700) and the file (0600; SQLite gives its ``-wal`` and ``-shm``
  the file's mode) when they are missing;
- takes an exclusive ``flock`` on ``<path>.lock``, without waiting, and writes its pid
  there: a second agent on the same file gets ``LedgerBusy`` (one line: which file, which
  pid has it, and what to do), and runs without a ledger;
- checks the file: one that is not SQLite (garbage, truncated in its header), fails
  ``PRAGMA quick_check`` (truncated, overwritten pages), belongs to another program (another
  ``application_id``, or tables that are not ours) or has a newer schema version than this
  code knows is moved aside, with its ``-wal`` and ``-shm``, to ``<name>.corrupt-<UTC
  yyyymmddTHHMMSS>`` (``.foreign-``, ``.newer-``), one WARNING line says what and where, and
  a new ledger is started. Nothing of the user's is deleted, and nothing writes to a file
  before it has passed: the checks read through a read-only connection, which neither
  checkpoints a WAL into the file nor removes it. ``quick_check`` reads every page once, so
  its cost grows with the file: about 2 s per GB from the page cache on the development
  machine (4.7 s for the 2.3 GB of a year at 10,000 leases a day,
  ``tests/benchmarks/bench_usage_store.py``), more from a cold disk, and never more than
  ``max_bytes`` allows. It skips what a full ``integrity_check`` adds at several times the
  cost: comparing every index with its table;
- brings an older file up to the current schema (``schema.migrate``, one transaction);
- reads the holds the previous run left open (``open_holds``);
- starts the writer thread.

Anything else that keeps the ledger from opening (the directory cannot be made, the file
system is read-only, the disk is full before the schema is written) is a
``LedgerUnavailable``, an ``OSError`` (``LedgerBusy`` is one), with a message of one line.

``submit(batch)`` only adds the batch to what waits, under a lock held for no more than
that (it is called from the event loop). The writer thread writes what waits in ONE
transaction: several batches waiting are merged first (a hold's latest figures win; hourly
deltas are summed by hour and group). A hold is upserted by its key (its figures, and its
labels when they changed, replace the earlier ones); an hourly delta is added to its row.
A ``kill -9`` loses at most the transaction being written: everything committed is in the
WAL, and SQLite recovers the WAL at the next open.

When a write fails (``database or disk is full``, ``disk I/O error``, a read-only file
system, the database locked by somebody's ``sqlite3`` session), what was to be written waits
in memory, merged with what comes after, and ``status().behind`` is true with SQLite's reason.
One WARNING says so when it starts, one INFO line when the ledger has caught up (``...
caught up: N batches written``). It is tried again after 1 s, then after twice as long each
time, at most every 30 s; a new batch does not make it try sooner. What waits is bounded:
``MAX_PENDING_HOLDS`` (20,000) distinct holds and ``MAX_PENDING_DELTAS`` (50,000) hourly
totals, about 26 MB in all (some 900 bytes a hold, 170 a total): two days of a node that
grants 10,000 leases a day, seven weeks of its hourly totals. Past a bound, the holds that
ended first (the open ones keep being updated) and the oldest hours' totals are dropped,
counted in ``status().lost``, one WARNING line per time the ledger falls behind. A file that turns
corrupt while written (``SQLITE_CORRUPT``, ``SQLITE_NOTADB``) is moved aside as at open, a
new ledger is started, and what waits is written there.

Retention runs on the writer thread, at open and then at most once an hour: the holds that
ended more than ``retention_s`` ago and the hours that began before that go, in chunks of
``DELETE_CHUNK`` holds (one transaction each). Then, while the file and its WAL take more
than ``max_bytes``, the oldest ended holds and the hourly rows before them go, chunk by chunk,
until the rows take at most ``SHRINK_TO`` of ``max_bytes`` (one INFO line says what went);
``PRAGMA incremental_vacuum`` gives the freed pages back, and a checkpoint truncates the
WAL.

``flush(timeout_s)`` waits until everything submitted so far is written; ``close()`` flushes,
stops the thread, closes the file and releases the lock (idempotent).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent.files import describe_size
from agent.usage import schema
from agent.usage.records import Batch, Hold

log = logging.getLogger("nvidia-docker-plugin.usage")

FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
BUSY_TIMEOUT_S = 1.0  # how long a write waits for another connection's lock (a sqlite3 CLI)
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
RETENTION_EVERY_S = 3600.0
MAX_PENDING_HOLDS = 20_000
MAX_PENDING_DELTAS = 50_000
DELETE_CHUNK = 5_000  # holds per transaction when retention deletes
SHRINK_TO = 0.9  # of max_bytes, when the size bound deletes
JOURNAL_SIZE_LIMIT = 4 * 1024 * 1024  # the WAL is truncated to this after a checkpoint
CACHE_KIB = 8 * 1024  # the writer's page cache
_HOURLY_DELETE_GROUPS = 200  # (dim, value) groups per transaction when hourly rows go
_SHRINK_STEP = 100  # the fewest holds one step of the size bound deletes

_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26

Deltas = dict[tuple[int, str, str], list[float]]  # (hour_s, dim, value): [held, busy, energy]


class LedgerUnavailable(OSError):
    """The ledger cannot be opened; the message is one line. The agent runs without it.
    (An ``OSError``: what keeps a ledger from opening is its files.)"""


class LedgerBusy(LedgerUnavailable):
    """Another process has the ledger's lock (another agent with the same state directory)."""


@dataclass(frozen=True, slots=True)
class LedgerStatus:
    """Where the writer stands: ``behind`` while writes fail (``reason``: SQLite's words),
    what waits to be written, what was dropped (``lost``: hold rows and hourly totals)."""

    behind: bool
    reason: str | None
    pending_holds: int
    pending_deltas: int
    lost: int


@dataclass(slots=True)
class _Pending:
    """Batches not written yet, merged: the latest figures per hold key, deltas summed."""

    holds: dict[str, Hold] = field(default_factory=dict)
    deltas: Deltas = field(default_factory=dict)
    batches: int = 0

    def add(self, batch: Batch) -> None:
        for hold in batch.holds:
            self.holds[hold.key] = hold
        for delta in batch.deltas:
            totals = self.deltas.get((delta.hour_s, delta.dim, delta.value))
            if totals is None:
                self.deltas[delta.hour_s, delta.dim, delta.value] = [
                    delta.held_s,
                    delta.busy_s,
                    delta.energy_j,
                ]
            else:
                totals[0] += delta.held_s
                totals[1] += delta.busy_s
                totals[2] += delta.energy_j
        self.batches += 1

    def then(self, later: _Pending) -> _Pending:
        """This, with ``later`` (newer) merged on top."""
        merged = _Pending(dict(self.holds), {k: list(v) for k, v in self.deltas.items()})
        merged.holds.update(later.holds)
        for key, (held, busy, energy) in later.deltas.items():
            totals = merged.deltas.setdefault(key, [0.0, 0.0, 0.0])
            totals[0] += held
            totals[1] += busy
            totals[2] += energy
        merged.batches = self.batches + later.batches
        return merged


class LedgerStore:
    """The ledger file's writer; see the module docstring. Build it with ``open``."""

    def __init__(
        self,
        path: Path,
        conn: sqlite3.Connection,
        lock_fd: int,
        *,
        retention_s: float,
        max_bytes: int,
        clock: Callable[[], float],
        max_pending_holds: int,
        max_pending_deltas: int,
    ) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = conn
        self._lock_fd = lock_fd
        self._retention_s = retention_s
        self._max_bytes = max_bytes
        self._clock = clock
        self._max_holds = max_pending_holds
        self._max_deltas = max_pending_deltas
        self._open_holds = _read_open_holds(conn)
        self._longest_s = _read_longest(conn)
        self._cond = threading.Condition()
        self._pending = _Pending()
        self._in_flight: _Pending | None = None
        self._submitted = 0  # batches submitted
        self._written = 0  # of those, how many are written (or dropped)
        self._reason: str | None = None  # why the last write failed; None: not behind
        self._behind_since = 0.0  # monotonic
        self._behind_written = 0  # self._written when it fell behind
        self._dropped_warned = False
        self._failures = 0
        self._retry_at = 0.0  # monotonic
        self._lost = 0
        self._next_retention_s = clock()  # the first turn of the writer runs it
        self._closed = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="usage-ledger", daemon=True)

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        retention_s: float,
        max_bytes: int,
        clock: Callable[[], float] = time.time,
        max_pending_holds: int = MAX_PENDING_HOLDS,
        max_pending_deltas: int = MAX_PENDING_DELTAS,
    ) -> LedgerStore:
        """The ledger at ``path``, checked, migrated, its writer started; ``LedgerBusy`` when
        another process has it, ``LedgerUnavailable`` when it cannot be opened."""
        path = Path(path)
        try:
            path.parent.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
        except OSError as err:
            raise LedgerUnavailable(
                f"usage ledger {path}: its directory cannot be made: {err.strerror or err}"
            ) from None
        lock_fd = _take_lock(path)
        try:
            conn = _open_database(path, clock)
            try:
                store = cls(
                    path,
                    conn,
                    lock_fd,
                    retention_s=retention_s,
                    max_bytes=max_bytes,
                    clock=clock,
                    max_pending_holds=max_pending_holds,
                    max_pending_deltas=max_pending_deltas,
                )
            except sqlite3.Error as err:
                conn.close()
                raise LedgerUnavailable(f"usage ledger {path} cannot be read: {err}") from None
        except BaseException:
            os.close(lock_fd)
            raise
        store._thread.start()
        return store

    # -- what the agent calls ----------------------------------------------------------------

    def open_holds(self) -> list[Hold]:
        """The holds the previous run left open (``ended_s`` NULL), as read at open."""
        return list(self._open_holds)

    def submit(self, batch: Batch) -> None:
        """Queue ``batch`` for the writer; returns at once. Its holds are kept as they are
        until written: the caller hands over copies (``Accounting.take_batch`` does)."""
        with self._cond:
            if self._closed:
                self._lost += len(batch.holds) + len(batch.deltas)
                log.debug("Usage ledger: a batch submitted after close is dropped")
                return
            self._pending.add(batch)
            self._submitted += 1
            self._bound(self._pending)
            self._cond.notify_all()

    def status(self) -> LedgerStatus:
        with self._cond:
            in_flight = self._in_flight or _Pending()
            return LedgerStatus(
                behind=self._reason is not None,
                reason=self._reason,
                pending_holds=len(self._pending.holds) + len(in_flight.holds),
                pending_deltas=len(self._pending.deltas) + len(in_flight.deltas),
                lost=self._lost,
            )

    def flush(self, timeout_s: float) -> bool:
        """Wait until every batch submitted so far is written; False when ``timeout_s`` ran
        out first (the ledger is behind, or the writer is busy) or the writer has stopped."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._submitted
            while self._written < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what waits (one more try at once when behind), within ``timeout_s``; then
        stop the writer, which closes the file and releases the lock. What is still not
        written is counted lost, in one WARNING line. Idempotent."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._retry_at = 0.0
            self._cond.notify_all()
        self.flush(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(max(0.1, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning(
                "Usage ledger: %s still being written after %.0f s at close; the writer "
                "closes it when done",
                self.path,
                timeout_s,
            )

    # -- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._due():
                        self._cond.wait(self._wait_s())
                    if self._stopping:
                        break
                    work, upto = self._pending, self._submitted
                    self._pending = _Pending()
                    self._in_flight = work
                failure = self._write(work) if work.batches else None
                if failure is None and self._clock() >= self._next_retention_s:
                    with self._cond:
                        self._in_flight = None  # written, but flush waits for retention too
                    self._retain()
                with self._cond:
                    self._in_flight = None
                    if failure is not None:
                        self._failed(failure, work)
                    elif work.batches:
                        self._wrote(upto)
                    self._cond.notify_all()
        finally:
            self._finish()

    def _due(self) -> bool:
        if time.monotonic() < self._retry_at:
            return False
        return self._pending.batches > 0 or self._clock() >= self._next_retention_s

    def _wait_s(self) -> float:
        now = time.monotonic()
        if self._retry_at > now:
            return self._retry_at - now
        return max(0.05, min(60.0, self._next_retention_s - self._clock()))

    def _wrote(self, upto: int) -> None:
        self._written = upto
        if self._reason is None:
            return
        batches = upto - self._behind_written
        lost = f", {self._lost:,} rows dropped so far" if self._lost else ""
        log.info(
            "Usage ledger: %s caught up: %d batches written (%.0f s behind: %s%s)",
            self.path,
            batches,
            time.monotonic() - self._behind_since,
            self._reason,
            lost,
        )
        self._reason = None
        self._failures = 0
        self._retry_at = 0.0
        self._dropped_warned = False

    def _failed(self, reason: str, work: _Pending) -> None:
        self._pending = work.then(self._pending)
        self._bound(self._pending)
        self._failures += 1
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (self._failures - 1))
        self._retry_at = time.monotonic() + delay
        if self._reason is None:
            self._behind_since = time.monotonic()
            self._behind_written = self._written
            log.warning(
                "Usage ledger: cannot write %s (%s): keeping what is to be written in memory "
                "(up to %s holds and %s hourly totals) and trying again in %.0f s, then at "
                "most every %.0f s",
                self.path,
                reason,
                f"{self._max_holds:,}",
                f"{self._max_deltas:,}",
                delay,
                RETRY_MAX_S,
            )
        self._reason = reason

    def _bound(self, pending: _Pending) -> None:
        """Keep ``pending`` within the bounds: drop the holds that ended first, then the
        oldest hours' totals (called with the lock held)."""
        dropped_holds = dropped_deltas = 0
        if len(pending.holds) > self._max_holds:
            excess = len(pending.holds) - int(self._max_holds * SHRINK_TO)
            ended = sorted(
                (hold.ended_s, key)
                for key, hold in pending.holds.items()
                if hold.ended_s is not None
            )
            for _ended, hold_key in ended[:excess]:
                del pending.holds[hold_key]
            dropped_holds = min(excess, len(ended))
        if len(pending.deltas) > self._max_deltas:
            excess = len(pending.deltas) - int(self._max_deltas * SHRINK_TO)
            for delta_key in sorted(pending.deltas)[:excess]:  # by hour first
                del pending.deltas[delta_key]
            dropped_deltas = excess
        if not dropped_holds and not dropped_deltas:
            return
        self._lost += dropped_holds + dropped_deltas
        if not self._dropped_warned:
            self._dropped_warned = True
            log.warning(
                "Usage ledger: too much waits to be written to %s (%s): dropped %d ended "
                "holds and %d hourly totals, the oldest (%s lost so far)",
                self.path,
                self._reason or "writes are slower than the batches",
                dropped_holds,
                dropped_deltas,
                f"{self._lost:,}",
            )

    def _write(self, work: _Pending) -> str | None:
        """Write ``work`` in one transaction; the reason (one line) when it failed. A file
        that turned corrupt is moved aside and ``work`` written to a new one."""
        for attempt in range(2):
            try:
                conn = self._connection()
                _write_batch(conn, work, self._longest_s)
                self._longest_s = max([self._longest_s, *_ended_spans(work)])
                return None
            except LedgerUnavailable as err:
                return str(err)
            except sqlite3.Error as err:
                self._rollback()
                if _is_corrupt(err) and attempt == 0:
                    self._replace_corrupt(str(err))
                    continue
                return str(err) or type(err).__name__
            except Exception as err:  # a bug: say it, keep the daemon and the figures
                self._rollback()
                log.error("Usage ledger: writing %s failed: %r", self.path, err)
                return f"{type(err).__name__}: {err}"
        return "the new ledger turned corrupt at once"  # pragma: no cover - two in a row

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:  # a replacement for a corrupt file that could not be made
            self._conn = _open_database(self.path, self._clock)
            self._longest_s = _read_longest(self._conn)
        return self._conn

    def _rollback(self) -> None:
        if self._conn is not None and self._conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")

    def _replace_corrupt(self, why: str) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None
        try:
            aside = _move_aside(self.path, "corrupt", self._clock())
        except OSError as err:
            log.error(
                "Usage ledger: %s turned corrupt while written (%s) and cannot be moved aside: %s",
                self.path,
                why,
                err.strerror or err,
            )
            return
        log.warning(
            "Usage ledger: %s turned corrupt while written (%s): moved it aside to %s and "
            "started a new ledger, where what waits is written",
            self.path,
            why,
            aside.name,
        )
        self._longest_s = 0.0

    def _retain(self) -> None:
        """Retention by age, then the size bound (see the module docstring)."""
        self._next_retention_s = self._clock() + RETENTION_EVERY_S
        conn = self._conn
        if conn is None:
            return
        try:
            cutoff = self._clock() - self._retention_s
            holds = _delete_holds(conn, "ended_s < ?", cutoff)
            hourly = _delete_hourly(conn, cutoff)
            if holds or hourly:
                log.debug(
                    "Usage ledger: retention deleted %d holds and %d hourly rows of %s",
                    holds,
                    hourly,
                    self.path,
                )
                _vacuum(conn)
            self._shrink(conn)
        except Exception as err:  # sqlite3.Error, or a bug: the writer goes on either way
            with contextlib.suppress(sqlite3.Error):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            log.warning(
                "Usage ledger: retention of %s failed (%s); trying again in an hour",
                self.path,
                err,
            )

    def _shrink(self, conn: sqlite3.Connection) -> None:
        size = _size_on_disk(self.path)
        if size <= self._max_bytes:
            return
        target = int(self._max_bytes * SHRINK_TO)
        holds = hourly = 0
        horizon: float | None = None
        ended = int(
            conn.execute("SELECT count(*) FROM holds WHERE ended_s IS NOT NULL").fetchone()[0]
        )
        while (used := _used_bytes(conn)) > target:
            step = _next_horizon(conn, ended - holds, (used - target) / used)
            if step is None:
                break  # nothing left to delete: open holds only
            horizon = step
            holds += _delete_holds(conn, "ended_s <= ?", horizon)
            hourly += _delete_hourly(conn, horizon - 3600)  # whole hours before the horizon
        _vacuum(conn)
        with contextlib.suppress(sqlite3.Error):
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        now = _size_on_disk(self.path)
        if horizon is None:  # a WAL or free pages that made it large, given back now
            if now > self._max_bytes:
                log.warning(
                    "Usage ledger: %s takes %s, more than its %s, and has nothing old to "
                    "delete (its rows are the open holds only)",
                    self.path,
                    describe_size(now),
                    describe_size(self._max_bytes),
                )
            return
        log.info(
            "Usage ledger: %s took %s, more than its %s: deleted the %d oldest holds and %d "
            "hourly rows (what ended before %s UTC); it takes %s now",
            self.path,
            describe_size(size),
            describe_size(self._max_bytes),
            holds,
            hourly,
            time.strftime("%Y-%m-%d %H:%M", time.gmtime(horizon)),
            describe_size(now),
        )

    def _finish(self) -> None:
        """The writer's end: count what was not written, close the file, release the lock."""
        with self._cond:
            left = self._pending
            self._pending = _Pending()
            if left.batches:
                self._lost += len(left.holds) + len(left.deltas)
                log.warning(
                    "Usage ledger: %s closed with %d holds and %d hourly totals not written (%s)",
                    self.path,
                    len(left.holds),
                    len(left.deltas),
                    self._reason or "the writer stopped",
                )
            self._cond.notify_all()
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


# -- opening ---------------------------------------------------------------------------------


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _take_lock(path: Path) -> int:
    """The exclusive lock of ``path``, with our pid written in the lock file."""
    lock = lock_path(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(lock, flags, FILE_MODE)
    except OSError as err:
        raise LedgerUnavailable(
            f"usage ledger {path}: its lock file {lock} cannot be opened: {err.strerror or err}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _read_pid(fd)
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            who = f"process {holder}" if holder else "another process"
            raise LedgerBusy(
                f"usage ledger {path} is in use by {who} (it holds {lock}): each agent on a "
                "machine needs its own --state-dir; this one runs without a usage ledger"
            ) from None
        raise LedgerUnavailable(
            f"usage ledger {path}: its lock {lock} cannot be taken: {err.strerror or err}"
        ) from None
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _open_database(path: Path, clock: Callable[[], float]) -> sqlite3.Connection:
    """A connection to a usable ledger at ``path``: checked, moved aside and replaced when
    unusable, migrated; ``LedgerUnavailable`` otherwise."""
    for attempt in range(2):
        _create_file(path)
        problem = _inspect(path)
        if problem is None:
            conn = _connect(path)
            try:
                _set_up(conn, clock())
                return conn
            except (sqlite3.Error, schema.SchemaError) as err:
                conn.close()
                cause = err.__cause__ if isinstance(err, schema.SchemaError) else err
                if not (isinstance(cause, sqlite3.Error) and _is_corrupt(cause)) or attempt:
                    raise LedgerUnavailable(
                        f"usage ledger {path} cannot be set up: {err}"
                    ) from None
                problem = ("corrupt", f"cannot be written ({err})")
        kind, why = problem
        try:
            aside = _move_aside(path, kind, clock())
        except OSError as err:
            raise LedgerUnavailable(
                f"usage ledger {path} {why} and cannot be moved aside: {err.strerror or err}"
            ) from None
        log.warning(
            "Usage ledger: %s %s: moved it aside to %s and started a new ledger",
            path,
            why,
            aside.name,
        )
    raise LedgerUnavailable(f"usage ledger {path} is unusable even when new")  # pragma: no cover


def _create_file(path: Path) -> None:
    """Create ``path`` (0600) when missing; a link or anything else is refused."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as err:
        what = "is a symbolic link" if err.errno == errno.ELOOP else "cannot be opened"
        raise LedgerUnavailable(f"usage ledger {path} {what}: {err.strerror or err}") from None
    os.close(fd)


def _connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(
        str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
    )


def _inspect(path: Path) -> tuple[str, str] | None:
    """``_problem_of`` the file, read through a read-only connection: one that never
    checkpoints the WAL into the file nor deletes it at close, so a file moved aside is as
    it was found."""
    uri = path.absolute().as_uri() + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as err:
        raise LedgerUnavailable(f"usage ledger {path} cannot be opened: {err}") from None
    try:
        return _problem_of(conn)
    except sqlite3.Error as err:
        if not _is_corrupt(err):
            raise LedgerUnavailable(f"usage ledger {path} cannot be read: {err}") from None
        return "corrupt", f"is not a readable SQLite database ({err})"
    finally:
        conn.close()


def _problem_of(conn: sqlite3.Connection) -> tuple[str, str] | None:
    """Why the file at ``conn`` is not a ledger to use ((kind, words)); None: it is ours,
    at a version we know, or new."""
    app, version = schema.versions(conn)
    tables = schema.table_names(conn)
    objects = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    if app == 0 and version == 0 and objects == 0:
        return None  # new
    if app != schema.APPLICATION_ID:
        if app:
            return "foreign", f"is another program's SQLite database (application_id {app:#x})"
        names = ", ".join(sorted(tables)[:4]) or "no tables"
        return "foreign", f"is another program's SQLite database ({names})"
    if version > schema.SCHEMA_VERSION:
        return (
            "newer",
            f"is at schema version {version}, newer than the {schema.SCHEMA_VERSION} this "
            "agent knows (a newer agent wrote it)",
        )
    check = [str(row[0]) for row in conn.execute("PRAGMA quick_check(3)")]
    if check != ["ok"]:
        return "corrupt", f"fails SQLite's quick_check ({check[0]})"
    missing = sorted(set(schema.TABLES) - tables) if version == schema.SCHEMA_VERSION else []
    if missing:
        return "corrupt", f"lacks its table(s) {', '.join(missing)}"
    return None


def _set_up(conn: sqlite3.Connection, now_s: float) -> None:
    if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
        schema.prepare_new_file(conn)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
    conn.execute(f"PRAGMA cache_size = -{CACHE_KIB}")
    schema.migrate(conn, now_s=now_s)


def _move_aside(path: Path, kind: str, now_s: float) -> Path:
    """Rename ``path`` and its ``-wal``/``-shm`` to ``<name>.<kind>-<UTC stamp>`` (``.1``,
    ``.2`` after it when taken); the new name of ``path``."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now_s))
    base = f"{path.name}.{kind}-{stamp}"
    name, n = base, 0
    while any(_exists(path.parent / f"{name}{suffix}") for suffix in ("", "-wal", "-shm")):
        n += 1
        name = f"{base}.{n}"
    aside = path.parent / name
    for suffix in ("", "-wal", "-shm"):
        source = path.parent / f"{path.name}{suffix}"
        if _exists(source):
            os.rename(source, path.parent / f"{name}{suffix}")
    return aside


def _exists(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _read_open_holds(conn: sqlite3.Connection) -> list[Hold]:
    rows = conn.execute(
        f"SELECT {schema.HOLD_COLUMNS} FROM holds WHERE ended_s IS NULL ORDER BY id"  # noqa: S608
    ).fetchall()
    labels = schema.labels_by_hold(conn, [int(row[0]) for row in rows])
    return [schema.hold_from_row(row, labels.get(int(row[0]), ())) for row in rows]


def _read_longest(conn: sqlite3.Connection) -> float:
    row = conn.execute("SELECT value FROM meta WHERE key = 'longest_hold_s'").fetchone()
    return float(row[0]) if row is not None and isinstance(row[0], int | float) else 0.0


# -- writing ---------------------------------------------------------------------------------

_UPDATE_HOLD = """UPDATE holds SET gpu_index = ?, unit = ?, lease_id = ?, image = ?, pid = ?,
    last_seen_s = ?, held_s = ?, busy_s = ?, peak_memory_mib = ?, energy_j = ?
    WHERE key = ? RETURNING id, ended_s, container_id, container_name"""
_INSERT_HOLD = """INSERT INTO holds (key, gpu_uuid, gpu_index, unit, mig_uuid, holder, lease_id,
    container_id, container_name, image, pid, started_s, last_seen_s, ended_s, held_s, busy_s,
    peak_memory_mib, energy_j) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    RETURNING id"""
_ADD_HOURLY = """INSERT INTO hourly (hour_s, dim, value, held_s, busy_s, energy_j)
    VALUES (?, ?, ?, ?, ?, ?)
    ON CONFLICT (dim, value, hour_s) DO UPDATE SET
        held_s = held_s + excluded.held_s,
        busy_s = busy_s + excluded.busy_s,
        energy_j = coalesce(energy_j + excluded.energy_j, energy_j, excluded.energy_j)"""
_SET_LONGEST = """INSERT INTO meta (key, value) VALUES ('longest_hold_s', ?)
    ON CONFLICT (key) DO UPDATE SET value = max(value, excluded.value)"""


def _write_batch(conn: sqlite3.Connection, work: _Pending, longest_s: float) -> None:
    """One transaction: the holds upserted (``ended_s``, which ``holds_ended`` indexes, the
    container and the labels only when they changed, so that an index is rewritten only
    when its column changed; the other columns always), the deltas added."""
    conn.execute("BEGIN IMMEDIATE")
    for hold in work.holds.values():
        _upsert_hold(conn, hold)
    conn.executemany(
        _ADD_HOURLY,
        [
            (hour, dim, value, held, busy, energy or None)
            for (hour, dim, value), (held, busy, energy) in work.deltas.items()
        ],
    )
    longest = max(_ended_spans(work), default=0.0)
    if longest > longest_s:
        conn.execute(_SET_LONGEST, (longest,))
    conn.execute("COMMIT")


def _upsert_hold(conn: sqlite3.Connection, hold: Hold) -> None:
    row = conn.execute(
        _UPDATE_HOLD,
        (
            hold.gpu_index,
            hold.unit,
            hold.lease_id,
            hold.image,
            hold.pid,
            hold.last_seen_s,
            hold.held_s,
            hold.busy_s,
            hold.peak_memory_mib,
            hold.energy_j,
            hold.key,
        ),
    ).fetchone()
    if row is None:
        (hold_id,) = conn.execute(
            _INSERT_HOLD,
            (
                hold.key,
                hold.gpu_uuid,
                hold.gpu_index,
                hold.unit,
                hold.mig_uuid,
                hold.holder.value,
                hold.lease_id,
                hold.container_id,
                hold.container_name,
                hold.image,
                hold.pid,
                hold.started_s,
                hold.last_seen_s,
                hold.ended_s,
                hold.held_s,
                hold.busy_s,
                hold.peak_memory_mib,
                hold.energy_j,
            ),
        ).fetchone()
        if hold.labels:
            conn.executemany(
                "INSERT INTO hold_labels (hold_id, key, value) VALUES (?, ?, ?)",
                [(hold_id, key, value) for key, value in hold.labels],
            )
        return
    hold_id, ended_s, container_id, container_name = row
    if ended_s != hold.ended_s:
        conn.execute("UPDATE holds SET ended_s = ? WHERE id = ?", (hold.ended_s, hold_id))
    if (container_id, container_name) != (hold.container_id, hold.container_name):
        conn.execute(
            "UPDATE holds SET container_id = ?, container_name = ? WHERE id = ?",
            (hold.container_id, hold.container_name, hold_id),
        )
    stored = conn.execute(
        "SELECT key, value FROM hold_labels WHERE hold_id = ? ORDER BY key", (hold_id,)
    ).fetchall()
    if [tuple(pair) for pair in stored] != sorted(hold.labels):
        conn.execute("DELETE FROM hold_labels WHERE hold_id = ?", (hold_id,))
        conn.executemany(
            "INSERT INTO hold_labels (hold_id, key, value) VALUES (?, ?, ?)",
            [(hold_id, key, value) for key, value in dict(hold.labels).items()],
        )


def _ended_spans(work: _Pending) -> Iterator[float]:
    for hold in work.holds.values():
        if hold.ended_s is not None:
            yield hold.ended_s - hold.started_s


def _is_corrupt(err: sqlite3.Error) -> bool:
    code = getattr(err, "sqlite_errorcode", None)
    if isinstance(code, int) and (code & 0xFF) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    text = str(err)
    return "malformed" in text or "not a database" in text


# -- retention -------------------------------------------------------------------------------


def _delete_holds(conn: sqlite3.Connection, condition: str, bound: float) -> int:
    """Delete the holds that meet ``condition`` (on ``ended_s``), oldest first, in chunks of
    ``DELETE_CHUNK`` (one transaction each); their labels go with them."""
    total = 0
    while True:
        conn.execute("BEGIN IMMEDIATE")
        deleted = conn.execute(
            "DELETE FROM holds WHERE id IN (SELECT id FROM holds WHERE "  # noqa: S608
            f"{condition} ORDER BY ended_s LIMIT ?)",
            (bound, DELETE_CHUNK),
        ).rowcount
        conn.execute("COMMIT")
        total += deleted
        if deleted < DELETE_CHUNK:
            return total


def _hourly_groups(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    """Every (dim, value) of the hourly table, each found by one seek of its key."""
    groups: list[tuple[str, str]] = []
    row = conn.execute("SELECT dim, value FROM hourly ORDER BY dim, value LIMIT 1").fetchone()
    while row is not None:
        groups.append((str(row[0]), str(row[1])))
        row = conn.execute(
            "SELECT dim, value FROM hourly WHERE (dim, value) > (?, ?) ORDER BY dim, value LIMIT 1",
            row,
        ).fetchone()
    return groups


def _delete_hourly(conn: sqlite3.Connection, before_s: float) -> int:
    """Delete the hourly rows of the hours that began before ``before_s``, group by group."""
    groups = _hourly_groups(conn)
    total = 0
    for start in range(0, len(groups), _HOURLY_DELETE_GROUPS):
        conn.execute("BEGIN IMMEDIATE")
        for dim, value in groups[start : start + _HOURLY_DELETE_GROUPS]:
            total += conn.execute(
                "DELETE FROM hourly WHERE dim = ? AND value = ? AND hour_s < ?",
                (dim, value, before_s),
            ).rowcount
        conn.execute("COMMIT")
    return total


def _next_horizon(conn: sqlite3.Connection, ended: int, share: float) -> float | None:
    """How far the size bound deletes next: to the end of the n-th oldest ended hold, n
    being ``share`` of the ``ended`` holds (at least ``_SHRINK_STEP``, at most
    ``DELETE_CHUNK``); with no ended hold left, one day of hourly rows past the oldest.
    None: nothing is left to delete."""
    if ended > 0:
        count = max(_SHRINK_STEP, min(DELETE_CHUNK, math.ceil(ended * share)))
        row = conn.execute(
            "SELECT ended_s FROM holds WHERE ended_s IS NOT NULL ORDER BY ended_s LIMIT 1 OFFSET ?",
            (min(count, ended) - 1,),
        ).fetchone()
        if row is not None:
            return float(row[0])
    oldest = [
        conn.execute(
            "SELECT min(hour_s) FROM hourly WHERE dim = ? AND value = ?", group
        ).fetchone()[0]
        for group in _hourly_groups(conn)
    ]
    if not oldest:
        return None
    return float(min(oldest)) + 3600 + 86400


def _vacuum(conn: sqlite3.Connection) -> None:
    """Give the free pages back to the file system (``executescript``: the pragma frees
    one page per step, and ``execute`` steps once)."""
    conn.executescript("PRAGMA incremental_vacuum;")


def _used_bytes(conn: sqlite3.Connection) -> int:
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    return int((pages - free) * size)


def _size_on_disk(path: Path) -> int:
    total = 0
    for name in (path.name, path.name + "-wal"):
        with contextlib.suppress(OSError):
            total += (path.parent / name).stat().st_size
    return total
