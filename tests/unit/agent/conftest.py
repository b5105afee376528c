from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from pytest_aiohttp import AiohttpClient

from agent.gpu import nodefile
from agent.gpu.model import DeviceStatus, PcieThroughput
from agent.gpu.simulated import SimulatedBackend
from agent.node_facts import NodeFacts
from agent.node_state import NodeState
from agent.rest import create_app
from agent.status_service import StatusService

CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm")

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[["CountingBackend"], Awaitable[Client]]


class CountingBackend(SimulatedBackend):
    """The simulated backend, counting calls, with a settable status-call cost."""

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
