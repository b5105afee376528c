"""Idle GPUs: units held by someone with no work on them for ``idle_after_s`` (a pure model).

A unit is *active* in a sweep when its utilisation is above 0 or a GPU process of one of its
holders runs on it (``UnitSample.active``); a holder whose unit has not been active since
``idle_since_s`` for ``idle_after_s`` is *idle*. The policy says what then happens, per node
(``--idle-policy``), and per container through its ``nvidia-docker.idle`` label:

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
    idle_since_s: float
    policy: IdlePolicy


def policy_of(holder: Holder, node_policy: IdlePolicy) -> IdlePolicy:
    """The holder's label when it names a policy, else the node's."""
    label = (holder.idle_policy or "").strip().lower()
    try:
        return IdlePolicy(label) if label else node_policy
    except ValueError:
        return node_policy


class IdleTracker:
    def __init__(self, idle_after_s: float, policy: IdlePolicy) -> None:
        self.idle_after_s = idle_after_s
        self.policy = policy
        self._since: dict[tuple[str, str], float] = {}  # (unit key, holder ident)
        self._told: set[tuple[str, str]] = set()  # became idle, not active since
        self._idle: tuple[IdleUnit, ...] = ()

    @property
    def idle(self) -> tuple[IdleUnit, ...]:
        """Every idle holder at the last sweep (``off`` ones left out)."""
        return self._idle

    def observe(self, t_s: float, units: Sequence[UnitSample]) -> tuple[IdleUnit, ...]:
        """Take one sweep; return the holders that became idle at it."""
        present: set[tuple[str, str]] = set()
        idle: list[IdleUnit] = []
        new: list[IdleUnit] = []
        for sample in units:
            unit_key = sample.mig_uuid or sample.gpu_uuid
            for holder in sample.holders:
                slot = (unit_key, holder.ident)
                present.add(slot)
                if sample.active:
                    self._since.pop(slot, None)
                    self._told.discard(slot)
                    continue
                since = self._since.setdefault(slot, t_s)
                policy = policy_of(holder, self.policy)
                if policy is IdlePolicy.OFF or t_s - since < self.idle_after_s:
                    continue
                found = IdleUnit(
                    sample.unit, sample.gpu_index, sample.gpu_uuid, sample.mig_uuid,
                    holder, since, policy,
                )  # fmt: skip
                idle.append(found)
                if slot not in self._told:
                    self._told.add(slot)
                    new.append(found)
        for slot in [s for s in self._since if s not in present]:
            del self._since[slot]
        self._told &= present
        self._idle = tuple(idle)
        return tuple(new)
