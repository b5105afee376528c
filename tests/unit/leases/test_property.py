"""THE property of the lease table, by a state machine that drives it as a node would.

Any interleaving of asks (count, named devices, MIG profiles, shared, waiting), releases,
withdrawals, time passing, container events of two engines (create, start, die, destroy;
leased containers, clones of them, foreign containers with devices), missed events and per-
engine resyncs, an engine that goes down (its containers change unseen: started, stopped,
created, removed) and comes back with its list, health changes, GPU processes, the GPUs'
loads (which steer picks), MIG changes and agent restarts (snapshot through JSON, of this
agent or without engines as an older one wrote it, restore, then each engine that is up
lists in any order; or the snapshot lost) never gives an exclusive GPU to two holders, never
exceeds a GPU's sharing count, never leases an unhealthy GPU, never grants what a foreign
holder holds, never refuses (or queues) an ask with nobody waiting while enough of the units
it may get are free, says each granted unit's sharing as it counts it, never keeps a holder
the world no longer has except a container its down engine has not listed yet (or one of an
unknown engine, for the grace time at most), so that, everyone gone and every engine back,
every GPU is free again: checked too at the end of every run; keeps every container's lease
bound to it until it ends by a rule (removal told by its own engine, release, grace), so
that one engine's list never ends another's leases; keeps the documented timings, and serves
the queue first come, first served with nothing overtaking it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agent.gpu.model import NodeInfo, PciLink
from agent.health.rule import HEALTHY
from agent.leases.answers import (
    Change,
    ChangeKind,
    Granted,
    Hold,
    Outcome,
    Queued,
    Refused,
    StartVerdict,
)
from agent.leases.asks import Ask, InvalidAsk
from agent.leases.containers import Container, GpuUser
from agent.leases.holders import ForeignSource, Lease, LeaseState
from agent.leases.labels import LeaseLabel, labels_for, read_label
from agent.leases.loads import GpuLoad
from agent.leases.settings import LeaseSettings
from agent.leases.snapshot import snapshot_from_json, snapshot_to_json
from agent.leases.table import LeaseTable
from agent.leases.units import NodeUnits
from agent.leases.view import TableView, UnitState, UnitView

from .nodes import T0, build_node, cid, sick, uuid

EXAMPLES = 200
STEPS = 50
DEADLINE_MS = 10_000  # per example: a hang fails, a slow shared machine does not

SETTINGS = LeaseSettings(max_wait_s=300, max_waiting=6, gpu_sharing=(("2", 2),))
_LINKS = {
    (0, 1): (PciLink.SAME_CPU, 4),
    (2, 3): (PciLink.SINGLE_SWITCH, 0),
    (0, 2): (PciLink.CROSS_CPU, 0),
}
# GPU 3 in MIG mode, in one of two layouts (a MIG change switches them).
NODES: dict[str, NodeInfo] = {
    "a": build_node([0, 0, 1, 1], _LINKS, {3: ["1g.10gb", "1g.10gb", "2g.20gb"]}, "a"),
    "b": build_node([0, 0, 1, 1], _LINKS, {3: ["3g.40gb", "1g.10gb"]}, "b"),
}
NAMES = ["0", "1", "2", "3", "3:0", "3:1", "3:2"]
PROFILES = ["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"]
FOREIGN_DEVICES = [
    "0",
    "1",
    "3:1",
    "all",
    "/dev/nvidia2",
    "nvidia.com/gpu=1",
    uuid(0),
    "/dev/nvidia-caps/nvidia-cap300",
]
STEPS_S = [0.0, 1.0, 10.0, 30.0, 59.0, 61.0, 200.0, 301.0, 601.0]
ENGINES = ("docker", "podman")
ENGINE = st.sampled_from(ENGINES)
WAITS = st.sampled_from([0.0, 0.0, 20.0, 400.0])
# What a question (may_start) may change: only what the passing of time does.
TIME_CHANGES = {
    ChangeKind.EXPIRED,
    ChangeKind.GRACE_ENDED,
    ChangeKind.TIMED_OUT,
    ChangeKind.DROPPED,
    ChangeKind.GRANTED,
    ChangeKind.FOREIGN_GONE,  # a container of an unknown engine, listed by none in time
}


@dataclass
class Box:
    """A container of the world the table follows."""

    id: str
    lease: LeaseLabel | None
    devices: tuple[str, ...]
    engine: str
    running: bool = False
    bound: str | None = None  # the lease the table bound it to (its changes said so)

    def container(self) -> Container:
        return Container(self.id, self.running, self.lease, self.devices, "--device", self.engine)


def _fits(unit: UnitView, exclusive: bool) -> bool:
    """Whether ``unit`` can take one more lease of that mode, by what the view shows."""
    if not unit.healthy or any(t.hold is Hold.FOREIGN for t in unit.holders):
        return False
    if exclusive:
        return not unit.holders
    return all(not t.exclusive for t in unit.holders) and len(unit.holders) < unit.sharing


# Preconditions are named functions, not lambdas: Hypothesis 6.100 (the declared minimum)
# describes a lambda by parsing its source at every rule choice, 40 times slower here.
def _any_granted(machine: LeaseMachine) -> bool:
    return bool(machine.seen)


def _any_waiting(machine: LeaseMachine) -> bool:
    return bool(machine.waiting)


def _any_container(machine: LeaseMachine) -> bool:
    return bool(machine.world)


def _any_running(machine: LeaseMachine) -> bool:
    return any(b.running for b in machine.world.values())


def _any_stopped(machine: LeaseMachine) -> bool:
    return any(not b.running for b in machine.world.values())


def _any_down(machine: LeaseMachine) -> bool:
    return bool(machine.down)


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.node = NODES["a"]
        self.health = [HEALTHY] * 4
        self.table = LeaseTable(self.node, self.health, SETTINGS, now_s=self.now)
        self.world: dict[str, Box] = {}
        self.seen: list[Lease] = []  # every lease granted: what containers are created with
        self.waiting: list[str] = []  # the tickets in line, first come first
        self.pids: dict[int, int] = {}  # GPU processes outside containers: pid -> GPU
        self.containers = 0
        self.down: set[str] = set()  # engines whose events and lists do not reach the table
        self.ghosts: dict[str, Box] = {}  # removed while their engine was down
        self.releasing: str | None = None  # the lease a release asks to end

    # --- driving the table, checking every answer and change ---------------------------

    def _do(self, op: Callable[[], Outcome[Any]]) -> Any:
        before = self.table.view()
        outcome = op()
        after = self.table.view()
        for change in outcome.changes:
            assert change.text.isprintable(), change.text
            self._follow(change, before, after)
        answer = outcome.answer
        if isinstance(answer, Granted | Refused | Queued | StartVerdict):
            assert answer.text.isprintable(), answer.text
        if isinstance(answer, Queued):
            assert self.waiting[-1] == answer.ticket
            assert answer.position == len(self.waiting)
        return answer

    def _follow(self, change: Change, before: TableView, after: TableView) -> None:
        if change.kind in (ChangeKind.GRANTED, ChangeKind.RELET):
            grant = change.grant
            assert grant is not None
            if change.ticket is not None:  # first come, first served
                assert self.waiting, change
                assert self.waiting[0] == change.ticket, (change, list(self.waiting))
                self.waiting.pop(0)
            else:  # nothing overtakes a waiting ask
                assert not self.waiting, (change.text, list(self.waiting))
            sharing = {u.name: u.sharing for u in after.units}
            for unit in grant.units:
                assert self.health[unit.gpu].healthy, f"leased unhealthy GPU {unit.gpu}"
                assert unit.sharing == sharing[unit.name], (change.text, unit)
                assert 1 <= unit.sharers <= unit.sharing, (change.text, unit)
                if grant.lease.exclusive:
                    assert unit.sharers == 1, (change.text, unit)
                shown = f"shared ({unit.sharers} of {unit.sharing})"
                assert grant.lease.exclusive or shown in change.text, (change.text, unit)
            keys = set(grant.lease.units)
            still = {(h.holder, h.source): h for h in after.foreign}
            for hold in before.foreign:
                kept = still.get((hold.holder, hold.source))
                if kept is not None:
                    assert not keys & set(hold.units) & set(kept.units), (change.text, hold)
            self.seen.append(grant.lease)
        if change.kind in (ChangeKind.BOUND, ChangeKind.RELET) and change.lease is not None:
            box = self.world.get(change.container_id or "")
            assert box is not None, change.text
            assert box.bound in (None, change.lease.id), (change.text, box)
            box.bound = change.lease.id
        elif change.kind in (ChangeKind.ENDED, ChangeKind.GRACE_ENDED) and change.lease:
            self._check_end(change.kind, change.lease)
            box = self.world.get(change.lease.container_id or "")
            if box is not None and box.bound == change.lease.id:
                box.bound = None
        elif change.kind is ChangeKind.QUEUED:
            assert change.ticket is not None
            self.waiting.append(change.ticket)
        elif change.kind in (ChangeKind.TIMED_OUT, ChangeKind.CANCELLED, ChangeKind.DROPPED):
            assert change.ticket in self.waiting
            self.waiting.remove(change.ticket)

    def _check_end(self, kind: ChangeKind, lease: Lease) -> None:
        """A bound lease ends by a rule only: released; its container removed, as its own
        engine told (an event, or its list without it); its time up."""
        if lease.container_id is None or lease.id == self.releasing:
            return
        if kind is ChangeKind.GRACE_ENDED:
            assert lease.until_s is not None, lease
            assert lease.until_s <= self.now, lease
            return
        assert lease.container_id not in self.world, f"{lease.id} ended, its container lives"
        ghost = self.ghosts.get(lease.container_id)
        assert ghost is None or ghost.engine not in self.down, f"{lease.id} ended unlisted"

    def _new_box(self, lease: LeaseLabel | None, devices: tuple[str, ...], engine: str) -> Box:
        self.containers += 1
        box = Box(cid(self.containers), lease, devices, engine)
        self.world[box.id] = box
        return box

    def _tell(self, box: Box, op: Callable[[], Outcome[Any]]) -> None:
        """``op`` (an event of ``box``) reaches the table unless its engine is down."""
        if box.engine not in self.down:
            self._do(op)

    def _remove(self, box: Box) -> None:
        del self.world[box.id]
        if box.engine in self.down:
            self.ghosts[box.id] = box

    def _pick(self, data: st.DataObject, running: bool | None = None) -> Box:
        ids = sorted(i for i, b in self.world.items() if running is None or b.running == running)
        return self.world[data.draw(st.sampled_from(ids))]

    # --- asks ----------------------------------------------------------------------------

    def _ask(self, ask: Ask) -> Any:
        """Ask, and check that no free unit is lost to it: with nobody waiting, an ask is
        refused for want of units (or queued) only when too few of those it may get fit."""
        before = self.table.view()
        answer = self._do(lambda: self.table.ask(ask, self.now))
        if before.waiting or not isinstance(answer, Refused | Queued):
            return answer
        fit = [u for u in before.units if _fits(u, ask.exclusive)]
        if ask.devices is not None:
            named = {u.key for u in NodeUnits(self.node).named(ask.devices)}
            assert not named <= {u.uuid for u in fit}, (ask, answer.text)
        elif ask.mig_profile is not None:
            assert len([u for u in fit if u.profile == ask.mig_profile]) < ask.count, answer
        else:
            assert len([u for u in fit if u.mig is None]) < ask.count, answer.text
        return answer

    @rule(count=st.integers(1, 3), exclusive=st.booleans(), wait=WAITS)
    def ask_count(self, count: int, exclusive: bool, wait: float) -> None:
        self._ask(Ask(count=count, exclusive=exclusive, wait_s=wait))

    @rule(
        devices=st.lists(st.sampled_from(NAMES), min_size=1, max_size=3),
        exclusive=st.booleans(),
        wait=WAITS,
    )
    def ask_devices(self, devices: list[str], exclusive: bool, wait: float) -> None:
        ask = Ask(devices=" ".join(devices), exclusive=exclusive, wait_s=wait)
        before = self.table.view()
        try:
            self._ask(ask)
        except InvalidAsk:  # a MIG device the layout does not have
            assert self.table.view() == before

    @rule(profile=st.sampled_from(PROFILES), count=st.integers(1, 2), wait=WAITS)
    def ask_mig(self, profile: str, count: int, wait: float) -> None:
        self._ask(Ask(count=count, mig_profile=profile, wait_s=wait))

    @precondition(_any_granted)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self.seen))
        self._release(lease.id)

    def _release(self, lease_id: str) -> None:
        self.releasing = lease_id
        try:
            self._do(lambda: self.table.release(lease_id, self.now))
        finally:
            self.releasing = None

    @precondition(_any_waiting)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.waiting))
        self._do(lambda: self.table.cancel(ticket, self.now))

    @rule(step_s=st.sampled_from(STEPS_S))
    def time_passes(self, step_s: float) -> None:
        self.now += step_s
        self._do(lambda: self.table.tick(self.now))

    # --- containers ----------------------------------------------------------------------

    @precondition(_any_granted)
    @rule(
        data=st.data(),
        with_devices=st.booleans(),
        extra=st.sampled_from([(), (), ("1",), ("all",)]),
        engine=ENGINE,
    )
    def create_leased(
        self, data: st.DataObject, with_devices: bool, extra: tuple[str], engine: str
    ) -> None:
        """A container created with the labels of a lease seen granted (maybe since ended,
        maybe bound to another container already: a clone)."""
        lease = data.draw(st.sampled_from(self.seen))
        devices = (lease.units if with_devices else ()) + extra
        box = self._new_box(read_label(labels_for(lease)), devices, engine)
        self._tell(box, lambda: self.table.created(box.container(), self.now))

    @rule(devices=st.lists(st.sampled_from(FOREIGN_DEVICES), max_size=2), engine=ENGINE)
    def create_foreign(self, devices: list[str], engine: str) -> None:
        box = self._new_box(None, tuple(devices), engine)
        self._tell(box, lambda: self.table.created(box.container(), self.now))

    @rule(
        count=st.integers(1, 2),
        named=st.none() | st.sampled_from(NAMES),
        exclusive=st.booleans(),
        extra=st.sampled_from([(), (), (), ("1",)]),
        engine=ENGINE,
    )
    def docker_run(
        self, count: int, named: str | None, exclusive: bool, extra: tuple[str, ...], engine: str
    ) -> None:
        """What the wrapper does: ask, create the container with the grant's labels (and
        devices), start it (on an engine that is down: unseen)."""
        ask = Ask(count=count, devices=named, exclusive=exclusive)
        try:
            grant = self._ask(ask)
        except InvalidAsk:
            return
        if not isinstance(grant, Granted):
            return
        box = self._new_box(read_label(labels_for(grant.lease)), grant.lease.units + extra, engine)
        self._tell(box, lambda: self.table.created(box.container(), self.now))
        self._start(box, obey=True)

    @rule(
        devices=st.lists(st.sampled_from(FOREIGN_DEVICES), min_size=1, max_size=2),
        engine=ENGINE,
    )
    def foreign_run(self, devices: list[str], engine: str) -> None:
        """``docker run --device ...`` past the table: it runs whatever the table says."""
        box = self._new_box(None, tuple(devices), engine)
        self._tell(box, lambda: self.table.created(box.container(), self.now))
        self._start(box, obey=False)

    @precondition(_any_stopped)
    @rule(data=st.data(), obey=st.booleans())
    def start(self, data: st.DataObject, obey: bool) -> None:
        """Started if the table says yes, or (``obey`` False: no authorization plugin)
        whatever it says."""
        self._start(self._pick(data, running=False), obey)

    def _start(self, box: Box, obey: bool) -> None:
        """Its engine down, it starts unseen, unasked (no authorization plugin reached)."""
        if box.engine in self.down:
            box.running = True
            return
        before = self.table.view()
        outcome = self.table.may_start(box.container(), self.now)
        assert {c.kind for c in outcome.changes} <= TIME_CHANGES
        self._do(lambda: outcome)  # what the passing of time did, checked as any change
        if not outcome.changes:
            after = self.table.view()
            assert (after.leases, after.foreign) == (before.leases, before.foreign)
        if obey and not outcome.answer.allowed:
            return
        box.running = True
        self._do(lambda: self.table.started(box.container(), self.now))

    @precondition(_any_running)
    @rule(data=st.data())
    def die(self, data: st.DataObject) -> None:
        box = self._pick(data, running=True)
        box.running = False
        self._tell(box, lambda: self.table.died(box.id, self.now))

    @precondition(_any_container)
    @rule(data=st.data())
    def destroy(self, data: st.DataObject) -> None:
        box = self._pick(data)
        self._remove(box)
        self._tell(box, lambda: self.table.destroyed(box.id, self.now))

    @precondition(_any_container)
    @rule(data=st.data(), what=st.sampled_from(["destroy", "die", "start"]))
    def missed_event_then_resync(self, data: st.DataObject, what: str) -> None:
        """An event lost: its engine lists its containers (if it is up)."""
        box = self._pick(data)
        if what == "destroy":
            self._remove(box)
        else:
            box.running = what == "start"
        if box.engine not in self.down:
            self._resync(box.engine)

    @rule(engine=ENGINE)
    def engine_lists(self, engine: str) -> None:
        """One engine lists its containers (its event stream reopened): the other's leases
        stay as they are."""
        if engine not in self.down:
            self._resync(engine)

    @rule(engine=ENGINE)
    def engine_goes_down(self, engine: str) -> None:
        """Its service stops (or its socket goes): its containers live on, unseen."""
        self.down.add(engine)

    @precondition(_any_down)
    @rule(data=st.data())
    def engine_comes_back(self, data: st.DataObject) -> None:
        engine = data.draw(st.sampled_from(sorted(self.down)))
        self.down.discard(engine)
        self._resync(engine)

    def _resync(self, engine: str) -> None:
        live = [b.container() for b in self.world.values() if b.engine == engine]
        self._do(lambda: self.table.resync(engine, live, self.now))

    @rule(pids=st.dictionaries(st.integers(100, 102), st.integers(0, 3), max_size=2))
    def gpu_processes(self, pids: dict[int, int]) -> None:
        self.pids = pids
        users = [GpuUser(gpu, None, pid) for pid, gpu in sorted(pids.items())]
        self._do(lambda: self.table.processes_seen(users, self.now))

    @rule(loads=st.lists(st.integers(0, 100), min_size=4, max_size=4))
    def sweep_loads(self, loads: list[int]) -> None:
        """A status sweep's loads (utilization alone): picks among equals follow them."""
        self.table.set_load([GpuLoad(pct) for pct in loads])

    # --- the node --------------------------------------------------------------------------

    @rule(gpu=st.integers(0, 3), ok=st.booleans())
    def health_changes(self, gpu: int, ok: bool) -> None:
        self.health[gpu] = HEALTHY if ok else sick(since_s=self.now)
        health = list(self.health)
        self._do(lambda: self.table.set_health(health, self.now))

    @rule()
    def mig_change(self) -> None:
        """GPU 3's MIG devices are made anew; the integrator resyncs after a node change."""
        self.node = NODES["b" if self.node is NODES["a"] else "a"]
        node, health = self.node, list(self.health)
        self._do(lambda: self.table.set_node(node, health, self.now))
        for engine in ENGINES:
            if engine not in self.down:
                self._resync(engine)

    @rule(
        lose_snapshot=st.booleans(),
        older_agent=st.booleans(),
        order=st.permutations(ENGINES),
        goes_down=st.sampled_from([(), (), ("podman",), ("docker",)]),
    )
    def agent_restarts(
        self, lose_snapshot: bool, older_agent: bool, order: list[str], goes_down: tuple[str]
    ) -> None:
        """A new table from the snapshot (through JSON; ``older_agent``: without the
        engines, as an older agent wrote it), then each engine that is up lists its
        containers, in any order (one that is down, ``goes_down`` with the agent among them,
        lists when it comes back); the queue is not kept (its askers were the old
        process's connections)."""
        self.down.update(goes_down)
        saved = json.loads(json.dumps(snapshot_to_json(self.table.snapshot())))
        if older_agent:
            for entry in saved["leases"] + saved["foreign"]:
                del entry["engine"]
            for entry in saved["foreign"]:
                del entry["until_s"]
        self.table = LeaseTable(self.node, list(self.health), SETTINGS, now_s=self.now)
        self.waiting.clear()
        for box in self.world.values():
            box.bound = None  # the new table binds them again (its changes say so)
        if lose_snapshot:
            self.pids = {}  # the processes' holds went with it; the next sweep finds them
        else:
            snapshot = snapshot_from_json(saved)
            self._do(lambda: self.table.restore(snapshot, self.now))
            for lease in self.table.view().leases:  # each container keeps its restored lease
                restored = self.world.get(lease.container_id or "")
                if restored is not None:
                    restored.bound = lease.id
        self._do(lambda: self.table.followed(ENGINES, self.now))
        for engine in order:
            if engine not in self.down:
                self._resync(engine)

    # --- what must always hold ------------------------------------------------------------

    @invariant()
    def an_exclusive_gpu_has_one_holder_and_a_shared_one_no_more_than_its_count(self) -> None:
        view = self.table.view()
        by_key: dict[str, list[Lease]] = {}
        for lease in view.leases:
            for key in lease.units:
                by_key.setdefault(key, []).append(lease)
        units = {u.uuid: u for u in view.units}
        for key, leases in by_key.items():
            if any(x.exclusive for x in leases):
                assert len(leases) == 1, (key, leases)
            if key in units:
                assert len(leases) <= units[key].sharing, (key, leases)

    @invariant()
    def every_holder_is_one_the_world_has(self) -> None:
        """No GPU is lost: each lease and foreign hold stands for something that exists, or
        for a container removed unseen while its engine is down (or, of an unknown engine,
        for the grace time at most)."""
        view = self.table.view()
        bound = [x.container_id for x in view.leases if x.container_id is not None]
        assert len(bound) == len(set(bound))
        gpus = NodeUnits(self.node)
        for box in self.world.values():
            if box.bound is not None:  # a container keeps the lease it was bound to
                kept = self.table.lease(box.bound)
                assert kept is not None, box
                assert kept.container_id == box.id, (box, kept)
        for lease in view.leases:
            if lease.state is LeaseState.PENDING:
                assert lease.container_id is None
                assert lease.engine is None
                assert lease.until_s == lease.since_s + SETTINGS.pending_s
                for key in lease.units:
                    unit = gpus.get(key)
                    assert unit is not None
                    assert self.health[unit.gpu].healthy
                continue
            if lease.until_s is not None:
                assert view.now_s < lease.until_s <= view.now_s + SETTINGS.grace_s
            holder = self._holder(lease.container_id or "", lease.engine, lease.until_s)
            if holder is None:
                continue  # a ghost: its engine has not listed since it was removed
            if lease.state is LeaseState.RUNNING:
                assert holder.running
                assert lease.until_s is None or lease.engine is None
            else:
                assert not holder.running
                assert lease.until_s is not None
        for hold in view.foreign:
            if hold.source is ForeignSource.CONTAINER:
                held_by = self._holder(hold.holder, hold.engine, hold.until_s)
                assert held_by is None or held_by.running
                if hold.until_s is not None:
                    assert hold.engine is None
                    assert view.now_s < hold.until_s <= view.now_s + SETTINGS.grace_s
            else:
                assert (hold.engine, hold.until_s) == (None, None)
                assert hold.holder in {f"pid {pid}" for pid in self.pids}

    def _holder(self, container_id: str, engine: str | None, until_s: float | None) -> Box | None:
        """The container a bound lease or container hold stands for, where the table can
        know its state (its engine is up and has told it so); None for one it cannot: of an
        engine that is down, or removed unseen (a ghost) while its engine was down."""
        box = self.world.get(container_id)
        if box is None:
            ghost = self.ghosts.get(container_id)
            assert ghost is not None, f"{container_id[:12]} is no container"
            if ghost.engine not in self.down:  # listed since: only an unknown engine's
                assert engine is None, (container_id[:12], engine)
                assert until_s is not None, container_id[:12]
            return None
        if box.engine in self.down:
            return None
        assert engine == box.engine, (container_id[:12], engine, box.engine)
        return box

    @invariant()
    def the_queue_is_the_line_the_askers_stand_in(self) -> None:
        assert [w.ticket for w in self.table.view().waiting] == self.waiting

    def teardown(self) -> None:
        self._all_leave()

    def _all_leave(self) -> None:
        """Every engine back (each lists its containers), every container removed, every
        ask withdrawn, every process gone, every grant released, and what an unknown
        engine's containers held kept no longer than its bound: then every GPU is free, and
        every healthy one can be leased again."""
        for engine in sorted(self.down):
            self.down.discard(engine)
            self._resync(engine)
        for box_id in sorted(self.world):
            del self.world[box_id]
            self._do(partial(self.table.destroyed, box_id, self.now))
        for ticket in list(self.waiting):
            self._do(partial(self.table.cancel, ticket, self.now))
        self.pids = {}
        self._do(lambda: self.table.processes_seen([], self.now))
        for lease in self.table.view().leases:
            if lease.state is not LeaseState.RUNNING:
                self._release(lease.id)
        view = self.table.view()
        for lease in view.leases:  # the ghosts of an unknown engine, each with its bound
            assert (lease.engine, lease.state) == (None, LeaseState.RUNNING), lease
            assert lease.container_id in self.ghosts, lease
        assert all(h.holder in self.ghosts and h.until_s is not None for h in view.foreign)
        while (due := self.table.next_deadline_s()) is not None:
            self.now = max(self.now, due)
            self._do(partial(self.table.tick, self.now))
        self.ghosts.clear()
        view = self.table.view()
        assert (view.leases, view.foreign, view.waiting) == ((), (), ())
        assert all(u.state is UnitState.FREE for u in view.units)
        usable = [u.name for u in view.units if u.healthy]
        if usable:
            ask = Ask(devices=" ".join(usable))
            grant = self._do(lambda: self.table.ask(ask, self.now))
            assert isinstance(grant, Granted), grant
            self._do(lambda: self.table.release(grant.lease.id, self.now))


LeaseMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=DEADLINE_MS,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLeaseTableProperty = LeaseMachine.TestCase
