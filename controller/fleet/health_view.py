"""The fleet's problems: unhealthy GPUs, nodes that do not answer, drivers that differ.

- ``problems(results)``: one ``Problem`` per unhealthy GPU (from the agents'
  ``/gpu/health/json``) and per node that did not answer, in the order of the nodes;
- ``problem_lines``: what ``nvidia-docker-ctl health`` prints, one whole line per problem
  (never cut to the terminal: the reason is the point);
- ``StatusNotes``: the lines ``nvidia-docker-ctl status`` prints after its table, gathered
  as nodes answer: each unhealthy GPU with its reason, and the driver versions when the
  fleet is not uniform (``drivers: 580.159.04 on 998 nodes, 575.64.05 on 2``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.fleet.query import NodeResult, json_int


@dataclass(frozen=True, slots=True)
class Problem:
    node: str
    gpu: int | None  # None: the node as a whole
    what: str
    since: str | None = None
    xid: int | None = None

    def json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "gpu": self.gpu,
            "problem": self.what,
            "since": self.since,
            "xid": self.xid,
        }


def _devices(answer: Any) -> list[Any]:
    devices = answer.get("Devices") if isinstance(answer, Mapping) else None
    return devices if isinstance(devices, list) else []


def _node_problem(result: NodeResult) -> Problem:
    error = result.error or "failed"
    if result.reason == "HTTP 503":
        what = error.rsplit(": ", 1)[-1]  # the agent's own words: "driver upgrade in progress"
    elif result.reason == "HTTP 404" and "/gpu/health" in error:
        what = "its agent has no /gpu/health (an older release: upgrade it to see GPU health)"
    else:
        what = f"does not answer: {error}"
    return Problem(result.node.name, None, what)


def gpu_problems(result: NodeResult) -> list[Problem]:
    found = []
    for index, device in enumerate(_devices(result.answers.get("health"))):
        if isinstance(device, Mapping) and device.get("Healthy") is False:
            reason = device.get("Reason")
            since = device.get("Since")
            xid = device.get("XID")
            found.append(
                Problem(
                    result.node.name,
                    index,
                    f"unhealthy: {reason}" if isinstance(reason, str) else "unhealthy",
                    since if isinstance(since, str) else None,
                    json_int(xid),
                )
            )
    return found


def problems(results: Sequence[NodeResult]) -> list[Problem]:
    found: list[Problem] = []
    for result in results:
        found += gpu_problems(result) if result.ok else [_node_problem(result)]
    return found


def problem_lines(results: Sequence[NodeResult]) -> list[str]:
    """``node3  GPU 2  unhealthy: XID 79 (...)  since 2026-...Z``; ``node5  does not ...``."""
    lines = []
    for problem in problems(results):
        where = problem.node if problem.gpu is None else f"{problem.node}  GPU {problem.gpu}"
        since = f"  since {problem.since}" if problem.since else ""
        lines.append(f"{where}  {problem.what}{since}")
    return lines


def driver_version(result: NodeResult) -> str | None:
    """The driver a node that answered runs (from its ``/gpu/info/json``)."""
    info = result.answers.get("info") if result.ok else None
    versions = info.get("Version") if isinstance(info, Mapping) else None
    version = versions.get("Driver") if isinstance(versions, Mapping) else None
    return version if isinstance(version, str) else None


def summary_of_drivers(versions: Counter[str]) -> str | None:
    """The drivers line from a count of nodes per driver version; None when uniform."""
    if len(versions) < 2:
        return None
    ranked = sorted(versions.items(), key=lambda item: (-item[1], item[0]))
    first, *rest = ranked
    parts = [f"{first[0]} on {first[1]} node{'s' if first[1] != 1 else ''}"]
    parts += [f"{version} on {count}" for version, count in rest]
    return ", ".join(parts)


MAX_NOTE_LINES = 1000  # unhealthy GPUs listed after a status table; the rest are counted


class StatusNotes:
    """The lines ``status`` prints after its table, gathered as nodes answer (a fleet of ten
    thousand keeps a counter of driver versions and at most ``MAX_NOTE_LINES`` lines)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._left_out = 0
        self._versions: Counter[str] = Counter()

    def add(self, result: NodeResult) -> None:
        version = driver_version(result)
        if version is not None:
            self._versions[version] += 1
        for problem in gpu_problems(result) if result.ok else []:
            if len(self._lines) >= MAX_NOTE_LINES:
                self._left_out += 1
                continue
            since = f" since {problem.since}" if problem.since else ""
            self._lines.append(f"{problem.node} GPU {problem.gpu} {problem.what}{since}")

    def lines(self) -> list[str]:
        notes = list(self._lines)
        if self._left_out:
            notes.append(
                f"and {self._left_out} more unhealthy GPUs (nvidia-docker-ctl health lists all)"
            )
        summary = summary_of_drivers(self._versions)
        if summary is not None:
            notes.append(f"drivers: {summary}")
        return notes
