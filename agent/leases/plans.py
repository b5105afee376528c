"""What an ask would get now, or the refusal that says why not: the table's decisions,
computed from the units, who holds them and how they are joined, and changing nothing."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, replace

from agent.leases.answers import Refusal, Refused
from agent.leases.asks import Ask, ask_text
from agent.leases.labels import LeaseLabel
from agent.leases.occupancy import Occupancy
from agent.leases.picking import Connectivity, LoadOf, PairScore, pick_gpus, pick_migs
from agent.leases.texts import plural, taken_list, taken_text, unit_label, units_text
from agent.leases.units import NodeUnits, Unit

# The refusals that waiting cannot change: a new ask gets them at once, a waiting one is
# dropped. (An unhealthy device named by a new ask is refused at once too, as /docker/cli
# does; a waiting ask waits on, since a GPU reset can make it healthy.)
FINAL = frozenset({Refusal.IMPOSSIBLE, Refusal.GONE})


# What to try, said after a refusal that goes back to the asker (not after a reason that is
# part of another line: a place in the queue, a timeout, a start verdict).
ADVICE = {
    Refusal.NOT_ENOUGH: "ask for fewer, or ask to wait",
    Refusal.TAKEN: "ask for other devices, for a count, or ask to wait",
}


def advised(refused: Refused) -> Refused:
    """``refused`` with what to try appended to its line, where there is advice."""
    advice = ADVICE.get(refused.kind)
    return replace(refused, text=f"{refused.text}; {advice}") if advice else refused


class Kind(enum.StrEnum):
    GPUS = "gpus"
    MIG = "mig"
    DEVICES = "devices"


@dataclass(frozen=True, slots=True)
class Wanted:
    """An ask reduced to what the table plans with: ``count`` whole GPUs, ``count`` MIG
    devices of ``profile``, or the units ``keys`` (named devices, matched when asked)."""

    kind: Kind
    exclusive: bool
    count: int = 1
    profile: str | None = None
    keys: tuple[str, ...] = ()
    names: tuple[str, ...] = ()  # the named devices' dev names, for the lines

    @property
    def text(self) -> str:
        """How it was asked, in words (``2 GPUs``, ``MIG 1g.18gb``, ``devices 0 1, shared``)."""
        if self.kind is Kind.DEVICES:
            what = "devices " + " ".join(self.names)
        elif self.kind is Kind.MIG:
            what = ask_text(Ask(count=self.count, mig_profile=self.profile))
        else:
            what = plural(self.count, "GPU")
        return what if self.exclusive else f"{what}, shared"


def wanted_of(ask: Ask, units: NodeUnits) -> Wanted:
    """The ask as planned (``InvalidParameter`` for a device entry that names nothing)."""
    if ask.devices is not None:
        named = units.named(ask.devices)
        return Wanted(
            Kind.DEVICES,
            ask.exclusive,
            len(named),
            keys=tuple(u.key for u in named),
            names=tuple(u.name for u in named),
        )
    if ask.mig_profile is not None:
        return Wanted(Kind.MIG, ask.exclusive, ask.count, profile=ask.mig_profile)
    return Wanted(Kind.GPUS, ask.exclusive, ask.count)


def wanted_of_label(label: LeaseLabel, units: NodeUnits) -> Wanted:
    """A lease label's units asked for again (a container whose lease ended)."""
    names = tuple(u.name if (u := units.get(k)) else k for k in label.units)
    return Wanted(Kind.DEVICES, label.exclusive, len(label.units), keys=label.units, names=names)


@dataclass(frozen=True, slots=True)
class FreeSet:
    """What an exclusive ask for ``count`` whole GPUs (or MIG devices of one profile) would
    get now: ``chosen``, empty when fewer than ``count`` are free; how many units of that
    kind are free (healthy, no holder) and how many the node has; for two or more whole GPUs
    the chosen set's pair scores, worst first; ``gpus``: the node's GPUs."""

    gpus: int
    free: int
    units: int
    chosen: tuple[Unit, ...]
    pairs: tuple[PairScore, ...]


class Planner:
    """Plans asks against one state of the table (its units, holders, links and loads)."""

    def __init__(
        self, units: NodeUnits, occupancy: Occupancy, conn: Connectivity, load_of: LoadOf
    ) -> None:
        self._units = units
        self._occ = occupancy
        self._conn = conn
        self._load_of = load_of

    def plan(self, wanted: Wanted) -> tuple[Unit, ...] | Refused:
        """The units ``wanted`` gets now, or why it gets none."""
        if wanted.kind is Kind.DEVICES:
            return self._devices(wanted)
        if wanted.kind is Kind.MIG:
            return self._count(wanted, self._units.mig_units(wanted.profile or ""))
        return self._count(wanted, self._units.whole_gpus())

    def free_set(self, count: int, profile: str | None) -> FreeSet:
        """The set an exclusive ask for ``count`` units would get now (whole GPUs, or MIG
        devices of ``profile``), the queue aside: what ``GET /leases/free`` answers."""
        pool = self._units.whole_gpus() if profile is None else self._units.mig_units(profile)
        free = [u for u in pool if self._occ.fits(u, True)]
        made = FreeSet(len(self._units.node.devices), len(free), len(pool), (), ())
        if count < 1 or len(free) < count:
            return made
        if profile is not None:
            return replace(made, chosen=pick_migs(free, count, self._load_of))
        chosen = pick_gpus(free, count, self._conn, self._load_of)
        pairs = itertools.combinations(chosen, 2)
        scores = tuple(sorted(self._conn.score(a.gpu, b.gpu) for a, b in pairs))
        return replace(made, chosen=chosen, pairs=scores)

    def _count(self, wanted: Wanted, pool: tuple[Unit, ...]) -> tuple[Unit, ...] | Refused:
        if len(pool) < wanted.count:
            return Refused(Refusal.IMPOSSIBLE, self._impossible(wanted, len(pool)))
        free = [u for u in pool if self._occ.fits(u, wanted.exclusive)]
        if len(free) < wanted.count:
            taken = self._occ.taken_of(pool, wanted.exclusive)
            noun = "GPUs" if wanted.kind is Kind.GPUS else f"MIG devices {wanted.profile}"
            share = " to share" if not wanted.exclusive else ""
            free_text = f" ({units_text(free)})" if free else ""
            text = (
                f"not enough free {noun}{share}: asked for {wanted.count}, {len(free)} free"
                f"{free_text}; taken: {taken_list(taken)}"
            )
            return Refused(Refusal.NOT_ENOUGH, text, tuple(taken))
        if wanted.kind is Kind.MIG:
            return pick_migs(free, wanted.count, self._load_of)
        return pick_gpus(free, wanted.count, self._conn, self._load_of)

    def _impossible(self, wanted: Wanted, have: int) -> str:
        profiles = self._units.profiles()
        if wanted.kind is Kind.MIG:
            has = ", ".join(profiles) or "none: no GPU is in MIG mode"
            return (
                f"asked for {wanted.text}: this node has {have} MIG devices of that profile "
                f"(its profiles: {has})"
            )
        text = f"asked for {wanted.text}: this node has {plural(have, 'GPU')} to lease"
        mig = [d.index for d in self._units.node.devices if d.mig_enabled]
        if mig:
            gpus = ", ".join(map(str, mig))
            text += f" (in MIG mode: GPU {gpus}; ask for a MIG profile: {', '.join(profiles)})"
        return text

    def _devices(self, wanted: Wanted) -> tuple[Unit, ...] | Refused:
        found = [(key, self._units.get(key)) for key in wanted.keys]
        gone = [name for (_, unit), name in zip(found, wanted.names, strict=True) if unit is None]
        if gone or not found:
            if gone:
                labels = ", ".join(unit_label(n) for n in gone)
                what = f"{labels} of {wanted.text} {'is' if len(gone) == 1 else 'are'}"
            else:  # a GPU named that is in MIG mode now, without MIG devices
                what = f"the devices of {wanted.text} are"
            text = f"{what} no longer on this node (driver reload or MIG change); ask again"
            return Refused(Refusal.GONE, text)
        units = tuple(unit for _, unit in found if unit is not None)
        sick = [t for u in units if not self._occ.healthy(u) for t in self._occ.taken(u)[:1]]
        if sick:
            text = f"unhealthy device: {'; '.join(map(taken_text, sick))}; choose another GPU"
            return Refused(Refusal.UNHEALTHY, text, tuple(sick))
        taken = self._occ.taken_of(units, wanted.exclusive)
        if taken:
            share = " (to share)" if not wanted.exclusive else ""
            text = f"devices taken{share}: {taken_list(taken)}"
            return Refused(Refusal.TAKEN, text, tuple(taken))
        return units
