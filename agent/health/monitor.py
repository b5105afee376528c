"""The daemon's view of its GPUs' health, fed by the GPU worker's pushes.

The worker pushes NVML events and health sweeps (``agent.gpu.worker``); this module runs
them through the health rule (``agent.health.rule.HealthTracker``) under the
``--health-checks`` policy, logs every change on one line, and calls ``on_change`` when a
GPU's health changed, so that the daemon serves new facts (``/gpu/health``, and
``/docker/cli``, ``/mesos/cli`` without the unhealthy GPUs and MIG devices). A driver reload
starts afresh (``follow(worker, fresh=True)``): a reload resets the GPUs; a new worker of
the same driver keeps what is known, with its node's MIG devices. Pushes of a worker that is
no longer followed are ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from agent.gpu import worker_protocol as wp
from agent.gpu.model import MigDevice, NodeInfo
from agent.gpu.worker_client import WorkerClient
from agent.health.policy import DEFAULT_POLICY, HealthPolicy
from agent.health.rule import DeviceHealth, HealthTracker

log = logging.getLogger("nvidia-docker-plugin.health")


class HealthView(Protocol):
    """Each GPU's health and last XID now, as ``/metrics`` reads them (``HealthMonitor``)."""

    @property
    def health(self) -> tuple[DeviceHealth, ...]: ...

    @property
    def last_xids(self) -> tuple[int, ...]: ...


class HealthMonitor:
    def __init__(
        self,
        count: int,
        *,
        on_change: Callable[[], None],
        on_driver_error: Callable[[int], None],
        policy: HealthPolicy = DEFAULT_POLICY,
    ) -> None:
        self._policy = policy
        self._tracker = HealthTracker(count, policy=policy)
        if policy != DEFAULT_POLICY:
            log.info("GPU health checks: %s (--health-checks)", policy)
        self._last_xid = [0] * count  # the last XID each GPU reported, 0: none (for /metrics)
        self._on_change = on_change
        self._on_driver_error = on_driver_error
        self._worker: WorkerClient | None = None
        self._followed = False  # a worker was followed before (its reset counts are gone)

    @property
    def health(self) -> tuple[DeviceHealth, ...]:
        return self._tracker.health()

    @property
    def last_xids(self) -> tuple[int, ...]:
        """The last XID each GPU reported since the driver was loaded (0: none), the
        application's ones too: what dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS`` shows."""
        return tuple(self._last_xid)

    def follow(self, worker: WorkerClient, *, fresh: bool = False) -> None:
        """Take health from ``worker`` from now on; ``fresh``: a new driver, a new start."""
        node = worker.node_info()
        if fresh:
            if any(not h.healthy or h.migs for h in self._tracker.health()):
                log.info("The driver was reloaded: every GPU's health starts afresh")
            self._tracker = HealthTracker(
                len(node.devices), policy=self._policy, mig_layout=_layout(node)
            )
            self._last_xid = [0] * len(node.devices)
        else:
            self._tracker.relayout(_layout(node))
            if self._followed:
                self._tracker.rebase()  # the new worker counts resets from 0
        self._followed = True
        self._worker = worker
        worker.set_push_handler(lambda message: self._on_push(worker, message))

    def forget(self) -> None:
        """The worker is being stopped: its last pushes mean nothing."""
        self._worker = None

    def _on_push(self, worker: WorkerClient, message: dict[str, Any]) -> None:
        if worker is not self._worker:
            return
        kind = message.get("push")
        before = self._tracker.health()
        try:
            if kind == wp.PUSH_EVENT:
                event = wp.decode_event(message["event"])
                if event.xid is not None and 0 <= event.index < len(self._last_xid):
                    self._last_xid[event.index] = event.xid
                lines = self._tracker.event(event)
            elif kind == wp.PUSH_CHECKS:
                checks = [wp.decode_check(check) for check in message["checks"]]
                lines = self._tracker.checks(checks)
            elif kind == wp.PUSH_DRIVER_ERROR:
                code = message.get("code")
                self._on_driver_error(code if isinstance(code, int) else -1)
                return
            else:
                return
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            log.debug("A health message of the GPU worker could not be read: %s", err)
            return
        after = self._tracker.health()
        for note in lines:
            log.log(logging.WARNING if note.warning else logging.INFO, "%s", note.text)
        if after != before:
            self._on_change()


def _layout(node: NodeInfo) -> list[tuple[MigDevice, ...]]:
    return [device.mig_devices for device in node.devices]
