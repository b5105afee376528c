"""Binding and release through the container's life, may-it-start verdicts, foreign
holders (containers with devices, GPU processes) and resync from a container list."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.health.rule import utc_text
from agent.leases.answers import ChangeKind, Refusal, Refused, Start
from agent.leases.asks import Ask
from agent.leases.containers import Container, GpuUser
from agent.leases.holders import ForeignSource, LeaseState
from agent.leases.table import LeaseTable
from agent.leases.units import NodeUnits
from agent.leases.view import UnitState

from .nodes import T0, build_node, builtin, cid, granted, healthy, leased_container, names, sick

AT = utc_text(T0)
NODE = build_node([0, 0, 1, 1])


def _table() -> LeaseTable:
    return LeaseTable(NODE, healthy(NODE), now_s=T0)


def _kinds(outcome: object) -> list[ChangeKind]:
    return [c.kind for c in getattr(outcome, "changes", ())]


def test_create_binds_the_pending_lease_start_runs_it_remove_ends_it() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="1"), T0)).lease
    container = leased_container(1, lease)
    created = table.created(container, T0 + 5)
    assert created.answer.decision is Start.YES
    assert (
        created.answer.text
        == f"container 0001abababab may start: it binds lease-1 (pending since {AT})"
    )
    (bound,) = created.changes
    assert bound.kind is ChangeKind.BOUND
    assert bound.text == (
        f"lease-1 bound to container 0001abababab: it keeps GPU 1 until {utc_text(T0 + 605)} "
        "unless it starts"
    )
    assert table.lease("lease-1") == replace(
        lease, state=LeaseState.STOPPED, container_id=cid(1), until_s=T0 + 605, engine=""
    )
    started = table.started(replace(container, running=True), T0 + 6)
    assert started.answer.text == "container 0001abababab may start: lease-1 (GPU 1)"
    assert _kinds(started) == [ChangeKind.STARTED]
    assert table.lease("lease-1").state is LeaseState.RUNNING  # type: ignore[union-attr]
    assert table.lease("lease-1").until_s is None  # type: ignore[union-attr]
    assert table.view().unit("1").state is UnitState.LEASED
    assert table.started(replace(container, running=True), T0 + 7).changes == ()  # again
    removed = table.destroyed(cid(1), T0 + 8)
    assert [c.text for c in removed.changes] == [
        "lease-1 ended: container 0001abababab was removed; GPU 1 is free again"
    ]
    assert table.view().unit("1").state is UnitState.FREE
    assert table.destroyed(cid(1), T0 + 9).changes == ()


def test_a_stopped_container_keeps_its_lease_for_the_grace_time_then_loses_it() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="0"), T0)).lease
    container = leased_container(1, lease, running=True)
    table.created(container, T0)
    table.started(container, T0)
    stopped = table.died(cid(1), T0 + 100)
    assert [c.text for c in stopped.changes] == [
        f"container 0001abababab stopped: lease-1 keeps GPU 0 until {utc_text(T0 + 700)} "
        "unless it starts again"
    ]
    assert table.next_deadline_s() == T0 + 700
    assert table.started(container, T0 + 699).answer.decision is Start.YES  # within grace
    table.died(cid(1), T0 + 800)
    assert table.tick(T0 + 1399).changes == ()
    (ended,) = table.tick(T0 + 1400).changes
    assert ended.kind is ChangeKind.GRACE_ENDED
    assert ended.text == (
        "lease-1 ended: container 0001abababab did not start again within 600 s of stopping; "
        "GPU 0 is free again"
    )


def test_a_created_container_that_never_starts_keeps_its_lease_for_the_grace_time() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="0"), T0)).lease
    table.created(leased_container(1, lease), T0 + 1)
    assert _kinds(table.tick(T0 + 601)) == [ChangeKind.GRACE_ENDED]


def test_started_again_after_its_gpus_went_elsewhere_is_no_and_says_who_has_them() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="2"), T0)).lease
    old = leased_container(1, lease, running=True)
    table.created(old, T0)
    table.started(old, T0)
    table.died(cid(1), T0 + 10)
    table.tick(T0 + 610)  # grace over
    new = granted(table.ask(Ask(devices="2"), T0 + 620)).lease
    table.created(leased_container(2, new), T0 + 621)
    verdict = table.may_start(old, T0 + 630).answer
    assert verdict.decision is Start.NO
    assert verdict.text == (
        "container 0001abababab may not start: its lease-1 has ended (stopped longer than 600 "
        "s, or unknown here) and its devices cannot be leased to it again: devices taken: GPU 2 "
        f"by container 0002abababab (lease-2), not running, since {utc_text(T0 + 620)}, until "
        f"{utc_text(T0 + 1221)}; recreate it to get GPUs"
    )
    assert verdict.refusal is not None
    assert verdict.refusal.kind is Refusal.TAKEN
    # Started anyway (nobody asked before): it holds GPU 2 as a foreign holder, a conflict.
    outcome = table.started(old, T0 + 631)
    assert _kinds(outcome) == [ChangeKind.FOREIGN, ChangeKind.CONFLICT]
    assert outcome.changes[0].text == (
        "container 0001abababab holds GPU 2 without a lease (the labels of lease-1, not its lease)"
    )
    assert table.view().unit("2").state is UnitState.CONFLICT
    assert _kinds(table.died(cid(1), T0 + 640)) == [ChangeKind.FOREIGN_GONE]
    assert table.view().unit("2").state is UnitState.LEASED


def test_started_again_after_its_lease_ended_with_its_gpus_free_is_a_re_lease() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="2 3", owner=(("job", "7"),)), T0)).lease
    container = leased_container(1, lease)
    table.created(container, T0)
    table.tick(T0 + 600)  # never started: the grace time ran out
    assert table.lease("lease-1") is None
    asked = table.may_start(container, T0 + 700)
    assert asked.answer.decision is Start.RELET
    assert asked.answer.text == (
        "container 0001abababab may start: its lease-1 had ended; GPU 2, GPU 3 were free and "
        "are leased to it again"
    )
    assert asked.changes == ()
    assert table.lease("lease-1") is None
    started = table.started(replace(container, running=True), T0 + 701)
    assert _kinds(started) == [ChangeKind.RELET]
    relet = table.lease("lease-1")
    assert relet is not None
    assert (relet.state, relet.container_id, relet.owner) == (
        LeaseState.RUNNING,
        cid(1),
        (("job", "7"),),
    )
    assert names(granted(table.ask(Ask(), T0 + 702))) == ["0"]  # a new id, not lease-1
    assert table.lease("lease-2") is not None


def test_created_with_an_expired_grant_is_a_re_lease_when_its_gpus_are_free() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="1"), T0)).lease
    table.tick(T0 + 61)
    outcome = table.created(leased_container(1, lease), T0 + 62)
    assert outcome.answer.decision is Start.RELET
    assert _kinds(outcome) == [ChangeKind.RELET]
    assert table.lease("lease-1").state is LeaseState.STOPPED  # type: ignore[union-attr]


def test_a_lease_serves_one_container() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="1"), T0)).lease
    table.created(leased_container(1, lease), T0)
    clone = leased_container(2, lease, running=True)
    verdict = table.may_start(clone, T0 + 1).answer
    assert verdict.refusal is not None
    assert verdict.refusal.kind is Refusal.OTHER_CONTAINER
    assert verdict.text == (
        f"container 0002abababab may not start: lease-1 is bound to container 0001abababab "
        f"since {AT}; a lease serves one container: ask for a new lease"
    )
    assert table.created(clone, T0 + 1).changes == ()


def test_a_label_with_other_devices_than_its_pending_lease_binds_nothing() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="1"), T0)).lease
    forged = leased_container(1, replace(lease, units=(NODE.devices[0].uuid or "",)))
    verdict = table.created(forged, T0).answer
    assert verdict.decision is Start.NO
    assert verdict.text == (
        "container 0001abababab may not start: its labels name lease-1 with other devices than "
        "the lease has (GPU 1); create it with the labels of its grant"
    )
    assert table.lease("lease-1").state is LeaseState.PENDING  # type: ignore[union-attr]


def test_a_bound_container_may_not_start_on_a_gpu_that_turned_unhealthy() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="3"), T0)).lease
    container = leased_container(1, lease)
    table.created(container, T0)
    table.set_health([*healthy(NODE)[:3], sick()], T0 + 1)
    assert table.lease("lease-1") is not None  # a bound lease stays: its container exists
    verdict = table.may_start(container, T0 + 2).answer
    assert verdict.decision is Start.NO
    assert verdict.text == (
        f"container 0001abababab may not start: lease-1 has GPU 3 unhealthy since {AT}: XID 79 "
        "(GPU has fallen off the bus); release lease-1 and recreate the container to get "
        "another GPU"
    )


def test_a_bound_container_whose_gpu_left_the_node_may_not_start() -> None:
    node = builtin("h200x2-mig")
    table = LeaseTable(node, healthy(node), now_s=T0)
    lease = granted(table.ask(Ask(mig_profile="2g.35gb"), T0)).lease
    container = leased_container(1, lease)
    table.created(container, T0)
    gpu0 = node.devices[0]
    other = replace(
        node, devices=(replace(gpu0, mig_devices=gpu0.mig_devices[:1]), node.devices[1])
    )
    assert table.set_node(other, healthy(other), T0 + 1).changes == ()
    verdict = table.may_start(container, T0 + 2).answer
    assert verdict.text == (
        "container 0001abababab may not start: MIG 0:1 of lease-1 is no longer on this node "
        "(driver reload or MIG change); recreate it to get GPUs"
    )


def test_a_foreign_container_holds_what_it_was_given_while_it_runs() -> None:
    table = _table()
    foreign = Container(cid(9), True, devices=("1",), how="--gpus device=1")
    assert table.may_start(foreign, T0).answer.text == (
        "container 0009abababab may start: GPU 1 is leased to nobody"
    )
    outcome = table.started(foreign, T0)
    assert [c.text for c in outcome.changes] == [
        "container 0009abababab holds GPU 1 without a lease (--gpus device=1)"
    ]
    (hold,) = table.view().foreign
    assert (hold.holder, hold.source, hold.how) == (
        cid(9),
        ForeignSource.CONTAINER,
        "--gpus device=1",
    )
    assert names(granted(table.ask(Ask(count=3), T0))) == ["0", "2", "3"]
    other = Container(cid(10), True, devices=("all",), how="--gpus all")
    verdict = table.may_start(other, T0).answer
    assert verdict.decision is Start.NO  # GPUs 0, 2 and 3 are leased (pending)
    assert verdict.text.startswith(
        "container 000aabababab may not start: it names GPUs leased to others: GPU 0, GPU 2, "
        "GPU 3 pending for lease-1 since"
    )
    assert verdict.text.endswith("; ask the lease table for GPUs instead of naming them")
    shares = Container(cid(11), True, devices=("/dev/nvidia1",))
    assert table.may_start(shares, T0).answer.allowed  # foreign beside foreign: as before
    assert [c.text for c in table.died(cid(9), T0 + 1).changes] == [
        "container 0009abababab stopped: GPU 1 no longer held by it"
    ]


def test_a_leased_container_with_devices_beyond_its_lease_holds_them_as_foreign() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="0"), T0)).lease
    container = replace(
        leased_container(1, lease, running=True), devices=("0", "1"), how="--device"
    )
    table.created(container, T0)
    table.started(container, T0)
    (hold,) = table.view().foreign
    assert hold.units == (NODE.devices[1].uuid,)
    other = granted(table.ask(Ask(devices="2"), T0)).lease
    greedy = replace(leased_container(2, other), devices=("2", "0"))
    verdict = table.may_start(greedy, T0).answer
    assert verdict.decision is Start.NO
    assert "it names GPUs leased to others: GPU 0 by container 0001abababab (lease-1)" in (
        verdict.text
    )


def test_a_gpu_process_of_nobody_holding_its_gpu_is_a_foreign_holder() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="0"), T0)).lease
    container = leased_container(1, lease, running=True)
    table.created(container, T0)
    table.started(container, T0)
    seen = table.processes_seen([GpuUser(0, cid(1), 100), GpuUser(2, None, 4242)], T0 + 1)
    assert [c.text for c in seen.changes] == [
        "pid 4242 holds GPU 2 without a lease (a GPU process)"
    ]
    refusal = table.ask(Ask(devices="2"), T0 + 2).answer
    assert isinstance(refusal, Refused)
    assert f"GPU 2 by pid 4242 (a GPU process) since {utc_text(T0 + 1)}" in refusal.text
    assert table.processes_seen([GpuUser(2, None, 4242)], T0 + 3).changes == ()  # the same
    gone = table.processes_seen([], T0 + 4)
    assert [c.text for c in gone.changes] == [
        "pid 4242 runs no GPU process any more: GPU 2 no longer held by it"
    ]


def test_a_gpu_process_on_a_mig_gpu_holds_all_its_mig_devices_unless_its_own() -> None:
    node = builtin("h200x2-mig")
    table = LeaseTable(node, healthy(node), now_s=T0)
    lease = granted(table.ask(Ask(devices="0:2"), T0)).lease
    container = leased_container(1, lease, running=True)
    table.created(container, T0)
    table.started(container, T0)
    assert table.processes_seen([GpuUser(0, cid(1), 7)], T0).changes == ()
    table.processes_seen([GpuUser(0, cid(2), 8)], T0)
    (hold,) = table.view().foreign
    assert len(hold.units) == 4
    assert hold.holder == cid(2)
    assert table.view().unit("0:2").state is UnitState.CONFLICT


def test_resync_ends_what_vanished_and_takes_up_what_runs() -> None:
    table = _table()
    gone = granted(table.ask(Ask(devices="0"), T0)).lease
    table.created(leased_container(1, gone), T0)
    missed = granted(table.ask(Ask(devices="1"), T0)).lease  # its create event was lost
    table.started(Container(cid(3), True, devices=("3",)), T0)
    outcome = table.resync(
        "",
        [
            leased_container(2, missed, running=True),
            Container(cid(4), True, devices=("/dev/nvidia2",), how="--device /dev/nvidia2"),
        ],
        T0 + 5,
    )
    assert _kinds(outcome) == [
        ChangeKind.ENDED,
        ChangeKind.FOREIGN_GONE,
        ChangeKind.BOUND,
        ChangeKind.FOREIGN,
    ]
    assert outcome.changes[0].text == (
        "lease-1 ended: container 0001abababab is gone (not in its engine's container list); "
        "GPU 0 is free again"
    )
    assert table.lease("lease-2").container_id == cid(2)  # type: ignore[union-attr]
    assert table.lease("lease-2").state is LeaseState.RUNNING  # type: ignore[union-attr]
    assert [u.state for u in table.view().units] == [
        UnitState.FREE,
        UnitState.LEASED,
        UnitState.FOREIGN,
        UnitState.FREE,
    ]


def test_resync_stops_the_clock_of_containers_that_stopped_unseen() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="0"), T0)).lease
    container = leased_container(1, lease, running=True)
    table.created(container, T0)
    table.started(container, T0)
    outcome = table.resync("", [replace(container, running=False)], T0 + 50)
    assert _kinds(outcome) == [ChangeKind.STOPPED]
    assert table.lease("lease-1").until_s == T0 + 650  # type: ignore[union-attr]


def test_resync_leaves_a_stopped_container_with_an_unknown_lease_holding_nothing() -> None:
    table = _table()
    lease = granted(table.ask(Ask(devices="0"), T0)).lease
    other = LeaseTable(NODE, healthy(NODE), now_s=T0)  # a table that never knew lease-1
    assert other.resync("", [leased_container(1, lease)], T0).changes == ()
    assert other.view().unit("0").state is UnitState.FREE
    relet = other.resync("", [leased_container(1, lease, running=True)], T0 + 1)
    assert _kinds(relet) == [ChangeKind.RELET]
    assert names(granted(other.ask(Ask(), T0 + 2))) == ["1"]
    assert other.lease("lease-2") is not None  # new ids come after the labels' ones


@pytest.mark.parametrize(
    ("devices", "got"),
    [
        (("1",), ["1"]),
        (("GPU-00000001",), ["1"]),
        (("nvidia.com/gpu=1",), ["1"]),
        (("/dev/nvidia1",), ["1"]),
        (("all",), ["0:0", "0:1", "0:2", "0:3", "1"]),
        (("nvidia.com/gpu=all",), ["0:0", "0:1", "0:2", "0:3", "1"]),
        (("0",), ["0:0", "0:1", "0:2", "0:3"]),
        (("/dev/nvidia0",), ["0:0", "0:1", "0:2", "0:3"]),
        (("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap49"), ["0:1"]),
        (("0:2", "MIG-f0e1"), ["0:2", "0:3"]),
        (("9", "GPU-nothing", "/dev/nvidiactl", "", "*", "0 1", "x" * 300), []),
    ],
)
def test_the_devices_a_container_was_given_in_any_form(
    devices: tuple[str, ...], got: list[str]
) -> None:
    node = builtin("h200x2-mig")
    if devices == ("GPU-00000001",):
        devices = (node.devices[1].uuid or "",)
    units = NodeUnits(node)
    assert [u.name for u in units.given(devices)] == got


def test_container_ids_are_ids() -> None:
    with pytest.raises(ValueError, match="not a container id"):
        Container("../etc")
    with pytest.raises(ValueError, match="not a container id"):
        GpuUser(0, "a b", 1)
