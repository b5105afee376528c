"""The ledger's readers (agent.usage.queries) on files the real store wrote: each grouping,
the hours a range is rounded out to, prorating by the span in the range, the limit and the
totals, the holds listed, and reading while a writer holds the file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from agent.usage import queries
from agent.usage.queries import LedgerUnreadable, UsageAnswer, UsageRow, read_usage
from agent.usage.records import Batch, HolderKind
from tests.unit.usage import DAY, GPUS, HOUR, T0, batch, delta, hold, open_store


def written(path: Path, *batches: Batch) -> Path:
    store = open_store(path)
    try:
        for each in batches:
            store.submit(each)
        assert store.flush(10)
    finally:
        store.close()
    return path


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    return tmp_path / "usage.db"


# -- the hourly groupings ----------------------------------------------------------------------


def test_by_gpu_reads_the_whole_hours_that_overlap_the_range(ledger: Path) -> None:
    written(
        ledger,
        batch(
            deltas=(
                delta(T0, "gpu", GPUS[0], 3600, 1800, 5000.0),
                delta(T0 + HOUR, "gpu", GPUS[0], 1200, 600, 1000.0),
                delta(T0 + HOUR, "gpu", GPUS[1], 3600, 3600),
                delta(T0 + 2 * HOUR, "gpu", GPUS[1], 100, 0),
                delta(T0 + HOUR, "image", "pytorch:2", 9999),
            )
        ),
    )
    answer = read_usage(ledger, since_s=T0 + 1800, until_s=T0 + HOUR + 1, by="gpu")
    assert answer == UsageAnswer(
        since_s=T0,
        until_s=T0 + 2 * HOUR,
        by="gpu",
        rows=(
            UsageRow(GPUS[0], 4800.0, 2400.0, 6000.0, None),
            UsageRow(GPUS[1], 3600.0, 3600.0, None, None),
        ),
        truncated=False,
        totals=UsageRow("total", 8400.0, 6000.0, 6000.0, None),
    )
    on_the_hour = read_usage(ledger, since_s=T0 + HOUR, until_s=T0 + 2 * HOUR, by="gpu")
    assert (on_the_hour.since_s, on_the_hour.until_s) == (T0 + HOUR, T0 + 2 * HOUR)
    assert [r.gpu_seconds for r in on_the_hour.rows] == [3600.0, 1200.0]


def test_by_image_and_by_label_group_their_values_the_unknown_one_included(
    ledger: Path,
) -> None:
    written(
        ledger,
        batch(
            deltas=(
                delta(T0, "image", "pytorch:2", 100, 50, 10.0),
                delta(T0, "image", "", 30),
                delta(T0, "label:team", "ml", 70),
                delta(T0, "label:team", "", 60),
                delta(T0, "label:project", "x", 1),
            )
        ),
    )
    images = read_usage(ledger, since_s=T0, until_s=T0 + HOUR, by="image")
    assert [(r.key, r.gpu_seconds, r.energy_joules) for r in images.rows] == [
        ("pytorch:2", 100.0, 10.0),
        ("", 30.0, None),
    ]
    teams = read_usage(ledger, since_s=T0, until_s=T0 + HOUR, by="label:team")
    assert [(r.key, r.gpu_seconds) for r in teams.rows] == [("ml", 70.0), ("", 60.0)]
    assert read_usage(ledger, since_s=T0, until_s=T0 + HOUR, by="label:owner").rows == ()


def test_a_grouping_of_many_values_gives_the_same_answer_read_in_one_pass(
    ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deltas = tuple(
        delta(T0 + h * HOUR, "label:job", f"job-{n:02d}", float(n + h), 1.0)
        for n in range(20)
        for h in range(48)
    )
    written(ledger, batch(deltas=deltas))
    by_value = read_usage(ledger, since_s=T0 + 5 * HOUR, until_s=T0 + DAY, by="label:job")
    monkeypatch.setattr(queries, "SEEK_GROUPS", 4)
    one_pass = read_usage(ledger, since_s=T0 + 5 * HOUR, until_s=T0 + DAY, by="label:job")
    assert one_pass == by_value
    assert by_value.rows[0] == UsageRow(
        "job-19", sum(19.0 + h for h in range(5, 24)), 19, None, None
    )


def test_the_limit_cuts_the_rows_and_the_totals_count_them_all(ledger: Path) -> None:
    deltas = tuple(delta(T0, "label:team", f"team-{n}", 10.0 * (n % 5), 1.0) for n in range(12))
    written(ledger, batch(deltas=deltas))
    answer = read_usage(ledger, since_s=T0, until_s=T0 + HOUR, by="label:team", limit=3)
    assert [(r.key, r.gpu_seconds) for r in answer.rows] == [
        ("team-4", 40.0),
        ("team-9", 40.0),
        ("team-3", 30.0),
    ]
    assert answer.truncated
    assert answer.totals == UsageRow("total", 210.0, 12.0, None, None)
    assert not read_usage(ledger, since_s=T0, until_s=T0 + 1, by="label:team", limit=12).truncated


def test_now_ends_a_range_that_reaches_past_it(ledger: Path) -> None:
    written(
        ledger, batch(deltas=(delta(T0, "gpu", GPUS[0], 60), delta(T0 + DAY, "gpu", GPUS[0], 60)))
    )
    answer = read_usage(ledger, since_s=T0, until_s=T0 + 2 * DAY, by="gpu", now_s=T0 + 90)
    assert (answer.since_s, answer.until_s) == (T0, T0 + HOUR)
    assert answer.totals.gpu_seconds == 60.0
    future = read_usage(ledger, since_s=T0 + DAY, until_s=T0 + 2 * DAY, by="container", now_s=T0)
    assert (future.since_s, future.until_s, future.rows) == (T0 + DAY, T0 + DAY, ())


# -- by container: the holds ---------------------------------------------------------------------


def test_by_container_prorates_each_hold_by_its_span_in_the_range(ledger: Path) -> None:
    c1, c2 = "1" * 64, "2" * 64
    written(
        ledger,
        batch(
            # 100 s, 50 of them in [T0 + 50, T0 + 150): half of its figures
            hold("lease-1", container_id=c1, name="train", ended=T0 + 100, busy=80, energy=400),
            # the same name, a later container: summed under the name, its id the newest
            hold("lease-2", container_id=c2, name="train", started=T0 + 100, ended=T0 + 200),
            # a lease not bound to a container yet, a foreign container, a process
            hold("lease-3", started=T0 + 120, ended=T0 + 130),
            hold(
                "c3",
                holder=HolderKind.CONTAINER,
                container_id="3" * 64,
                started=T0,
                ended=T0 + 1000,
            ),
            hold("pid 42", holder=HolderKind.PROCESS, pid=42, started=T0 + 60, last_seen=T0 + 80),
            # outside the range: ended at its start, and began at its end
            hold("lease-4", name="before", ended=T0 + 50),
            hold("lease-5", name="after", started=T0 + 150, ended=T0 + 160),
        ),
    )
    answer = read_usage(ledger, since_s=T0 + 50, until_s=T0 + 150, by="container")
    assert (answer.since_s, answer.until_s) == (T0 + 50, T0 + 150)  # not rounded
    rows = {r.key: r for r in answer.rows}
    assert set(rows) == {"train", "3" * 64, "lease-3", "pid 42"}
    assert rows["train"].gpu_seconds == pytest.approx(50 + 50)
    assert rows["train"].busy_gpu_seconds == pytest.approx(40)
    assert rows["train"].energy_joules == pytest.approx(200)
    assert rows["train"].holds == 2
    assert rows["train"].extra == (("container_id", c2),)
    assert rows["3" * 64].gpu_seconds == pytest.approx(100)  # a tenth of its 1000 s
    assert rows["3" * 64].energy_joules is None
    assert rows["lease-3"].gpu_seconds == pytest.approx(10)
    assert rows["lease-3"].extra == ()
    assert rows["pid 42"].gpu_seconds == pytest.approx(20)  # still open: to its last sighting
    assert answer.totals.holds == 5
    assert answer.totals.gpu_seconds == pytest.approx(230)
    assert [r.key for r in answer.rows] == ["3" * 64, "train", "pid 42", "lease-3"]


def test_a_long_hold_that_began_long_before_the_range_is_found(ledger: Path) -> None:
    written(
        ledger,
        batch(
            hold("lease-1", name="long", ended=T0 + 30 * DAY),
            *(
                hold(f"lease-{n}", name="short", started=T0 + n * HOUR, ended=T0 + n * HOUR + 60)
                for n in range(2, 50)
            ),
        ),
    )
    answer = read_usage(ledger, since_s=T0 + 20 * DAY, until_s=T0 + 20 * DAY + HOUR, by="container")
    assert [r.key for r in answer.rows] == ["long"]
    assert answer.rows[0].gpu_seconds == pytest.approx(3600)


def test_a_hold_of_no_length_counts_where_it_began(ledger: Path) -> None:
    written(ledger, batch(hold("lease-1", name="blip", started=T0 + 10, ended=T0 + 10, held=0)))
    inside = read_usage(ledger, since_s=T0, until_s=T0 + 20, by="container")
    assert [(r.key, r.holds) for r in inside.rows] == [("blip", 1)]
    assert read_usage(ledger, since_s=T0 + 10.5, until_s=T0 + 20, by="container").rows == ()


def test_newest_lease_number_is_the_highest_lease_the_newest_holds_name(
    ledger: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert queries.newest_lease_number(ledger) == 0  # no ledger yet
    written(
        ledger,
        batch(
            hold("lease-9", ended=T0 + 10),
            hold("lease-12", gpu=1, started=T0 + 5),
            hold("c1", gpu=2, holder=HolderKind.CONTAINER, container_id="c1"),
            hold("lease-3", gpu=3, started=T0 + 20),
        ),
    )
    assert queries.newest_lease_number(ledger) == 12
    written(ledger, batch(hold("p7", gpu=4, holder=HolderKind.PROCESS, pid=7)))
    monkeypatch.setattr(queries, "NEWEST_HOLDS", 2)  # the process and lease-3 only
    assert queries.newest_lease_number(ledger) == 3


# -- the file ------------------------------------------------------------------------------------


def test_no_file_or_a_file_not_set_up_yet_is_an_empty_answer(ledger: Path) -> None:
    answer = read_usage(ledger, since_s=T0, until_s=T0 + DAY, by="container")
    assert answer == UsageAnswer(
        T0, T0 + DAY, "container", (), False, UsageRow("total", 0, 0, None, 0)
    )
    ledger.touch()
    assert read_usage(ledger, since_s=T0, until_s=T0 + DAY, by="gpu").rows == ()
    assert queries.newest_lease_number(ledger) == 0


def test_a_file_that_is_not_a_ledger_is_one_line(ledger: Path) -> None:
    conn = sqlite3.connect(ledger)
    conn.execute("CREATE TABLE photos (id INTEGER)")
    conn.close()
    with pytest.raises(LedgerUnreadable) as err:
        read_usage(ledger, since_s=T0, until_s=T0 + DAY, by="gpu")
    assert str(err.value) == f"usage ledger {ledger} is another program's SQLite database"
    ledger.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(LedgerUnreadable, match="cannot be read: file is not a database"):
        read_usage(ledger, since_s=T0, until_s=T0 + DAY, by="gpu")
    with pytest.raises(LedgerUnreadable, match="cannot be read: file is not a database"):
        queries.newest_lease_number(ledger)


@pytest.mark.parametrize(
    ("by", "since", "until", "limit", "message"),
    [
        ("user", T0, T0 + 1, 10, "by must be gpu, container, image or label:KEY, not 'user'"),
        ("label:", T0, T0 + 1, 10, "by must be gpu, container, image or label:KEY, not 'label:'"),
        ("gpu", T0 + 1, T0 + 1, 10, f"since ({T0 + 1}) must be before until ({T0 + 1})"),
        ("gpu", T0, float("nan"), 10, "since and until must be finite times"),
        ("gpu", T0, T0 + 1, 0, "limit must be 1 or more, not 0"),
    ],
)
def test_a_bad_question_is_a_value_error_of_one_line(
    ledger: Path, by: str, since: float, until: float, limit: int, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        read_usage(ledger, since_s=since, until_s=until, by=by, limit=limit)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_a_reader_reads_while_a_writer_holds_a_long_transaction(ledger: Path) -> None:
    written(
        ledger,
        batch(hold("lease-1", name="done", ended=T0 + 60), deltas=(delta(T0, "gpu", GPUS[0], 60),)),
    )
    writer = sqlite3.connect(ledger, isolation_level=None, timeout=0)
    try:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute(
            "INSERT INTO hourly (hour_s, dim, value, held_s, busy_s) VALUES (?, 'gpu', ?, 1, 1)",
            (T0, GPUS[1]),
        )
        writer.execute("UPDATE holds SET held_s = 1e9")
        gpus = read_usage(ledger, since_s=T0, until_s=T0 + HOUR, by="gpu")
        containers = read_usage(ledger, since_s=T0, until_s=T0 + HOUR, by="container")
        # (a reader that waited for the writer's lock would have failed, after its timeout)
        assert [(r.key, r.gpu_seconds) for r in gpus.rows] == [(GPUS[0], 60.0)]  # committed only
        assert [(r.key, r.gpu_seconds) for r in containers.rows] == [("done", 60.0)]
        writer.execute("COMMIT")
    finally:
        writer.close()
    assert len(read_usage(ledger, since_s=T0, until_s=T0 + HOUR, by="gpu").rows) == 2


def test_a_long_read_does_not_hold_up_the_writer(ledger: Path) -> None:
    store = open_store(ledger)
    reader = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, isolation_level=None)
    try:
        store.submit(batch(deltas=(delta(T0, "gpu", GPUS[0], 60),)))
        assert store.flush(5)
        reader.execute("BEGIN")
        assert reader.execute("SELECT sum(held_s) FROM hourly").fetchone() == (60.0,)
        store.submit(batch(deltas=(delta(T0, "gpu", GPUS[0], 60),)))
        assert store.flush(5)  # written while the reader keeps its snapshot
        assert reader.execute("SELECT sum(held_s) FROM hourly").fetchone() == (60.0,)
        reader.execute("COMMIT")
        assert read_usage(ledger, since_s=T0, until_s=T0 + HOUR, by="gpu").totals.gpu_seconds == 120
    finally:
        reader.close()
        store.close()
