"""How the GPU worker tells that a GPU was reset, also when no sweep saw it down.

A GPU reset (``nvidia-smi -r``, a bus reset, the driver's own recovery) clears what the
GPU has kept since it was last initialised. ``ResetCounter`` compares each check of a GPU
(``DeviceCheck``) with the one before and counts a reset when:

- the GPU did not answer and answers again;
- its volatile double-bit ECC count went down (only a reset or a driver reload clears it);
- a row remapping, or a page retirement, was pending and no longer is (a reset carries it
  out);
- the driver asked for a recovery action (a GPU reset, a node reboot, ...) and no longer
  does.

So a reset between two sweeps is seen whenever the error left one of these traces, which
the driver's critical XIDs do (an ECC error counts and asks for a remap; a driver that has
the recovery action field names one for the others). The worker also checks a GPU as soon
as an event arrives for it, so that the trace is seen even when the reset follows the
event within a sweep. A reset that leaves no trace at all (an XID, on a driver without the
recovery action field, that changes nothing else) is not seen: the GPU stays unhealthy
until a driver reload.

The count is the worker's: a new worker starts again from 0, and the daemon's health
tracker takes that as the new baseline of the events it holds (``HealthTracker.rebase``).
"""

from __future__ import annotations

import threading
from dataclasses import replace

from agent.gpu.health import DeviceCheck

NO_RECOVERY = 0  # nvmlDeviceGpuRecoveryAction_t NVML_GPU_RECOVERY_ACTION_NONE


def was_reset(before: DeviceCheck, after: DeviceCheck) -> bool:
    """Whether ``after`` shows a reset of the GPU since ``before`` (the module says how)."""
    if not after.answering:
        return False
    if not before.answering:
        return True
    if (
        before.volatile_dbe is not None
        and after.volatile_dbe is not None
        and after.volatile_dbe < before.volatile_dbe
    ):
        return True
    if before.row_remap_pending and not after.row_remap_pending:
        return True
    if before.retired_pages_pending and not after.retired_pages_pending:
        return True
    return (
        before.recovery_action is not None
        and before.recovery_action != NO_RECOVERY
        and after.recovery_action == NO_RECOVERY
    )


class ResetCounter:
    """The resets seen of each GPU; shared by the worker's sweep and event threads."""

    def __init__(self, count: int) -> None:
        self._lock = threading.Lock()
        self._last: list[DeviceCheck | None] = [None] * count
        self._resets = [0] * count

    def observe(self, index: int, check: DeviceCheck) -> DeviceCheck:
        """``check`` with ``resets`` set, after counting the reset it shows, if any."""
        with self._lock:
            last = self._last[index]
            if last is not None and was_reset(last, check):
                self._resets[index] += 1
            self._last[index] = check
            return replace(check, resets=self._resets[index])

    def resets(self, index: int) -> int:
        with self._lock:
            return self._resets[index]
