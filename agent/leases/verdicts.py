"""May a container be created or started: the answer, and what the table does when it is.

- A container bound to a lease may start while its units are on the node, healthy and held
  by no foreign holder but itself; otherwise no, and why.
- A container whose lease label names a pending lease binds it (the label's units must be
  the lease's).
- A container whose label names a lease that has ended (its container stopped longer than
  the grace time, or the table does not know it) gets its units again when they fit now,
  under the rules of any ask (healthy, free, nobody waiting before it): a re-lease. If they
  do not, no: the container would share them silently with their new holder.
- A label naming a lease bound to another container: no (a lease serves one container).
- A container with no lease label may run unless a device it names is leased to another
  (foreign containers may share GPUs among themselves, as on a node without leases).
- Devices a leased container names beyond its lease are checked as a foreign container's.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.leases.answers import Hold, Refusal, Refused, Start, StartVerdict, Taken
from agent.leases.containers import Container
from agent.leases.holders import Lease
from agent.leases.occupancy import Occupancy
from agent.leases.plans import Planner, Wanted, wanted_of_label
from agent.leases.settings import LeaseSettings
from agent.leases.texts import plural, short_id, taken_list, unit_label, units_text, when
from agent.leases.units import NodeUnits, Unit


class Step(enum.Enum):
    NONE = "none"  # nothing to bind: a container without a (usable) lease label
    BOUND = "bound"  # the container is bound to ``lease`` already
    BIND = "bind"  # bind the pending ``lease`` to the container
    RELET = "relet"  # lease ``wanted`` (``units``) to the container again, under the label's id
    UNHONOURED = "unhonoured"  # its label names a lease it may not have


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: StartVerdict
    step: Step
    lease: Lease | None = None
    wanted: Wanted | None = None
    units: tuple[Unit, ...] = ()


class Verdicts:
    """Decides for one state of the table (changing nothing)."""

    def __init__(
        self,
        units: NodeUnits,
        occ: Occupancy,
        planner: Planner,
        leases: Mapping[str, Lease],
        waiting: int,
        settings: LeaseSettings,
    ) -> None:
        self._units = units
        self._occ = occ
        self._planner = planner
        self._leases = leases
        self._waiting = waiting
        self._settings = settings

    def bound_lease(self, container_id: str) -> Lease | None:
        for lease in self._leases.values():
            if lease.container_id == container_id:
                return lease
        return None

    def decide(self, c: Container) -> Decision:
        bound = self.bound_lease(c.id)
        if bound is not None:
            decision = Decision(self._bound(c, bound), Step.BOUND, bound)
        elif c.lease is None:
            decision = Decision(self._extras(c, ()), Step.NONE)
        else:
            decision = self._labelled(c)
        if decision.verdict.allowed and decision.step is not Step.NONE:
            own = decision.lease.units if decision.lease else (c.lease.units if c.lease else ())
            extra = self._extras(c, own)
            if not extra.allowed:
                return Decision(
                    extra, decision.step, decision.lease, decision.wanted, decision.units
                )
        return decision

    def _bound(self, c: Container, lease: Lease) -> StartVerdict:
        who = f"container {short_id(c.id)}"
        gone = [n for k, n in zip(lease.units, lease.names, strict=True) if not self._units.get(k)]
        if gone:
            text = (
                f"{who} may not start: {', '.join(map(unit_label, gone))} of {lease.id} is no "
                "longer on this node (driver reload or MIG change); recreate it to get GPUs"
            )
            return _no(text, Refusal.GONE, lease.id)
        units = [u for k in lease.units if (u := self._units.get(k))]
        sick = [t for u in units for t in self._occ.taken(u) if t.hold is Hold.UNHEALTHY]
        if sick:
            text = (
                f"{who} may not start: {lease.id} has {taken_list(sick)}; release "
                f"{lease.id} and recreate the container to get another GPU"
            )
            return _no(text, Refusal.UNHEALTHY, lease.id, sick)
        foreign = [
            t
            for u in units
            for t in self._occ.taken(u)
            if t.hold is Hold.FOREIGN and t.container_id != c.id
        ]
        if foreign:
            text = (
                f"{who} may not start: its {lease.id} GPUs are in use by another holder: "
                f"{taken_list(foreign)}; stop that first"
            )
            return _no(text, Refusal.TAKEN, lease.id, foreign)
        return StartVerdict(
            Start.YES, f"{who} may start: {lease.id} ({units_text(units)})", lease.id
        )

    def _labelled(self, c: Container) -> Decision:
        assert c.lease is not None
        label = c.lease
        who = f"container {short_id(c.id)}"
        lease = self._leases.get(label.lease_id)
        if lease is not None and lease.container_id is not None:
            text = (
                f"{who} may not start: {lease.id} is bound to container "
                f"{short_id(lease.container_id)} since {when(lease.since_s)}; a lease serves "
                "one container: ask for a new lease"
            )
            return Decision(_no(text, Refusal.OTHER_CONTAINER, lease.id), Step.UNHONOURED)
        if lease is not None:  # pending
            if set(label.units) != set(lease.units):
                text = (
                    f"{who} may not start: its labels name {lease.id} with other devices than "
                    f"the lease has ({', '.join(map(unit_label, lease.names))}); create it "
                    "with the labels of its grant"
                )
                return Decision(_no(text, Refusal.UNKNOWN_LEASE, lease.id), Step.UNHONOURED)
            text = f"{who} may start: it binds {lease.id} (pending since {when(lease.since_s)})"
            return Decision(StartVerdict(Start.YES, text, lease.id), Step.BIND, lease)
        wanted = wanted_of_label(label, self._units)
        plan = self._planner.plan(wanted)
        if not isinstance(plan, Refused) and self._waiting:
            plan = Refused(
                Refusal.OTHERS_WAITING,
                f"{plural(self._waiting, 'ask')} "
                f"{'waits' if self._waiting == 1 else 'wait'} for GPUs before it",
            )
        if isinstance(plan, Refused):
            text = (
                f"{who} may not start: its {label.lease_id} has ended (stopped longer than "
                f"{self._settings.grace_s:g} s, or unknown here) and its devices cannot be "
                f"leased to it again: {plan.text}; recreate it to get GPUs"
            )
            return Decision(_no(text, plan.kind, label.lease_id, plan.taken), Step.UNHONOURED)
        text = (
            f"{who} may start: its {label.lease_id} had ended; {units_text(plan)} were free "
            "and are leased to it again"
        )
        verdict = StartVerdict(Start.RELET, text, label.lease_id)
        return Decision(verdict, Step.RELET, None, wanted, plan)

    def _extras(self, c: Container, own: tuple[str, ...]) -> StartVerdict:
        """Whether the devices ``c`` names beyond ``own`` are leased to anyone else (a pending
        lease, or another container's)."""
        given = [u for u in self._units.given(c.devices) if u.key not in own]
        leased = [
            t
            for u in given
            for t in self._occ.taken(u)
            if t.hold in (Hold.PENDING, Hold.RUNNING, Hold.STOPPED) and t.container_id != c.id
        ]
        who = f"container {short_id(c.id)}"
        if leased:
            text = (
                f"{who} may not start: it names GPUs leased to others: {taken_list(leased)}; "
                "ask the lease table for GPUs instead of naming them"
            )
            return _no(text, Refusal.TAKEN, None, leased)
        if not given:
            beyond = " beyond its lease" if own else ""
            return StartVerdict(Start.YES, f"{who} may start: it names no GPU{beyond}")
        verb = "is" if len(given) == 1 else "are"
        return StartVerdict(
            Start.YES, f"{who} may start: {units_text(given)} {verb} leased to nobody"
        )


def _no(
    text: str, kind: Refusal, lease_id: str | None, taken: Sequence[Taken] = ()
) -> StartVerdict:
    return StartVerdict(Start.NO, text, lease_id, Refused(kind, text, tuple(taken)))
