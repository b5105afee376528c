"""``/docker/cli?format=cdi``: a selection's GPUs as CDI devices, ``--device=nvidia.com/gpu=X``.

The CDI form carries no volume: the node's spec mounts the driver volume for every device
of its kind (docs/cdi.md). The names are those of the spec in force (``CdiNaming``): ours
(kind ``nvidia.com/gpu``, or the one ``--cdi-kind`` gives), or, while the agent steps aside
for another producer's spec, that spec's. Engines that read CDI (Podman, Docker 25+ with CDI
on) take these arguments as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.api import render_json
from agent.cdi_spec.inputs import OWN_NAMING, CdiNaming, cdi_names
from agent.node.selection import Target
from cdi.spec import KIND


@dataclass(frozen=True, slots=True)
class CdiCli:
    devices: tuple[str, ...]  # "nvidia.com/gpu=GPU-..."
    kind: str = KIND

    def text(self) -> str:
        """One line, space separated, as ``/docker/cli?format=cdi`` answers it."""
        return " ".join(f"--device={device}" for device in self.devices) + "\n"

    def json(self) -> bytes:
        return render_json.encode({"Kind": self.kind, "Devices": list(self.devices)})


def cdi_cli(targets: Sequence[Target], naming: CdiNaming = OWN_NAMING) -> CdiCli:
    """The CDI form of ``targets``; ``InvalidParameter`` for one the spec in force lacks."""
    return CdiCli(devices=cdi_names(targets, naming), kind=naming.kind)
