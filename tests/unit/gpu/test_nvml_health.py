"""NVML health on the fake pynvml: every check, every event kind, and waits that fail."""

from __future__ import annotations

import logging

import pytest

from agent.gpu import nvml_health
from agent.gpu.health import DOUBLE_BIT_ECC, XID, DeviceCheck
from tests.unit.gpu.conftest import MakeFake, StartBackend
from tests.unit.gpu.fake_nvml import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    GPU_IS_LOST,
    Handle,
    Struct,
)


def test_checks_of_a_healthy_gpu(make_fake: MakeFake, start_backend: StartBackend) -> None:
    backend = start_backend(make_fake("h200"))
    assert backend.health_check(0) == DeviceCheck(answering=True, volatile_dbe=0)


@pytest.mark.parametrize(
    ("rows", "retired", "expected"),
    [
        ((0, 0, 0, 1), None, DeviceCheck(row_remap_failure=True, volatile_dbe=0)),
        ((5, 1, 1, 0), None, DeviceCheck(row_remap_pending=True, volatile_dbe=0)),
        ((0, 0, 0, 0), 1, DeviceCheck(retired_pages_pending=True, volatile_dbe=0)),
        ((0, 0, 0, 0), 0, DeviceCheck(volatile_dbe=0)),
    ],
)
def test_each_memory_repair_condition(
    make_fake: MakeFake,
    start_backend: StartBackend,
    rows: tuple[int, int, int, int],
    retired: int | None,
    expected: DeviceCheck,
) -> None:
    fake = make_fake("h200")
    fake.remapped_rows[0] = rows
    if retired is not None:
        fake.retired_pending[0] = retired
    assert start_backend(fake).health_check(0) == expected


def test_a_lost_gpu_and_one_nvml_cannot_open(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    fake.fail("nvmlDeviceGetHandleByIndex", GPU_IS_LOST, 1)
    backend = start_backend(fake)
    assert backend.health_check(1) == DeviceCheck(answering=False)  # no handle at all
    fake.volatile_dbe[0] = 2
    assert backend.health_check(0).volatile_dbe == 2
    fake.lose(0)
    assert backend.health_check(0) == DeviceCheck(answering=False)


def test_every_event_kind_is_read_and_others_ignored(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    backend = start_backend(fake)
    watch = backend.event_watch()
    assert watch is not None
    assert watch.registered == {
        0: EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC,
        1: EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC,
    }  # single-bit ECC errors are corrected: not watched
    assert watch.wait(0.01) == []  # NVML_ERROR_TIMEOUT: nothing to deliver
    fake.emit_xid(1, 48)
    (xid,) = watch.wait(1)
    assert (xid.index, xid.kind, xid.xid) == (1, XID, 48)
    assert xid.at_s > 0
    fake.emit_double_bit_ecc(0)
    (dbe,) = watch.wait(1)
    assert (dbe.index, dbe.kind, dbe.xid) == (0, DOUBLE_BIT_ECC, None)
    for event_set in fake.event_sets:  # a kind not watched, delivered anyway
        event_set.ready.put(Struct(device=Handle(0), eventType=EVENT_SINGLE_BIT_ECC, eventData=0))
    assert watch.wait(1) == []
    watch.close()
    assert fake.event_sets[0].freed


def test_a_failing_wait_is_logged_once_and_does_not_spin(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_fake("h200")
    watch = start_backend(fake).event_watch()
    assert watch is not None
    fake.fail("nvmlEventSetWait", GPU_IS_LOST)
    assert watch.wait(0.01) == []
    assert watch.wait(0.01) == []
    failures = [r for r in caplog.records if "Waiting for GPU events failed" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].levelno == logging.WARNING


def test_no_gpu_that_can_deliver_means_no_watch(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    fake.supported_events[0] = EVENT_SINGLE_BIT_ECC
    assert start_backend(fake).event_watch() is None
    assert all(s.freed for s in fake.event_sets)
    assert nvml_health.WATCHED_EVENTS == EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC
