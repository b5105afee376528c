"""Where ``/metrics`` gets each GPU's health and last XID error, when something provides them.

The agent's GPU health work (events and per-sweep checks) is the source; until it is wired
(``MetricsService(health=...)``), no source is given and the two metrics are absent, as
dcgm-exporter leaves out what it cannot read. A source is a function called at each scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """One GPU's health as the health watcher sees it now."""

    healthy: bool | None = None  # None: not judged (yet)
    last_xid: int | None = None  # the last XID error seen; 0: none seen; None: not watched


HealthSource = Callable[[], Mapping[int, GpuHealth]]
"""GPU index -> its health; a GPU left out has unknown health."""
