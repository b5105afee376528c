"""GPU health: the rule that turns the worker's events and checks into healthy or unhealthy.

The GPU worker reports NVML's events (``HealthEvent``: critical XID errors, double-bit ECC
errors) and one check per GPU per sweep (``DeviceCheck``): ``agent.gpu.health``.

``HealthTracker`` keeps, per GPU, the critical event that made it unhealthy (sticky) and the
condition the last check found (not sticky). A GPU is unhealthy while either holds; the
event is the reason shown when both do. An event is cleared only by a reset that happens
after it: the GPU stops answering and answers again (a GPU reset or a driver reload does
that), or its volatile double-bit ECC counter goes down (only a reset clears it). A driver
reload starts a new tracker. The XIDs that are the application's fault, not the GPU's, are
logged and change nothing (``APPLICATION_XIDS``). docs/node-life.md is the operator's page.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agent.gpu.health import XID, DeviceCheck, HealthEvent

# XIDs that an application causes (a bad kernel, a bad stream), not the GPU: NVIDIA's own
# device plugin for Kubernetes skips the same ones. They are logged, never held against a GPU.
APPLICATION_XIDS: dict[int, str] = {
    13: "graphics engine exception",  # a kernel's illegal instruction or out-of-range access
    31: "GPU memory page fault",  # an application touched memory it does not own
    43: "GPU stopped processing",  # the driver stopped a faulting application's channel
    45: "preemptive cleanup, due to previous errors",  # a killed process's work cleaned up
    68: "NVDEC0 exception",  # the video decoder rejected an application's stream
    109: "context switch timeout",  # an application's context did not yield in time
}

# Names of the XIDs that mean the GPU (or its driver) is in trouble, for the reason shown.
# Any other XID is critical too and shown by number.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def xid_text(xid: int) -> str:
    """``XID 79 (GPU has fallen off the bus)``; ``XID 200`` for one without a known name."""
    name = CRITICAL_XIDS.get(xid) or APPLICATION_XIDS.get(xid)
    return f"XID {xid} ({name})" if name else f"XID {xid}"


def event_text(event: HealthEvent) -> str:
    """The event in words: ``XID 79 (GPU has fallen off the bus)``, ``double-bit ECC error``."""
    if event.kind == XID and event.xid is not None:
        return xid_text(event.xid)
    return "double-bit ECC error"


def is_application_error(event: HealthEvent) -> bool:
    """An XID an application caused: logged, never held against the GPU."""
    return event.kind == XID and event.xid in APPLICATION_XIDS


def check_problem(check: DeviceCheck) -> str | None:
    """The condition ``check`` found that makes the GPU unhealthy now, in words; None when
    there is none."""
    if not check.answering:
        return "GPU is lost (not answering: fallen off the bus?)"
    if check.row_remap_failure:
        return "row remapping failed (the GPU needs service)"
    if check.row_remap_pending:
        return "row remapping pending (needs a GPU reset)"
    if check.retired_pages_pending:
        return "retired pages pending (needs a GPU reset)"
    return None


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """Healthy, or unhealthy with the reason, the XID (when an XID is the reason) and since."""

    healthy: bool = True
    reason: str | None = None
    xid: int | None = None
    since_s: float | None = None  # Unix time it became unhealthy


HEALTHY = DeviceHealth()


@dataclass(frozen=True, slots=True)
class HealthNote:
    """One line for the log; ``warning`` when a GPU got worse (or stays bad)."""

    text: str
    warning: bool = False


@dataclass(frozen=True, slots=True)
class _Sticky:
    """A critical event held against a GPU until a reset after it."""

    reason: str
    xid: int | None
    since_s: float
    dbe_high: int | None  # highest volatile DBE count seen since the event


@dataclass(frozen=True, slots=True)
class _Condition:
    reason: str
    since_s: float


class HealthTracker:
    """Per-GPU health of one driver's life. Not thread-safe: one owner feeds it.

    ``event`` and ``checks`` return what to log (``HealthNote``); ``health()`` is the
    current value of every GPU.
    """

    def __init__(self, count: int) -> None:
        self._count = count
        self._sticky: list[_Sticky | None] = [None] * count
        self._condition: list[_Condition | None] = [None] * count
        self._last: list[DeviceCheck | None] = [None] * count

    def health(self) -> tuple[DeviceHealth, ...]:
        return tuple(self._health(i) for i in range(self._count))

    def _health(self, index: int) -> DeviceHealth:
        sticky = self._sticky[index]
        if sticky is not None:
            return DeviceHealth(False, sticky.reason, sticky.xid, sticky.since_s)
        condition = self._condition[index]
        if condition is not None:
            return DeviceHealth(False, condition.reason, None, condition.since_s)
        return HEALTHY

    def event(self, event: HealthEvent) -> list[HealthNote]:
        index = event.index
        if not 0 <= index < self._count:
            text = f"{event_text(event)} on GPU {index}, which this node does not have: ignored"
            return [HealthNote(text)]
        if is_application_error(event):
            text = (
                f"GPU {index}: {event_text(event)}: an application's error, not the GPU's; "
                "the GPU stays healthy"
            )
            return [HealthNote(text)]
        at_s = event.at_s or time.time()
        sticky = self._sticky[index]
        if sticky is not None:
            text = f"GPU {index}: {event_text(event)} (already unhealthy: {sticky.reason})"
            return [HealthNote(text, warning=True)]
        last = self._last[index]
        self._sticky[index] = _Sticky(
            event_text(event),
            event.xid if event.kind == XID else None,
            at_s,
            last.volatile_dbe if last is not None else None,
        )
        text = (
            f"GPU {index} is unhealthy: {event_text(event)}; it is no longer handed out "
            "until a GPU reset or driver reload"
        )
        return [HealthNote(text, warning=True)]

    def checks(self, checks: Sequence[DeviceCheck], at_s: float | None = None) -> list[HealthNote]:
        now = time.time() if at_s is None else at_s
        lines: list[HealthNote] = []
        for index, check in enumerate(checks[: self._count]):
            lines += self._check(index, check, now)
        return lines

    def _check(self, index: int, check: DeviceCheck, now: float) -> list[HealthNote]:
        before = self._health(index)
        last = self._last[index]
        self._last[index] = check
        sticky = self._sticky[index]
        if sticky is not None:
            reset = last is not None and not last.answering and check.answering
            if check.volatile_dbe is not None:
                if sticky.dbe_high is not None and check.volatile_dbe < sticky.dbe_high:
                    reset = True
                elif sticky.dbe_high is None or check.volatile_dbe > sticky.dbe_high:
                    self._sticky[index] = replace(sticky, dbe_high=check.volatile_dbe)
            if reset:
                self._sticky[index] = None
        problem = check_problem(check)
        condition = self._condition[index]
        if problem is None:
            self._condition[index] = None
        elif condition is None or condition.reason != problem:
            self._condition[index] = _Condition(problem, now)
        after = self._health(index)
        if after == before:
            return []
        if after.healthy:
            if sticky is not None and self._sticky[index] is None:
                text = (
                    f"GPU {index} answers again after a reset, with no new critical event: "
                    f"healthy again (was: {before.reason})"
                )
                return [HealthNote(text)]
            return [HealthNote(f"GPU {index} is healthy again (was: {before.reason})")]
        if before.healthy:
            text = f"GPU {index} is unhealthy: {after.reason}; it is no longer handed out"
            return [HealthNote(text, warning=True)]
        text = f"GPU {index} is still unhealthy: {after.reason} (was: {before.reason})"
        return [HealthNote(text, warning=True)]


def utc_text(at_s: float) -> str:
    """``2026-11-30T13:17:38Z``: a health time as JSON and the log show it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at_s))
