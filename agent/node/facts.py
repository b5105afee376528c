"""The static answers of one node, rendered once: what ``/gpu/info``, ``/docker/cli`` and
``/mesos/cli`` serve as cached bytes until the node changes.

The GPUs' health is part of the facts: ``/docker/cli`` (both forms) and ``/mesos/cli`` hand
out only healthy GPUs and MIG devices (``agent.health.selection``), so a health change
builds new facts (``agent.node.life``). Each ``NodeFacts`` keeps its own cache of the
``/docker/cli`` answers it rendered (per query, at most ``CACHED_ANSWERS``), which goes with
it when new facts replace it."""

from __future__ import annotations

from agent.api import render_json, render_text
from agent.api.cdi_cli import cdi_cli
from agent.api.docker_cli import docker_cli_for
from agent.api.mesos_cli import MesosCli
from agent.cdi_spec.inputs import OWN_NAMING, CdiNaming
from agent.gpu.model import DeviceInfo, NodeInfo
from agent.health.rule import HEALTHY, DeviceHealth
from agent.health.selection import select_usable
from agent.node.selection import Target, select_devices, select_volumes

CACHED_ANSWERS = 256  # distinct /docker/cli queries kept per node (clients ask a few)
_AnswerKey = tuple[str, str | None, str | None, bool, CdiNaming | None]


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
        self._answers: dict[_AnswerKey, bytes] = {}

    def devices(self, dev: str | None) -> tuple[DeviceInfo, ...]:
        """The GPUs a ``dev`` parameter names; ``InvalidParameter`` for a bad entry."""
        return select_devices(self.node.devices, dev)

    def usable(self, dev: str | None) -> tuple[Target, ...]:
        """The GPUs and MIG devices ``dev`` names that may be handed out: ``InvalidParameter``
        for an entry that names nothing, ``UnhealthyDevice`` for an unhealthy one."""
        return select_usable(self.node.devices, dev, self.health)

    @property
    def unhealthy(self) -> frozenset[int]:
        """Indices of the GPUs that are not handed out now."""
        return frozenset(i for i, health in enumerate(self.health) if not health.healthy)

    @property
    def unhealthy_migs(self) -> frozenset[tuple[int, int]]:
        """``(GPU, MIG device)`` of the MIG devices withdrawn on their own (their GPU is
        healthy: an XID the driver attributed to their GPU instance)."""
        return frozenset(
            (i, mig) for i, health in enumerate(self.health) for mig in health.unhealthy_migs
        )

    def docker_cli(self, dev: str | None, vol: str | None, as_json: bool) -> bytes:
        """The ``/docker/cli`` answer; ``InvalidParameter`` or ``UnhealthyDevice`` (not
        cached: a refusal is rendered again)."""
        key = ("volume", dev, vol, as_json, None)
        body = self._answers.get(key)
        if body is None:
            cli = docker_cli_for(
                self.node.driver_version,
                self.control_devices,
                self.usable(dev),
                select_volumes(vol),
            )
            body = self._keep(key, cli.json() if as_json else cli.text().encode())
        return body

    def docker_cli_cdi(
        self, dev: str | None, vol: str | None, as_json: bool, naming: CdiNaming = OWN_NAMING
    ) -> bytes:
        """The CDI form (``format=cdi``) in the names of the spec in force (``naming``);
        ``vol`` is checked, the spec mounts the volume."""
        key = ("cdi", dev, vol, as_json, naming)
        body = self._answers.get(key)
        if body is None:
            select_volumes(vol)
            cli = cdi_cli(self.usable(dev), naming)
            body = self._keep(key, cli.json() if as_json else cli.text().encode())
        return body

    def _keep(self, key: _AnswerKey, body: bytes) -> bytes:
        if len(self._answers) >= CACHED_ANSWERS:
            self._answers.pop(next(iter(self._answers)))  # the oldest query
        self._answers[key] = body
        return body
