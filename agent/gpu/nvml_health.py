"""GPU health from NVML: the event watch and the per-sweep checks (``agent.gpu.health``).

- ``NvmlEventWatch.register(handles)`` creates one NVML event set and registers every GPU
  for the critical XID and double-bit ECC events it supports
  (``nvmlDeviceGetSupportedEventTypes``); ``wait`` is ``nvmlEventSetWait``, run by one
  thread of the worker. A GPU that supports neither is logged once and left to the checks.
  On a GPU in MIG mode an event carries the GPU instance and compute instance the driver
  attributes it to (``gpuInstanceId``, ``computeInstanceId``; ``0xFFFFFFFF``: none).
- ``check_device(handle)`` is one sweep of one GPU: does it answer (power draw, as the
  status read), row remapping (``nvmlDeviceGetRemappedRows``: failure, pending), retired
  pages pending (``nvmlDeviceGetRetiredPagesPendingStatus``, the pre-Ampere mechanism), the
  volatile double-bit ECC count (a reset clears it) and the recovery action the driver asks
  for (field value ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, on drivers that have it). "Not
  supported" counts as "no".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from agent.gpu import nvml_query as nvml
from agent.gpu.health import DOUBLE_BIT_ECC, XID, DeviceCheck, HealthEvent
from agent.gpu.nvml_telemetry import field_values

log = logging.getLogger(__name__)

EVENT_XID_CRITICAL = 0x0000000000000008  # nvmlEventTypeXidCriticalError
EVENT_DOUBLE_BIT_ECC = 0x0000000000000002  # nvmlEventTypeDoubleBitEccError
WATCHED_EVENTS = EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC
ERROR_TIMEOUT = 10  # NVML_ERROR_TIMEOUT: nvmlEventSetWait had nothing to deliver
MEMORY_ERROR_UNCORRECTED = 1  # nvmlMemoryErrorType_t
VOLATILE_ECC = 0  # nvmlEccCounterType_t
ENABLED = 1  # nvmlEnableState_t: retired pages pending
NO_INSTANCE = 0xFFFFFFFF  # an event's gpuInstanceId/computeInstanceId: not a MIG instance's
FI_GET_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION


class NvmlEventWatch:
    """One NVML event set with every GPU that can deliver the watched events."""

    def __init__(self, event_set: Any, registered: dict[int, int]) -> None:
        self._set = event_set
        self.registered = registered  # GPU index -> event mask
        self._failed_logged = False

    @classmethod
    def register(cls, handles: Sequence[Any | None]) -> NvmlEventWatch | None:
        """The watch for ``handles``; None (logged) when no GPU can deliver any event."""
        try:
            event_set = nvml.call("nvmlEventSetCreate")
        except nvml.NvmlCallError as err:
            log.warning("GPU events cannot be watched (%s): health comes from the checks", err)
            return None
        registered: dict[int, int] = {}
        for index, handle in enumerate(handles):
            if handle is None:
                continue
            supported = nvml.query("nvmlDeviceGetSupportedEventTypes", handle)
            mask = WATCHED_EVENTS & supported if isinstance(supported, int) else WATCHED_EVENTS
            if not mask:
                log.info("GPU %d delivers neither XID nor double-bit ECC events", index)
                continue
            outcome = nvml.attempt("nvmlDeviceRegisterEvents", handle, mask, event_set)
            if outcome.error is not None:
                log.warning(
                    "GPU %d: its events cannot be watched (%s): health comes from the checks",
                    index,
                    nvml.error_name(outcome.error),
                )
                continue
            registered[index] = mask
        if not registered:
            nvml.attempt("nvmlEventSetFree", event_set)
            return None
        log.info("Watching NVML events of GPU(s) %s: %s", _indices(registered), _kinds(registered))
        return cls(event_set, registered)

    def wait(self, timeout_s: float) -> list[HealthEvent]:
        try:
            data = nvml.call("nvmlEventSetWait", self._set, max(1, int(timeout_s * 1000)))
        except nvml.NvmlCallError as err:
            if err.code == ERROR_TIMEOUT:
                return []
            if not self._failed_logged:
                self._failed_logged = True
                log.warning("Waiting for GPU events failed (%s): the checks go on", err)
            time.sleep(timeout_s)  # a lost GPU makes every wait fail at once: do not spin
            return []
        event = _event(data)
        return [] if event is None else [event]

    def close(self) -> None:
        nvml.attempt("nvmlEventSetFree", self._set)


def _event(data: Any) -> HealthEvent | None:
    index = nvml.query("nvmlDeviceGetIndex", getattr(data, "device", None))
    event_type = getattr(data, "eventType", 0)
    if not isinstance(index, int) or not isinstance(event_type, int):
        return None
    now = time.time()
    gi = _instance(getattr(data, "gpuInstanceId", None))
    ci = _instance(getattr(data, "computeInstanceId", None)) if gi is not None else None
    if event_type & EVENT_XID_CRITICAL:
        xid = getattr(data, "eventData", None)
        number = int(xid) if isinstance(xid, int) else None
        return HealthEvent(index, XID, number, now, gpu_instance_id=gi, compute_instance_id=ci)
    if event_type & EVENT_DOUBLE_BIT_ECC:
        return HealthEvent(
            index, DOUBLE_BIT_ECC, None, now, gpu_instance_id=gi, compute_instance_id=ci
        )
    return None


def _instance(value: Any) -> int | None:
    """A MIG instance id of an event; None for ``0xFFFFFFFF`` (none) and anything odd."""
    if isinstance(value, bool) or not isinstance(value, int) or value == NO_INSTANCE:
        return None
    return value if 0 <= value < NO_INSTANCE else None


def check_device(handle: Any | None) -> DeviceCheck:
    """One health sweep of one GPU; never raises."""
    if handle is None:
        return DeviceCheck(answering=False)
    if nvml.attempt("nvmlDeviceGetPowerUsage", handle).lost:
        return DeviceCheck(answering=False)
    rows = nvml.query("nvmlDeviceGetRemappedRows", handle)
    failure = pending = False
    if isinstance(rows, list | tuple) and len(rows) == 4:
        pending, failure = bool(rows[2]), bool(rows[3])
    retired = nvml.query("nvmlDeviceGetRetiredPagesPendingStatus", handle)
    dbe = nvml.query("nvmlDeviceGetTotalEccErrors", handle, MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC)
    recovery = field_values(handle, (FI_GET_GPU_RECOVERY_ACTION,)).get(FI_GET_GPU_RECOVERY_ACTION)
    return DeviceCheck(
        answering=True,
        row_remap_failure=failure,
        row_remap_pending=pending,
        retired_pages_pending=retired == ENABLED,
        volatile_dbe=dbe if isinstance(dbe, int) and not isinstance(dbe, bool) else None,
        recovery_action=recovery,
    )


def _indices(registered: dict[int, int]) -> str:
    return ", ".join(str(i) for i in sorted(registered))


def _kinds(registered: dict[int, int]) -> str:
    masks = set(registered.values())
    kinds = []
    if any(m & EVENT_XID_CRITICAL for m in masks):
        kinds.append("critical XID errors")
    if any(m & EVENT_DOUBLE_BIT_ECC for m in masks):
        kinds.append("double-bit ECC errors")
    return ", ".join(kinds)
