"""The table as the REST API lists it: every unit with its state and holders, every
lease, every foreign holder and every waiting ask."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from agent.leases.answers import Hold, Taken
from agent.leases.holders import ForeignHold, Lease
from agent.leases.occupancy import Occupancy
from agent.leases.units import Unit
from agent.leases.waiting import Waiting


class UnitState(enum.StrEnum):
    FREE = "free"  # no holder (it may still be unhealthy: see ``healthy``)
    PENDING = "pending"  # granted, its container not created yet
    LEASED = "leased"  # leased to one container (or shared by several)
    FOREIGN = "foreign"  # held by a container or process the table did not lease it to
    CONFLICT = "conflict"  # leased, and held by a foreign holder too


@dataclass(frozen=True, slots=True)
class UnitView:
    name: str  # dev name: "3", "0:1"
    uuid: str | None
    gpu: int
    mig: int | None
    profile: str | None
    numa_node: int | None
    state: UnitState
    healthy: bool
    health_reason: str | None
    sharing: int  # how many shared leases it takes at once
    holders: tuple[Taken, ...]


@dataclass(frozen=True, slots=True)
class TableView:
    now_s: float  # the table's clock: the latest time it was given
    units: tuple[UnitView, ...]
    leases: tuple[Lease, ...]
    foreign: tuple[ForeignHold, ...]
    waiting: tuple[Waiting, ...]

    def unit(self, name: str) -> UnitView:
        """The unit of that dev name (``KeyError`` when there is none)."""
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(name)


def unit_view(unit: Unit, occ: Occupancy) -> UnitView:
    holders = tuple(t for t in occ.taken(unit) if t.hold is not Hold.UNHEALTHY)
    foreign = any(t.hold is Hold.FOREIGN for t in holders)
    leased = [t for t in holders if t.hold is not Hold.FOREIGN]
    if foreign:
        state = UnitState.CONFLICT if leased else UnitState.FOREIGN
    elif not leased:
        state = UnitState.FREE
    elif all(t.hold is Hold.PENDING for t in leased):
        state = UnitState.PENDING
    else:
        state = UnitState.LEASED
    health = occ.health_of(unit)
    return UnitView(
        unit.name,
        unit.uuid,
        unit.gpu,
        unit.mig,
        unit.profile,
        unit.numa_node,
        state,
        health.healthy,
        health.reason,
        occ.sharing(unit),
        holders,
    )
