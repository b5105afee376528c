"""nvidia-docker-plugin 1.0.1's figures from the side-by-side run, for the benchmarks' ratios.

Where they come from: 1.0.1 built from its public source and ours, measured one after the
other on the same H200 machine (one H200, 16 vCPUs), each loaded by 4 closed-loop client
processes, one run of two rounds (docs/performance.md). That run gave the old tool's own
rate only for ``/gpu/info/json``; for the other routes it gave the ratio ours / old, so
that is what is recorded here: no absolute figure is made up for the old tool.
"""

from __future__ import annotations

from dataclasses import dataclass

CLIENT_PROCESSES = 4
"""Client processes of the side-by-side run."""


@dataclass(frozen=True, slots=True)
class Span:
    """A low-high range over the rounds of one run."""

    low: float
    high: float

    def text(self, fmt: str = ",.0f") -> str:
        low, high = format(self.low, fmt), format(self.high, fmt)
        return low if low == high else f"{low}-{high}"


@dataclass(frozen=True, slots=True)
class RouteFigure:
    """One route of the side-by-side run."""

    path: str
    clients: tuple[int, ...]  # the client counts the figure covers; () if the run did not say
    old_rate_per_s: Span | None  # the old tool's own rate, where the run gave it
    ours_vs_old: Span  # our rate divided by the old tool's, in that run

    def covers(self, path: str, clients: int) -> bool:
        return path == self.path and (not self.clients or clients in self.clients)


ROUTES = (
    RouteFigure("/gpu/info/json", (16, 64), Span(85_000, 93_000), Span(0.26, 0.32)),
    RouteFigure("/docker/cli", (), None, Span(0.44, 1.07)),
    RouteFigure("/gpu/status/json", (64,), None, Span(22, 26)),
    RouteFigure("/gpu/status/json", (1,), None, Span(96, 100)),
    RouteFigure("/mesos/cli", (), None, Span(1.6, 6.5)),
)


@dataclass(frozen=True, slots=True)
class Memory:
    """Resident memory in MB: idle after start, after the load, and the peak."""

    idle_mb: float
    loaded_mb: float
    peak_mb: float


OLD_MEMORY = Memory(idle_mb=33, loaded_mb=60, peak_mb=144)
OURS_MEMORY_THEN = Memory(idle_mb=73, loaded_mb=73, peak_mb=79)
"""Ours in the side-by-side run, for comparison with a rerun."""


def figure_for(path: str, clients: int) -> RouteFigure | None:
    """The side-by-side figure for this route and client count, if the run had one."""
    return next((figure for figure in ROUTES if figure.covers(path, clients)), None)


def comparison(path: str, clients: int, ours_per_s: Span) -> str:
    """What our rate (over the rounds) means against 1.0.1: a ratio where the old tool's rate
    is known, and always the ratio of the side-by-side run, for reference."""
    figure = figure_for(path, clients)
    if figure is None:
        return ""
    then = f"side-by-side run {figure.ours_vs_old.text('.2f')}x"
    old = figure.old_rate_per_s
    if old is None:
        return then
    now = Span(ours_per_s.low / old.high, ours_per_s.high / old.low)
    return f"{now.text('.2f')}x of {old.text()}/s ({then})"
