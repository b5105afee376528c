"""The volumes the plugin offers, by name, and where containers mount them.

A volume's Docker name is ``<name>_<driver version>``, e.g. ``nvidia_driver_580.159.04``.
"""

from __future__ import annotations

from dataclasses import dataclass

VOLUME_DRIVER = "nvidia-docker"
"""The name Docker knows the plugin by (``--volume-driver=nvidia-docker``)."""


@dataclass(frozen=True, slots=True)
class VolumeSpec:
    name: str  # "nvidia_driver"
    mountpoint: str  # where containers see it
    mount_options: str  # docker's -v options

    def docker_name(self, driver_version: str) -> str:
        return f"{self.name}_{driver_version}"

    def binding(self, driver_version: str) -> str:
        """``name_version:mountpoint:options``, the value of docker's ``--volume``."""
        return f"{self.docker_name(driver_version)}:{self.mountpoint}:{self.mount_options}"


VOLUMES: tuple[VolumeSpec, ...] = (
    VolumeSpec(name="nvidia_driver", mountpoint="/usr/local/nvidia", mount_options="ro"),
)


def spec_by_name(name: str) -> VolumeSpec | None:
    return next((spec for spec in VOLUMES if spec.name == name), None)
