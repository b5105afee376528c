"""The lease table: who may have which GPU (or MIG device) on this node, decided in one place.

Every ask, release, engine event, health or node change and the passing of time is one call,
given the time (``now_s``, Unix seconds; a time before the last one counts as the last one)
and answered with an ``Outcome``: the answer and the changes it made, each with its line for
the log. The table does no I/O and keeps no clock: the integrator serialises the calls (one
at a time), hands waiting asks what ``Change.grant`` says, calls ``tick`` by
``next_deadline_s``, and writes ``snapshot()`` when an outcome has changes.

The rules (docs/leases.md has them for people):

- a unit is free, pending (granted, its container not created yet), leased to a container
  (running, or stopped within its grace time), or held by a foreign holder; an exclusive
  lease or a foreign holder takes it alone, shared leases up to its sharing count;
- an unhealthy unit gets no new lease, and a pending lease whose unit turns unhealthy (or
  leaves the node) is revoked; leases of existing containers stay, and their containers
  may not start again on the unhealthy GPU;
- a pending lease expires after ``pending_s``; a stopped container keeps its lease for
  ``grace_s``, its removal ends it at once; a running container's lease cannot be released;
- a bound lease (and a running container's foreign hold) is its container's engine's: only
  that engine's container list (``resync``) ends it. One whose engine is unknown (an older
  snapshot, an engine no longer followed) is kept until an engine lists its container, or
  for ``grace_s`` after the first list that lacks it;
- asks that wait are served first come, first served, and nothing overtakes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from agent.gpu.model import NodeInfo
from agent.health.rule import DeviceHealth
from agent.leases.answers import (
    Answer,
    ChangeKind,
    Outcome,
    Queued,
    Refusal,
    Refused,
    Released,
    StartVerdict,
)
from agent.leases.asks import Ask, InvalidAsk, check_ask
from agent.leases.containers import Container, GpuUser, check_engine
from agent.leases.holders import ForeignSource, Lease, LeaseState, lease_number
from agent.leases.loads import GpuLoad
from agent.leases.plans import FINAL, FreeSet, Wanted, advised, wanted_of
from agent.leases.snapshot import Snapshot
from agent.leases.state import TableState
from agent.leases.texts import plural, short_id, when
from agent.leases.verdicts import Step
from agent.leases.view import TableView, unit_view
from agent.leases.waiting import Waiting


class LeaseTable(TableState):
    """The lease table of one node. Not thread-safe: one owner calls it, one call at a time.

    Built with the node's facts, each GPU's health (by index), the settings and the time.
    """

    def ask(self, ask: Ask, now_s: float) -> Outcome[Answer]:
        """Grant, queue or refuse ``ask``; ``InvalidAsk`` (nothing changed) for an ask that
        asks for nothing valid, a device entry that names nothing included."""
        check_ask(ask)
        try:
            wanted = wanted_of(ask, self._units)
        except ValueError as err:  # InvalidParameter: names nothing on this node
            raise InvalidAsk("devices", str(err)) from None
        self._begin(now_s)
        return self._done(self._ask(ask, wanted))

    def _ask(self, ask: Ask, wanted: Wanted) -> Answer:
        plan = self._planner().plan(wanted)
        if isinstance(plan, Refused) and (plan.kind in FINAL or plan.kind is Refusal.UNHEALTHY):
            return plan
        if isinstance(plan, Refused):
            return self._enqueue(ask, wanted, plan) if ask.wait_s > 0 else advised(plan)
        if self._waiting:
            first = self._waiting[0]
            reason = (
                f"{plural(len(self._waiting), 'ask')} "
                f"{'waits' if len(self._waiting) == 1 else 'wait'} before this one (the first, "
                f"{first.ticket} for {first.wanted.text}, since {when(first.asked_s)})"
            )
            behind = Refused(Refusal.OTHERS_WAITING, reason)
            if ask.wait_s > 0:
                return self._enqueue(ask, wanted, behind)
            return Refused(behind.kind, f"{reason}; ask to wait to queue behind them")
        return self._grant(wanted, ask.owner, ask.cpuset, plan)

    def _enqueue(self, ask: Ask, wanted: Wanted, why: Refused) -> Answer:
        """Queue ``ask``, which ``why`` keeps from being served now."""
        wait_s = min(ask.wait_s, self._settings.max_wait_s)
        if wait_s <= 0:
            return Refused(why.kind, f"{why.text}; this node queues no ask", why.taken)
        if len(self._waiting) >= self._settings.max_waiting:
            text = (
                f"{plural(len(self._waiting), 'ask')} waiting already, the most this node "
                "queues; "
                f"{why.text}; try again later"
            )
            return Refused(Refusal.QUEUE_FULL, text, why.taken)
        ticket = f"wait-{self._next_ticket}"
        self._next_ticket += 1
        waiting = Waiting(ticket, wanted, ask.owner, ask.cpuset, self._now, self._now + wait_s)
        self._waiting.append(waiting)
        text = (
            f"waiting for {wanted.text} as {ticket}, number {len(self._waiting)} in line, "
            f"until {when(waiting.until_s)}: {why.text}"
        )
        self._note(ChangeKind.QUEUED, text, ticket=ticket)
        return Queued(ticket, len(self._waiting), waiting.until_s, text)

    def cancel(self, ticket: str, now_s: float) -> Outcome[bool]:
        """Withdraw a waiting ask (its asker went away); False when it waits no more."""
        self._begin(now_s)
        found = [w for w in self._waiting if w.ticket == ticket]
        for waiting in found:
            self._waiting.remove(waiting)
            text = f"{ticket} withdrawn: it waited for {waiting.wanted.text} since " + when(
                waiting.asked_s
            )
            self._note(ChangeKind.CANCELLED, text, ticket=ticket)
        return self._done(bool(found))

    def release(self, lease_id: str, now_s: float) -> Outcome[Released | Refused]:
        """End a lease that is pending or whose container is stopped; a running container's
        lease ends when the container is removed."""
        self._begin(now_s)
        lease = self._leases.get(lease_id)
        answer: Released | Refused
        if lease is None:
            text = (
                f"no lease {lease_id[:40]!r} on this node (ended, or never granted); the lease "
                "list shows what it holds"
            )
            answer = Refused(Refusal.UNKNOWN_LEASE, text)
        elif lease.state is LeaseState.RUNNING:
            text = (
                f"{lease.id} is in use by running container {short_id(lease.container_id or '')}"
                f": it ends when the container is removed, or {self._settings.grace_s:g} s "
                "after it stops"
            )
            answer = Refused(Refusal.IN_USE, text)
        else:
            text = f"{lease.id} released: {self._free(lease)}"
            self._end(lease, ChangeKind.ENDED, text)
            answer = Released(lease, text)
        return self._done(answer)

    def may_start(self, container: Container, now_s: float) -> Outcome[StartVerdict]:
        """May ``container`` be created or started? (Before the engine does it: the table
        changes nothing but the passing of time.)"""
        self._begin(now_s)
        return self._done(self._verdicts(container.id).decide(container).verdict)

    def created(self, container: Container, now_s: float) -> Outcome[StartVerdict]:
        """The engine created ``container``: its label binds its pending lease (or re-leases
        an ended one), which it keeps for ``grace_s`` unless it starts (then while it runs)."""
        self._begin(now_s)
        decision = self._verdicts(container.id).decide(container)
        if decision.step is Step.BIND and decision.lease is not None:
            self._bind(decision.lease, container, running=False)
        elif decision.step is Step.RELET and decision.verdict.allowed:
            self._relet(container, decision, running=False)
        return self._done(decision.verdict)

    def started(self, container: Container, now_s: float) -> Outcome[StartVerdict]:
        """The engine started ``container`` (it runs, whatever the verdict): its lease runs;
        what it holds without a lease makes it a foreign holder."""
        self._begin(now_s)
        return self._done(self._start(container))

    def died(self, container_id: str, now_s: float) -> Outcome[None]:
        """Container ``container_id`` stopped: its lease keeps its units for ``grace_s``;
        what it held without a lease while it ran is free."""
        self._begin(now_s)
        self._stop(container_id)
        self._drop_foreign(container_id, ForeignSource.CONTAINER, "stopped")
        return self._done(None)

    def destroyed(self, container_id: str, now_s: float) -> Outcome[None]:
        """Container ``container_id`` was removed: its lease ends, what it held is free."""
        self._begin(now_s)
        self._remove_container(container_id, "was removed")
        return self._done(None)

    def processes_seen(self, users: Iterable[GpuUser], now_s: float) -> Outcome[None]:
        """A status sweep's GPU processes: a process of a holder that holds nothing on its
        GPU makes that holder a foreign holder of the whole GPU until a sweep no longer sees
        it (these replace the last sweep's)."""
        self._begin(now_s)
        gpus: dict[tuple[str, bool], set[int]] = {}
        for user in users:
            if 0 <= user.gpu < len(self._units.node.devices):
                gpus.setdefault((user.holder, user.container_id is not None), set()).add(user.gpu)
        seen: set[str] = set()
        for (holder, is_container), on in sorted(gpus.items()):
            own = self._gpus_held_by(holder)
            keys = tuple(u.key for g in sorted(on - own) for u in self._units.of_gpu(g))
            if keys:
                seen.add(holder)
                self._set_foreign(
                    holder, ForeignSource.PROCESS, keys, "a GPU process", is_container
                )
        for holder, source in list(self._foreign):
            if source is ForeignSource.PROCESS and holder not in seen:
                self._drop_foreign(holder, source, "runs no GPU process any more")
        return self._done(None)

    def resync(self, engine: str, containers: Iterable[Container], now_s: float) -> Outcome[None]:
        """Make the table agree with ``engine``'s full container list (at start, when its
        event stream was lost; each container's ``engine`` is ``engine``). Leases and holds
        of ``engine``'s containers not in it end; those of other engines stay as they are;
        a container of an unknown engine that it lacks keeps what it holds for ``grace_s``
        more unless an engine lists it. Listed containers are ``engine``'s: running ones are
        taken as started; a stopped one's running lease starts its ``grace_s``, and a pending
        lease its label names is bound to it; a stopped container whose lease the table does
        not know holds nothing (started, it may get its units again)."""
        check_engine(engine)
        listed: dict[str, Container] = {}
        for c in containers:
            if c.engine != engine:
                raise ValueError(
                    f"container {short_id(c.id)} of engine {c.engine!r} in the list of {engine!r}"
                )
            listed[c.id] = c
        self._begin(now_s)
        gone = "is gone (not in its engine's container list)"
        for lease in list(self._leases.values()):
            if lease.container_id is None or lease.container_id in listed:
                continue
            if lease.engine == engine:
                self._remove_container(lease.container_id, gone)
            elif lease.engine is None:
                self._unlisted(lease, engine)
        for key in list(self._foreign):
            hold = self._foreign.get(key)
            if hold is None or hold.source is not ForeignSource.CONTAINER or hold.holder in listed:
                continue
            if hold.engine == engine:
                self._drop_foreign(hold.holder, hold.source, gone)
            elif hold.engine is None:
                self._unlisted_hold(hold, engine)
        for c in listed.values():
            if c.lease is not None and (number := lease_number(c.lease.lease_id)):
                self._next_lease = max(self._next_lease, number + 1)
        order = sorted(
            listed.values(), key=lambda c: (self._bound_lease(c.id) is None, c.lease is None, c.id)
        )
        for c in order:
            if c.running:
                self._start(c)
                continue
            self._stop(c.id)
            self._drop_foreign(c.id, ForeignSource.CONTAINER, "does not run")
            decision = self._verdicts(c.id).decide(c)
            if decision.step is Step.BIND and decision.lease is not None:
                self._bind(decision.lease, c, running=False)
            elif decision.step is Step.BOUND and decision.lease is not None:
                self._claim(self._leases[decision.lease.id], engine)
        return self._done(None)

    def followed(self, engines: Iterable[str], now_s: float) -> Outcome[None]:
        """The engines the integrator follows (the names its containers carry): the leases
        and holds of any other engine's containers (a restored snapshot's, of an engine no
        longer followed) count as of an unknown engine from now on (see ``resync``)."""
        names = {check_engine(e) for e in engines}
        self._begin(now_s)
        self._unfollowed(names)
        return self._done(None)

    def set_health(self, health: Sequence[DeviceHealth], now_s: float) -> Outcome[None]:
        """Each GPU's health now (by index): pending leases on an unhealthy GPU are revoked."""
        self._check_health(self._units.node, health)
        self._begin(now_s)
        self._health = tuple(health)
        self._revoke_unusable()
        return self._done(None)

    def set_node(
        self, node: NodeInfo, health: Sequence[DeviceHealth], now_s: float
    ) -> Outcome[None]:
        """The node's devices changed (driver reload, MIG change): units are matched by UUID;
        pending leases on units that left are revoked, and containers whose units left may
        not start again. The GPUs' loads are forgotten until the next ``set_load``."""
        self._check_health(node, health)
        self._begin(now_s)
        self._node(node, health)
        self._levels = {}  # by index, of the old devices: the next sweep says anew
        self._revoke_unusable()
        return self._done(None)

    def set_load(self, loads: Sequence[GpuLoad | None]) -> None:
        """Each GPU's load in the latest status sweep (by index; None: unknown, taken as
        idle): what "least loaded" weighs after the leases on a unit, as its busy level
        (``GpuLoad.level``). These replace the last sweep's; a node change forgets them
        until the next sweep. Nothing else changes: it is not an operation (no changes,
        no time), and picks depend on it as on any other input."""
        count = len(self._units.node.devices)
        self._levels = {
            i: load.level for i, load in enumerate(loads) if load is not None and i < count
        }

    def tick(self, now_s: float) -> Outcome[None]:
        """Let time pass: expiries, ends of grace, queue timeouts, and the queue served."""
        self._begin(now_s)
        return self._done(None)

    def view(self) -> TableView:
        occ = self._occ()
        return TableView(
            self._now,
            tuple(unit_view(u, occ) for u in self._units.all()),
            tuple(self._leases.values()),
            tuple(self._foreign.values()),
            tuple(self._waiting),
        )

    def free_set(self, count: int, profile: str | None = None) -> FreeSet:
        """What an exclusive ask for ``count`` whole GPUs (MIG devices of ``profile``) would
        get now, the queue aside; changes nothing."""
        return self._planner().free_set(count, profile)

    def lease(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def next_deadline_s(self) -> float | None:
        """When the table next changes by itself (an expiry, an end of grace, a timeout):
        call ``tick`` then; None when nothing is due."""
        due = self._due()
        return due[0] if due else None

    def number_above(self, number: int) -> None:
        """Give new leases numbers above ``number`` (one that the usage ledger names)."""
        self._next_lease = max(self._next_lease, number + 1)

    def snapshot(self) -> Snapshot:
        return Snapshot(
            self._now,
            self._next_lease,
            tuple(self._leases.values()),
            tuple(self._foreign.values()),
        )

    def restore(self, snapshot: Snapshot, now_s: float) -> Outcome[None]:
        """Take up a snapshot's leases and foreign holders (a new table, after a restart);
        what expired meanwhile ends now. Then ``resync`` with the live containers."""
        if self._leases or self._foreign or self._waiting:
            raise RuntimeError("a lease table is restored before it holds anything")
        self._changes = []
        self._leases = {lease.id: lease for lease in snapshot.leases}
        self._foreign = {(h.holder, h.source): h for h in snapshot.foreign}
        self._next_lease = max([snapshot.next_lease, *(x.number + 1 for x in snapshot.leases)])
        self._now = max(self._now, snapshot.saved_s)
        text = (
            f"restored {plural(len(snapshot.leases), 'lease')} and "
            f"{plural(len(snapshot.foreign), 'foreign holder')} from the snapshot of "
            f"{when(snapshot.saved_s)}"
        )
        self._note(ChangeKind.RESTORED, text)
        self._advance(now_s)
        self._revoke_unusable()
        return self._done(None)
