"""The health rule: which events and checks make a GPU unhealthy, and what makes it healthy."""

from __future__ import annotations

import pytest

from agent.gpu.health import DOUBLE_BIT_ECC, XID, DeviceCheck, HealthEvent
from agent.health.rule import APPLICATION_XIDS, HEALTHY, DeviceHealth, HealthTracker, xid_text

OK = DeviceCheck()
LOST = DeviceCheck(answering=False)


@pytest.mark.parametrize("xid", sorted(APPLICATION_XIDS))
def test_application_xids_leave_the_gpu_healthy(xid: int) -> None:
    tracker = HealthTracker(2)
    (note,) = tracker.event(HealthEvent(1, XID, xid, 100.0))
    line = note.text
    assert tracker.health() == (HEALTHY, HEALTHY)
    assert "an application's error, not the GPU's" in line
    assert f"XID {xid}" in line


def test_a_critical_xid_makes_the_gpu_unhealthy_with_reason_xid_and_time() -> None:
    tracker = HealthTracker(4)
    (note,) = tracker.event(HealthEvent(3, XID, 79, 1700000000.5))
    line = note.text
    assert tracker.health()[3] == DeviceHealth(
        healthy=False,
        reason="XID 79 (GPU has fallen off the bus)",
        xid=79,
        since_s=1700000000.5,
    )
    assert tracker.health()[:3] == (HEALTHY,) * 3
    assert line.startswith("GPU 3 is unhealthy: XID 79")


def test_an_unknown_xid_is_critical_and_shown_by_number() -> None:
    tracker = HealthTracker(1)
    tracker.event(HealthEvent(0, XID, 4242, 1.0))
    assert tracker.health()[0].reason == "XID 4242"
    assert xid_text(4242) == "XID 4242"


def test_double_bit_ecc_makes_the_gpu_unhealthy_without_an_xid() -> None:
    tracker = HealthTracker(1)
    tracker.event(HealthEvent(0, DOUBLE_BIT_ECC, None, 5.0))
    assert tracker.health()[0] == DeviceHealth(False, "double-bit ECC error", None, 5.0)


def test_a_sticky_event_survives_answering_checks_until_a_reset() -> None:
    tracker = HealthTracker(1)
    tracker.event(HealthEvent(0, XID, 48, 1.0))
    for at in (2.0, 3.0, 4.0):
        assert tracker.checks([OK], at) == []
        assert not tracker.health()[0].healthy
    # A reset: the GPU stops answering, then answers again.
    assert tracker.checks([LOST], 5.0) == []  # still unhealthy, the event stays the reason
    assert tracker.health()[0].reason == "XID 48 (double-bit ECC error)"
    (note,) = tracker.checks([OK], 6.0)
    line = note.text
    assert tracker.health()[0] == HEALTHY
    assert "answers again after a reset, with no new critical event" in line


def test_a_reset_seen_as_the_volatile_dbe_counter_going_down_clears_the_event() -> None:
    tracker = HealthTracker(1)
    tracker.checks([DeviceCheck(volatile_dbe=0)], 1.0)
    tracker.event(HealthEvent(0, DOUBLE_BIT_ECC, None, 2.0))
    tracker.checks([DeviceCheck(volatile_dbe=2)], 3.0)
    assert not tracker.health()[0].healthy
    tracker.checks([DeviceCheck(volatile_dbe=0)], 4.0)  # only a reset clears it
    assert tracker.health()[0] == HEALTHY


def test_a_lost_gpu_is_unhealthy_while_lost_and_healthy_when_it_answers() -> None:
    tracker = HealthTracker(2)
    (note,) = tracker.checks([OK, LOST], 10.0)
    line = note.text
    assert tracker.health()[1] == DeviceHealth(
        False, "GPU is lost (not answering: fallen off the bus?)", None, 10.0
    )
    assert "GPU 1 is unhealthy: GPU is lost" in line
    tracker.checks([OK, LOST], 11.0)
    assert tracker.health()[1].since_s == 10.0  # since it was first seen
    (note,) = tracker.checks([OK, OK], 12.0)
    line = note.text
    assert tracker.health() == (HEALTHY, HEALTHY)
    assert line == "GPU 1 is healthy again (was: GPU is lost (not answering: fallen off the bus?))"


@pytest.mark.parametrize(
    ("check", "reason"),
    [
        (DeviceCheck(row_remap_failure=True), "row remapping failed (the GPU needs service)"),
        (DeviceCheck(row_remap_pending=True), "row remapping pending (needs a GPU reset)"),
        (DeviceCheck(retired_pages_pending=True), "retired pages pending (needs a GPU reset)"),
    ],
)
def test_memory_repair_conditions_hold_while_the_check_finds_them(
    check: DeviceCheck, reason: str
) -> None:
    tracker = HealthTracker(1)
    tracker.checks([check], 1.0)
    assert tracker.health()[0] == DeviceHealth(False, reason, None, 1.0)
    tracker.checks([OK], 2.0)
    assert tracker.health()[0] == HEALTHY


def test_a_second_event_keeps_the_first_reason_and_time() -> None:
    tracker = HealthTracker(1)
    tracker.event(HealthEvent(0, XID, 79, 1.0))
    (note,) = tracker.event(HealthEvent(0, XID, 94, 2.0))
    line = note.text
    assert tracker.health()[0].xid == 79
    assert tracker.health()[0].since_s == 1.0
    assert "already unhealthy" in line


def test_an_event_after_the_reset_makes_it_unhealthy_again() -> None:
    tracker = HealthTracker(1)
    tracker.event(HealthEvent(0, XID, 79, 1.0))
    tracker.checks([LOST], 2.0)
    tracker.checks([OK], 3.0)
    assert tracker.health()[0] == HEALTHY
    tracker.event(HealthEvent(0, XID, 79, 4.0))
    assert tracker.health()[0].since_s == 4.0


def test_an_event_for_a_gpu_the_node_does_not_have_is_ignored() -> None:
    tracker = HealthTracker(1)
    (note,) = tracker.event(HealthEvent(5, XID, 79, 1.0))
    line = note.text
    assert tracker.health() == (HEALTHY,)
    assert "does not have" in line
