"""Simulated backend: a node described by a node file, selected only with ``--simulate FILE``.

It is a real backend with the same model and the same threading contract as NVML, so the
whole agent (REST API, plugin, Mesos flags) runs on machines without a GPU. It can mimic
NVML's call costs (``timing`` in the node file) so that benchmarks see realistic latencies.

It follows its file as NVML follows the hardware (docs/node-file.md, "Events and
health"): once ``event_watch`` is asked for (the GPU worker does), the file is polled, and a
new version of it (renamed into place) updates the statuses, the health flags, and delivers
the ``events`` it has not delivered yet, each once, as ``nvmlEventSetWait`` would. Events
already in the file when the backend starts are history: NVML delivers only what happens
after it registers. An ``xid`` event 79 makes the GPU lost, as the real "fallen off the bus"
does; ``answers_again`` brings it back through a reset (one check sees it not answering).
An event with ``mig`` carries that MIG device's GPU and compute instance ids, as NVML's do
on a GPU in MIG mode; a device's ``recovery_action`` is what its checks report (a new
version of the file that sets it back to 0 is a reset no check saw the GPU down for). The
profiling values (``status.telemetry.profiling``) are served as they are: no sampling.
A device's energy counter (``status.telemetry.total_energy_mj``) starts at the file's value
and grows at the device's power draw while the backend runs, as a GPU's does, read with the
slow sample (``pcie_throughput``) as the NVML backend reads it: status serves the counter of
the device's last sample. A version of the file with another value for it starts it again
there (a driver reload).
A version that cannot be used (not a regular file, too large, too deep, not JSON, not a
node file: ``nodefile``'s bounds) is one log line, and the previous version stays in force.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from agent.gpu import nodefile
from agent.gpu.health import DOUBLE_BIT_ECC, XID, DeviceCheck, HealthEvent
from agent.gpu.model import (
    LOST_DEVICE_STATUS,
    UNKNOWN_THROUGHPUT,
    DeviceStatus,
    NodeInfo,
    PcieThroughput,
)

log = logging.getLogger(__name__)

FILE_POLL_S = 0.1  # how often the event watch looks at the file (one stat)
FALLEN_OFF_THE_BUS_XID = 79


class SimulatedBackend:
    def __init__(
        self,
        node: nodefile.NodeFile,
        source: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._node = node
        self._clock = clock
        # by device index: (the file's counter, mJ drawn since, when last sampled)
        self._energy: dict[int, tuple[int, float, float]] = {}
        self._source = source
        self._lock = threading.Lock()
        self._lost: dict[int, bool] = {}  # set by events; else the file's ``lost``
        self._resetting: set[int] = set()  # the next check sees it not answering
        self._delivered = {event.id for event in node.events}
        self._seen = _signature(Path(source))

    @classmethod
    def from_file(
        cls, name_or_path: str, *, clock: Callable[[], float] = time.monotonic
    ) -> SimulatedBackend:
        """Load a node file (or a built-in node name); raises ``NodeFileError``."""
        path = str(nodefile.resolve(name_or_path))
        return cls(nodefile.load(name_or_path), path, clock=clock)

    @property
    def name(self) -> str:
        return f"simulated ({self._source})"

    def node_info(self) -> NodeInfo:
        return self._node.info

    def _is_lost(self, index: int) -> bool:
        return self._lost.get(index, self._node.devices[index].lost)

    def device_status(self, index: int) -> DeviceStatus:
        if self._node.status_call_s:
            time.sleep(self._node.status_call_s)
        if self._is_lost(index):
            return LOST_DEVICE_STATUS
        return self._with_energy(index, self._node.devices[index].status)

    def _sample_energy(self, index: int, status: DeviceStatus) -> None:
        """Grow the device's energy counter by its draw since its previous sample."""
        telemetry = status.telemetry
        base = telemetry.total_energy_mj
        if base is None:
            return
        draw_mw = telemetry.power_mw
        if draw_mw is None:
            draw_mw = 1000 * (status.power_w or 0)
        now = self._clock()
        with self._lock:
            then_base, drawn_mj, then = self._energy.get(index, (base, 0.0, now))
            if then_base != base:  # a new file version set the counter: it starts there
                drawn_mj, then = 0.0, now
            drawn_mj += draw_mw * max(0.0, now - then)
            self._energy[index] = (base, drawn_mj, now)

    def _with_energy(self, index: int, status: DeviceStatus) -> DeviceStatus:
        """``status`` with the energy counter of the device's last sample."""
        base = status.telemetry.total_energy_mj
        with self._lock:
            sampled = self._energy.get(index)
        if base is None or sampled is None or sampled[0] != base or sampled[1] < 1.0:
            return status
        grown = replace(status.telemetry, total_energy_mj=base + int(sampled[1]))
        return replace(status, telemetry=grown)

    def pcie_throughput(self, index: int) -> PcieThroughput:
        if self._node.pcie_sample_s:
            time.sleep(self._node.pcie_sample_s)
        device = self._node.devices[index]
        if self._is_lost(index):
            return UNKNOWN_THROUGHPUT
        self._sample_energy(index, device.status)
        return device.throughput

    def health_check(self, index: int) -> DeviceCheck:
        with self._lock:
            resetting = index in self._resetting
            self._resetting.discard(index)
        device = self._node.devices[index]
        return DeviceCheck(
            answering=not (resetting or self._is_lost(index)),
            row_remap_failure=device.row_remap_failure,
            row_remap_pending=device.row_remap_pending,
            retired_pages_pending=device.retired_pages_pending,
            volatile_dbe=device.status.ecc_errors.global_,
            recovery_action=device.recovery_action,
        )

    def event_watch(self) -> SimulatedEventWatch:
        return SimulatedEventWatch(self)

    def follow_file(self) -> list[HealthEvent]:
        """Re-read the file if it changed; the new events, as NVML would deliver them.

        Each version is read once (``nodefile.load``: within its bounds, never blocking);
        one that cannot be used is one log line, and what the file said before stays in
        force until a good version comes. A half-written file gets a new signature when done.
        """
        path = Path(self._source)
        signature = _signature(path)
        if signature is None or signature == self._seen:
            return []
        self._seen = signature  # even if reading it raises: the next look waits for a change
        try:
            node = nodefile.load(str(path))
        except nodefile.NodeFileError as err:
            log.warning("%s: keeping what the file said before", err)
            return []
        if len(node.devices) != len(self._node.devices):
            log.warning(
                "%s now has %d devices, not %d: only its events are taken",
                path,
                len(node.devices),
                len(self._node.devices),
            )
        else:
            self._node = nodefile.NodeFile(
                info=self._node.info,  # static facts change only with a new driver (worker)
                devices=node.devices,
                status_call_s=node.status_call_s,
                pcie_sample_s=node.pcie_sample_s,
                events=node.events,
            )
        return self._deliver(node.events)

    def _deliver(self, events: tuple[nodefile.SimulatedEvent, ...]) -> list[HealthEvent]:
        delivered: list[HealthEvent] = []
        now = time.time()
        for event in events:
            if event.id in self._delivered or event.gpu >= len(self._node.devices):
                continue
            self._delivered.add(event.id)
            if event.kind == "answers_again":
                with self._lock:
                    self._lost.pop(event.gpu, None)
                    self._resetting.add(event.gpu)
                continue
            if event.kind == "xid" and event.xid == FALLEN_OFF_THE_BUS_XID:
                self._lost[event.gpu] = True
            kind = XID if event.kind == "xid" else DOUBLE_BIT_ECC
            gi = ci = None
            for mig in self._node.info.devices[event.gpu].mig_devices:
                if event.mig is not None and mig.index == event.mig:
                    gi, ci = mig.gpu_instance_id, mig.compute_instance_id
            delivered.append(
                HealthEvent(
                    event.gpu, kind, event.xid, now, gpu_instance_id=gi, compute_instance_id=ci
                )
            )
        return delivered

    def close(self) -> None:
        return None


class SimulatedEventWatch:
    """``nvmlEventSetWait`` for a node file: polls it, returns its new events."""

    def __init__(self, backend: SimulatedBackend) -> None:
        self._backend = backend

    def wait(self, timeout_s: float) -> list[HealthEvent]:
        deadline = time.monotonic() + timeout_s
        while True:
            events = self._backend.follow_file()
            left = deadline - time.monotonic()
            if events or left <= 0:
                return events
            time.sleep(min(FILE_POLL_S, left))

    def close(self) -> None:
        return None


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is rewritten or renamed into place; None when absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)
