"""Idle GPUs (agent.usage.idle): held units with no work for the configured time."""

from __future__ import annotations

import dataclasses

from agent.usage.accounting import Holder, UnitSample
from agent.usage.idle import IdlePolicy, IdleTracker
from agent.usage.records import HolderKind

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
TRAIN = Holder(HolderKind.LEASE, "lease-1", lease_id="lease-1", container_id="c1")
OPTED_OUT = Holder(HolderKind.CONTAINER, "c2", container_id="c2", idle_policy="off")
STOP_ME = Holder(HolderKind.CONTAINER, "c3", container_id="c3", idle_policy="Stop")


def unit(*holders: Holder, active: bool = False) -> UnitSample:
    return UnitSample("0", 0, GPU0, None, 0, 0, None, holders, active)


def test_a_holder_is_idle_once_its_unit_did_no_work_for_the_time_and_told_once() -> None:
    tracker = IdleTracker(60, IdlePolicy.NOTIFY)
    assert tracker.observe(0, [unit(TRAIN)]) == ()
    assert tracker.observe(59, [unit(TRAIN)]) == ()
    (found,) = tracker.observe(60, [unit(TRAIN)])
    assert (found.holder, found.idle_since_s, found.policy) == (TRAIN, 0, IdlePolicy.NOTIFY)
    assert tracker.observe(120, [unit(TRAIN)]) == ()  # told once
    assert [f.holder for f in tracker.idle] == [TRAIN]


def test_work_resets_the_clock_and_a_later_idle_spell_is_told_again() -> None:
    tracker = IdleTracker(60, IdlePolicy.NOTIFY)
    tracker.observe(0, [unit(TRAIN)])
    assert tracker.observe(60, [unit(TRAIN)])
    tracker.observe(70, [unit(TRAIN, active=True)])
    assert tracker.idle == ()
    assert tracker.observe(100, [unit(TRAIN)]) == ()
    assert tracker.observe(160, [unit(TRAIN)])[0].idle_since_s == 100


def test_the_label_overrides_the_node_policy_and_off_is_never_idle() -> None:
    tracker = IdleTracker(10, IdlePolicy.NOTIFY)
    tracker.observe(0, [unit(OPTED_OUT, STOP_ME)])
    found = tracker.observe(10, [unit(OPTED_OUT, STOP_ME)])
    assert [(f.holder.ident, f.policy) for f in found] == [("c3", IdlePolicy.STOP)]


def test_a_holder_that_left_is_forgotten() -> None:
    tracker = IdleTracker(10, IdlePolicy.RELEASE)
    tracker.observe(0, [unit(TRAIN)])
    tracker.observe(5, [unit()])
    assert tracker.observe(12, [unit(TRAIN)]) == ()  # back, and its clock starts again
    assert tracker.observe(22, [unit(TRAIN)])[0].idle_since_s == 12


def test_a_lease_whose_container_starts_again_starts_a_new_idle_spell() -> None:
    stopped = dataclasses.replace(TRAIN, running=False)
    running = dataclasses.replace(TRAIN, running=True)
    tracker = IdleTracker(60, IdlePolicy.STOP)
    tracker.observe(0, [unit(running)])
    tracker.observe(50, [unit(stopped)])  # docker stop
    assert tracker.observe(55, [unit(running)]) == ()  # docker start: its job loads data
    assert tracker.observe(110, [unit(running)]) == ()
    assert tracker.observe(115, [unit(running)])[0].idle_since_s == 55


def test_a_stopped_lease_stays_idle_from_before_it_stopped() -> None:
    """What ``release`` relies on: the spell goes on while its container is stopped."""
    tracker = IdleTracker(60, IdlePolicy.RELEASE)
    tracker.observe(0, [unit(dataclasses.replace(TRAIN, running=True))])
    (found,) = tracker.observe(60, [unit(dataclasses.replace(TRAIN, running=False))])
    assert found.idle_since_s == 0
