"""What the ledger stores, as plain values: holds, hourly totals, and the batch that carries
both from the accounting (``agent.usage.accounting``) to the store (``agent.usage.store``).

A *hold* is one holder on one GPU unit (a whole GPU, or one MIG device) from the first sweep
that saw it there to the last: a lease (pending, then bound to its container), a container
that has the unit without a lease (a foreign container), or a GPU process outside any
container. Its figures are totals since it started: ``held_s`` (GPU-seconds held: wall
seconds, one per unit), ``busy_s`` (the unit's utilisation integrated over those seconds,
shared equally among the holders of a shared unit), ``peak_memory_mib`` and ``energy_j``
(the GPU's energy counter over the hold, shared like ``busy_s``; None where the GPU has no
counter, or for a MIG device).

Hourly totals (``HourDelta``) are the same figures added up per UTC hour and per grouping
(``gpu``, ``image``, ``label:KEY``): what a report over a long range reads, so that a year
of holds is answered from a few thousand rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]  # (key, value), sorted by key


class HolderKind(enum.StrEnum):
    LEASE = "lease"  # a lease of the table (docs/leases.md)
    CONTAINER = "container"  # a container on the unit without a lease of it
    PROCESS = "process"  # a GPU process outside any container (its pid)


@dataclass(slots=True)
class Hold:
    """One holder on one unit; ``key`` is unique over the ledger's life (it ends with the
    start time), and a later write of the same key replaces the earlier figures."""

    key: str
    gpu_uuid: str
    gpu_index: int
    unit: str  # the unit's dev name: "3", "0:1"
    mig_uuid: str | None
    holder: HolderKind
    lease_id: str | None
    container_id: str | None
    container_name: str | None
    image: str | None
    pid: int | None
    labels: Labels  # the owner labels recorded (docs/usage.md): Compose project, team, ...
    started_s: float  # Unix seconds
    last_seen_s: float
    ended_s: float | None  # None while it lasts
    held_s: float = 0.0
    busy_s: float = 0.0
    peak_memory_mib: int | None = None
    energy_j: float | None = None


@dataclass(frozen=True, slots=True)
class HourDelta:
    """What to add to one hour's total of one group: ``dim`` is ``gpu``, ``image`` or
    ``label:KEY``; ``value`` the group's key (a GPU UUID, an image, a label's value)."""

    hour_s: int  # the hour's first second (Unix, UTC)
    dim: str
    value: str
    held_s: float
    busy_s: float
    energy_j: float  # 0.0 where unknown


@dataclass(frozen=True, slots=True)
class Batch:
    """One write: the holds that changed (their figures now) and the hourly deltas since the
    last batch; one transaction."""

    holds: tuple[Hold, ...]
    deltas: tuple[HourDelta, ...]


GROUPINGS = ("gpu", "container", "image")  # and "label:KEY"


def hour_of(t_s: float) -> int:
    """The first second of the UTC hour ``t_s`` falls in."""
    return int(t_s // 3600) * 3600
