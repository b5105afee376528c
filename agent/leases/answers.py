"""What the lease table answers: grants, refusals, places in the queue, start verdicts, and
the changes every operation reports. All frozen values of plain fields, for JSON."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

from agent.leases.holders import Lease

T_co = TypeVar("T_co", covariant=True)


class Hold(enum.StrEnum):
    """Why a unit cannot be handed out now (``Taken.hold``)."""

    PENDING = "pending"  # granted to a lease whose container is not created yet
    RUNNING = "running"  # leased to a running container
    STOPPED = "stopped"  # leased to a stopped container, within its grace time
    FOREIGN = "foreign"  # held by a container (or process) the table did not lease it to
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class Taken:
    """One reason one unit is not free: a holder, or ill health."""

    unit: str  # its dev name: "3", "0:1"
    uuid: str | None
    hold: Hold
    lease_id: str | None = None
    container_id: str | None = None  # foreign: the holder (a container id, or "pid <n>")
    since_s: float | None = None  # lease: granted; foreign: seen; unhealthy: since
    # pending: expiry; stopped: end of grace; a container of an unknown engine that an
    # engine's list lacked: when it ends unless an engine lists it
    until_s: float | None = None
    why: str | None = None  # foreign: how it got it; unhealthy: the reason; pending: owner
    exclusive: bool = True


class Refusal(enum.StrEnum):
    """The kind of a refusal, for programs (which never parse the text)."""

    NOT_ENOUGH = "not_enough"  # fewer free units than asked; not asked to wait
    TAKEN = "taken"  # a named device is held
    UNHEALTHY = "unhealthy"  # a named device is unhealthy
    IMPOSSIBLE = "impossible"  # the node does not have that many (of that profile) at all
    OTHERS_WAITING = "others_waiting"  # asks wait before this one; not asked to wait
    QUEUE_FULL = "queue_full"
    TIMED_OUT = "timed_out"  # waited as long as asked
    GONE = "gone"  # a device is no longer on the node (driver reload, MIG change)
    UNKNOWN_LEASE = "unknown_lease"
    IN_USE = "in_use"  # releasing a lease whose container runs
    OTHER_CONTAINER = "other_container"  # the lease is bound to another container
    BOUND = "bound"  # releasing an unused lease that a container has (or carries the label of)
    UNCHECKED = "unchecked"  # releasing an unused lease: an engine's containers were not listed
    NO_ENGINE_ACCESS = "no_engine_access"  # an engine's socket refuses the agent: no lease


@dataclass(frozen=True, slots=True)
class Refused:
    """No: ``text`` is the one line for a person, ``taken`` what stands in the way."""

    kind: Refusal
    text: str
    taken: tuple[Taken, ...] = ()


@dataclass(frozen=True, slots=True)
class GrantedUnit:
    """One unit of a grant, with its sharing said: ``sharers`` of ``sharing`` leases."""

    name: str  # dev name: "3", "0:1"
    uuid: str | None
    gpu: int
    mig: int | None
    profile: str | None
    path: str | None  # the GPU's device file
    sharing: int  # how many leases may share it (an exclusive lease takes it alone)
    sharers: int  # leases on it now, this one included


@dataclass(frozen=True, slots=True)
class Granted:
    """Yes: the lease (pending until its container is created), its units and the cpuset
    hint (the NUMA nodes of its GPUs, for ``--cpuset-mems``/``--cpuset-cpus``; None when
    asked without one, or when the NUMA nodes are unknown)."""

    lease: Lease
    units: tuple[GrantedUnit, ...]
    numa_nodes: tuple[int, ...] | None
    text: str

    @property
    def dev(self) -> str:
        """The ``dev`` entries of its units (UUIDs where known): what ``/docker/cli`` takes."""
        return " ".join(u.uuid or u.name for u in self.units)


@dataclass(frozen=True, slots=True)
class Queued:
    """Not now: waiting as ``ticket``, ``position`` in line (1: next), until ``until_s``."""

    ticket: str
    position: int
    until_s: float
    text: str


Answer = Granted | Refused | Queued


class Start(enum.StrEnum):
    YES = "yes"  # its lease holds (or it asks for no GPU the table gave another)
    RELET = "relet"  # its lease had ended; its GPUs were free and are leased to it again
    NO = "no"


@dataclass(frozen=True, slots=True)
class StartVerdict:
    """May a container be created or started: yes, yes after a re-lease, or no and why."""

    decision: Start
    text: str
    lease_id: str | None = None
    refusal: Refused | None = None

    @property
    def allowed(self) -> bool:
        return self.decision is not Start.NO


@dataclass(frozen=True, slots=True)
class Released:
    lease: Lease
    text: str


class ChangeKind(enum.StrEnum):
    GRANTED = "granted"  # a lease was granted (``ticket`` set: to a waiting ask)
    QUEUED = "queued"
    CANCELLED = "cancelled"  # a waiting ask was withdrawn
    TIMED_OUT = "timed_out"  # a waiting ask waited as long as it asked
    # a waiting ask can never be served now (its devices left the node, or the node has too few)
    DROPPED = "dropped"
    EXPIRED = "expired"  # a pending lease ended: no container was created with it in time
    REVOKED = "revoked"  # a pending lease ended: a unit became unhealthy or left the node
    BOUND = "bound"  # a pending lease was bound to its container
    RELET = "relet"  # a container whose lease had ended got its units again
    STARTED = "started"  # a lease's container runs (again)
    STOPPED = "stopped"  # a lease's container stopped: its grace time runs
    # a stopped container's lease ended, or that of a container of an unknown engine that no
    # engine listed within the grace time
    GRACE_ENDED = "grace_ended"
    ENDED = "ended"  # a lease ended: released, or its container was removed
    FOREIGN = "foreign"  # a foreign holder took units
    FOREIGN_GONE = "foreign_gone"
    CONFLICT = "conflict"  # a container runs on units the table gave another
    RESTORED = "restored"  # the table was restored from a snapshot
    # A container of an unknown engine (``Lease.engine`` None) ...
    LISTED = "listed"  # ... is in an engine's list (or event): its lease or hold is that one's
    UNLISTED = "unlisted"  # ... is not in an engine's list: it ends at ``until_s`` unless listed
    UNFOLLOWED = "unfollowed"  # a container's engine is not followed any more: now unknown


@dataclass(frozen=True, slots=True)
class Change:
    """One thing an operation changed, with its line for the log. ``grant`` and ``refusal``
    answer a waiting ask (``ticket``): what the integrator hands the asker that waits."""

    kind: ChangeKind
    text: str
    lease: Lease | None = None
    ticket: str | None = None
    container_id: str | None = None
    grant: Granted | None = None
    refusal: Refused | None = None


@dataclass(frozen=True, slots=True)
class Outcome(Generic[T_co]):
    """An operation's answer and the changes it made (empty: the table is as it was)."""

    answer: T_co
    changes: tuple[Change, ...] = ()
