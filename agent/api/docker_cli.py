"""The ``docker run`` arguments that give a container GPUs and the driver volume.

Control devices come first (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, and
``/dev/nvidia-uvm-tools`` only where it exists), then the selected GPUs in index order. A GPU
in MIG mode comes with the capability nodes of its MIG devices (``/dev/nvidia-caps/...``):
all of them for the whole GPU, those of one MIG device when only that one is selected.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.api import render_json
from agent.gpu.model import DeviceInfo
from agent.node.selection import Target
from plugin.volume_specs import VOLUME_DRIVER, VolumeSpec

UVM_TOOLS = "/dev/nvidia-uvm-tools"


def control_devices(exists: Callable[[str], bool] = os.path.exists) -> tuple[str, ...]:
    """The device nodes every GPU container needs, as present on this node."""
    devices = ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    if exists(UVM_TOOLS):
        devices.append(UVM_TOOLS)
    return tuple(devices)


@dataclass(frozen=True, slots=True)
class DockerCli:
    volume_driver: str
    volumes: tuple[str, ...]  # "name_version:mountpoint:options"
    devices: tuple[str, ...]

    def text(self) -> str:
        """One line, space separated, as ``/docker/cli`` answers it."""
        args = [f"--volume-driver={self.volume_driver}"] if self.volumes else []
        args += [f"--volume={volume}" for volume in self.volumes]
        args += [f"--device={device}" for device in self.devices]
        return " ".join(args) + "\n"

    def json(self) -> bytes:
        return render_json.encode(
            {
                "VolumeDriver": self.volume_driver,
                "Volumes": list(self.volumes),
                "Devices": list(self.devices),
            }
        )


def docker_cli(
    driver_version: str,
    control: tuple[str, ...],
    devices: tuple[DeviceInfo, ...],
    volumes: tuple[VolumeSpec, ...],
) -> DockerCli:
    """The arguments for whole GPUs."""
    return docker_cli_for(driver_version, control, [Target(dev) for dev in devices], volumes)


def docker_cli_for(
    driver_version: str,
    control: tuple[str, ...],
    targets: Sequence[Target],
    volumes: tuple[VolumeSpec, ...],
) -> DockerCli:
    """The arguments for a selection of GPUs and MIG devices."""
    volume_args = tuple(spec.binding(driver_version) for spec in volumes)
    return DockerCli(
        volume_driver=VOLUME_DRIVER, volumes=volume_args, devices=control + gpu_nodes(targets)
    )


def gpu_nodes(targets: Sequence[Target]) -> tuple[str, ...]:
    """The device nodes of a selection, in order, each once: a GPU's node, then the
    capability nodes of its MIG devices (of every one for a whole GPU). A GPU whose node is
    unknown (NVML could not open it) gives nothing."""
    nodes: list[str] = []
    for target in targets:
        if not target.gpu.path:
            continue
        migs = target.gpu.mig_devices if target.mig is None else (target.mig,)
        for node in (target.gpu.path, *(cap for mig in migs for cap in mig.capabilities)):
            if node not in nodes:
                nodes.append(node)
    return tuple(nodes)
