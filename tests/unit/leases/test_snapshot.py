"""The snapshot (JSON and back, refusals of what is not one), the container labels, and the
rebuild after a restart: restore the snapshot, resync with the live containers."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from agent.leases.answers import ChangeKind
from agent.leases.asks import Ask
from agent.leases.containers import Container
from agent.leases.holders import ForeignHold, ForeignSource, Lease, LeaseState
from agent.leases.labels import (
    LABEL_DEVICES,
    LABEL_ID,
    LABEL_MODE,
    LABEL_OWNER,
    LeaseLabel,
    labels_for,
    read_label,
)
from agent.leases.snapshot import (
    SCHEMA,
    Snapshot,
    SnapshotError,
    snapshot_from_json,
    snapshot_to_json,
)
from agent.leases.table import LeaseTable
from agent.leases.view import UnitState

from .nodes import T0, build_node, cid, granted, healthy, leased_container

NODE = build_node([0, 0, 1, 1])


def _busy_table() -> LeaseTable:
    """A pending lease, a running one, a stopped one, and a foreign container."""
    table = LeaseTable(NODE, healthy(NODE), now_s=T0)
    granted(table.ask(Ask(devices="0", owner=(("user", "ann"),)), T0))
    for n, dev in ((1, "1"), (2, "2")):
        lease = granted(table.ask(Ask(devices=dev, exclusive=False), T0)).lease
        container = leased_container(n, lease, running=True)
        table.created(container, T0)
        table.started(container, T0)
    table.died(cid(2), T0 + 1)
    table.started(Container(cid(3), True, devices=("3",), how="--device /dev/nvidia3"), T0 + 2)
    return table


def _round_trip(snapshot: Snapshot) -> Snapshot:
    return snapshot_from_json(json.loads(json.dumps(snapshot_to_json(snapshot))))


def test_a_snapshot_survives_json() -> None:
    snapshot = _busy_table().snapshot()
    assert [x.state for x in snapshot.leases] == [
        LeaseState.PENDING,
        LeaseState.RUNNING,
        LeaseState.STOPPED,
    ]
    assert len(snapshot.foreign) == 1
    assert _round_trip(snapshot) == snapshot
    assert snapshot_to_json(snapshot)["schema"] == SCHEMA


def test_a_restored_table_is_the_table_it_was() -> None:
    table = _busy_table()
    restored = LeaseTable(NODE, healthy(NODE), now_s=T0 + 3)
    outcome = restored.restore(_round_trip(table.snapshot()), T0 + 3)
    assert [c.text for c in outcome.changes] == [
        "restored 3 leases and 1 foreign holder from the snapshot of 2026-09-21T14:13:22Z"
    ]
    assert restored.view().units == table.view().units
    assert restored.view().leases == table.view().leases
    restored.release("lease-1", T0 + 4)
    assert granted(restored.ask(Ask(), T0 + 4)).lease.id == "lease-4"


def test_rebuild_after_a_restart_restores_then_resyncs_with_the_live_containers() -> None:
    """Down for 100 s: the pending grant expired meanwhile, container 1 was removed, 2 was
    started again, and the foreign container 3 still runs."""
    old = _busy_table()
    snapshot = _round_trip(old.snapshot())
    leases = {x.id: x for x in snapshot.leases}
    table = LeaseTable(NODE, healthy(NODE), now_s=T0 + 100)
    restored = table.restore(snapshot, T0 + 100)
    assert [c.kind for c in restored.changes] == [ChangeKind.RESTORED, ChangeKind.EXPIRED]
    live = [
        leased_container(2, leases["lease-3"], running=True),
        Container(cid(3), True, devices=("3",), how="--device /dev/nvidia3"),
    ]
    synced = table.resync("", live, T0 + 100)
    assert [c.kind for c in synced.changes] == [ChangeKind.ENDED, ChangeKind.STARTED]
    assert [u.state for u in table.view().units] == [
        UnitState.FREE,
        UnitState.FREE,
        UnitState.LEASED,
        UnitState.FOREIGN,
    ]


def test_rebuild_without_a_snapshot_takes_the_running_containers_labels() -> None:
    old = _busy_table()
    leases = {x.id: x for x in old.snapshot().leases}
    table = LeaseTable(NODE, healthy(NODE), now_s=T0 + 100)
    live = [
        leased_container(1, leases["lease-2"], running=True),
        leased_container(2, leases["lease-3"]),  # stopped: it holds nothing now
    ]
    synced = table.resync("", live, T0 + 100)
    assert [c.kind for c in synced.changes] == [ChangeKind.RELET]
    relet = table.lease("lease-2")
    assert relet is not None
    assert not relet.exclusive
    assert relet.container_id == cid(1)
    assert granted(table.ask(Ask(), T0 + 101)).lease.id == "lease-4"  # after every label


def test_a_snapshot_names_each_containers_engine_known_or_not() -> None:
    """Engines by name; a lease and a hold of an unknown engine waiting for a list, with
    their bound."""
    table = LeaseTable(NODE, healthy(NODE), now_s=T0)
    for n, dev in ((1, "1"), (2, "2")):
        lease = granted(table.ask(Ask(devices=dev), T0)).lease
        table.started(leased_container(n, lease, running=True, engine="/run/docker.sock"), T0)
    foreign = Container(cid(3), True, devices=("3",), engine="/run/docker.sock")
    table.started(foreign, T0)
    saved = snapshot_to_json(table.snapshot())
    assert [x["engine"] for x in saved["leases"]] == ["/run/docker.sock"] * 2
    assert [(h["engine"], h["until_s"]) for h in saved["foreign"]] == [("/run/docker.sock", None)]
    assert _round_trip(table.snapshot()) == table.snapshot()

    unknown = LeaseTable(NODE, healthy(NODE), now_s=T0)  # another, its engines not followed
    unknown.restore(_round_trip(table.snapshot()), T0)
    unknown.followed(["/run/podman/podman.sock"], T0)
    unknown.resync("/run/podman/podman.sock", [], T0 + 5)
    snapshot = unknown.snapshot()
    assert [(x.engine, x.until_s) for x in snapshot.leases] == [(None, T0 + 605)] * 2
    assert [(h.engine, h.until_s) for h in snapshot.foreign] == [(None, T0 + 605)]
    assert _round_trip(snapshot) == snapshot


def test_an_older_agents_snapshot_reads_its_containers_engines_as_unknown() -> None:
    data = _valid()
    for entry in data["leases"] + data["foreign"]:
        del entry["engine"]
    for entry in data["foreign"]:
        del entry["until_s"]
    snapshot = snapshot_from_json(data)
    assert [x.engine for x in snapshot.leases] == [None, None, None]
    assert [(h.engine, h.until_s) for h in snapshot.foreign] == [(None, None)]
    assert [x.state for x in snapshot.leases] == [x.state for x in _busy_table().snapshot().leases]


def test_restore_needs_an_empty_table() -> None:
    table = _busy_table()
    with pytest.raises(RuntimeError, match="restored before it holds anything"):
        table.restore(table.snapshot(), T0)


def _valid() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(snapshot_to_json(_busy_table().snapshot())))
    return data


@pytest.mark.parametrize(
    ("spoil", "line"),
    [
        (lambda d: [], "snapshot: not an object"),
        (lambda d: {**d, "schema": "other/1"}, "schema: not nvidia-docker-leases/1: 'other/1'"),
        (lambda d: {**d, "next_lease": 0}, "next_lease: not a whole number from 1"),
        (lambda d: {**d, "saved_s": "now"}, "saved_s: not a time in seconds"),
        (lambda d: {**d, "leases": {}}, "leases: not a list of at most 4096"),
        (lambda d: {**d, "leases": [{}] * 4097}, "leases: not a list of at most 4096"),
        (lambda d: _lease(d, id="lease-x"), "leases[0].id: not a lease id: 'lease-x'"),
        (lambda d: _lease(d, state="gone"), "leases[0].state: not a lease state: 'gone'"),
        (lambda d: _lease(d, units=[]), "leases[0].units: one or more, and a name for each"),
        (lambda d: _lease(d, container_id=cid(1)), "leases[0]: a pending lease has no container"),
        (lambda d: _lease(d, until_s=None), "leases[0].until_s: set unless its container runs"),
        (lambda d: _lease(d, exclusive=1), "leases[0].exclusive: not true or false"),
        (lambda d: _lease(d, owner={"bad key": "x"}), "leases[0].owner: not owner labels"),
        (lambda d: _lease(d, asked="a\nb"), "leases[0].asked: not a printable string"),
        (lambda d: {**d, "leases": d["leases"][:1] * 2}, "leases: a lease id is given twice"),
        (lambda d: _foreign(d, holder="../x"), "foreign[0].holder: not a container id: '../x'"),
        (
            lambda d: _foreign(d, holder="pid x", container=False),
            "foreign[0].holder: not a container id or pid: 'pid x'",
        ),
        (lambda d: _foreign(d, source="magic"), "foreign[0].source: not a source: 'magic'"),
        (lambda d: _lease(d, engine="a\nb"), "leases[0].engine: not a printable string"),
        (lambda d: _lease(d, engine="x" * 300), "leases[0].engine: not an engine name: 'xx"),
        (lambda d: _lease(d, engine="/run/docker.sock"), "leases[0].engine: a pending lease"),
        (
            lambda d: _lease(d, 1, until_s=T0),
            "leases[1].until_s: set unless its container runs (and is its engine's",
        ),
        (
            lambda d: _foreign(d, source="process"),
            "foreign[0].engine: only a running container's hold has one",
        ),
        (
            lambda d: _foreign(d, until_s=T0),
            "foreign[0].until_s: only a container's hold of an unknown engine has one",
        ),
    ],
)
def test_what_is_not_a_snapshot_is_refused_naming_the_field(spoil: Any, line: str) -> None:
    with pytest.raises(SnapshotError) as caught:
        snapshot_from_json(spoil(_valid()))
    assert str(caught.value).startswith(line)


def _lease(data: dict[str, Any], at: int = 0, **fields: object) -> dict[str, Any]:
    leases = list(data["leases"])
    leases[at] = {**leases[at], **fields}
    return {**data, "leases": leases}


def _foreign(data: dict[str, Any], **fields: object) -> dict[str, Any]:
    return {**data, "foreign": [{**data["foreign"][0], **fields}]}


def test_labels_name_the_lease_its_devices_its_mode_and_its_owner() -> None:
    lease = granted(
        LeaseTable(NODE, healthy(NODE)).ask(
            Ask(count=2, exclusive=False, owner=(("user", "ann"), ("job", "7"))), T0
        )
    ).lease
    labels = labels_for(lease)
    assert labels == {
        LABEL_ID: "lease-1",
        LABEL_DEVICES: ",".join(lease.units),
        LABEL_MODE: "shared",
        LABEL_OWNER: '{"user":"ann","job":"7"}',
    }
    assert read_label(labels) == LeaseLabel("lease-1", lease.units, False, lease.owner)


@pytest.mark.parametrize(
    "spoil",
    [
        {LABEL_ID: None},
        {LABEL_ID: "lease-0"},
        {LABEL_ID: "L1"},
        {LABEL_DEVICES: None},
        {LABEL_DEVICES: ""},
        {LABEL_DEVICES: "GPU-a,GPU-a"},
        {LABEL_DEVICES: "GPU-a, GPU-b"},
        {LABEL_DEVICES: ",".join(f"GPU-{i}" for i in range(600))},
        {LABEL_MODE: "mine"},
    ],
)
def test_a_label_not_of_the_tables_form_is_no_label(spoil: dict[str, str | None]) -> None:
    labels = {LABEL_ID: "lease-3", LABEL_DEVICES: "GPU-a", LABEL_MODE: "exclusive"}
    labels.update(spoil)  # type: ignore[arg-type]
    assert read_label({k: v for k, v in labels.items() if v is not None}) is None


@pytest.mark.parametrize("owner", ["", "[1]", '{"a": 1}', '{"bad key": "x"}', "{" * 9000])
def test_malformed_owner_labels_read_as_none(owner: str) -> None:
    labels = {LABEL_ID: "lease-3", LABEL_DEVICES: "GPU-a", LABEL_OWNER: owner}
    assert read_label(labels) == LeaseLabel("lease-3", ("GPU-a",), True, ())


def test_a_snapshot_over_the_bound_is_written_so_that_it_reads_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """More leases and foreign holders than a snapshot reads (4,096 each: shared MIG devices
    of a 16-GPU node, thousands of GPU processes): what is written reads back after a
    restart, keeps every pending and stopped lease and every container's hold, and one
    warning line says what was left out."""
    pending = [
        Lease(f"lease-{n}", (f"GPU-{n}",), ("0",), False, (), "1 GPU, shared", T0, until_s=T0 + 60)
        for n in range(1, 1101)
    ]
    stopped = [
        replace(x, id=f"lease-{x.number + 2000}", state=LeaseState.STOPPED)
        for x in pending
        for x in [replace(x, container_id=cid(x.number), until_s=T0 + 600, engine="/d.sock")]
    ]
    running = [
        replace(x, id=f"lease-{x.number + 4000}", state=LeaseState.RUNNING, until_s=None)
        for x in stopped
    ] + [
        replace(x, id=f"lease-{x.number + 6000}", state=LeaseState.RUNNING, until_s=None)
        for x in stopped
    ]
    containers = [
        ForeignHold(cid(n), ForeignSource.CONTAINER, ("GPU-1",), "--device /dev/nvidia1", T0)
        for n in range(1, 101)
    ]
    processes = [
        ForeignHold(f"pid {n}", ForeignSource.PROCESS, ("GPU-2",), "a GPU process", T0, False)
        for n in range(1, 4101)
    ]
    snapshot = Snapshot(T0, 9001, (*running, *stopped, *pending), (*processes, *containers))
    with caplog.at_level("WARNING", logger="agent.leases.snapshot"):
        back = _round_trip(snapshot)
    assert len(back.leases) == 4096
    assert len(back.foreign) == 4096
    assert set(pending) | set(stopped) <= set(back.leases)
    assert set(containers) <= set(back.foreign)
    assert back.next_lease == 9001
    assert [r.getMessage() for r in caplog.records] == [
        "Leases: the snapshot holds at most 4096 leases and 4096 foreign holders: 304 leases "
        "(of running containers first; a resync rebuilds them from their labels) and 104 "
        "foreign holders (GPU processes first; seen again by the next sweep) are left out of "
        "the state file"
    ]


def test_a_lease_of_many_named_mig_devices_reads_back() -> None:
    """An ask naming every GPU of a 20-GPU node in MIG mode (140 MIG devices) is asked in
    more words than a snapshot's text field holds: its lease still reads back."""
    node = build_node([i // 10 for i in range(20)], migs={i: ["1g.10gb"] * 7 for i in range(20)})
    table = LeaseTable(node, healthy(node), now_s=T0)
    lease = granted(table.ask(Ask(devices=" ".join(map(str, range(20)))), T0)).lease
    assert len(lease.units) == 140
    assert len(lease.asked) > 512
    (back,) = _round_trip(table.snapshot()).leases
    assert back.units == lease.units
    assert back.asked == lease.asked[:511] + "\u2026"
