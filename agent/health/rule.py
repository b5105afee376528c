"""GPU health: the rule that turns the worker's events and checks into healthy or unhealthy.

The GPU worker reports NVML's events (``HealthEvent``: critical XID errors, double-bit ECC
errors) and one check per GPU per sweep (``DeviceCheck``): ``agent.gpu.health``.

``HealthTracker`` keeps, per GPU, the critical event that made it unhealthy (sticky) and the
condition the last check found (not sticky). A GPU is unhealthy while either holds; the
event is the reason shown when both do. An event the driver attributes to one GPU instance
of a GPU in MIG mode makes only that instance's MIG devices unhealthy (sticky as well): the
GPU and its other MIG devices stay healthy (``DeviceHealth.migs``).

An event is cleared only by a reset that happens after it: the worker counted one since the
event (``DeviceCheck.resets``: a trace the reset cleared, ``agent.gpu.resets``), the GPU
stops answering and answers again, or its volatile double-bit ECC counter goes down. A reset
of the GPU clears its MIG devices' events too. A driver reload starts a new tracker.

What counts is the ``--health-checks`` policy (``agent.health.policy``): by default every
signal, less the XIDs that are the application's fault, which are logged and change
nothing. docs/node-life.md is the operator's page.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from agent.gpu.health import XID, DeviceCheck, HealthEvent
from agent.gpu.model import MigDevice
from agent.health.policy import APPLICATION_XIDS, DEFAULT_POLICY, NONE, HealthPolicy

__all__ = ["APPLICATION_XIDS", "CRITICAL_XIDS", "HEALTHY", "DeviceHealth", "HealthTracker"]

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

# What the driver asks for, by nvmlDeviceGpuRecoveryAction_t (DeviceCheck.recovery_action).
RECOVERY_ACTIONS: dict[int, str] = {
    1: "a GPU reset",
    2: "a node reboot",
    3: "peer-to-peer traffic drained",
    4: "its work drained and a GPU reset",
    5: "its IMEX domain recovered",
    6: "a bus reset",
    7: "a system reboot",
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
    """An XID an application caused (ignored by default): logged, never held against the GPU."""
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
    action = check.recovery_action
    if action:
        wanted = RECOVERY_ACTIONS.get(action, "a recovery action")
        return f"the driver asks for {wanted} (recovery action {action})"
    return None


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """Healthy, or unhealthy with the reason, the XID (when an XID is the reason) and since.

    ``migs``: the MIG devices of a healthy GPU that are unhealthy on their own, by MIG index
    (an event the driver attributed to their GPU instance); the GPU itself and its other MIG
    devices stay healthy. ``of_mig`` says what one MIG device is.
    """

    healthy: bool = True
    reason: str | None = None
    xid: int | None = None
    since_s: float | None = None  # Unix time it became unhealthy
    migs: tuple[tuple[int, DeviceHealth], ...] = ()

    def of_mig(self, mig: int | None) -> DeviceHealth:
        """The whole GPU's health (``mig`` None), or its MIG device ``mig``'s: unhealthy when
        the GPU is, or when that MIG device is on its own."""
        if mig is None or not self.healthy:
            return self
        for index, health in self.migs:
            if index == mig:
                return health
        return HEALTHY

    @property
    def unhealthy_migs(self) -> tuple[int, ...]:
        """The MIG devices unhealthy on their own (the GPU's own health aside)."""
        return tuple(index for index, _ in self.migs)


HEALTHY = DeviceHealth()


@dataclass(frozen=True, slots=True)
class HealthNote:
    """One line for the log; ``warning`` when a GPU got worse (or stays bad)."""

    text: str
    warning: bool = False


@dataclass(frozen=True, slots=True)
class _Sticky:
    """A critical event held against a GPU (or a MIG device) until a reset after it."""

    reason: str
    xid: int | None
    since_s: float
    dbe_high: int | None  # highest volatile DBE count seen since the event
    resets: int  # the worker's reset count of the GPU when the event arrived


@dataclass(frozen=True, slots=True)
class _Condition:
    reason: str
    since_s: float


MigLayout = Sequence[Sequence[MigDevice]]  # per GPU, its MIG devices


class HealthTracker:
    """Per-GPU health of one driver's life. Not thread-safe: one owner feeds it.

    ``event`` and ``checks`` return what to log (``HealthNote``); ``health()`` is the
    current value of every GPU. ``mig_layout`` (per GPU, its MIG devices) is how an event's
    GPU instance is found; ``relayout`` follows a new one (MIG devices that left are
    forgotten).
    """

    def __init__(
        self, count: int, *, policy: HealthPolicy = DEFAULT_POLICY, mig_layout: MigLayout = ()
    ) -> None:
        self._count = count
        self._policy = policy
        self._layout: list[tuple[MigDevice, ...]] = [()] * count
        self._sticky: list[_Sticky | None] = [None] * count
        self._mig_sticky: dict[tuple[int, int], _Sticky] = {}
        self._condition: list[_Condition | None] = [None] * count
        self._last: list[DeviceCheck | None] = [None] * count
        self.relayout(mig_layout)

    def relayout(self, mig_layout: MigLayout) -> None:
        """The node's MIG devices now; the events of MIG devices no longer there go."""
        self._layout = [
            tuple(mig_layout[i]) if i < len(mig_layout) else () for i in range(self._count)
        ]
        present = {(gpu, m.index) for gpu, migs in enumerate(self._layout) for m in migs}
        self._mig_sticky = {k: v for k, v in self._mig_sticky.items() if k in present}

    def rebase(self) -> None:
        """A new GPU worker of the same driver: its reset counts start again from 0, so the
        events held count the resets after them from 0 too."""
        self._sticky = [None if s is None else replace(s, resets=0) for s in self._sticky]
        self._mig_sticky = {k: replace(s, resets=0) for k, s in self._mig_sticky.items()}

    def health(self) -> tuple[DeviceHealth, ...]:
        return tuple(self._health(i) for i in range(self._count))

    def _health(self, index: int) -> DeviceHealth:
        sticky = self._sticky[index]
        if sticky is not None:
            return DeviceHealth(False, sticky.reason, sticky.xid, sticky.since_s)
        condition = self._condition[index]
        if condition is not None:
            return DeviceHealth(False, condition.reason, None, condition.since_s)
        migs = tuple(
            (mig, DeviceHealth(False, s.reason, s.xid, s.since_s))
            for (gpu, mig), s in sorted(self._mig_sticky.items())
            if gpu == index
        )
        return DeviceHealth(migs=migs) if migs else HEALTHY

    # -- events ----------------------------------------------------------------------------

    def event(self, event: HealthEvent) -> list[HealthNote]:
        index = event.index
        if not 0 <= index < self._count:
            text = f"{event_text(event)} on GPU {index}, which this node does not have: ignored"
            return [HealthNote(text)]
        where = self._where(event)
        if not self._counts(event):
            text = f"{where}: {event_text(event)}: {self._why_ignored(event)}"
            return [HealthNote(text)]
        sticky = self._new_sticky(event)
        migs = self._migs_of(event)
        if migs:
            return self._mig_event(event, where, migs, sticky)
        held = self._sticky[index]
        if held is not None:
            text = f"GPU {index}: {event_text(event)} (already unhealthy: {held.reason})"
            return [HealthNote(text, warning=True)]
        self._sticky[index] = sticky
        text = (
            f"GPU {index} is unhealthy: {event_text(event)}; it is no longer handed out "
            "until a GPU reset or driver reload"
        )
        return [HealthNote(text, warning=True)]

    def _mig_event(
        self, event: HealthEvent, where: str, migs: tuple[int, ...], sticky: _Sticky
    ) -> list[HealthNote]:
        index = event.index
        fresh = [m for m in migs if (index, m) not in self._mig_sticky]
        for mig in fresh:
            self._mig_sticky[index, mig] = sticky
        names = ", ".join(f"{index}:{m}" for m in migs)
        if self._sticky[index] is not None or self._condition[index] is not None:
            text = f"{where}: {event_text(event)} (GPU {index} is already unhealthy)"
            return [HealthNote(text, warning=True)]
        if not fresh:
            return [HealthNote(f"{where}: {event_text(event)} (already unhealthy)", warning=True)]
        text = (
            f"MIG device {names} is unhealthy: {event_text(event)} ({where}); it is no longer "
            f"handed out until a GPU reset or driver reload; GPU {index} and its other MIG "
            "devices stay in service"
        )
        return [HealthNote(text, warning=True)]

    def _counts(self, event: HealthEvent) -> bool:
        if event.kind == XID:
            return self._policy.counts_xid(event.xid)
        return self._policy.checks  # double-bit ECC events

    def _why_ignored(self, event: HealthEvent) -> str:
        policy = self._policy
        if is_application_error(event) and policy.base != NONE and event.xid in policy.ignored:
            return "an application's error, not the GPU's; the GPU stays healthy"
        return f"ignored (--health-checks {policy}); the GPU stays healthy"

    def _new_sticky(self, event: HealthEvent) -> _Sticky:
        last = self._last[event.index]
        resets = event.resets if event.resets is not None else (last.resets if last else 0)
        return _Sticky(
            event_text(event),
            event.xid if event.kind == XID else None,
            event.at_s or time.time(),
            last.volatile_dbe if last is not None else None,
            resets,
        )

    def _migs_of(self, event: HealthEvent) -> tuple[int, ...]:
        """The MIG devices the event's instances name; () for the whole GPU (no instance
        given, or one this node does not know: then the GPU is held, to be safe)."""
        gi, ci = event.gpu_instance_id, event.compute_instance_id
        if gi is None:
            return ()
        return tuple(
            m.index
            for m in self._layout[event.index]
            if m.gpu_instance_id == gi and (ci is None or m.compute_instance_id == ci)
        )

    def _where(self, event: HealthEvent) -> str:
        gi, ci = event.gpu_instance_id, event.compute_instance_id
        if gi is None:
            return f"GPU {event.index}"
        instance = f"GPU instance {gi}" + ("" if ci is None else f", compute instance {ci}")
        return f"GPU {event.index} ({instance})"

    # -- checks ----------------------------------------------------------------------------

    def checks(self, checks: Sequence[DeviceCheck], at_s: float | None = None) -> list[HealthNote]:
        now = time.time() if at_s is None else at_s
        lines: list[HealthNote] = []
        for index, check in enumerate(checks[: self._count]):
            lines += self._check(index, check, now)
        return lines

    def _reset_clears(self, sticky: _Sticky, last: DeviceCheck | None, check: DeviceCheck) -> bool:
        if check.resets > sticky.resets:
            return True
        if last is not None and not last.answering and check.answering:
            return True
        return (
            check.volatile_dbe is not None
            and sticky.dbe_high is not None
            and check.volatile_dbe < sticky.dbe_high
        )

    @staticmethod
    def _dbe_seen(sticky: _Sticky, check: DeviceCheck) -> _Sticky:
        if check.volatile_dbe is not None and (
            sticky.dbe_high is None or check.volatile_dbe > sticky.dbe_high
        ):
            return replace(sticky, dbe_high=check.volatile_dbe)
        return sticky

    def _check(self, index: int, check: DeviceCheck, now: float) -> list[HealthNote]:
        before = self._health(index)
        last = self._last[index]
        self._last[index] = check
        sticky = self._sticky[index]
        if sticky is not None:
            cleared = self._reset_clears(sticky, last, check)
            self._sticky[index] = None if cleared else self._dbe_seen(sticky, check)
        cleared_migs: list[int] = []
        for key, held in list(self._mig_sticky.items()):
            if key[0] != index:
                continue
            if self._reset_clears(held, last, check):
                del self._mig_sticky[key]
                cleared_migs.append(key[1])
            else:
                self._mig_sticky[key] = self._dbe_seen(held, check)
        problem = check_problem(check) if self._policy.checks else None
        condition = self._condition[index]
        if problem is None:
            self._condition[index] = None
        elif condition is None or condition.reason != problem:
            self._condition[index] = _Condition(problem, now)
        after = self._health(index)
        if after == before:
            return []
        return [self._change_note(index, before, after, sticky, cleared_migs)]

    def _change_note(
        self,
        index: int,
        before: DeviceHealth,
        after: DeviceHealth,
        sticky: _Sticky | None,
        cleared_migs: list[int],
    ) -> HealthNote:
        if after.healthy and not before.healthy:
            if sticky is not None and self._sticky[index] is None:
                return HealthNote(
                    f"GPU {index} answers again after a reset, with no new critical event: "
                    f"healthy again (was: {before.reason})"
                )
            return HealthNote(f"GPU {index} is healthy again (was: {before.reason})")
        if after.healthy:  # only MIG devices changed
            names = ", ".join(f"{index}:{m}" for m in cleared_migs)
            return HealthNote(f"MIG device {names} healthy again after a reset of GPU {index}")
        if before.healthy:
            return HealthNote(
                f"GPU {index} is unhealthy: {after.reason}; it is no longer handed out",
                warning=True,
            )
        return HealthNote(
            f"GPU {index} is still unhealthy: {after.reason} (was: {before.reason})",
            warning=True,
        )


def utc_text(at_s: float) -> str:
    """``2026-11-30T13:17:38Z``: a health time as JSON and the log show it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at_s))
