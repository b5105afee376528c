"""The usage ledger's store and readers, on real SQLite files; what the tests build with.

``hold(...)`` and ``batch(...)`` build the values the accounting hands the store, with the
key shape it gives (``ident|unit|start``); ``Clock`` is a wall clock that moves only when a
test moves it (retention reads it); ``sql(path, ...)`` reads a ledger through a connection of
the test's own; ``wait_for`` polls a condition within a bound; ``read_line`` reads a child
process's next line within a bound.
"""

from __future__ import annotations

import select
import sqlite3
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.usage.records import Batch, Hold, HolderKind, HourDelta, Labels
from agent.usage.store import LedgerStore

T0 = 1_767_225_600  # 2026-01-01 00:00:00 UTC, an hour's first second
HOUR = 3600
DAY = 86400
GPUS = tuple(f"GPU-{n:08x}-0000-4000-8000-{n:012x}" for n in range(8))
LOGGER = "nvidia-docker-plugin.usage"
ROOT = Path(__file__).resolve().parents[3]  # the checkout: where a child process imports agent


@dataclass
class Clock:
    """A wall clock for the store; ``now`` moves when a test sets it."""

    now: float = T0 + DAY

    def __call__(self) -> float:
        return self.now


def hold(
    ident: str = "lease-1",
    *,
    gpu: int = 0,
    started: float = T0,
    last_seen: float | None = None,
    ended: float | None = None,
    held: float | None = None,
    busy: float = 0.0,
    energy: float | None = None,
    holder: HolderKind = HolderKind.LEASE,
    container_id: str | None = None,
    name: str | None = None,
    image: str | None = None,
    pid: int | None = None,
    labels: Labels = (),
    peak: int | None = None,
) -> Hold:
    """A hold of ``ident`` on GPU ``gpu``; ``held`` defaults to its span."""
    seen = last_seen if last_seen is not None else (ended if ended is not None else started)
    return Hold(
        key=f"{ident}|{GPUS[gpu]}|{started:.3f}",
        gpu_uuid=GPUS[gpu],
        gpu_index=gpu,
        unit=str(gpu),
        mig_uuid=None,
        holder=holder,
        lease_id=ident if holder is HolderKind.LEASE else None,
        container_id=container_id,
        container_name=name,
        image=image,
        pid=pid,
        labels=labels,
        started_s=started,
        last_seen_s=seen,
        ended_s=ended,
        held_s=seen - started if held is None else held,
        busy_s=busy,
        peak_memory_mib=peak,
        energy_j=energy,
    )


def delta(
    hour_s: int, dim: str, value: str, held: float, busy: float = 0.0, energy: float = 0.0
) -> HourDelta:
    return HourDelta(hour_s, dim, value, held, busy, energy)


def batch(*holds: Hold, deltas: tuple[HourDelta, ...] = ()) -> Batch:
    return Batch(holds, deltas)


def open_store(path: Path, clock: Clock | None = None, **options: Any) -> LedgerStore:
    """A store as the agent opens it: 90 days' retention, 1 GiB, a test clock."""
    options.setdefault("retention_s", 90 * DAY)
    options.setdefault("max_bytes", 1 << 30)
    return LedgerStore.open(path, clock=clock or Clock(), **options)


def sql(path: Path, query: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
    """The rows of ``query`` on the ledger at ``path``, through a connection of the test's."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(query, params).fetchall()
    finally:
        conn.close()


def on_disk(path: Path) -> int:
    """The sizes of the ledger at ``path`` and of its WAL, added up (bytes)."""
    return sum(
        (path.parent / name).stat().st_size
        for name in (path.name, f"{path.name}-wal")
        if (path.parent / name).exists()
    )


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 20.0) -> None:
    """Poll ``condition`` every 10 ms until it is true; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.01)


def read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The next line of ``proc``'s stdout, waiting at most ``timeout_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        raise AssertionError(f"no line from the child within {timeout_s:.0f} s")
    return proc.stdout.readline().decode().strip()
