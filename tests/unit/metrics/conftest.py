"""A REST app with metrics on the simulated backend, as the daemon wires it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import pytest
from aiohttp import web
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from agent.api.routes import create_app
from agent.attribution.owners import Attributor
from agent.edge.connections import ConnectionGuard, ConnectionLimits
from agent.health.monitor import HealthView
from agent.metrics.agent_metrics import AgentMetrics
from agent.metrics.service import MetricsService
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.unit.agent.conftest import CONTROL, CountingBackend

if TYPE_CHECKING:  # types only: generic from aiohttp 3.11 / pytest-aiohttp 1.1 (above the floors)
    from aiohttp.test_utils import TestClient
    from pytest_aiohttp import AiohttpClient

    Client = TestClient[web.Request, web.Application]


@dataclass
class Agent:
    client: Client
    backend: CountingBackend
    service: MetricsService
    counters: AgentMetrics

    async def scrape(self) -> str:
        resp = await self.client.get("/metrics")
        assert resp.status == 200
        return await resp.text()


MakeAgent = Callable[..., Awaitable[Agent]]


@dataclass
class Sample:
    name: str
    labels: dict[str, str]
    value: float
    type: str = field(default="")


def samples(text: str) -> list[Sample]:
    """Every sample of an exposition text, parsed by prometheus_client's own parser."""
    found = []
    lines = "\n" + text
    parse = cast(Callable[[str], Iterable[Metric]], text_string_to_metric_families)
    for family in parse(text):  # untyped in older prometheus_client versions
        for s in family.samples:
            name = s.name
            # The parser names a counter's samples <name>_total; the GPU counters are
            # written without the suffix, as dcgm-exporter writes them: keep their names.
            if family.type == "counter" and name.endswith("_total") and f"\n{name}" not in lines:
                name = name.removesuffix("_total")
            found.append(Sample(name, dict(s.labels), s.value, family.type))
    return found


def values(text: str, name: str, **labels: str) -> list[float]:
    return [
        s.value
        for s in samples(text)
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


@pytest.fixture
async def make_agent(aiohttp_client: AiohttpClient) -> AsyncIterator[MakeAgent]:
    made: list[tuple[StatusService, MetricsService]] = []

    async def make(
        backend: CountingBackend,
        *,
        attributor: Attributor | None = None,
        health: HealthView | None = None,
    ) -> Agent:
        node = backend.node_info()
        status = StatusService(backend, node, pcie_interval_s=60)
        await status.sample_pcie()
        state = NodeState(NodeFacts(node, CONTROL))
        counters = AgentMetrics()
        status.add_sweep_listener(counters.observe_sweep)
        service = MetricsService(
            state, status, attributor=attributor, agent=counters, hostname="gpu-node-7",
            health=health,
        )  # fmt: skip
        made.append((status, service))
        guard = ConnectionGuard("REST API", ConnectionLimits(10, 60), on_answer=counters.count)
        app = create_app(state, status, around=[guard.wrap], metrics=service)
        return Agent(await aiohttp_client(app), backend, service, counters)

    yield make
    for status, service in made:
        await service.close()
        await status.close()
