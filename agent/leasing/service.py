"""The node's lease table at work: one owner in the event loop, its state on disk, its timer.

``LeaseService`` is the only code that calls the ``agent.leases.LeaseTable`` (a pure model):
every ask, release, engine event, health or node change and the passing of time goes
through it, one call at a time, in the event loop, with ``now_s`` the wall clock. After
every call it:

- logs each change's line (``Change.text``);
- answers the asks that wait in the queue: a ``GRANTED``, ``TIMED_OUT`` or ``DROPPED``
  change names the ticket, whose waiting request gets the grant or the refusal;
- writes the table's snapshot to ``<state dir>/leases.json`` (0600, through
  ``agent.files.write_atomically``: never a half file), when the call changed it, at most
  one write in flight (later changes fold into one more write);
- sets its timer for the table's next deadline (a pending lease's expiry, a stopped
  container's end of grace, a waiting ask's end).

At start (``open``) the snapshot is read back, within ``MAX_STATE_BYTES``, without following
links; one that cannot be read is one line, and the table starts empty: what the engines
list then (``resync``) rebuilds the leases of live containers from their labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

from agent import files
from agent.gpu.model import NodeInfo
from agent.health.rule import DeviceHealth
from agent.leases.answers import (
    Change,
    ChangeKind,
    Granted,
    Outcome,
    Queued,
    Refusal,
    Refused,
    Released,
    StartVerdict,
)
from agent.leases.asks import Ask
from agent.leases.containers import Container, GpuUser
from agent.leases.holders import Lease, LeaseState
from agent.leases.loads import GpuLoad
from agent.leases.plans import FreeSet
from agent.leases.settings import LeaseSettings
from agent.leases.snapshot import Snapshot, SnapshotError, snapshot_from_json, snapshot_to_json
from agent.leases.table import LeaseTable
from agent.leases.texts import short_id, when
from agent.leases.view import TableView

log = logging.getLogger("nvidia-docker-plugin.leases")

STATE_NAME = "leases.json"
MAX_STATE_BYTES = 8 * 1024 * 1024  # 4,096 leases and foreign holders, each a few hundred bytes
STATE_MODE = 0o600

Answered = Granted | Refused


class NotListed(Exception):
    """An engine's containers could not be listed (one line: which engine, and why)."""


# The containers that carry a lease's label, of every engine that may have created one
# (``EngineFeed.labelled``); ``NotListed`` when an engine that may have cannot be asked.
Labelled = Callable[[str], Awaitable[Sequence[Container]]]


class LeaseService:
    """The lease table of a running agent; see the module docstring."""

    def __init__(
        self,
        table: LeaseTable,
        state_dir: Path | None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._table = table
        self._state_dir = state_dir
        self._clock = clock
        self._waiting: dict[str, asyncio.Future[Answered]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._save: asyncio.Task[None] | None = None
        self._dirty = False
        self._closed = False
        self._labelled: Labelled | None = None
        self._denied: Callable[[], str | None] = lambda: None
        self.saves = 0  # snapshots written, since start

    @classmethod
    def open(
        cls,
        node: NodeInfo,
        health: Sequence[DeviceHealth],
        settings: LeaseSettings,
        state_dir: Path | None,
        *,
        numbered_above: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> LeaseService:
        """The table of ``node``, restored from the state file if there is a usable one; new
        leases are numbered above ``numbered_above`` too (the highest lease number the usage
        ledger names: without the state file, the table knows only the live containers')."""
        now = clock()
        service = cls(LeaseTable(node, health, settings, now), state_dir, clock=clock)
        snapshot = service._read_state()
        if snapshot is not None:
            service._apply(service._table.restore(snapshot, now))
        service._table.number_above(numbered_above)
        return service

    @property
    def state_file(self) -> Path | None:
        return None if self._state_dir is None else self._state_dir / STATE_NAME

    def describe(self) -> str:
        """One line for the start log: units, sharing, timeouts and what was restored."""
        view, settings = self._table.view(), self._table.settings
        gpus = len({u.gpu for u in view.units})
        return (
            f"{gpus} GPUs ({len(view.units)} leasable devices), {settings.sharing} shared "
            f"lease(s) per GPU, pending {settings.pending_s:g} s, grace {settings.grace_s:g} s, "
            f"{len(view.leases)} lease(s) and {len(view.foreign)} foreign holder(s) now"
        )

    # -- asks and releases (the REST API) -------------------------------------------------

    async def ask(self, ask: Ask) -> Answered:
        """Grant or refuse ``ask``; one that waits is answered when the queue serves it or
        its time is up. ``InvalidAsk`` (nothing changed) for a malformed ask. A caller that
        goes away while waiting (a cancelled task) leaves the queue. Refused with
        ``NO_ENGINE_ACCESS`` (nothing changed) while an engine's socket refuses the agent
        (``refuse_while``)."""
        denied = self._denied()
        if denied is not None:
            return Refused(
                Refusal.NO_ENGINE_ACCESS,
                f"no GPU leases: the agent {denied}; without that engine's container events "
                "a lease could not follow its container, and its GPUs could be given twice "
                "(docs/leases.md)",
            )
        outcome = self._table.ask(ask, self._clock())
        answer = outcome.answer
        future: asyncio.Future[Answered] | None = None
        if isinstance(answer, Queued):
            future = asyncio.get_running_loop().create_future()
            self._waiting[answer.ticket] = future
        self._apply(outcome)
        if not isinstance(answer, Queued):
            return answer
        assert future is not None
        try:
            return await future
        except asyncio.CancelledError:
            self._waiting.pop(answer.ticket, None)
            if future.done() and not future.cancelled():
                served = future.result()  # served just as its asker left: give it back
                if isinstance(served, Granted):
                    self._apply(self._table.release(served.lease.id, self._clock()))
            else:
                self._apply(self._table.cancel(answer.ticket, self._clock()))
            raise

    def release(self, lease_id: str) -> Released | Refused:
        outcome = self._table.release(lease_id, self._clock())
        self._apply(outcome)
        return outcome.answer

    def find_labelled_with(self, labelled: Labelled) -> None:
        """How ``release_unused`` finds the containers that carry a lease's label (the
        engine feed gives its own at start)."""
        self._labelled = labelled

    def refuse_while(self, denied: Callable[[], str | None]) -> None:
        """Asks are refused while ``denied`` gives a line: an engine whose socket refuses
        the agent (EACCES; the engine feed gives its own at start). An engine that is down
        refuses nothing: it creates no containers, and its list resyncs the table when it
        is back; a refused socket is a setting that stays wrong until someone mends it."""
        self._denied = denied

    async def release_unused(self, lease_id: str) -> Released | Refused:
        """Release ``lease_id`` only if it is pending and no container carries its label:
        its asker's ``docker run`` ended without creating the container (a bad flag, a
        name in use, an engine that refused). The engines are asked first (``Labelled``):
        a container whose create event has not been read yet binds the lease instead, as
        that event would; without a way to ask them (no engine feed started: the table
        then learns of no container), the lease is released as its expiry would end it.
        Refused with ``BOUND`` for a lease that has a container, ``UNCHECKED`` (nothing
        changed) when an engine could not be asked, ``UNKNOWN_LEASE`` for one the table
        does not have."""
        refused = self._in_use(lease_id)
        if refused is not None:
            return refused
        found: Sequence[Container] = ()
        if self._labelled is not None:
            try:
                found = await self._labelled(lease_id)
            except NotListed as err:
                lease = self._table.lease(lease_id)
                until = f" at {when(lease.until_s)}" if lease and lease.until_s else ""
                text = (
                    f"{lease_id} kept: {err}, so a container created with it may be there; "
                    f"unless one is, it ends by itself{until}"
                )
                return Refused(Refusal.UNCHECKED, text)
        for container in found:
            self.created(container)  # what its create event does, when it comes
        refused = self._in_use(lease_id)
        if refused is not None:
            return refused
        if found:
            text = (
                f"{lease_id} kept: container {short_id(found[0].id)} carries its labels "
                "(the agent's log says why it does not hold it)"
            )
            return Refused(Refusal.BOUND, text)
        return self.release(lease_id)

    def _in_use(self, lease_id: str) -> Refused | None:
        """Why ``release_unused`` leaves ``lease_id`` alone (None: it is pending)."""
        lease = self._table.lease(lease_id)
        if lease is None:  # the table's answer for a lease it does not have
            answer = self.release(lease_id)
            return answer if isinstance(answer, Refused) else None
        if lease.state is LeaseState.PENDING:
            return None
        text = (
            f"{lease.id} is {lease.state.value} with container "
            f"{short_id(lease.container_id or '')}: not released (it ends with its container)"
        )
        return Refused(Refusal.BOUND, text)

    def left_s(self, lease: Lease) -> float | None:
        """Seconds until ``lease`` ends by itself (a pending one: unless its container is
        created), by the table's clock; None when it has no end."""
        if lease.until_s is None:
            return None
        return max(0.0, lease.until_s - self._clock())

    def view(self) -> TableView:
        return self._table.view()

    def free_set(self, count: int, profile: str | None = None) -> FreeSet:
        """What an exclusive ask for ``count`` would get now (``LeaseTable.free_set``)."""
        return self._table.free_set(count, profile)

    def lease(self, lease_id: str) -> Lease | None:
        return self._table.lease(lease_id)

    # -- what the node and the engines say -----------------------------------------------

    def may_start(self, container: Container) -> StartVerdict:
        """May ``container`` be created or started now (the authorization plugin asks before
        the engine does it)? Only the passing of time changes the table."""
        outcome = self._table.may_start(container, self._clock())
        self._apply(outcome)
        return outcome.answer

    def created(self, container: Container) -> None:
        self._apply(self._table.created(container, self._clock()))

    def started(self, container: Container) -> None:
        self._apply(self._table.started(container, self._clock()))

    def died(self, container_id: str) -> None:
        self._apply(self._table.died(container_id, self._clock()))

    def destroyed(self, container_id: str) -> None:
        self._apply(self._table.destroyed(container_id, self._clock()))

    def resync(self, engine: str, containers: Iterable[Container]) -> None:
        """Every container ``engine`` has now (at start, when its event stream reopens):
        ends only what that engine's containers held (``LeaseTable.resync``)."""
        self._apply(self._table.resync(engine, containers, self._clock()))

    def followed(self, engines: Iterable[str]) -> None:
        """The engines the feed follows: leases of any other engine's containers count as
        of an unknown engine (``LeaseTable.followed``)."""
        self._apply(self._table.followed(engines, self._clock()))

    def processes_seen(self, users: Iterable[GpuUser]) -> None:
        self._apply(self._table.processes_seen(users, self._clock()))

    def set_health(self, health: Sequence[DeviceHealth]) -> None:
        self._apply(self._table.set_health(health, self._clock()))

    def set_node(self, node: NodeInfo, health: Sequence[DeviceHealth]) -> None:
        self._apply(self._table.set_node(node, health, self._clock()))

    def set_load(self, loads: Sequence[GpuLoad | None]) -> None:
        """Each GPU's load in the latest status sweep (the usage ledger's, every interval):
        what picks weigh among equally connected GPUs. Changes no lease."""
        self._table.set_load(loads)

    # -- after every call ------------------------------------------------------------------

    def _apply(self, outcome: Outcome[object]) -> None:
        if self._closed:
            return  # closed: what the waiters it woke change is neither logged nor written
        for change in outcome.changes:
            self._log(change)
            self._answer_waiting(change)
        if outcome.changes:
            self._save_soon()
        self._arm()

    @staticmethod
    def _log(change: Change) -> None:
        quiet = change.kind in (ChangeKind.QUEUED, ChangeKind.CANCELLED)
        log.log(logging.DEBUG if quiet else logging.INFO, "%s", change.text)

    def _answer_waiting(self, change: Change) -> None:
        if change.ticket is None or (change.grant is None and change.refusal is None):
            return  # QUEUED, CANCELLED: nobody to answer yet, or any more
        future = self._waiting.pop(change.ticket, None)
        if future is None or future.done():
            return
        if change.grant is not None:
            future.set_result(change.grant)
        elif change.refusal is not None:
            future.set_result(change.refusal)

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self._table.next_deadline_s()
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, deadline - self._clock()) + 0.001  # just past it
        self._timer = loop.call_later(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._apply(self._table.tick(self._clock()))

    # -- the state file ----------------------------------------------------------------------

    def _read_state(self) -> Snapshot | None:
        path = self.state_file
        if path is None or not (path.is_symlink() or path.exists()):
            return None  # a link, even to nowhere, is refused below with its line
        try:
            raw = json.loads(
                files.read_regular(path, limit=MAX_STATE_BYTES, what="lease state", follow=False)
            )
            return snapshot_from_json(raw)
        except (files.UnusableFile, SnapshotError) as err:
            why = str(err)
        except (ValueError, RecursionError):
            why = "not JSON"
        log.error(
            "Leases: the state file %s cannot be used (%s): starting from the containers' "
            "labels alone",
            path,
            why,
        )
        return None

    def _save_soon(self) -> None:
        if self._state_dir is None:
            return
        self._dirty = True
        if self._save is None or self._save.done():
            self._save = asyncio.get_running_loop().create_task(self._saving(), name="leases")

    async def _saving(self) -> None:
        while self._dirty:
            self._dirty = False
            data = (json.dumps(snapshot_to_json(self._table.snapshot())) + "\n").encode()
            assert self._state_dir is not None
            try:
                await asyncio.to_thread(
                    files.write_atomically, self._state_dir, STATE_NAME, data, mode=STATE_MODE
                )
                self.saves += 1
            except OSError as err:
                log.error("Leases: the state file %s not written: %s", self.state_file, err)

    async def settled(self) -> None:
        """Wait until the state file holds every change so far (tests, shutdown)."""
        while self._save is not None and not self._save.done():
            await asyncio.shield(self._save)

    async def close(self) -> None:
        """Stop the timer, cancel the asks that wait (nothing is applied after this), and
        wait for the state file write in flight, which holds every change so far."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()
        with contextlib.suppress(Exception):
            await self.settled()
