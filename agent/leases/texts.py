"""The table's lines: what is taken, by which container, since when; bounded in length."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from agent.health.rule import utc_text
from agent.leases.answers import Hold, Taken
from agent.leases.units import Unit

SHOWN_TAKEN = 8  # holders named in one line; the rest are counted
SHORT_ID = 12  # container ids are shown as Docker shows them


def short_id(container_id: str) -> str:
    return container_id[:SHORT_ID]


def when(at_s: float | None) -> str:
    return utc_text(at_s) if at_s is not None else "an unknown time"


def unit_label(name: str) -> str:
    """``GPU 3`` or ``MIG 0:1``, from a dev name."""
    return f"MIG {name}" if ":" in name else f"GPU {name}"


def units_text(units: Sequence[Unit]) -> str:
    """``GPU 0, GPU 1`` (``none`` for no unit)."""
    return ", ".join(u.label for u in units) or "none"


def foreign_holder(taken: Taken) -> str:
    """A foreign holder: ``container 3f2a1b9c0d4e``, ``pid 4242`` or ``an unknown holder``."""
    holder = taken.container_id
    if holder is None:
        return "an unknown holder"
    return holder if holder.startswith("pid ") else f"container {short_id(holder)}"


def taken_text(taken: Taken, units: Sequence[str] = ()) -> str:
    """One holder (or ill health) in words: ``GPU 0 by container 3f2a1b9c0d4e (lease-4)
    since …Z``; ``units``: the dev names it holds, said instead of ``taken.unit`` when given."""
    unit = ", ".join(unit_label(u) for u in (units or (taken.unit,)))
    lease = f" ({taken.lease_id})" if taken.lease_id else ""
    mode = "" if taken.exclusive else " shared"
    if taken.hold is Hold.UNHEALTHY:
        return f"{unit} unhealthy since {when(taken.since_s)}: {taken.why or 'unknown reason'}"
    if taken.hold is Hold.PENDING:
        owner = f", {taken.why}" if taken.why else ""
        return (
            f"{unit} pending{mode} for {taken.lease_id}{owner} since {when(taken.since_s)}, "
            f"until {when(taken.until_s)}"
        )
    holder = taken.container_id
    until = f", until {when(taken.until_s)}" if taken.until_s is not None else ""
    if taken.hold is Hold.FOREIGN:
        what = foreign_holder(taken)
        what = f"foreign {what}" if what.startswith("container ") else what
        how = f" ({taken.why})" if taken.why else ""
        return f"{unit} by {what}{how} since {when(taken.since_s)}{until}"
    who = f"container {short_id(holder)}" if holder else "an unknown container"
    if taken.hold is Hold.STOPPED:  # created and not started yet, or stopped
        return (
            f"{unit}{mode} by {who}{lease}, not running, since "
            f"{when(taken.since_s)}, until {when(taken.until_s)}"
        )
    return f"{unit}{mode} by {who}{lease} since {when(taken.since_s)}{until}"


def taken_list(taken: Sequence[Taken]) -> str:
    """The holders in one line, each once with all the units it holds, at most
    ``SHOWN_TAKEN`` of them named (``none`` for none)."""
    groups: dict[Taken, list[str]] = {}
    for t in taken:
        groups.setdefault(replace(t, unit="", uuid=None), []).append(t.unit)
    items = list(groups.items())
    shown = [taken_text(t, units) for t, units in items[:SHOWN_TAKEN]]
    if len(items) > SHOWN_TAKEN:
        shown.append(f"and {len(items) - SHOWN_TAKEN} more (list the leases)")
    return "; ".join(shown) or "none"


def engine_text(engine: str) -> str:
    """``the engine at /run/podman/podman.sock`` (``its engine`` for the unnamed one)."""
    return f"the engine at {engine}" if engine else "its engine"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
