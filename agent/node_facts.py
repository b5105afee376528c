"""The static answers of one node, rendered once: what ``/gpu/info``, ``/docker/cli`` and
``/mesos/cli`` serve as cached bytes until the node changes.

The GPUs' health is part of the facts: ``/docker/cli`` and ``/mesos/cli`` hand out only
healthy GPUs (``agent.health_selection``), so a health change builds new facts."""

from __future__ import annotations

import functools

from agent import render_json, render_text
from agent.docker_cli import docker_cli
from agent.gpu.health import HEALTHY, DeviceHealth
from agent.gpu.model import DeviceInfo, NodeInfo
from agent.health_selection import select_usable
from agent.mesos_cli import MesosCli
from agent.selection import select_devices, select_volumes


class NodeFacts:
    """The static facts of a node and their cached renderings; immutable once built."""

    def __init__(
        self,
        node: NodeInfo,
        control_devices: tuple[str, ...],
        health: tuple[DeviceHealth, ...] | None = None,
    ) -> None:
        self.node = node
        self.control_devices = control_devices
        if health is None or len(health) != len(node.devices):
            health = (HEALTHY,) * len(node.devices)
        self.health = health
        self.info_json = render_json.info(node)
        self.info_text = render_text.info(node).encode()
        self.mesos = MesosCli(node, self.info_json, health)

    def devices(self, dev: str | None) -> tuple[DeviceInfo, ...]:
        """The GPUs a ``dev`` parameter names; ``InvalidParameter`` for a bad entry."""
        return select_devices(self.node.devices, dev)

    def usable(self, dev: str | None) -> tuple[DeviceInfo, ...]:
        """The GPUs ``dev`` names that may be handed out (``agent.health_selection``)."""
        return select_usable(self.node.devices, dev, self.health)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one instance per node, lives as long
    def docker_cli(self, dev: str | None, vol: str | None, as_json: bool) -> bytes:
        cli = docker_cli(
            self.node.driver_version,
            self.control_devices,
            self.usable(dev),
            select_volumes(vol),
        )
        return cli.json() if as_json else cli.text().encode()
