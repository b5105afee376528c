"""Who holds each unit now, and whether a unit can take one more lease.

The rule of the table lives here: an exclusive lease or a foreign holder takes a unit alone;
shared leases take it together, at most its sharing count of them; an unhealthy unit takes
no new lease.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from agent.health.rule import DeviceHealth
from agent.leases.answers import Hold, Taken
from agent.leases.asks import owner_text
from agent.leases.holders import ForeignHold, Lease, LeaseState
from agent.leases.settings import LeaseSettings
from agent.leases.units import NodeUnits, Unit

_HOLDS = {
    LeaseState.PENDING: Hold.PENDING,
    LeaseState.RUNNING: Hold.RUNNING,
    LeaseState.STOPPED: Hold.STOPPED,
}


class Occupancy:
    """The holders of every unit key, as of the leases and foreign holds given."""

    def __init__(
        self,
        units: NodeUnits,
        health: Sequence[DeviceHealth],
        settings: LeaseSettings,
        leases: Iterable[Lease],
        foreign: Iterable[ForeignHold],
    ) -> None:
        self._units = units
        self._health = health
        self._settings = settings
        self.leases: dict[str, list[Lease]] = {}
        self.foreign: dict[str, list[ForeignHold]] = {}
        for lease in leases:
            for key in lease.units:
                self.leases.setdefault(key, []).append(lease)
        for hold in foreign:
            for key in hold.units:
                self.foreign.setdefault(key, []).append(hold)

    def healthy(self, unit: Unit) -> bool:
        return self.health_of(unit).healthy

    def health_of(self, unit: Unit) -> DeviceHealth:
        """The unit's health: its GPU's, or its own for a MIG device withdrawn alone."""
        return self._health[unit.gpu].of_mig(unit.mig)

    def sharing(self, unit: Unit) -> int:
        return self._settings.sharing_of(unit, self._units.node.devices[unit.gpu].uuid)

    def sharers(self, unit: Unit) -> int:
        """Leases on it now (of any mode)."""
        return len(self.leases.get(unit.key, ()))

    def fits(self, unit: Unit, exclusive: bool) -> bool:
        """Whether ``unit`` can take one more lease of that mode now (healthy, and free, or
        shared by fewer shared leases than its sharing count)."""
        if not self.healthy(unit) or self.foreign.get(unit.key):
            return False
        leases = self.leases.get(unit.key, ())
        if exclusive:
            return not leases
        return all(not lease.exclusive for lease in leases) and len(leases) < self.sharing(unit)

    def taken(self, unit: Unit) -> list[Taken]:
        """What holds ``unit`` (and its ill health), in words the refusals show."""
        found: list[Taken] = []
        health = self.health_of(unit)
        if not health.healthy:
            found.append(
                Taken(
                    unit.name, unit.uuid, Hold.UNHEALTHY, since_s=health.since_s, why=health.reason
                )
            )
        for lease in self.leases.get(unit.key, ()):
            found.append(
                Taken(
                    unit.name,
                    unit.uuid,
                    _HOLDS[lease.state],
                    lease_id=lease.id,
                    container_id=lease.container_id,
                    since_s=lease.since_s,
                    until_s=lease.until_s,
                    why=owner_text(lease.owner) or None
                    if lease.state is LeaseState.PENDING
                    else None,
                    exclusive=lease.exclusive,
                )
            )
        for hold in self.foreign.get(unit.key, ()):
            found.append(
                Taken(
                    unit.name,
                    unit.uuid,
                    Hold.FOREIGN,
                    container_id=hold.holder,
                    since_s=hold.since_s,
                    until_s=hold.until_s,
                    why=hold.how,
                )
            )
        return found

    def taken_of(self, units: Iterable[Unit], exclusive: bool) -> list[Taken]:
        """What keeps each of ``units`` that does not fit from taking a lease of that mode."""
        return [t for unit in units if not self.fits(unit, exclusive) for t in self.taken(unit)]
