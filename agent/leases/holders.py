"""Who holds a unit: leases (what the table granted) and foreign holders (what it did not)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

Owner = tuple[tuple[str, str], ...]  # an ask's owner labels, (key, value) in the asker's order

LEASE_ID = re.compile(r"lease-([1-9][0-9]{0,11})")  # the table's lease ids: lease-1, lease-2, …
# A container as the table names it: its engine's id (Docker and Podman: 64 hex digits), or
# a name where there is no id yet (a create the authorization plugin sees). ASCII letters,
# digits and _.- only, so that no holder passes for a process (``pid 42``) or, by a
# look-alike character, for another container.
CONTAINER_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")


class LeaseState(enum.StrEnum):
    PENDING = "pending"  # granted; its container is not created yet (it expires)
    RUNNING = "running"  # bound to a container that runs
    STOPPED = "stopped"  # bound to a container that exists and does not run (created, or
    # stopped): it ends when the grace time has passed, unless the container starts again


@dataclass(frozen=True, slots=True)
class Lease:
    """A grant of units to one asker, then to one container.

    ``units`` are unit keys (``Unit.key``); ``names`` their ``dev`` names when it was granted,
    for the lines that name a unit no longer on the node. ``until_s`` is when it ends by
    itself: a pending lease's expiry, a stopped container's end of grace, or the end of the
    wait for an unknown engine to list its running container; None while its container runs
    (and is its engine's). ``engine`` names the engine of its container (``Container.engine``):
    only that engine's list can end it. None for a pending lease, and for a bound one whose
    engine is unknown (restored from an older agent's state file, or of an engine the agent
    no longer follows). Times are Unix seconds.
    """

    id: str  # "lease-17"
    units: tuple[str, ...]
    names: tuple[str, ...]
    exclusive: bool
    owner: Owner
    asked: str  # how it was asked, in words: "2 GPUs", "MIG 1g.18gb", "devices 0 1"
    since_s: float  # when it was granted
    state: LeaseState = LeaseState.PENDING
    container_id: str | None = None
    until_s: float | None = None
    engine: str | None = None

    @property
    def number(self) -> int:
        """The id's number (``lease-17``: 17)."""
        return lease_number(self.id) or 0


def lease_number(lease_id: str) -> int | None:
    """The number of a lease id of the table's form, None for any other text."""
    match = LEASE_ID.fullmatch(lease_id)
    return int(match.group(1)) if match else None


class ForeignSource(enum.StrEnum):
    CONTAINER = "container"  # a running container's devices, not (all) leased to it
    PROCESS = "process"  # a GPU process the attribution sees, of nobody holding that GPU


@dataclass(frozen=True, slots=True)
class ForeignHold:
    """A holder of units that the table did not grant them to: it holds them exclusively.

    ``holder`` is a container id, or ``pid <n>`` for a GPU process outside any container.
    ``how`` says how it got them: what the integrator said (``--device /dev/nvidia1``,
    ``--gpus device=1``, ``/docker/cli``), or ``a GPU process``. A running container's hold
    (``ForeignSource.CONTAINER``) names its ``engine``, as a lease does (None: unknown; then
    ``until_s`` may say when it goes unless an engine lists the container); a process's hold
    has neither: each status sweep replaces those.
    """

    holder: str
    source: ForeignSource
    units: tuple[str, ...]
    how: str
    since_s: float
    container: bool = True  # holder is a container id (not a pid)
    engine: str | None = None
    until_s: float | None = None
