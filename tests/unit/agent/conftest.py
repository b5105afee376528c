from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import pytest
from aiohttp import web

from agent.api.routes import create_app
from agent.gpu import nodefile
from agent.gpu.model import DeviceStatus, PcieThroughput
from agent.gpu.simulated import SimulatedBackend
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.support.readers import ThreadReader

CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm")

if TYPE_CHECKING:
    # Types only: aiohttp's TestClient is generic only from 3.11 on, pytest-aiohttp's own
    # ``AiohttpClient`` type only from 1.1 on (which needs aiohttp 3.11), and both are above
    # the floors of pyproject.toml that the min-version venv runs these tests with.
    from aiohttp.test_utils import TestClient

    Client = TestClient[web.Request, web.Application]
    MakeClient = Callable[["CountingBackend"], Awaitable[Client]]
    AiohttpClient = Callable[[web.Application], Awaitable[Client]]


class CountingBackend(SimulatedBackend):
    """The simulated backend, counting calls, with a settable status-call cost; read as the
    daemon reads its GPU worker (a ``GpuReader``: every device at once, in threads)."""

    def __init__(self, name: str, status_delay_s: float = 0.0) -> None:
        super().__init__(nodefile.load(name), name)
        self.status_delay_s = status_delay_s
        self.status_calls = 0
        self.pcie_calls = 0
        self.failing: set[int] = set()
        self._lock = threading.Lock()

    def device_status(self, index: int) -> DeviceStatus:
        with self._lock:
            self.status_calls += 1
        if index in self.failing:
            raise RuntimeError("GPU is lost")
        if self.status_delay_s:
            time.sleep(self.status_delay_s)
        return super().device_status(index)

    def pcie_throughput(self, index: int) -> PcieThroughput:
        with self._lock:
            self.pcie_calls += 1
        if index in self.failing:
            raise RuntimeError("GPU is lost")
        return super().pcie_throughput(index)

    async def read_statuses(self) -> tuple[DeviceStatus, ...]:
        return await ThreadReader(self).read_statuses()

    async def read_throughputs(self) -> tuple[PcieThroughput, ...]:
        return await ThreadReader(self).read_throughputs()


@pytest.fixture
async def make_client(aiohttp_client: AiohttpClient) -> AsyncIterator[MakeClient]:
    services: list[StatusService] = []

    async def make(backend: CountingBackend) -> Client:
        node = backend.node_info()
        status = StatusService(backend, node, pcie_interval_s=60)
        services.append(status)
        await status.sample_pcie()
        return await aiohttp_client(create_app(NodeState(NodeFacts(node, CONTROL)), status))

    yield make
    for service in services:
        await service.close()
