"""The daemon's health monitor: worker pushes in, health and log lines out."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import pytest

from agent.gpu import nodefile
from agent.gpu import worker_protocol as wp
from agent.gpu.health import DeviceCheck, HealthEvent
from agent.gpu.model import NodeInfo
from agent.gpu.worker_client import WorkerClient
from agent.health.monitor import HealthMonitor


class StubWorker:
    """What the monitor uses of a worker client: its node, and where its pushes go."""

    def __init__(self, name: str = "h200x2") -> None:
        self._node = nodefile.load(name).info
        self.push: Callable[[dict[str, Any]], None] | None = None

    def node_info(self) -> NodeInfo:
        return self._node

    def set_push_handler(self, handler: Callable[[dict[str, Any]], None]) -> None:
        self.push = handler

    def send(self, message: dict[str, Any]) -> None:
        assert self.push is not None
        self.push(message)


def event(index: int, kind: str, xid: int | None = None) -> dict[str, Any]:
    return {"push": wp.PUSH_EVENT, "event": wp.encode_event(HealthEvent(index, kind, xid, 1.0))}


def checks(*found: DeviceCheck) -> dict[str, Any]:
    return {"push": wp.PUSH_CHECKS, "checks": [wp.encode_check(c) for c in found]}


def test_pushes_change_health_log_and_tell(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    changes: list[int] = []
    errors: list[int] = []
    monitor = HealthMonitor(2, on_change=lambda: changes.append(1), on_driver_error=errors.append)
    worker = StubWorker()
    monitor.follow(cast(WorkerClient, worker))
    worker.send(checks(DeviceCheck(), DeviceCheck()))
    assert changes == []  # nothing changed
    worker.send(event(1, "xid", 13))
    assert changes == []
    assert monitor.last_xids == (0, 13)
    worker.send(event(1, "xid", 79))
    assert changes == [1]
    assert monitor.health[1].xid == 79
    assert monitor.last_xids == (0, 79)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "GPU 1 is unhealthy: XID 79 (GPU has fallen off the bus); it is no longer handed out "
        "until a GPU reset or driver reload"
    ]
    worker.send({"push": wp.PUSH_DRIVER_ERROR, "code": 9})
    assert errors == [9]
    worker.send({"push": wp.PUSH_CHECKS, "checks": "garbage"})  # ignored, no crash
    assert monitor.health[1].xid == 79


def test_a_worker_no_longer_followed_is_not_heard_and_a_new_driver_starts_afresh() -> None:
    changes: list[int] = []
    monitor = HealthMonitor(2, on_change=lambda: changes.append(1), on_driver_error=print)
    old = StubWorker()
    monitor.follow(cast(WorkerClient, old))
    old.send(event(0, "double_bit_ecc"))
    assert not monitor.health[0].healthy
    monitor.forget()
    old.send(checks(DeviceCheck(answering=False), DeviceCheck()))
    assert len(changes) == 1  # the old worker's last words change nothing
    new = StubWorker()
    monitor.follow(cast(WorkerClient, new), fresh=True)
    assert all(h.healthy for h in monitor.health)
    assert monitor.last_xids == (0, 0)
