"""What ``/metrics`` and ``/gpu/processes/json`` serve, from the same sweeps as ``/gpu/status``.

A scrape asks ``StatusService.sweep()``, so it joins the sweep in flight if there is one
and costs no more NVML time than a status request. What is derived from a sweep is done
once per sweep, however many scrapes share it: the GPU processes' owners (one cgroup read
per process, the Docker engine only for containers it has not seen) and the GPU families'
exposition text. The agent's own counters are rendered at every scrape (they move between
scrapes that share a sweep), as are the values read at scrape time (PCIe sample age, build
info, the attribution cache, the lease table, the usage ledger).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from agent import __version__
from agent.attribution.owners import Attributor, ProcessOwner
from agent.gpu.model import DeviceInfo
from agent.health.monitor import HealthView
from agent.leases.view import TableView
from agent.metrics.agent_metrics import AgentMetrics
from agent.metrics.exposition import render_families
from agent.metrics.gpu_families import gpu_families
from agent.metrics.lease_families import Named, lease_families
from agent.metrics.processes_json import processes_body
from agent.node.state import NodeState
from agent.node.status import StatusService, StatusUnavailable, Sweep

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the format generate_latest writes


class Families(Collector):
    """A fixed list of families, in the shape prometheus_client's renderer collects from."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(families: Iterable[Metric]) -> bytes:
    """The text exposition of ``families``, by prometheus_client's own renderer."""
    registry = CollectorRegistry(auto_describe=False)  # never collects on register
    registry.register(Families(families))
    return generate_latest(registry)


class _SweepView:
    """What is derived from one sweep, computed once: owners, then the GPU text."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep
        self.owners: asyncio.Future[dict[int, ProcessOwner]] | None = None
        self.gpu_text: bytes | None = None
        self.processes_json: dict[tuple[int, ...], bytes] = {}


class MetricsService:
    """One agent's metrics; the caller owns ``status`` and closes this (``close()``)."""

    def __init__(
        self,
        node: NodeState,
        status: StatusService,
        *,
        attributor: Attributor | None = None,
        agent: AgentMetrics | None = None,
        hostname: str | None = None,
        health: HealthView | None = None,
        leases: Callable[[], TableView] | None = None,
        usage: Callable[[], list[Metric]] | None = None,
    ) -> None:
        self.node = node
        self.status = status
        self.attributor = attributor if attributor is not None else Attributor(None)
        self.agent = agent if agent is not None else AgentMetrics()
        self.hostname = hostname or socket.gethostname()
        self.health = health
        self.leases = leases  # the lease table's view, read at every scrape
        self.usage = usage  # the usage ledger's families (agent.metrics.usage_families)
        self._view: _SweepView | None = None

    async def scrape(self) -> bytes:
        """The whole ``/metrics`` body.

        While no status can be read (a driver upgrade has the GPUs released, or the GPU
        worker restarts), the GPU families are absent and ``nvidia_docker_gpus_released``
        says why, so the target stays up; the agent's own counters, the lease table's and
        the usage ledger's families keep flowing.
        """
        try:
            sweep = await self.status.sweep()
        except StatusUnavailable as err:
            live = self._live(None, await self._lease_containers())
            return self.agent.render() + render([*live, self._released(str(err))])
        view = self._view_of(sweep)
        owners = await self._owners(view)
        if view.gpu_text is None:
            families = gpu_families(
                sweep.node.devices,
                sweep.statuses,
                sweep.throughputs,
                owners,
                driver_version=self.node.facts.node.driver_version,
                hostname=self.hostname,
                health=self.health.health if self.health is not None else None,
                last_xids=self.health.last_xids if self.health is not None else None,
            )
            view.gpu_text = render_families(families)  # counters keep dcgm-exporter's names
        live = self._live(sweep, await self._lease_containers())
        return view.gpu_text + self.agent.render() + render(live)

    async def processes(self, devices: Sequence[DeviceInfo]) -> bytes:
        """The ``/gpu/processes/json`` body for the given GPUs."""
        sweep = await self.status.sweep()
        view = self._view_of(sweep)
        owners = await self._owners(view)
        key = tuple(d.index for d in devices)
        body = view.processes_json.get(key)
        if body is None:
            body = processes_body(devices, sweep.statuses, owners)
            view.processes_json[key] = body
        return body

    def _view_of(self, sweep: Sweep) -> _SweepView:
        view = self._view
        if view is None or view.sweep is not sweep:
            view = _SweepView(sweep)
            self._view = view
        return view

    async def _owners(self, view: _SweepView) -> dict[int, ProcessOwner]:
        if view.owners is None:
            pids = [p.pid for status in view.sweep.statuses for p in status.processes]
            view.owners = asyncio.ensure_future(self.attributor.owners(pids))
        return await asyncio.shield(view.owners)

    def _build_info(self) -> Metric:
        node = self.node.facts.node
        build = InfoMetricFamily(
            "nvidia_docker_build",
            "The agent's version, and the driver and CUDA version it serves (always 1).",
            labels=("version", "driver_version", "cuda_version"),
        )
        build.add_metric([__version__, node.driver_version, node.cuda_version], {})
        return build

    def _released(self, why: str) -> Metric:
        released = GaugeMetricFamily(
            "nvidia_docker_gpus_released",
            "1 while the agent has released the GPUs (a driver upgrade), with the reason.",
            labels=("reason",),
        )
        released.add_metric([why], 1)
        return released

    async def _lease_containers(self) -> dict[str, Named]:
        """The name and image of every leased container, from the attribution's cache (an
        engine is asked once for a container it has not seen, as for a GPU process)."""
        if self.leases is None:
            return {}
        ids = {lease.container_id for lease in self.leases().leases if lease.container_id}
        named: dict[str, Named] = {}
        for container_id in sorted(ids):
            known = await self.attributor.container(container_id)
            if known is not None:
                named[container_id] = (known[1].name, known[1].image)
        return named

    def _live(self, sweep: Sweep | None, lease_containers: dict[str, Named]) -> list[Metric]:
        """The families read at scrape time; ``sweep`` None: no status could be read."""
        families: list[Metric] = [self._build_info()]
        if sweep is not None and sweep.throughput_age_s is not None:
            families.append(
                GaugeMetricFamily(
                    "nvidia_docker_pcie_sample_age_seconds",
                    "Age of the PCIe throughput sample this scrape serves.",
                    value=sweep.throughput_age_s,
                )
            )
        families.append(
            GaugeMetricFamily(
                "nvidia_docker_attribution_cached_containers",
                "Containers whose name and image the agent has cached.",
                value=self.attributor.cached_containers,
            )
        )
        lookups = CounterMetricFamily(
            "nvidia_docker_container_lookups",
            "Requests the agent made to the Docker engine for a container's name, by outcome.",
            labels=("outcome",),
        )
        failures = self.attributor.lookup_failures
        lookups.add_metric(["answered"], self.attributor.lookups - failures)
        lookups.add_metric(["failed"], failures)
        families.append(lookups)
        if self.leases is not None:
            families += lease_families(self.leases(), self.hostname, lease_containers)
        if self.usage is not None:
            families += self.usage()
        return families

    async def close(self) -> None:
        await self.attributor.close()
