"""The queue: asks that wait for units, first come, first served.

No ask overtakes one that waits: while any ask waits, a new one waits behind it (or, not
asked to wait, is refused), and the queue is served from its head only. So an ask for many
GPUs is not starved by a stream of asks for one; it holds the line for at most its wait.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.leases.holders import Owner
from agent.leases.plans import Wanted


@dataclass(frozen=True, slots=True)
class Waiting:
    """An ask in the queue, as ``ticket``, from ``asked_s`` until ``until_s`` (Unix s)."""

    ticket: str  # "wait-3"
    wanted: Wanted
    owner: Owner
    cpuset: bool
    asked_s: float
    until_s: float
