"""Asking: grants, what each refusal says, sharing, pending expiry, and the queue."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from agent.health.rule import utc_text
from agent.leases.answers import (
    ChangeKind,
    Granted,
    Hold,
    Queued,
    Refusal,
    Refused,
    Released,
)
from agent.leases.asks import Ask, InvalidAsk
from agent.leases.containers import Container
from agent.leases.holders import LeaseState
from agent.leases.labels import labels_for
from agent.leases.settings import LeaseSettings
from agent.leases.table import LeaseTable
from agent.leases.view import UnitState

from .nodes import T0, build_node, builtin, cid, granted, healthy, leased_container, names, sick

AT = utc_text(T0)


def _table(gpus: int = 4, settings: LeaseSettings | None = None) -> LeaseTable:
    node = build_node([0] * (gpus // 2) + [1] * (gpus - gpus // 2))
    return LeaseTable(node, healthy(node), settings, now_s=T0)


def _refused(table: LeaseTable, ask: Ask, at: float = T0) -> Refused:
    answer = table.ask(ask, at).answer
    assert isinstance(answer, Refused), answer
    assert answer.text.isprintable()
    return answer


def _running(table: LeaseTable, n: int, devices: str, at: float = T0) -> str:
    """Lease ``devices`` to container ``n``, created and started at ``at``."""
    grant = granted(table.ask(Ask(devices=devices), at))
    container = leased_container(n, grant.lease, running=True)
    assert table.created(container, at).answer.allowed
    assert table.started(container, at).answer.allowed
    return grant.lease.id


def test_a_grant_is_pending_for_60_s_and_says_how_to_use_it() -> None:
    table = _table()
    outcome = table.ask(Ask(count=1, owner=(("user", "alice"),)), T0)
    grant = granted(outcome)
    lease = grant.lease
    assert (lease.id, lease.state, lease.until_s, lease.since_s) == (
        "lease-1",
        LeaseState.PENDING,
        T0 + 60,
        T0,
    )
    assert lease.owner == (("user", "alice"),)
    assert lease.asked == "1 GPU"
    assert grant.units[0].sharing == 1
    assert grant.units[0].sharers == 1
    assert grant.dev == lease.units[0]  # the UUID
    assert grant.text == (
        "granted lease-1 (1 GPU): GPU 0; NUMA node 0; create its container with its labels "
        "within 60 s"
    )
    assert [c.kind for c in outcome.changes] == [ChangeKind.GRANTED]
    assert labels_for(lease)["nvidia-docker.lease"] == "lease-1"
    assert table.view().unit("0").state is UnitState.PENDING
    assert table.next_deadline_s() == T0 + 60


def test_a_pending_lease_expires_at_60_s_and_its_gpu_is_free_again() -> None:
    table = _table()
    granted(table.ask(Ask(devices="2"), T0))
    assert table.tick(T0 + 59.9).changes == ()
    (change,) = table.tick(T0 + 60).changes
    assert change.kind is ChangeKind.EXPIRED
    assert change.text == (
        "lease-1 expired: no container was created with it within 60 s; GPU 2 is free again"
    )
    assert table.view().unit("2").state is UnitState.FREE
    assert table.next_deadline_s() is None


def test_the_pending_time_is_a_setting() -> None:
    table = _table(settings=LeaseSettings(pending_s=5))
    granted(table.ask(Ask(), T0))
    assert [c.kind for c in table.tick(T0 + 5).changes] == [ChangeKind.EXPIRED]


def test_a_clock_that_goes_back_is_held_at_the_latest_time() -> None:
    table = _table()
    table.tick(T0 + 100)
    grant = granted(table.ask(Ask(), T0))
    assert grant.lease.since_s == T0 + 100
    assert table.view().now_s == T0 + 100


@pytest.mark.parametrize(
    ("ask", "field", "line"),
    [
        (Ask(devices="0", mig_profile="1g.18gb"), "devices", "name devices or a MIG profile"),
        (Ask(devices=""), "devices", "name the devices (indices or UUIDs), or ask for a count"),
        (Ask(devices="*"), "devices", "name the devices"),
        (Ask(count=0), "count", "count must be 1 to 64: 0"),
        (Ask(count=65), "count", "count must be 1 to 64: 65"),
        (Ask(mig_profile="big"), "mig_profile", "not a MIG profile: 'big' (like 1g.18gb)"),
        (Ask(wait_s=-1), "wait_s", "wait must be a number of seconds >= 0: -1"),
        (Ask(wait_s=math.nan), "wait_s", "wait must be a number of seconds >= 0: nan"),
        (Ask(owner=(("a", "1"), ("a", "2"))), "owner", "an owner label is given twice"),
        (Ask(owner=(("bad key", "1"),)), "owner", "owner label key 'bad key'"),
        (Ask(owner=(("k", "v\n"),)), "owner", "owner label k: at most 128 printable"),
        (Ask(owner=tuple((f"k{i}", "v") for i in range(17))), "owner", "at most 16 owner"),
        (Ask(devices="9"), "devices", "invalid device: 9"),
        (Ask(devices="0:1"), "devices", "invalid device: 0:1 (GPU 0 is not in MIG mode)"),
    ],
)
def test_an_invalid_ask_is_refused_with_its_field_and_changes_nothing(
    ask: Ask, field: str, line: str
) -> None:
    table = _table()
    granted(table.ask(Ask(devices="3"), T0))
    before = table.view()
    with pytest.raises(InvalidAsk) as caught:
        table.ask(ask, T0 + 61)  # the pending lease would expire: nothing changes at all
    assert caught.value.field == field
    assert str(caught.value).startswith("invalid ask: ")
    assert line in str(caught.value)
    assert table.view() == before


def test_not_enough_names_what_is_taken_by_which_container_since_when() -> None:
    table = _table()
    _running(table, 1, "0 1")
    table.ask(Ask(devices="2", owner=(("user", "bob"),)), T0)
    refusal = _refused(table, Ask(count=2))
    assert refusal.kind is Refusal.NOT_ENOUGH
    assert refusal.text == (
        "not enough free GPUs: asked for 2, 1 free (GPU 3); taken: GPU 0, GPU 1 by container "
        f"0001abababab (lease-1) since {AT}; GPU 2 pending for lease-2, user=bob since {AT}, "
        f"until {utc_text(T0 + 60)}; ask for fewer, or ask to wait"
    )
    assert [(t.unit, t.hold, t.container_id) for t in refusal.taken] == [
        ("0", Hold.RUNNING, cid(1)),
        ("1", Hold.RUNNING, cid(1)),
        ("2", Hold.PENDING, None),
    ]


def test_not_enough_names_the_unhealthy_gpus_too() -> None:
    node = build_node([0, 0])
    table = LeaseTable(node, [healthy(node)[0], sick("row remapping failed")], now_s=T0)
    refusal = _refused(table, Ask(count=2))
    assert refusal.text == (
        "not enough free GPUs: asked for 2, 1 free (GPU 0); taken: GPU 1 unhealthy since "
        f"{AT}: row remapping failed; ask for fewer, or ask to wait"
    )


def test_unhealthy_gpus_are_never_leased() -> None:
    node = build_node([0, 0])
    table = LeaseTable(node, [healthy(node)[0], sick()], now_s=T0)
    assert names(granted(table.ask(Ask(), T0))) == ["0"]
    assert _refused(table, Ask()).kind is Refusal.NOT_ENOUGH
    refusal = _refused(table, Ask(devices="1", wait_s=60))  # not queued: named and unhealthy
    assert refusal.kind is Refusal.UNHEALTHY
    assert refusal.text == (
        f"unhealthy device: GPU 1 unhealthy since {AT}: XID 79 (GPU has fallen off the bus); "
        "choose another GPU"
    )
    assert table.view().waiting == ()


def test_named_devices_held_by_a_container_are_refused_with_the_holder() -> None:
    table = _table()
    _running(table, 1, "1")
    refusal = _refused(table, Ask(devices="0 1"))
    assert refusal.kind is Refusal.TAKEN
    assert refusal.text == (
        f"devices taken: GPU 1 by container 0001abababab (lease-1) since {AT}; ask for other "
        "devices, for a count, or ask to wait"
    )


def test_named_devices_held_by_a_foreign_container_are_refused_with_how_it_got_them() -> None:
    table = _table()
    foreign = Container(cid(7), True, devices=("/dev/nvidia2",), how="--device /dev/nvidia2")
    table.started(foreign, T0)
    refusal = _refused(table, Ask(devices="GPU-00000002"))
    assert refusal.text == (
        f"devices taken: GPU 2 by foreign container 0007abababab (--device /dev/nvidia2) since "
        f"{AT}; ask for other devices, for a count, or ask to wait"
    )
    assert table.view().unit("2").state is UnitState.FOREIGN


def test_stopped_containers_are_named_with_the_end_of_their_grace() -> None:
    table = _table()
    _running(table, 1, "0")
    table.died(cid(1), T0 + 10)
    refusal = _refused(table, Ask(devices="0"), T0 + 10)
    assert refusal.text == (
        f"devices taken: GPU 0 by container 0001abababab (lease-1), not running, since {AT}, until "
        f"{utc_text(T0 + 610)}; ask for other devices, for a count, or ask to wait"
    )


def test_a_long_list_of_holders_is_cut_and_counted() -> None:
    node = build_node([0] * 12)
    table = LeaseTable(node, healthy(node), now_s=T0)
    for n in range(10):
        _running(table, n + 1, str(n))
    refusal = _refused(table, Ask(count=3))
    assert refusal.text.count(" by container ") == 8
    assert "; and 2 more (list the leases); ask for fewer, or ask to wait" in refusal.text
    assert len(refusal.taken) == 10


def test_sharing_lets_n_leases_share_a_gpu_and_every_answer_says_so() -> None:
    table = _table(2, LeaseSettings(sharing=2))
    one = granted(table.ask(Ask(devices="0", exclusive=False), T0))
    two = granted(table.ask(Ask(devices="0", exclusive=False), T0))
    assert (one.units[0].sharing, one.units[0].sharers) == (2, 1)
    assert (two.units[0].sharing, two.units[0].sharers) == (2, 2)
    assert "GPU 0 shared (2 of 2)" in two.text
    assert two.lease.asked == "devices 0, shared"
    refusal = _refused(table, Ask(devices="0", exclusive=False))
    assert refusal.text.startswith(
        f"devices taken (to share): GPU 0 pending shared for lease-1 since {AT}"
    )
    assert _refused(table, Ask(devices="0")).kind is Refusal.TAKEN  # exclusive: not beside
    granted(table.ask(Ask(devices="1"), T0))
    assert _refused(table, Ask(devices="1", exclusive=False)).kind is Refusal.TAKEN


def test_a_shared_count_ask_takes_gpus_with_room() -> None:
    table = _table(2, LeaseSettings(sharing=2))
    granted(table.ask(Ask(devices="0"), T0))  # exclusive: no room on GPU 0
    assert names(granted(table.ask(Ask(exclusive=False), T0))) == ["1"]
    assert names(granted(table.ask(Ask(exclusive=False), T0))) == ["1"]
    refusal = _refused(table, Ask(exclusive=False))
    assert refusal.text.startswith("not enough free GPUs to share: asked for 1, 0 free;")


def test_the_sharing_count_can_be_set_per_gpu_by_index_or_uuid() -> None:
    node = build_node([0, 0, 0])
    settings = LeaseSettings(gpu_sharing=(("1", 3), (node.devices[2].uuid or "", 2)))
    table = LeaseTable(node, healthy(node), settings, now_s=T0)
    assert [u.sharing for u in table.view().units] == [1, 3, 2]
    with pytest.raises(ValueError, match="sharing count of 0 must be 1 to 64: 65"):
        LeaseSettings(gpu_sharing=(("0", 65),))


def test_release_ends_a_pending_lease_and_refuses_unknown_and_running_ones() -> None:
    table = _table()
    grant = granted(table.ask(Ask(devices="1"), T0))
    outcome = table.release(grant.lease.id, T0 + 1)
    assert isinstance(outcome.answer, Released)
    assert outcome.answer.text == "lease-1 released: GPU 1 is free again"
    assert [c.kind for c in outcome.changes] == [ChangeKind.ENDED]
    unknown = table.release("lease-1", T0 + 2).answer
    assert isinstance(unknown, Refused)
    assert unknown.kind is Refusal.UNKNOWN_LEASE
    assert unknown.text == (
        "no lease 'lease-1' on this node (ended, or never granted); the lease list shows what "
        "it holds"
    )
    lease_id = _running(table, 3, "2")
    running = table.release(lease_id, T0 + 3).answer
    assert isinstance(running, Refused)
    assert running.kind is Refusal.IN_USE
    assert running.text == (
        "lease-2 is in use by running container 0003abababab: it ends when the container is "
        "removed, or 600 s after it stops"
    )
    table.died(cid(3), T0 + 4)
    assert isinstance(table.release(lease_id, T0 + 5).answer, Released)
    assert table.view().unit("2").state is UnitState.FREE


def test_asked_to_wait_an_ask_is_queued_and_served_when_gpus_free() -> None:
    table = _table(2)
    first = granted(table.ask(Ask(count=2), T0))
    outcome = table.ask(Ask(count=1, wait_s=30), T0 + 1)
    queued = outcome.answer
    assert isinstance(queued, Queued)
    assert (queued.ticket, queued.position, queued.until_s) == ("wait-1", 1, T0 + 31)
    assert queued.text.startswith(
        f"waiting for 1 GPU as wait-1, number 1 in line, until {utc_text(T0 + 31)}: not enough "
        "free GPUs: asked for 1, 0 free; taken: GPU 0, GPU 1 pending for lease-1"
    )
    assert [c.kind for c in outcome.changes] == [ChangeKind.QUEUED]
    assert table.next_deadline_s() == T0 + 31
    released = table.release(first.lease.id, T0 + 2)
    kinds = [(c.kind, c.ticket) for c in released.changes]
    assert kinds == [(ChangeKind.ENDED, None), (ChangeKind.GRANTED, "wait-1")]
    grant = released.changes[1].grant
    assert isinstance(grant, Granted)
    assert grant.lease.since_s == T0 + 2
    assert grant.lease.until_s == T0 + 62
    assert grant.text.startswith("granted lease-2 to wait-1 (1 GPU): GPU 0;")


def test_the_queue_is_first_come_first_served_and_nothing_overtakes_it() -> None:
    table = _table(2)
    lease = granted(table.ask(Ask(devices="0"), T0)).lease
    granted(table.ask(Ask(devices="1"), T0))
    big = table.ask(Ask(count=2, wait_s=100), T0).answer
    small = table.ask(Ask(count=1, wait_s=100), T0 + 1).answer
    assert isinstance(big, Queued)
    assert isinstance(small, Queued)
    assert small.position == 2
    assert small.text.startswith(
        f"waiting for 1 GPU as wait-2, number 2 in line, until {utc_text(T0 + 101)}: not "
        "enough free GPUs: asked for 1, 0 free; taken: GPU 0 pending for lease-1"
    )
    assert "ask to wait" not in small.text
    freed = table.release(lease.id, T0 + 2)  # GPU 0 frees: the small ask waits behind
    assert [c.kind for c in freed.changes] == [ChangeKind.ENDED]
    one = _table(2)
    granted(one.ask(Ask(devices="0"), T0))
    one.ask(Ask(count=2, wait_s=100), T0)
    assert _refused(one, Ask(devices="1"), T0 + 1).text.startswith(
        f"1 ask waits before this one (the first, wait-1 for 2 GPUs, since {AT}); ask to wait"
    )
    refusal = _refused(table, Ask(devices="0"), T0 + 3)  # free, but asks wait before it
    assert refusal.kind is Refusal.OTHERS_WAITING
    assert refusal.text == (
        f"2 asks wait before this one (the first, wait-1 for 2 GPUs, since {AT}); ask to wait "
        "to queue behind them"
    )
    later = table.tick(T0 + 60)  # lease-2 expires: the big ask first, then the small one waits
    assert [(c.kind, c.ticket) for c in later.changes] == [
        (ChangeKind.EXPIRED, None),
        (ChangeKind.GRANTED, "wait-1"),
    ]
    assert [w.ticket for w in table.view().waiting] == ["wait-2"]


def test_a_waiting_ask_times_out_with_what_is_taken_and_the_next_is_served_then() -> None:
    table = _table(2)
    granted(table.ask(Ask(devices="0"), T0))
    granted(table.ask(Ask(devices="1"), T0 + 20))
    table.ask(Ask(count=2, wait_s=30), T0 + 1)  # times out at T0 + 31
    table.ask(Ask(count=1, wait_s=300), T0 + 2)
    outcome = table.tick(T0 + 100)  # lease-1 expired at T0 + 60: the small one got GPU 0
    assert [(c.kind, c.ticket) for c in outcome.changes] == [
        (ChangeKind.TIMED_OUT, "wait-1"),
        (ChangeKind.EXPIRED, None),
        (ChangeKind.GRANTED, "wait-2"),
        (ChangeKind.EXPIRED, None),
    ]
    timed_out = outcome.changes[0].refusal
    assert timed_out is not None
    assert timed_out.kind is Refusal.TIMED_OUT
    assert timed_out.text.startswith(
        "wait-1 waited 30 s for 2 GPUs and got none: not enough free GPUs: asked for 2, 0 free;"
    )
    grant = outcome.changes[2].grant
    assert grant is not None
    assert names(grant) == ["0"]
    assert grant.lease.since_s == T0 + 100  # the time the table learnt it, not before


def test_a_waiting_ask_can_be_withdrawn() -> None:
    table = _table(1)
    granted(table.ask(Ask(), T0))
    table.ask(Ask(wait_s=10), T0)
    outcome = table.cancel("wait-1", T0 + 1)
    assert outcome.answer is True
    assert outcome.changes[0].text == f"wait-1 withdrawn: it waited for 1 GPU since {AT}"
    assert table.cancel("wait-1", T0 + 2).answer is False


def test_the_queue_has_a_bound_and_a_longest_wait() -> None:
    table = _table(1, LeaseSettings(max_waiting=1, max_wait_s=20))
    granted(table.ask(Ask(), T0))
    queued = table.ask(Ask(wait_s=3600), T0).answer
    assert isinstance(queued, Queued)
    assert queued.until_s == T0 + 20
    full = _refused(table, Ask(wait_s=10))
    assert full.kind is Refusal.QUEUE_FULL
    assert full.text.startswith("1 ask waiting already, the most this node queues; not enough")
    assert full.text.endswith("; try again later")
    none = LeaseTable(build_node([0]), healthy(build_node([0])), LeaseSettings(max_wait_s=0))
    granted(none.ask(Ask(), T0))
    refusal = _refused(none, Ask(wait_s=5))
    assert refusal.kind is Refusal.NOT_ENOUGH
    assert refusal.text.endswith(f"until {utc_text(T0 + 60)}; this node queues no ask")


def test_a_waiting_ask_for_devices_that_left_the_node_is_dropped() -> None:
    node = builtin("h200x2-mig")
    table = LeaseTable(node, healthy(node), now_s=T0)
    granted(table.ask(Ask(devices="0:1"), T0))
    assert isinstance(table.ask(Ask(devices="0:1", wait_s=50), T0).answer, Queued)
    gpu0 = node.devices[0]
    changed = replace(
        node, devices=(replace(gpu0, mig_devices=gpu0.mig_devices[:1]), node.devices[1])
    )
    outcome = table.set_node(changed, healthy(changed), T0 + 1)
    kinds = [(c.kind, c.ticket) for c in outcome.changes]
    assert kinds == [(ChangeKind.REVOKED, None), (ChangeKind.DROPPED, "wait-1")]
    assert outcome.changes[0].text == (
        "lease-1 revoked before its container was created: MIG 0:1 left the node; ask again"
    )
    dropped = outcome.changes[1].refusal
    assert dropped is not None
    assert dropped.kind is Refusal.GONE
    assert dropped.text == (
        "wait-1 dropped: MIG 0:1 of devices 0:1 is no longer on this node (driver reload or MIG "
        "change); ask again"
    )


def test_a_pending_lease_on_a_gpu_that_turns_unhealthy_is_revoked() -> None:
    table = _table(2)
    granted(table.ask(Ask(devices="1"), T0))
    outcome = table.set_health([healthy(build_node([0]))[0], sick()], T0 + 1)
    (change,) = outcome.changes
    assert change.kind is ChangeKind.REVOKED
    assert change.text == (
        f"lease-1 revoked before its container was created: GPU 1 unhealthy since {AT}: XID 79 "
        "(GPU has fallen off the bus); ask again"
    )
    with pytest.raises(ValueError, match="health of 1 GPUs for a node of 2 GPUs"):
        table.set_health([sick()], T0)


def test_a_gpu_that_heals_serves_the_waiting_ask() -> None:
    node = build_node([0])
    table = LeaseTable(node, [sick()], now_s=T0)
    assert isinstance(table.ask(Ask(wait_s=60), T0).answer, Queued)
    outcome = table.set_health(healthy(node), T0 + 5)
    assert [(c.kind, c.ticket) for c in outcome.changes] == [(ChangeKind.GRANTED, "wait-1")]
