"""Idle GPUs: units held by someone with no work on them for ``idle_after_s`` (a pure model).

A unit is *active* in a sweep when its utilisation is above 0 or a GPU process of one of its
holders runs on it, and also when the sweep could not tell (``UnitSample.active``: no
utilisation reading of a whole GPU, a GPU that did not answer, a process on a MIG GPU that
the attribution cannot place); a holder whose unit has not been active since
``idle_since_s`` for ``idle_after_s`` is *idle*. Durations are measured on a monotonic
clock, so a wall clock set back or forward changes no idle time; ``idle_since_s`` is the
wall time that many seconds before the sweep. An idle spell starts afresh when sweeps were
missed for longer than ``max_gap_s`` (the status could not be read: nothing is known of
that time), when a lease's container starts running again after a sweep saw it not running,
and when the agent starts (the tracker keeps nothing across runs).

The policy says what then happens, per node (``--idle-policy``), and per container through
its ``nvidia-docker.idle`` label:

- ``notify`` (the default): one log line and the metric ``nvidia_docker_gpu_idle_seconds``;
- ``release``: as ``notify``, and a lease whose container is stopped ends at once (its
  grace time is not waited for);
- ``stop``: as ``notify``, and the container is stopped through its engine's API;
- ``off`` (a label only): never acted on, not even reported as idle. The opt-out.

``IdleTracker.observe`` returns the holders that became idle at that sweep, once each until
their unit is active again: the daemon acts on those (``agent.usage.ledger``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from agent.usage.accounting import Holder, UnitSample

IDLE_LABEL = "nvidia-docker.idle"


class IdlePolicy(enum.StrEnum):
    NOTIFY = "notify"
    RELEASE = "release"
    STOP = "stop"
    OFF = "off"  # a container's opt-out


@dataclass(frozen=True, slots=True)
class IdleUnit:
    """A holder idle on a unit, and the policy that applies to it."""

    unit: str
    gpu_index: int
    gpu_uuid: str
    mig_uuid: str | None
    holder: Holder
    idle_since_s: float  # Unix seconds: idle_s before the sweep that found it
    policy: IdlePolicy
    idle_s: float = 0.0  # how long it had been idle at that sweep (monotonic seconds)


def policy_of(holder: Holder, node_policy: IdlePolicy) -> IdlePolicy:
    """The holder's label when it names a policy, else the node's."""
    label = (holder.idle_policy or "").strip().lower()
    try:
        return IdlePolicy(label) if label else node_policy
    except ValueError:
        return node_policy


class IdleTracker:
    def __init__(
        self, idle_after_s: float, policy: IdlePolicy, *, max_gap_s: float = math.inf
    ) -> None:
        self.idle_after_s = idle_after_s
        self.policy = policy
        self.max_gap_s = max_gap_s
        # (unit key, holder ident): the monotonic seconds its idle spell started at
        self._since: dict[tuple[str, str], float] = {}
        self._told: set[tuple[str, str]] = set()  # became idle, not active since
        self._stopped: set[tuple[str, str]] = set()  # a lease seen not running at the last sweep
        self._last_mono: float | None = None
        self._idle: tuple[IdleUnit, ...] = ()

    @property
    def idle(self) -> tuple[IdleUnit, ...]:
        """Every idle holder at the last sweep (``off`` ones left out)."""
        return self._idle

    def observe(
        self, t_s: float, units: Sequence[UnitSample], *, mono_s: float | None = None
    ) -> tuple[IdleUnit, ...]:
        """Take one sweep, made at Unix time ``t_s`` and at ``mono_s`` on a monotonic clock
        (``t_s`` when not given); return the holders that became idle at it."""
        mono = t_s if mono_s is None else mono_s
        last, self._last_mono = self._last_mono, mono
        if last is not None and not 0.0 <= mono - last <= self.max_gap_s:
            # Sweeps were missed (the status could not be read): the units may have worked
            # meanwhile, so every spell starts afresh.
            self._since.clear()
            self._told.clear()
        present: set[tuple[str, str]] = set()
        idle: list[IdleUnit] = []
        new: list[IdleUnit] = []
        for sample in units:
            unit_key = sample.mig_uuid or sample.gpu_uuid
            for holder in sample.holders:
                slot = (unit_key, holder.ident)
                present.add(slot)
                if holder.running is False:
                    self._stopped.add(slot)
                elif slot in self._stopped:
                    # its container runs again (restarted): what it did before is no sign
                    self._stopped.discard(slot)
                    self._since.pop(slot, None)
                    self._told.discard(slot)
                if sample.active:
                    self._since.pop(slot, None)
                    self._told.discard(slot)
                    continue
                idle_s = mono - self._since.setdefault(slot, mono)
                policy = policy_of(holder, self.policy)
                if policy is IdlePolicy.OFF or not idle_s >= self.idle_after_s:
                    continue
                found = IdleUnit(
                    sample.unit, sample.gpu_index, sample.gpu_uuid, sample.mig_uuid,
                    holder, t_s - idle_s, policy, idle_s,
                )  # fmt: skip
                idle.append(found)
                if slot not in self._told:
                    self._told.add(slot)
                    new.append(found)
        for slot in [s for s in self._since if s not in present]:
            del self._since[slot]
        self._told &= present
        self._stopped &= present
        self._idle = tuple(idle)
        return tuple(new)
