"""The summary of several rounds of load: one Markdown row per route and client count, with
the low-high range over the rounds, ready to paste into docs/performance.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tests.benchmarks import old_tool
from tests.benchmarks.loadgen import Measurement
from tests.benchmarks.old_tool import Span


def _range(
    group: Sequence[Measurement], value: Callable[[Measurement], float | None], fmt: str
) -> str:
    """``low-high`` of ``value`` over the group (one figure if they agree), ``?`` if unknown."""
    values = [v for m in group if (v := value(m)) is not None]
    return Span(min(values), max(values)).text(fmt) if values else "?"


def _grouped(measurements: Sequence[Measurement]) -> list[list[Measurement]]:
    """Measurements of the same route and client count together, in first-seen order."""
    groups: dict[tuple[str, int], list[Measurement]] = {}
    for measurement in measurements:
        groups.setdefault((measurement.path, measurement.clients), []).append(measurement)
    return list(groups.values())


def summary_table(measurements: Sequence[Measurement], against_old_tool: bool) -> list[str]:
    """Markdown table over the rounds; the last column compares with 1.0.1's side-by-side
    figures when ``against_old_tool`` (a run on the real GPUs)."""
    head = (
        "| route | clients | client procs | req/s | p50 ms | p99 ms | client cores "
        "| server cores | other work | CPU-bound |"
    )
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    if against_old_tool:
        head += " vs 1.0.1 |"
        rule += " --- |"
    rows = [head, rule]
    for group in _grouped(measurements):
        first = group[0]
        seen = {side for m in group for side in m.saturated}
        sides: tuple[str, ...] = ("server", "client", "machine")
        bound = [side for side in sides if side in seen] or ["neither"]
        cells = [
            f"`{first.path}`",
            str(first.clients),
            "/".join(sorted({str(m.processes) for m in group})),
            _range(group, lambda m: m.rate_per_s, ",.0f"),
            _range(group, lambda m: m.p50_ms, ".3f"),
            _range(group, lambda m: m.p99_ms, ".3f"),
            _range(group, lambda m: m.client_cores, ".2f"),
            _range(group, lambda m: m.server_cores, ".2f"),
            _range(group, lambda m: m.other_cores, ".2f"),
            ", ".join(bound),
        ]
        if against_old_tool:
            rates = [m.rate_per_s for m in group]
            ours = Span(min(rates), max(rates))
            cells.append(old_tool.comparison(first.path, first.clients, ours))
        rows.append("| " + " | ".join(cells) + " |")
    return rows
