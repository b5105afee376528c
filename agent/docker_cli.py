"""The ``docker run`` arguments that give a container GPUs and the driver volume.

Control devices come first (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, and
``/dev/nvidia-uvm-tools`` only where it exists), then the selected GPUs in index order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from agent import render_json
from agent.gpu.model import DeviceInfo
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
    volume_args = tuple(spec.binding(driver_version) for spec in volumes)
    gpu_paths = tuple(dev.path for dev in devices if dev.path)
    return DockerCli(volume_driver=VOLUME_DRIVER, volumes=volume_args, devices=control + gpu_paths)
