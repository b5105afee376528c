"""The agent's spec beside other producers' specs of its kind: what to say, once each.

``cdi.others`` says where ours stands (``Standing``); this module words it for the log and
the API, and keeps track of what was already said, so that a poll every few seconds says a
thing once per episode (docs/cdi.md, "Beside NVIDIA's toolkit: one producer per kind"):

- ours is *aside* (another spec in its directory defines some of its devices): one warning
  naming the other file and the two ways out, again only when the set of files changes, and
  one line when ours is back;
- another spec elsewhere defines some of its devices: one warning naming it and which of
  the two engines use (by directory order).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cdi import others
from cdi.others import OtherSpec, Standing

log = logging.getLogger("nvidia-docker-plugin.cdi")

OTHER_KIND = "nvidia-docker.com/gpu"  # the kind the warning proposes, which nothing else uses
TOOLKIT_UNITS = "nvidia-cdi-refresh.path nvidia-cdi-refresh.service"
SAMPLE = 3  # device names a line shows


def _paths(specs: Iterable[OtherSpec]) -> str:
    return ", ".join(sorted(spec.path for spec in specs))


def _sample(names: Iterable[str]) -> str:
    ordered = sorted(names, key=lambda n: (not n[:1].isdigit(), len(n), n))
    shown = ", ".join(ordered[:SAMPLE])
    return f"{shown}, ..." if len(ordered) > SAMPLE else shown


def aside_reason(standing: Standing, kind: str) -> str:
    """One line for ``/cdi/spec`` while ours is aside."""
    return (
        f"the agent stepped aside: {_paths(standing.clashing)} defines {kind} devices in the "
        "directory of its spec, and engines drop a device that two specs of one directory "
        "define; that spec serves them (see the agent's log, docs/cdi.md)"
    )


@dataclass
class Beside:
    """What was said about other specs; ``tell`` says what is new."""

    spec_path: Path
    kind: str
    scanned: tuple[Path, ...]  # the engines' default directories, in their order
    _aside: frozenset[str] | None = None  # the paths ours stepped aside for
    _elsewhere: frozenset[str] = field(default_factory=frozenset)

    @property
    def aside(self) -> bool:
        return self._aside is not None

    def tell(self, standing: Standing, ours: frozenset[str], our_dirs: frozenset[str]) -> None:
        """Log what changed since the last call: aside or back, and others elsewhere."""
        if standing.aside:
            paths = frozenset(spec.path for spec in standing.clashing)
            if paths != self._aside:
                self._warn_aside(standing, ours)
            self._aside = paths
        elif self._aside is not None:
            log.info(
                "CDI spec %s no longer defines %s devices beside ours: ours (%s) is back",
                ", ".join(sorted(self._aside)),
                self.kind,
                self.spec_path,
            )
            self._aside = None
        elsewhere = frozenset(spec.path for spec in standing.elsewhere)
        for spec in standing.elsewhere:
            if spec.path not in self._elsewhere:
                self._warn_elsewhere(spec, ours, our_dirs)
        self._elsewhere = elsewhere

    def _warn_aside(self, standing: Standing, ours: frozenset[str]) -> None:
        common = standing.names_in_force & ours
        first = sorted(spec.path for spec in standing.clashing)[0]
        log.warning(
            "CDI spec %s defines %s devices (%s) in the directory engines read ours from, "
            "where engines drop every device that two specs define: the agent steps aside "
            "(no %s) and %s serves them. To have ours back, remove that spec (NVIDIA's "
            "toolkit: systemctl disable --now %s; rm %s) or start the agent with --cdi-kind "
            "%s (docs/cdi.md)",
            _paths(standing.clashing),
            self.kind,
            _sample(common),
            self.spec_path,
            "it" if len(standing.clashing) == 1 else "they",
            TOOLKIT_UNITS,
            first,
            OTHER_KIND,
        )

    def _warn_elsewhere(self, spec: OtherSpec, ours: frozenset[str], dirs: frozenset[str]) -> None:
        order = [os.path.realpath(d) for d in self.scanned]
        mine = next((d for d in reversed(order) if d in dirs), None)
        winner = others.later(spec.directory, mine, order) if mine is not None else None
        if winner is None or mine is None:
            which = "the spec in the later of the two directories in the engine's list"
        else:
            loser = mine if winner == spec.directory else spec.directory
            whose = spec.path if winner == spec.directory else "ours"
            which = f"{whose} ({winner} comes after {loser} in Podman's and Docker's order)"
        log.warning(
            "CDI spec %s also defines %s devices (%s): engines take each of them from %s; "
            "keep one producer of %s on a node (docs/cdi.md)",
            spec.path,
            self.kind,
            _sample(spec.names & ours),
            which,
            self.kind,
        )
