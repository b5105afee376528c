"""Resets the worker sees, also between two sweeps, and what an event says of its instances."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import worker_protocol as wp
from agent.gpu.health import XID, DeviceCheck, HealthEvent
from agent.gpu.nvml_health import FI_GET_GPU_RECOVERY_ACTION
from agent.gpu.resets import ResetCounter, was_reset
from agent.health.rule import HEALTHY, HealthTracker
from tests.unit.gpu.conftest import MakeFake, StartBackend
from tests.unit.gpu.test_worker import Serve, nvml_starter, serve  # noqa: F401 - a fixture

OK = DeviceCheck()


@pytest.mark.parametrize(
    ("before", "after", "reset"),
    [
        (DeviceCheck(answering=False), OK, True),  # down, then up again
        (OK, DeviceCheck(answering=False), False),  # going down is no reset yet
        (DeviceCheck(volatile_dbe=3), DeviceCheck(volatile_dbe=0), True),
        (DeviceCheck(volatile_dbe=0), DeviceCheck(volatile_dbe=3), False),
        (DeviceCheck(volatile_dbe=3), DeviceCheck(volatile_dbe=None), False),  # unread
        (DeviceCheck(row_remap_pending=True), OK, True),  # the reset did the remap
        (DeviceCheck(retired_pages_pending=True), OK, True),
        (DeviceCheck(recovery_action=1), DeviceCheck(recovery_action=0), True),
        (DeviceCheck(recovery_action=1), DeviceCheck(recovery_action=None), False),
        (DeviceCheck(recovery_action=0), DeviceCheck(recovery_action=1), False),
        (OK, OK, False),
    ],
)
def test_what_counts_as_a_reset(before: DeviceCheck, after: DeviceCheck, reset: bool) -> None:
    assert was_reset(before, after) is reset


def test_the_counter_counts_per_gpu_and_from_threads() -> None:
    counter = ResetCounter(2)
    assert counter.observe(0, DeviceCheck(recovery_action=1)).resets == 0
    assert counter.observe(0, DeviceCheck(recovery_action=0)).resets == 1
    assert counter.observe(1, OK).resets == 0
    assert counter.observe(0, DeviceCheck(recovery_action=0)).resets == 1
    flips = [DeviceCheck(answering=False), OK] * 50

    def flap() -> None:
        for check in flips:
            counter.observe(1, check)

    threads = [threading.Thread(target=flap) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 50 <= counter.resets(1) <= 100  # every down-up pair one reset, whoever saw it


def test_an_event_carries_its_mig_instances(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    watch = start_backend(fake).event_watch()
    assert watch is not None
    fake.emit_xid(0, 94, gpu_instance=5, compute_instance=0)
    fake.emit_xid(1, 79)  # 0xFFFFFFFF: the whole GPU
    fake.emit_xid(0, 31, gpu_instance=13)  # an instance, no compute instance
    events = [event for _ in range(3) for event in watch.wait(1)]
    assert [(e.index, e.xid, e.gpu_instance_id, e.compute_instance_id) for e in events] == [
        (0, 94, 5, 0),
        (1, 79, None, None),
        (0, 31, 13, None),
    ]


def test_the_check_reads_the_recovery_action(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    backend = start_backend(fake)
    assert backend.health_check(0).recovery_action is None  # a driver without the field
    fake.field_values[0][FI_GET_GPU_RECOVERY_ACTION] = 1
    assert backend.health_check(0).recovery_action == 1
    fake.field_values[0][FI_GET_GPU_RECOVERY_ACTION] = 0
    assert backend.health_check(0).recovery_action == 0


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


class Fed:
    """The worker's pushes, fed to a health tracker as the daemon's monitor does."""

    def __init__(self, count: int) -> None:
        self.tracker = HealthTracker(count)
        self.events: list[HealthEvent] = []
        self.checks: list[list[DeviceCheck]] = []

    def __call__(self, message: dict[str, Any]) -> None:
        if message["push"] == wp.PUSH_EVENT:
            event = wp.decode_event(message["event"])
            self.events.append(event)
            self.tracker.event(event)
        elif message["push"] == wp.PUSH_CHECKS:
            checks = [wp.decode_check(c) for c in message["checks"]]
            self.checks.append(checks)
            self.tracker.checks(checks)


async def test_a_reset_between_two_sweeps_is_seen(
    make_fake: MakeFake,
    serve: Serve,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    """XID 119: the driver asks for a GPU reset; the reset happens and the GPU never stops
    answering for a sweep to see: the recovery action going back to none shows it."""
    fake = make_fake("h200")
    fake.field_values[0][FI_GET_GPU_RECOVERY_ACTION] = 0
    client, _ = await serve(nvml_starter(fake, tmp_path), interval_s=0.02)
    fed = Fed(1)
    client.set_push_handler(fed)
    await _until(lambda: bool(fed.checks), "the first sweep")
    await _until(lambda: bool(fake.event_sets) and bool(fake.event_sets[0].masks), "the watch")
    fake.field_values[0][FI_GET_GPU_RECOVERY_ACTION] = 1  # with the XID, the driver asks
    fake.emit_xid(0, 119)
    await _until(lambda: bool(fed.events), "the event")
    assert fed.events[0].resets == 0
    assert not fed.tracker.health()[0].healthy
    fake.field_values[0][FI_GET_GPU_RECOVERY_ACTION] = 0  # reset: nothing asked any more
    await _until(lambda: fed.tracker.health()[0] == HEALTHY, "healthy after the reset")
    assert fed.checks[-1][0].resets == 1
    assert all(check[0].answering for check in fed.checks)  # never seen down


async def test_a_reset_just_before_an_event_does_not_clear_it(
    make_fake: MakeFake,
    serve: Serve,  # noqa: F811 - the fixture
    tmp_path: Path,
) -> None:
    fake = make_fake("h200")
    fake.field_values[0][FI_GET_GPU_RECOVERY_ACTION] = 1  # a reset is wanted (an old error)
    client, _ = await serve(nvml_starter(fake, tmp_path), interval_s=0.02)
    fed = Fed(1)
    client.set_push_handler(fed)
    await _until(lambda: bool(fed.checks), "the first sweep")
    await _until(lambda: bool(fake.event_sets) and bool(fake.event_sets[0].masks), "the watch")
    fake.field_values[0][FI_GET_GPU_RECOVERY_ACTION] = 0  # the reset...
    fake.emit_xid(0, 48)  # ... and at once a new critical XID, before any sweep
    await _until(lambda: bool(fed.events), "the event")
    assert fed.events[0].resets == 1  # the check at the event saw the reset first
    await _until(
        lambda: fed.checks[-1][0] == DeviceCheck(recovery_action=0, volatile_dbe=0, resets=1),
        "a sweep after the reset (checks are pushed when they change)",
    )
    health = fed.tracker.health()[0]
    assert (health.healthy, health.xid) == (False, 48)
    assert fed.events[0].kind == XID
