"""Usage ledger benchmark: a year of a busy 8-GPU node in ``usage.db``, and what reading and
writing it cost.

    python -m tests.benchmarks.bench_usage_store [--days 365] [--leases 10000] [--runs 7]
        [--keep DIR]

It builds the ledger as the agent's store lays it out (``LedgerStore.open`` creates the
file, then the rows go in by bulk inserts, one transaction a day, not through ``submit``):
``--leases`` leases a day, each one GPU of eight, back to back on its GPU with gaps between
(durations log-normal around 30 s, up to 30 minutes: 10,000 a day fill about 70% of the
GPUs' time), each with three owner labels: ``team`` (20 values, some busier than others),
``com.docker.compose.project`` (8 per team) and ``com.docker.compose.service`` (6 names);
a container name per project, service and replica; one of 30 images. The hourly rows are
those the accounting writes: every hold's seconds, busy seconds and joules spread over the
UTC hours it overlaps, per ``gpu``, ``image`` and each label key.

Then, one line per figure (the median of ``--runs`` runs where it is a time):

- ``read_usage(by="label:team")`` over the whole range (target: under 100 ms; the ratio to
  it), and over the last day;
- ``by="gpu"`` over the whole range and the last day; ``by="label:com.docker.compose.project"``
  (160 values) over the whole range;
- ``by="container"`` over the last 30 days, the last day and its last hour (read from the
  holds, prorated);
- the file's size, and per year of this load (MB);
- ``LedgerStore.open`` on it (``PRAGMA quick_check`` reads the whole file);
- a typical batch (8 open holds updated, 40 hourly deltas): ``submit`` alone and ``submit``
  until written (``flush``), in microseconds, and the WAL it writes (KiB a batch);
- the retention pass that deletes one day's holds and hours (what an hourly pass costs when
  it has a day to delete, or more than an hour: the worst that happens once an hour).
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from agent.usage.queries import read_usage
from agent.usage.records import Batch, Hold, HolderKind, HourDelta, hour_of
from agent.usage.store import LedgerStore

START = 1_735_689_600  # 2025-01-01 00:00:00 UTC
DAY = 86400
GPUS = tuple(f"GPU-{n:08x}-5e1f-4c3a-9d2b-{n:012x}" for n in range(8))
TEAMS = tuple(f"team-{n:02d}" for n in range(20))
TEAM_WEIGHTS = tuple(1.0 / (n + 1) for n in range(20))  # a few teams use most
SERVICES = ("train", "eval", "notebook", "serve", "etl", "sweep")
IMAGES = tuple(f"registry.example.com/ml/{s}:2025.{n}" for s in SERVICES for n in range(5))
LABEL_KEYS = ("com.docker.compose.project", "com.docker.compose.service", "team")
TARGET_MS = 100.0  # read_usage(by="label:team") over a year

_INSERT_HOLD = (
    "INSERT INTO holds (id, key, gpu_uuid, gpu_index, unit, mig_uuid, holder, lease_id, "
    "container_id, container_name, image, pid, started_s, last_seen_s, ended_s, held_s, "
    "busy_s, peak_memory_mib, energy_j) VALUES (?, ?, ?, ?, ?, NULL, 'lease', ?, ?, ?, ?, "
    "NULL, ?, ?, ?, ?, ?, ?, ?)"
)
_ADD_HOURLY = (
    "INSERT INTO hourly (hour_s, dim, value, held_s, busy_s, energy_j) VALUES (?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (dim, value, hour_s) DO UPDATE SET held_s = held_s + excluded.held_s, "
    "busy_s = busy_s + excluded.busy_s, energy_j = energy_j + excluded.energy_j"
)

Hours = dict[tuple[int, str, str], list[float]]


def build(path: Path, days: int, leases_per_day: int, seed: int = 23) -> tuple[int, float]:
    """The ledger of ``days`` days at ``path``; (holds written, longest hold in seconds)."""
    LedgerStore.open(path, retention_s=10 * 365 * DAY, max_bytes=1 << 40).close()
    rnd = random.Random(seed)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")  # a bulk load: the figures below are not about it
    conn.execute("PRAGMA cache_size = -262144")
    hours: Hours = {}
    hold_id = 0
    longest = 0.0
    per_gpu = leases_per_day // len(GPUS)
    for day in range(days):
        day_s = START + day * DAY
        holds: list[tuple[object, ...]] = []
        labels: list[tuple[int, str, str]] = []
        for gpu, uuid in enumerate(GPUS):
            for started, length in _schedule(rnd, day_s, per_gpu):
                hold_id += 1
                team = rnd.choices(TEAMS, TEAM_WEIGHTS)[0]
                project = f"{team}-project-{rnd.randrange(8)}"
                service = rnd.choice(SERVICES)
                image = IMAGES[SERVICES.index(service) * 5 + rnd.randrange(5)]
                util = rnd.uniform(0.2, 1.0)
                ended = started + length
                busy, joules = length * util, length * (90.0 + 600.0 * util)
                holds.append(
                    (
                        hold_id,
                        f"lease-{hold_id}|{uuid}|{started:.3f}",
                        uuid,
                        gpu,
                        str(gpu),
                        f"lease-{hold_id}",
                        f"{rnd.getrandbits(256):064x}",
                        f"{project}-{service}-{rnd.randrange(1, 4)}",
                        image,
                        started,
                        ended,
                        ended,
                        length,
                        busy,
                        rnd.randrange(1000, 140_000),
                        joules,
                    )
                )
                labels += [
                    (hold_id, LABEL_KEYS[0], project),
                    (hold_id, LABEL_KEYS[1], service),
                    (hold_id, LABEL_KEYS[2], team),
                ]
                longest = max(longest, length)
                groups = (
                    ("gpu", uuid),
                    ("image", image),
                    (f"label:{LABEL_KEYS[0]}", project),
                    (f"label:{LABEL_KEYS[1]}", service),
                    (f"label:{LABEL_KEYS[2]}", team),
                )
                _spread(hours, started, ended, busy, joules, groups)
        done = [key for key in hours if key[0] < day_s + DAY]  # no later lease adds to them
        conn.execute("BEGIN")
        conn.executemany(_INSERT_HOLD, holds)
        conn.executemany("INSERT INTO hold_labels (hold_id, key, value) VALUES (?, ?, ?)", labels)
        conn.executemany(_ADD_HOURLY, [(*key, *hours.pop(key)) for key in done])
        conn.execute("COMMIT")
    conn.execute("BEGIN")
    conn.executemany(_ADD_HOURLY, [(*key, *totals) for key, totals in hours.items()])
    conn.execute(
        "INSERT INTO meta (key, value) VALUES ('longest_hold_s', ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (longest,),
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return hold_id, longest


def _schedule(rnd: random.Random, day_s: int, count: int) -> list[tuple[float, float]]:
    """``count`` (start, length) of one GPU's day, back to back with random gaps."""
    lengths = [min(1800.0, max(5.0, rnd.lognormvariate(math.log(30.0), 1.0))) for _ in range(count)]
    busy = sum(lengths)
    if busy > 0.95 * DAY:
        lengths = [x * 0.95 * DAY / busy for x in lengths]
        busy = 0.95 * DAY
    cuts = sorted(rnd.uniform(0.0, DAY - busy) for _ in range(count))
    out, at, free_before = [], float(day_s), 0.0
    for length, cut in zip(lengths, cuts, strict=True):
        at += cut - free_before
        free_before = cut
        out.append((round(at, 3), length))
        at += length
    return out


def _spread(
    hours: Hours,
    start: float,
    end: float,
    busy: float,
    joules: float,
    groups: tuple[tuple[str, str], ...],
) -> None:
    span = end - start
    at = start
    while at < end:
        hour = hour_of(at)
        piece = min(end, hour + 3600) - at
        for dim, value in groups:
            totals = hours.setdefault((hour, dim, value), [0.0, 0.0, 0.0])
            totals[0] += piece
            totals[1] += busy * piece / span
            totals[2] += joules * piece / span
        at += piece


def timed(runs: int, call: Callable[[], object]) -> float:
    """The median wall time of ``call``, in ms."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def typical_batch(n: int, now_s: float) -> Batch:
    """What one sweep of the node hands the store: its 8 open holds (one a GPU, each of
    another team, project and image), and their deltas to the current hour: 8 per grouping
    but the 6 services, 38 in all."""
    holders = [(TEAMS[g], f"{TEAMS[g]}-project-1", SERVICES[g % 6], IMAGES[g]) for g in range(8)]
    holds = tuple(
        Hold(
            key=f"lease-open-{gpu}|{GPUS[gpu]}|{now_s - 3000:.3f}",
            gpu_uuid=GPUS[gpu],
            gpu_index=gpu,
            unit=str(gpu),
            mig_uuid=None,
            holder=HolderKind.LEASE,
            lease_id=f"lease-open-{gpu}",
            container_id=f"{gpu:064x}",
            container_name=f"{project}-{service}-1",
            image=image,
            pid=None,
            labels=((LABEL_KEYS[0], project), (LABEL_KEYS[1], service), (LABEL_KEYS[2], team)),
            started_s=now_s - 3000,
            last_seen_s=now_s + n * 10,
            ended_s=None,
            held_s=3000.0 + n * 10,
            busy_s=1500.0 + n * 5,
            peak_memory_mib=40_000,
            energy_j=900_000.0 + n * 3000,
        )
        for gpu, (team, project, service, image) in enumerate(holders)
    )
    hour = hour_of(now_s)
    groups = {("gpu", uuid) for uuid in GPUS}
    for team, project, service, image in holders:
        groups |= {
            ("image", image),
            (f"label:{LABEL_KEYS[0]}", project),
            (f"label:{LABEL_KEYS[1]}", service),
            (f"label:{LABEL_KEYS[2]}", team),
        }
    deltas = tuple(HourDelta(hour, dim, value, 10.0, 5.0, 3000.0) for dim, value in sorted(groups))
    return Batch(holds, deltas)


def writes(path: Path, end_s: float, batches: int) -> tuple[float, float, float]:
    """(submit µs, submit until written µs, WAL KiB per batch), medians over ``batches``."""
    store = LedgerStore.open(path, retention_s=10 * 365 * DAY, max_bytes=1 << 40)
    try:
        store.submit(typical_batch(0, end_s))  # the holds exist: the rest are updates
        store.flush(30)
        submits, whole = [], []
        for n in range(1, batches + 1):
            one = typical_batch(n, end_s)
            started = time.perf_counter()
            store.submit(one)
            submitted = time.perf_counter()
            store.flush(30)
            done = time.perf_counter()
            submits.append(submitted - started)
            whole.append(done - started)
        probe = sqlite3.connect(path, isolation_level=None)
        try:
            probe.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            for n in range(batches + 1, batches + 21):
                store.submit(typical_batch(n, end_s))
                store.flush(30)
            frames = probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]
            page = probe.execute("PRAGMA page_size").fetchone()[0]
        finally:
            probe.close()
    finally:
        store.close()
    wal_kib = frames * (page + 24) / 20 / 1024
    return statistics.median(submits) * 1e6, statistics.median(whole) * 1e6, wal_kib


def retention_of_a_day(path: Path, days: int) -> tuple[float, int]:
    """The first retention pass that deletes the oldest day, in ms; the holds it deleted."""
    before = _count(path)
    clock_now = START + days * DAY
    store = LedgerStore.open(
        path, retention_s=(days - 1) * DAY, max_bytes=1 << 40, clock=lambda: clock_now
    )
    opened = time.perf_counter()
    store.submit(Batch((), ()))
    store.flush(600)  # the first turn: retention, then this empty batch
    done = time.perf_counter()
    store.close()
    return (done - opened) * 1e3, before - _count(path)


def _count(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT count(*) FROM holds").fetchone()[0])
    finally:
        conn.close()


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--leases", type=int, default=10_000, help="leases a day")
    parser.add_argument("--runs", type=int, default=7, help="runs of each read (the median)")
    parser.add_argument("--batches", type=int, default=200, help="typical batches written")
    parser.add_argument("--keep", type=Path, help="build in this directory and keep the file")
    args = parser.parse_args()
    if args.days < 2 or args.leases < 8 or args.runs < 1 or args.batches < 1:
        raise SystemExit("bench_usage_store: --days 2+, --leases 8+, --runs and --batches 1+")
    workdir = Path(tempfile.mkdtemp(prefix="bench-usage-", dir=args.keep))
    path = workdir / "usage.db"
    try:
        started = time.perf_counter()
        holds, longest = build(path, args.days, args.leases)
        built_s = time.perf_counter() - started
        end = START + args.days * DAY
        size = _size(path)
        print(
            f"usage ledger: {args.days} days of {args.leases:,} leases a day on 8 GPUs "
            f"({holds:,} holds, longest {longest:.0f} s), built in {built_s:.0f} s"
        )
        print(f"  file size: {size / 1e6:.1f} MB, {size / 1e6 * 365 / args.days:.0f} MB per year")
        started = time.perf_counter()
        LedgerStore.open(path, retention_s=10 * 365 * DAY, max_bytes=1 << 40).close()
        print(
            f"  LedgerStore.open (quick_check of the file): {time.perf_counter() - started:.2f} s"
        )
        whole = {"since_s": START, "until_s": end}
        last_month = {"since_s": end - min(30, args.days) * DAY, "until_s": end}
        last_day = {"since_s": end - DAY, "until_s": end}
        last_hour = {"since_s": end - 3600, "until_s": end}
        reads = [
            ("label:team, whole range", "label:team", whole, TARGET_MS),
            ("label:team, last day", "label:team", last_day, None),
            ("gpu, whole range", "gpu", whole, None),
            ("gpu, last day", "gpu", last_day, None),
            (
                "label:com.docker.compose.project, whole range",
                f"label:{LABEL_KEYS[0]}",
                whole,
                None,
            ),
            (f"container, last {min(30, args.days)} days", "container", last_month, None),
            ("container, last day", "container", last_day, None),
            ("container, last hour", "container", last_hour, None),
        ]
        for name, by, span, target in reads:
            answer = read_usage(path, by=by, **span)
            ms = timed(args.runs, partial(read_usage, path, by=by, **span))
            ratio = f" ({ms / target:.2f}x the {target:.0f} ms target)" if target else ""
            print(f"  read_usage by {name}: {ms:.1f} ms, {len(answer.rows)} rows{ratio}")
        submit_us, written_us, wal_kib = writes(path, end - 1800.0, args.batches)
        print(
            f"  a typical batch (8 holds, 40 deltas): submit {submit_us:.0f} us, submit until "
            f"written {written_us:.0f} us, {wal_kib:.0f} KiB of WAL"
        )
        retention_ms, deleted = retention_of_a_day(path, args.days)
        print(
            f"  retention deleting the oldest day ({deleted:,} holds and their hours): "
            f"{retention_ms:.0f} ms"
        )
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"  kept: {path}")


if __name__ == "__main__":
    main()
