"""The usage ledger of a running agent: every ``interval_s`` a sweep is accounted, written,
and checked for idle GPUs (docs/usage.md).

Each tick takes the node's status the way every reader does (``StatusService.sweep``, as a
quiet reader: a scrape's sweep in flight is joined, and the resting PCIe sampler is left
resting, so the ledger adds one worker round trip per interval at most and no NVML call of
its own), the lease table's view (who holds each unit), and the owners of the GPU processes
(``agent.attribution``: its cache keeps the engines out of it). The table is told first what
the sweep shows (``agent.usage.table_feed``: each GPU's load, which picks weigh among
equally connected GPUs, and the GPU processes' holders), so that a process started outside
the engines makes its GPU foreign within one interval. From those it builds one
``UnitSample`` per unit (``build_samples``), runs them through the accounting and the idle
tracker, and submits the batch to the store (one transaction, on the store's own thread:
the event loop never waits for SQLite). Holders that became idle are acted on by policy
(``agent.usage.idle``): a line in the log, a stopped container's lease released, or the
container stopped through its engine.

The store is opened off the event loop once the agent serves (``start``): a ledger that
another agent holds (``LedgerBusy``) or that cannot be opened leaves the agent serving
without one, and says so in one line; the REST routes then answer 404 with that reason
(503 while it is being opened).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from agent.attribution.cgroup import OwnerKind
from agent.attribution.owners import Attributor, ProcessOwner
from agent.display import shown
from agent.engines.http import EngineError
from agent.leases.answers import Hold as TakenHold
from agent.leases.answers import Taken
from agent.leases.holders import Lease, LeaseState
from agent.leases.view import TableView
from agent.leasing.service import LeaseService
from agent.node.status import StatusService, StatusUnavailable, Sweep
from agent.usage.accounting import Accounting, Holder, UnitSample
from agent.usage.idle import IDLE_LABEL, IdlePolicy, IdleTracker, IdleUnit
from agent.usage.records import Batch, HolderKind
from agent.usage.store import LedgerStatus, LedgerStore, LedgerUnavailable
from agent.usage.table_feed import gpu_loads, gpu_users

log = logging.getLogger("nvidia-docker-plugin.usage")

COMPOSE_PROJECT = "com.docker.compose.project"
COMPOSE_SERVICE = "com.docker.compose.service"
DEFAULT_LABELS = (COMPOSE_PROJECT, COMPOSE_SERVICE, "team", "user")
LEDGER_FILE = "usage.db"  # in the state directory
MAX_SERIES = 1000  # owner-label series of the usage counters; beyond, "(other)"
# A lease whose container is not known yet waits this long for it before the labels of its
# ask are taken as its own (accounting.Holder.settled); the wrapper creates the container
# within a second of the grant.
SETTLE_S = 5.0
STOP_TIMEOUT_S = 10  # the engine's grace before it kills an idle container it stops
# While nobody reads status (the PCIe sampler rests), a sweep takes a new slow sample, which
# brings the GPUs' energy counters, when the last is older than this (one sample a minute).
ENERGY_SAMPLE_S = 60.0


@dataclass(frozen=True, slots=True)
class UsageSettings:
    path: Path
    interval_s: float = 10.0
    retention_s: float = 90 * 86400.0
    max_bytes: int = 1 << 30
    label_keys: tuple[str, ...] = DEFAULT_LABELS
    idle_after_s: float = 3600.0
    idle_policy: IdlePolicy = IdlePolicy.NOTIFY


class UsageLedger:
    """The accounting, the idle tracker and the store of one agent."""

    def __init__(
        self,
        settings: UsageSettings,
        status: StatusService,
        leases: LeaseService,
        attributor: Attributor,
        store: LedgerStore | None,
        *,
        off_reason: str | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.status = status
        self.leases = leases
        self.attributor = attributor
        self.store = store
        self.off_reason = off_reason  # why there is no store (None: there is one)
        self._clock = clock
        self._monotonic = monotonic
        self.accounting = Accounting(
            settings.label_keys,
            max_gap_s=3 * settings.interval_s,
            # a counter sampled once a minute moves about that often: a miss or two allowed
            max_energy_span_s=3 * ENERGY_SAMPLE_S,
        )
        self.idle = IdleTracker(
            settings.idle_after_s, settings.idle_policy, max_gap_s=3 * settings.interval_s
        )
        # Held and busy GPU-seconds since the agent started, by (label key, value): the
        # Prometheus counters (agent.metrics.usage_families).
        self.by_owner: dict[tuple[str, str], list[float]] = {}
        self.actions: dict[tuple[str, str], str] = {}  # (unit key, holder): what was done
        self._task: asyncio.Task[None] | None = None
        self._acting: set[asyncio.Task[None]] = set()
        if store is not None:
            self.accounting.resume(store.open_holds())

    @classmethod
    def for_agent(
        cls,
        settings: UsageSettings,
        status: StatusService,
        leases: LeaseService,
        attributor: Attributor,
    ) -> UsageLedger:
        """The agent's ledger, its store not open yet: ``start()`` opens it off the event
        loop (a large file's check takes about 2 s per GB), and the agent serves meanwhile."""
        for engine in attributor.engines.values():
            engine.wanted_labels = frozenset((*settings.label_keys, IDLE_LABEL))
        return cls(settings, status, leases, attributor, None)

    @property
    def opening(self) -> bool:
        """The store is being opened (neither open nor given up)."""
        return self.store is None and self.off_reason is None

    async def _open_store(self) -> None:
        """Open the store; on failure, one line and the agent goes on without a ledger."""
        settings = self.settings
        try:
            store = await asyncio.to_thread(
                LedgerStore.open,
                settings.path,
                retention_s=settings.retention_s,
                max_bytes=settings.max_bytes,
            )
        except LedgerUnavailable as err:  # LedgerBusy too: its one line names the file
            self.off_reason = str(err)
        except OSError as err:
            self.off_reason = f"the usage ledger {settings.path} cannot be opened: {err}"
        else:
            self.accounting.resume(store.open_holds())
            self.store = store
            return
        log.warning(
            "%s; the agent serves without a usage ledger (its GPU sweeps still feed the lease "
            "table and the idle policies)",
            self.off_reason,
        )

    @property
    def path(self) -> Path:
        return self.settings.path

    def store_status(self) -> LedgerStatus | None:
        return self.store.status() if self.store is not None else None

    async def flush_soon(self, timeout_s: float = 2.0) -> None:
        """Wait (at most ``timeout_s``) until what was submitted is written: a report asked
        right after a tick sees that tick."""
        if self.store is not None:
            await asyncio.to_thread(self.store.flush, timeout_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="usage-ledger")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task in list(self._acting):
            task.cancel()
        if self.store is not None:
            store, self.store = self.store, None
            self._submit_to(store, self.accounting.take_batch())
            await asyncio.to_thread(store.close)

    async def _run(self) -> None:
        if self.store is None:
            # without its file the ledger records nothing, but its sweeps still give the
            # lease table each GPU's load and GPU processes, and the idle policies run
            await self._open_store()
        interval = self.settings.interval_s
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except Exception:  # the ledger must never cost the agent anything else
                log.exception("The usage ledger's tick failed; it tries again next interval")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def tick(self) -> None:
        """One sweep accounted, written and checked for idle GPUs."""
        try:
            sweep = await self.status.sweep(quiet=True, sample_within_s=ENERGY_SAMPLE_S)
        except StatusUnavailable:
            return  # the driver is being replaced: the gap is not counted
        now_s = self._clock()
        now_mono = self._monotonic()
        owners = await self.attributor.owners(
            p.pid for status in sweep.statuses for p in status.processes
        )
        self.leases.set_load(gpu_loads(sweep))  # first: an ask served next picks by them
        self.leases.processes_seen(gpu_users(sweep, owners))
        view = self.leases.view()  # with the foreign holders just seen
        lease_facts = await self._lease_containers(view, owners)
        samples = build_samples(sweep, view, owners, lease_facts, now_s)
        self.accounting.observe(now_s, samples)
        newly_idle = self.idle.observe(now_s, samples, mono_s=now_mono)
        batch = self.accounting.take_batch()
        if batch is not None:
            self._count_owners(batch)
            if self.store is not None:
                self._submit_to(self.store, batch)
        for found in newly_idle:
            self._act(found)
        self._forget_actions()
        self._release_stopped()

    async def _lease_containers(
        self, view: TableView, owners: dict[int, ProcessOwner]
    ) -> dict[str, ProcessOwner]:
        """The name, image and labels of every leased and foreign container: those of this
        sweep's GPU processes as their owners say them (their engine known), the others
        from the attribution's cached lookups."""
        found = {
            owner.container_id: owner
            for owner in owners.values()
            if owner.in_container and owner.container_id
        }
        ids = [lease.container_id for lease in view.leases if lease.container_id is not None]
        ids += [hold.holder for hold in view.foreign if hold.container]
        for container_id in dict.fromkeys(ids):
            if container_id in found:
                continue
            known = await self.attributor.container(container_id)
            if known is not None:
                kind, facts = known
                found[container_id] = ProcessOwner(
                    kind, facts.id, facts.name, facts.image, labels=facts.labels
                )
        return found

    @staticmethod
    def _submit_to(store: LedgerStore, batch: Batch | None) -> None:
        if batch is not None:
            store.submit(batch)

    def _count_owners(self, batch: Batch) -> None:
        for delta in batch.deltas:
            if not delta.dim.startswith("label:"):
                continue
            key = (delta.dim.removeprefix("label:"), delta.value)
            if key not in self.by_owner and len(self.by_owner) >= MAX_SERIES:
                key = (key[0], "(other)")
            totals = self.by_owner.setdefault(key, [0.0, 0.0])
            totals[0] += delta.held_s
            totals[1] += delta.busy_s

    # -- idle policies ---------------------------------------------------------------------

    def _act(self, found: IdleUnit) -> None:
        holder = found.holder
        slot = (found.mig_uuid or found.gpu_uuid, holder.ident)
        idle_for = _duration(found.idle_s)
        who = _holder_text(holder)
        if found.policy is IdlePolicy.STOP and holder.container_id is not None:
            self.actions[slot] = "stopping"
            task = asyncio.get_running_loop().create_task(self._stop(found, slot, idle_for))
            self._acting.add(task)
            task.add_done_callback(self._acting.discard)
            return
        self.actions[slot] = "notified"
        log.warning(
            "GPU %s has been idle for %s, held by %s; policy %s%s",
            found.unit,
            idle_for,
            who,
            found.policy.value,
            ": its lease ends once its container is stopped"
            if found.policy is IdlePolicy.RELEASE
            else ": nothing done",
        )

    async def _stop(self, found: IdleUnit, slot: tuple[str, str], idle_for: str) -> None:
        holder = found.holder
        container_id = holder.container_id or ""
        known = await self.attributor.container(container_id)
        engine = self.attributor.engines.get(known[0] if known else OwnerKind.DOCKER)
        if engine is None:
            self.actions[slot] = "kept: no engine to stop it through"
            return
        path = f"/containers/{quote(container_id, safe='')}/stop?t={STOP_TIMEOUT_S}"
        try:
            answered = await engine.post(
                path, f"to stopping container {container_id[:12]}", timeout_s=STOP_TIMEOUT_S + 20
            )
        except EngineError as err:
            self.actions[slot] = "kept: the engine could not be asked"
            log.warning(
                "GPU %s has been idle for %s, held by %s; policy stop, but stopping it failed: %s",
                found.unit,
                idle_for,
                _holder_text(holder),
                err,
            )
            return
        if answered in (204, 304):
            self.actions[slot] = "stopped"
            log.warning(
                "Stopped %s: its GPU %s had been idle for %s (idle policy stop; the label "
                "%s=off keeps a container from this)",
                _holder_text(holder),
                found.unit,
                idle_for,
                IDLE_LABEL,
            )
        else:
            self.actions[slot] = f"kept: the engine answered HTTP {answered}"
            log.warning(
                "GPU %s has been idle for %s, held by %s; policy stop, but %s answered HTTP "
                "%d to the stop",
                found.unit,
                idle_for,
                _holder_text(holder),
                engine.what,
                answered,
            )

    def _release_stopped(self) -> None:
        """Idle units under ``release`` whose lease's container is stopped: end the lease."""
        stopped = {
            lease.id for lease in self.leases.view().leases if lease.state is LeaseState.STOPPED
        }
        for found in self.idle.idle:
            lease_id = found.holder.lease_id
            if found.policy is not IdlePolicy.RELEASE or lease_id not in stopped:
                continue
            self.leases.release(lease_id)
            stopped.discard(lease_id)
            self.actions[(found.mig_uuid or found.gpu_uuid, found.holder.ident)] = "released"
            log.warning(
                "Released %s: its container is stopped and GPU %s had been idle for %s "
                "(idle policy release)",
                lease_id,
                found.unit,
                _duration(found.idle_s),
            )

    def _forget_actions(self) -> None:
        """What was done for holders that are no longer idle (they worked again, or let
        their GPU go) is forgotten: an action is shown only beside an idle holder, and a new
        idle spell is acted on anew. A stop still in flight writes its outcome when done."""
        idle = {(u.mig_uuid or u.gpu_uuid, u.holder.ident) for u in self.idle.idle}
        for slot in [s for s in self.actions if s not in idle]:
            del self.actions[slot]

    def action_of(self, found: IdleUnit) -> str | None:
        return self.actions.get((found.mig_uuid or found.gpu_uuid, found.holder.ident))


def build_samples(
    sweep: Sweep,
    view: TableView,
    owners: dict[int, ProcessOwner],
    lease_containers: dict[str, ProcessOwner],
    now_s: float,
) -> list[UnitSample]:
    """One sample per unit of the table: its holders (leases, foreign holders, and GPU
    processes of nobody the table knows) and how busy it is. A unit whose work the sweep
    cannot rule out is ``active``: a whole GPU without a utilisation reading (it did not
    answer), a MIG device of a GPU that did not answer, or of a GPU running a process that
    the attribution cannot place (its MIG device is not known: it may be this one's)."""
    leases = {lease.id: lease for lease in view.leases}
    statuses = sweep.statuses
    samples: list[UnitSample] = []
    # The energy counters come with the slow sample: read when it was taken, not at now_s.
    age_s = sweep.throughput_age_s
    energy_at_s = now_s - age_s if age_s is not None else now_s
    for unit in view.units:
        if unit.gpu >= len(statuses) or unit.uuid is None:
            continue
        status = statuses[unit.gpu]
        device = sweep.node.devices[unit.gpu] if unit.gpu < len(sweep.node.devices) else None
        gpu_uuid = device.uuid if device is not None and device.uuid else unit.uuid
        whole = unit.mig is None
        holders: list[Holder] = []
        containers: set[str] = set()
        for taken in unit.holders:
            holder = _holder_of(taken, leases, lease_containers, now_s)
            if holder is not None and holder.ident not in {h.ident for h in holders}:
                holders.append(holder)
                if holder.container_id:
                    containers.add(holder.container_id)
        pids_of_holders = False
        for process in status.processes:
            owner = owners.get(process.pid)
            container_id = owner.container_id if owner is not None else None
            if container_id is not None and container_id in containers:
                pids_of_holders = True
                continue
            if not whole:
                # A MIG GPU's processes cannot be told apart by MIG device here: one that is
                # in no known place (another PID namespace, ended) may be this unit's work.
                if owner is None or owner.kind is OwnerKind.UNKNOWN:
                    pids_of_holders = True
                continue
            if f"pid {process.pid}" in {h.ident for h in holders}:
                continue  # the table's foreign holder of this process (agent.usage.table_feed)
            holder = _process_holder(process.pid, owner)
            if holder.ident not in {h.ident for h in holders}:
                holders.append(holder)
                pids_of_holders = True
        util = status.utilization.gpu_pct if whole else None
        unknown = util is None if whole else status.memory_used_mib is None
        samples.append(
            UnitSample(
                unit=unit.name,
                gpu_index=unit.gpu,
                gpu_uuid=gpu_uuid,
                mig_uuid=None if whole else unit.uuid,
                utilization_pct=util,
                memory_used_mib=status.memory_used_mib if whole else None,
                energy_mj=status.telemetry.total_energy_mj if whole else None,
                holders=tuple(holders),
                energy_at_s=energy_at_s,
                active=unknown or bool(util) or pids_of_holders,
            )
        )
    return samples


def _holder_of(
    taken: Taken,
    leases: dict[str, Lease],
    lease_containers: dict[str, ProcessOwner],
    now_s: float,
) -> Holder | None:
    if taken.hold is TakenHold.UNHEALTHY:
        return None
    if taken.hold is TakenHold.FOREIGN:
        ident = taken.container_id or "unknown"
        if ident.startswith("pid "):
            pid = int(ident.removeprefix("pid ")) if ident[4:].isdigit() else None
            return Holder(HolderKind.PROCESS, ident, pid=pid)
        facts = lease_containers.get(ident)
        labels = dict(facts.labels) if facts is not None else {}
        policy = labels.pop(IDLE_LABEL, None)
        return Holder(
            HolderKind.CONTAINER,
            ident,
            container_id=ident,
            container_name=facts.container_name if facts else None,
            image=facts.image if facts else None,
            labels=tuple(sorted(labels.items())),
            idle_policy=policy,
        )
    lease = leases.get(taken.lease_id or "")
    if lease is None:
        return None
    facts = lease_containers.get(lease.container_id or "")
    labels = dict(lease.owner)
    if facts is not None:
        labels.update(facts.labels)
    policy = labels.pop(IDLE_LABEL, None)
    return Holder(
        HolderKind.LEASE,
        lease.id,
        lease_id=lease.id,
        container_id=lease.container_id,
        container_name=facts.container_name if facts else None,
        image=facts.image if facts else None,
        labels=tuple(sorted(labels.items())),
        since_s=lease.since_s,
        idle_policy=policy,
        # the container's labels count for the whole lease, its pending seconds too
        settled=facts is not None or now_s - lease.since_s >= SETTLE_S,
        running=lease.state is LeaseState.RUNNING,
    )


def _process_holder(pid: int, owner: ProcessOwner | None) -> Holder:
    if owner is not None and owner.in_container and owner.container_id:
        labels = dict(owner.labels)
        policy = labels.pop(IDLE_LABEL, None)
        return Holder(
            HolderKind.CONTAINER,
            owner.container_id,
            container_id=owner.container_id,
            container_name=owner.container_name,
            image=owner.image,
            labels=tuple(sorted(labels.items())),
            idle_policy=policy,
        )
    return Holder(HolderKind.PROCESS, f"pid {pid}", pid=pid)


def _holder_text(holder: Holder) -> str:
    if holder.kind is HolderKind.PROCESS:
        return f"process {holder.pid}"
    name = shown(holder.container_name) if holder.container_name else None
    container = f"container {name}" if name else f"container {(holder.container_id or '?')[:12]}"
    if holder.kind is HolderKind.LEASE:
        return f"{container} ({holder.lease_id})" if holder.container_id else str(holder.lease_id)
    return container


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def idle_rows(ledger: UsageLedger) -> Sequence[tuple[IdleUnit, str | None]]:
    """Every idle holder now, with what was done about it."""
    return [(found, ledger.action_of(found)) for found in ledger.idle.idle]
