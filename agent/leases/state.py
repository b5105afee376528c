"""The lease table's state and the steps its operations are made of (``table`` has the
operations themselves).

An operation is framed by ``_begin`` (the clock moves on: what fell due ends, in the order it
fell due) and ``_done`` (the queue is served; the changes noted meanwhile are the outcome's).
Every change of the leases, the foreign holders and the queue goes through a step here that
notes it, so that an outcome with no changes left them as they were (the node, its health
and loads are the integrator's to give, and not noted).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

from agent.gpu.model import NodeInfo
from agent.health.rule import DeviceHealth
from agent.leases.answers import (
    Change,
    ChangeKind,
    Granted,
    GrantedUnit,
    Outcome,
    Refusal,
    Refused,
    Start,
    StartVerdict,
)
from agent.leases.containers import Container
from agent.leases.holders import ForeignHold, ForeignSource, Lease, LeaseState, Owner, lease_number
from agent.leases.occupancy import Occupancy
from agent.leases.picking import Connectivity
from agent.leases.plans import FINAL, Planner, Wanted
from agent.leases.set_search import Load
from agent.leases.settings import LeaseSettings
from agent.leases.texts import engine_text, short_id, taken_list, unit_label, when
from agent.leases.units import NodeUnits, Unit
from agent.leases.verdicts import Decision, Step, Verdicts
from agent.leases.waiting import Waiting

T = TypeVar("T")


class TableState:
    """The leases, foreign holders and waiting asks of one node, and how they change."""

    def __init__(
        self,
        node: NodeInfo,
        health: Sequence[DeviceHealth],
        settings: LeaseSettings | None = None,
        now_s: float = 0.0,
    ) -> None:
        self._settings = settings or LeaseSettings()
        self._node(node, health)
        self._levels: dict[int, int] = {}  # GPU index -> busy level (set_load)
        self._leases: dict[str, Lease] = {}
        self._foreign: dict[tuple[str, ForeignSource], ForeignHold] = {}
        self._waiting: list[Waiting] = []
        self._now = now_s
        self._next_lease = 1
        self._next_ticket = 1
        self._changes: list[Change] = []

    @property
    def settings(self) -> LeaseSettings:
        """What the table was built with (timeouts, sharing, the queue's bounds)."""
        return self._settings

    def _start(self, container: Container) -> StartVerdict:
        decision = self._verdicts(container.id).decide(container)
        lease = decision.lease
        if decision.step is Step.BOUND and lease is not None:
            if lease.state is not LeaseState.RUNNING:
                new = replace(
                    lease, state=LeaseState.RUNNING, until_s=None, engine=container.engine
                )
                self._leases[lease.id] = new
                self._note(
                    ChangeKind.STARTED,
                    f"container {short_id(container.id)} runs: {lease.id} ({self._names(lease)})",
                    lease=new,
                    container_id=container.id,
                )
            else:
                self._claim(lease, container.engine)
        elif decision.step is Step.BIND and lease is not None:
            self._bind(lease, container, running=True)
        elif decision.step is Step.RELET and decision.verdict.allowed:
            self._relet(container, decision, running=True)
        self._hold_container(container, decision)
        return decision.verdict

    def _stop(self, container_id: str) -> None:
        lease = self._bound_lease(container_id)
        if lease is None or lease.state is not LeaseState.RUNNING:
            return
        new = replace(lease, state=LeaseState.STOPPED, until_s=self._now + self._settings.grace_s)
        self._leases[lease.id] = new
        text = (
            f"container {short_id(container_id)} stopped: {lease.id} keeps "
            f"{self._names(lease)} until {when(new.until_s)} unless it starts again"
        )
        self._note(ChangeKind.STOPPED, text, lease=new, container_id=container_id)

    def _claim(self, lease: Lease, engine: str) -> None:
        """``engine`` told of the container of ``lease`` (bound): the lease is that
        engine's, and no longer waits for an engine to list it."""
        running = lease.state is LeaseState.RUNNING
        if lease.engine == engine and not (running and lease.until_s is not None):
            return
        new = replace(lease, engine=engine, until_s=None if running else lease.until_s)
        self._leases[lease.id] = new
        container_id = lease.container_id or ""
        text = (
            f"{lease.id}: container {short_id(container_id)} found by {engine_text(engine)}, "
            "whose container list alone can end the lease from now on"
        )
        self._note(ChangeKind.LISTED, text, lease=new, container_id=container_id)

    def _unlisted(self, lease: Lease, engine: str) -> None:
        """``engine`` listed its containers without the container of ``lease``, whose engine
        is unknown: a running one keeps its lease for ``grace_s`` more, unless an engine
        lists it (a stopped one's grace time bounds it already)."""
        if lease.state is not LeaseState.RUNNING or lease.until_s is not None:
            return
        new = replace(lease, until_s=self._now + self._settings.grace_s)
        self._leases[lease.id] = new
        container_id = lease.container_id or ""
        text = (
            f"{lease.id}: container {short_id(container_id)}, of an unknown engine, is not in "
            f"the container list of {engine_text(engine)}: it keeps {self._names(lease)} until "
            f"{when(new.until_s)} unless an engine lists it"
        )
        self._note(ChangeKind.UNLISTED, text, lease=new, container_id=container_id)

    def _unlisted_hold(self, hold: ForeignHold, engine: str) -> None:
        """As ``_unlisted``, for a running container's foreign hold of an unknown engine."""
        if hold.until_s is not None:
            return
        new = replace(hold, until_s=self._now + self._settings.grace_s)
        self._foreign[(hold.holder, hold.source)] = new
        text = (
            f"container {short_id(hold.holder)}, of an unknown engine, is not in the container "
            f"list of {engine_text(engine)}: it holds {self._hold_names(hold)} until "
            f"{when(new.until_s)} unless an engine lists it"
        )
        self._note(ChangeKind.UNLISTED, text, container_id=hold.holder)

    def _unfollowed(self, engines: set[str]) -> None:
        """Leases and holds of engines not in ``engines`` become of an unknown engine."""
        for lease in list(self._leases.values()):
            if lease.engine is None or lease.engine in engines:
                continue
            new = replace(lease, engine=None)
            self._leases[lease.id] = new
            container_id = lease.container_id or ""
            text = (
                f"{lease.id}: container {short_id(container_id)} is of "
                f"{engine_text(lease.engine)}, which this agent does not follow: its engine is "
                "unknown now"
            )
            self._note(ChangeKind.UNFOLLOWED, text, lease=new, container_id=container_id)
        for key, hold in list(self._foreign.items()):
            if hold.engine is None or hold.engine in engines:
                continue
            self._foreign[key] = replace(hold, engine=None)
            text = (
                f"container {short_id(hold.holder)} is of {engine_text(hold.engine)}, which "
                "this agent does not follow: its engine is unknown now"
            )
            self._note(ChangeKind.UNFOLLOWED, text, container_id=hold.holder)

    def _remove_container(self, container_id: str, why: str) -> None:
        lease = self._bound_lease(container_id)
        if lease is not None:
            text = (
                f"{lease.id} ended: container {short_id(container_id)} {why}; {self._free(lease)}"
            )
            self._end(lease, ChangeKind.ENDED, text)
        for source in ForeignSource:
            self._drop_foreign(container_id, source, why)

    def _begin(self, now_s: float) -> None:
        self._changes = []
        self._advance(now_s)

    def _done(self, answer: T) -> Outcome[T]:
        self._serve()
        changes, self._changes = tuple(self._changes), []
        return Outcome(answer, changes)

    def _note(
        self,
        kind: ChangeKind,
        text: str,
        *,
        lease: Lease | None = None,
        ticket: str | None = None,
        container_id: str | None = None,
        grant: Granted | None = None,
        refusal: Refused | None = None,
    ) -> None:
        self._changes.append(Change(kind, text, lease, ticket, container_id, grant, refusal))

    def _advance(self, now_s: float) -> None:
        """Move the clock to ``now_s`` and end what is due, in the order it fell due."""
        if not math.isfinite(now_s):
            raise ValueError(f"not a time: {now_s}")
        self._now = max(self._now, now_s)
        while (due := self._due()) is not None and due[0] <= self._now:
            _, order, name = due
            if order == 0:
                self._end_by_time(self._leases[name])
            elif order == 1:
                self._drop_foreign(
                    name,
                    ForeignSource.CONTAINER,
                    "of an unknown engine was in no engine's container list within "
                    f"{self._settings.grace_s:g} s",
                )
            else:
                self._time_out(next(w for w in self._waiting if w.ticket == name))
            self._serve()

    def _due(self) -> tuple[float, int, str] | None:
        items = [(x.until_s, 0, x.id) for x in self._leases.values() if x.until_s is not None]
        items += [(h.until_s, 1, h.holder) for h in self._foreign.values() if h.until_s is not None]
        items += [(w.until_s, 2, w.ticket) for w in self._waiting]
        return min(items, default=None)

    def _end_by_time(self, lease: Lease) -> None:
        if lease.state is LeaseState.PENDING:
            text = (
                f"{lease.id} expired: no container was created with it within "
                f"{self._settings.pending_s:g} s; {self._free(lease)}"
            )
            self._end(lease, ChangeKind.EXPIRED, text)
        elif lease.state is LeaseState.RUNNING:  # of an unknown engine, listed by none
            text = (
                f"{lease.id} ended: container {short_id(lease.container_id or '')}, of an "
                f"unknown engine, was in no engine's container list within "
                f"{self._settings.grace_s:g} s; {self._free(lease)}"
            )
            self._end(lease, ChangeKind.GRACE_ENDED, text)
        else:
            text = (
                f"{lease.id} ended: container {short_id(lease.container_id or '')} did not "
                f"start again within {self._settings.grace_s:g} s of stopping; "
                f"{self._free(lease)}"
            )
            self._end(lease, ChangeKind.GRACE_ENDED, text)

    def _time_out(self, waiting: Waiting) -> None:
        self._waiting.remove(waiting)
        plan = self._planner().plan(waiting.wanted)
        why = plan.text if isinstance(plan, Refused) else "asks before it still waited"
        taken = plan.taken if isinstance(plan, Refused) else ()
        text = (
            f"{waiting.ticket} waited {waiting.until_s - waiting.asked_s:g} s for "
            f"{waiting.wanted.text} and got none: {why}"
        )
        refusal = Refused(Refusal.TIMED_OUT, text, taken)
        self._note(ChangeKind.TIMED_OUT, text, ticket=waiting.ticket, refusal=refusal)

    def _serve(self) -> None:
        """Hand out what is free to the waiting asks, from the head of the queue only."""
        while self._waiting:
            head = self._waiting[0]
            plan = self._planner().plan(head.wanted)
            if isinstance(plan, Refused):
                if plan.kind not in FINAL:
                    return
                self._waiting.pop(0)
                text = f"{head.ticket} dropped: {plan.text}"
                refusal = Refused(plan.kind, text, plan.taken)
                self._note(ChangeKind.DROPPED, text, ticket=head.ticket, refusal=refusal)
                continue
            self._waiting.pop(0)
            self._grant(head.wanted, head.owner, head.cpuset, plan, ticket=head.ticket)

    def _grant(
        self,
        wanted: Wanted,
        owner: Owner,
        cpuset: bool,
        units: tuple[Unit, ...],
        ticket: str | None = None,
        relet: tuple[str, Container, bool] | None = None,  # (lease id, container, running)
    ) -> Granted:
        engine: str | None = None
        container_id: str | None = None
        if relet is None:
            lease_id, state = self._new_id(), LeaseState.PENDING
            until: float | None = self._now + self._settings.pending_s
        else:
            lease_id, container, running = relet
            container_id, engine = container.id, container.engine
            state = LeaseState.RUNNING if running else LeaseState.STOPPED
            until = None if running else self._now + self._settings.grace_s
        lease = Lease(
            lease_id,
            tuple(u.key for u in units),
            tuple(u.name for u in units),
            wanted.exclusive,
            owner,
            wanted.text,
            self._now,
            state,
            container_id,
            until,
            engine,
        )
        self._leases[lease.id] = lease
        occ = self._occ()
        granted = tuple(
            GrantedUnit(
                u.name, u.uuid, u.gpu, u.mig, u.profile, u.path, occ.sharing(u), occ.sharers(u)
            )
            for u in units
        )
        numa = sorted({u.numa_node for u in units if u.numa_node is not None})
        numa_nodes = tuple(numa) if cpuset and numa else None
        shown = ", ".join(
            unit_label(g.name)
            + ("" if lease.exclusive else f" shared ({g.sharers} of {g.sharing})")
            for g in granted
        )
        nodes = "node" if numa_nodes and len(numa_nodes) == 1 else "nodes"
        numa_text = f"; NUMA {nodes} {','.join(map(str, numa_nodes))}" if numa_nodes else ""
        if relet is None:
            to = f" to {ticket}" if ticket else ""
            text = (
                f"granted {lease.id}{to} ({wanted.text}): {shown}{numa_text}; create its "
                f"container with its labels within {self._settings.pending_s:g} s"
            )
            kind = ChangeKind.GRANTED
        else:
            text = (
                f"{lease.id} leased again to container {short_id(container_id or '')}"
                f": {shown}{numa_text} (its lease had ended; they were free)"
            )
            kind = ChangeKind.RELET
        grant = Granted(lease, granted, numa_nodes, text)
        self._note(kind, text, lease=lease, ticket=ticket, container_id=container_id, grant=grant)
        return grant

    def _relet(self, container: Container, decision: Decision, running: bool) -> None:
        label = container.lease
        if label is None or decision.wanted is None:
            return
        if (number := lease_number(label.lease_id)) is not None:
            self._next_lease = max(self._next_lease, number + 1)
        relet = (label.lease_id, container, running)
        self._grant(decision.wanted, label.owner, True, decision.units, relet=relet)

    def _bind(self, lease: Lease, container: Container, running: bool) -> None:
        until = None if running else self._now + self._settings.grace_s
        state = LeaseState.RUNNING if running else LeaseState.STOPPED
        container_id = container.id
        new = replace(
            lease, state=state, container_id=container_id, until_s=until, engine=container.engine
        )
        self._leases[lease.id] = new
        keeps = "while it runs" if running else f"until {when(until)} unless it starts"
        text = (
            f"{lease.id} bound to container {short_id(container_id)}: it keeps "
            f"{self._names(lease)} {keeps}"
        )
        self._note(ChangeKind.BOUND, text, lease=new, container_id=container_id)

    def _end(self, lease: Lease, kind: ChangeKind, text: str) -> None:
        del self._leases[lease.id]
        self._note(kind, text, lease=lease, container_id=lease.container_id)

    def _revoke_unusable(self) -> None:
        occ = self._occ()
        for lease in list(self._leases.values()):
            if lease.state is not LeaseState.PENDING:
                continue
            units = [self._units.get(k) for k in lease.units]
            gone = [n for n, u in zip(lease.names, units, strict=True) if u is None]
            sick = [
                t for u in units if u is not None and not occ.healthy(u) for t in occ.taken(u)[:1]
            ]
            if gone:
                why = f"{', '.join(map(unit_label, gone))} left the node"
            elif sick:
                why = f"{taken_list(sick)}"
            else:
                continue
            text = f"{lease.id} revoked before its container was created: {why}; ask again"
            self._end(lease, ChangeKind.REVOKED, text)

    def _hold_container(self, container: Container, decision: Decision) -> None:
        """What a running container holds beyond its lease: a foreign hold (or none)."""
        lease = self._bound_lease(container.id)
        own = set(lease.units) if lease else set()
        used = [u.key for u in self._units.given(container.devices)]
        how = container.how
        if lease is None and container.lease is not None:
            used += list(container.lease.units)
            how = f"the labels of {container.lease.lease_id}, not its lease"
        extra = tuple(dict.fromkeys(k for k in used if k not in own))
        if not extra:
            self._drop_foreign(container.id, ForeignSource.CONTAINER, "holds only its lease")
            return
        changed = self._set_foreign(
            container.id, ForeignSource.CONTAINER, extra, how, True, container.engine
        )
        if changed and decision.verdict.decision is Start.NO:
            self._note(
                ChangeKind.CONFLICT,
                f"container {short_id(container.id)} runs though refused: {decision.verdict.text}",
                container_id=container.id,
            )

    def _set_foreign(
        self,
        holder: str,
        source: ForeignSource,
        keys: tuple[str, ...],
        how: str,
        container: bool,
        engine: str | None = None,  # a running container's (CONTAINER) hold: its engine
    ) -> bool:
        """Record what ``holder`` holds without a lease; False when it held that already
        (the hold is then ``engine``'s, and an end it had as an unknown engine's is lifted)."""
        old = self._foreign.get((holder, source))
        if old is not None and old.units == keys and old.how == how:
            if old.engine != engine or old.until_s is not None:
                self._foreign[(holder, source)] = replace(old, engine=engine, until_s=None)
                text = (
                    f"container {short_id(holder)} found by {engine_text(engine or '')}, "
                    "whose container list alone can end its hold from now on"
                )
                self._note(ChangeKind.LISTED, text, container_id=holder)
            return False
        since = old.since_s if old is not None else self._now
        hold = ForeignHold(holder, source, keys, how, since, container, engine)
        self._foreign[(holder, source)] = hold
        who = f"container {short_id(holder)}" if container else holder
        text = f"{who} holds {self._hold_names(hold)} without a lease ({how})"
        self._note(ChangeKind.FOREIGN, text, container_id=holder if container else None)
        return True

    def _drop_foreign(self, holder: str, source: ForeignSource, why: str) -> None:
        hold = self._foreign.pop((holder, source), None)
        if hold is None:
            return
        who = f"container {short_id(holder)}" if hold.container else holder
        text = f"{who} {why}: {self._hold_names(hold)} no longer held by it"
        self._note(ChangeKind.FOREIGN_GONE, text, container_id=holder if hold.container else None)

    def _hold_names(self, hold: ForeignHold) -> str:
        """``GPU 2, MIG 3:1``: the units of a foreign hold."""
        return ", ".join(u.label if (u := self._units.get(k)) else k for k in hold.units)

    def _bound_lease(self, container_id: str) -> Lease | None:
        """The lease bound to ``container_id`` (a container has at most one)."""
        return next((x for x in self._leases.values() if x.container_id == container_id), None)

    def _gpus_held_by(self, holder: str) -> set[int]:
        keys = [k for x in self._leases.values() if x.container_id == holder for k in x.units]
        hold = self._foreign.get((holder, ForeignSource.CONTAINER))
        keys += list(hold.units) if hold else []
        return {u.gpu for k in keys if (u := self._units.get(k))}

    def _node(self, node: NodeInfo, health: Sequence[DeviceHealth]) -> None:
        self._check_health(node, health)
        self._units = NodeUnits(node)
        self._conn = Connectivity(node)
        self._health = tuple(health)

    @staticmethod
    def _check_health(node: NodeInfo, health: Sequence[DeviceHealth]) -> None:
        if len(health) != len(node.devices):
            raise ValueError(f"health of {len(health)} GPUs for a node of {len(node.devices)} GPUs")

    def _new_id(self) -> str:
        while f"lease-{self._next_lease}" in self._leases:
            self._next_lease += 1
        lease_id = f"lease-{self._next_lease}"
        self._next_lease += 1
        return lease_id

    @staticmethod
    def _names(lease: Lease) -> str:
        """``GPU 0, GPU 1``: a lease's units as granted."""
        return ", ".join(unit_label(n) for n in lease.names)

    @staticmethod
    def _free(lease: Lease) -> str:
        """``GPU 0 is free again``, ``GPU 0, GPU 1 are free again``."""
        verb = "is" if len(lease.names) == 1 else "are"
        return f"{TableState._names(lease)} {verb} free again"

    def _occ(self, besides: str | None = None) -> Occupancy:
        """Who holds what; ``besides``: a holder whose foreign holds are not counted."""
        foreign = [h for h in self._foreign.values() if h.holder != besides]
        return Occupancy(self._units, self._health, self._settings, self._leases.values(), foreign)

    def _planner(self, besides: str | None = None) -> Planner:
        occ = self._occ(besides)

        def load_of(unit: Unit) -> Load:
            return (occ.sharers(unit), self._levels.get(unit.gpu, 0))

        return Planner(self._units, occ, self._conn, load_of)

    def _verdicts(self, container_id: str | None = None) -> Verdicts:
        """Verdicts for ``container_id``: what it holds without a lease does not stand in
        its own way (it gives that up to run on its lease)."""
        occ = self._occ(container_id)
        planner = self._planner(container_id)
        return Verdicts(self._units, occ, planner, self._leases, len(self._waiting), self._settings)
