"""The REST API's side of the node's life: 503 while the driver changes, health routes,
unhealthy GPUs left out of the default selection and refused by name."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

import pytest

from agent.api.routes import create_app
from agent.health.rule import HEALTHY, DeviceHealth
from agent.node.facts import NodeFacts
from agent.node.life import UPGRADE_IN_PROGRESS
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.unit.agent.conftest import CONTROL, CountingBackend

if TYPE_CHECKING:
    from tests.unit.agent.conftest import AiohttpClient, Client

SICK = DeviceHealth(False, "XID 79 (GPU has fallen off the bus)", 79, 1764509858.0)
Make = Callable[[], Awaitable[tuple["Client", NodeState, StatusService]]]


@pytest.fixture
async def make(aiohttp_client: AiohttpClient) -> AsyncIterator[Make]:
    services: list[StatusService] = []

    async def start() -> tuple[Client, NodeState, StatusService]:
        backend = CountingBackend("hgx-h200-8")
        node = backend.node_info()
        status = StatusService(backend, node, pcie_interval_s=60)
        services.append(status)
        state = NodeState(NodeFacts(node, CONTROL))
        return await aiohttp_client(create_app(state, status)), state, status

    yield start
    for service in services:
        await service.close()


def sick(state: NodeState, *indices: int) -> None:
    facts = state.facts
    health = tuple(SICK if i in indices else HEALTHY for i in range(len(facts.node.devices)))
    state.replace(NodeFacts(facts.node, facts.control_devices, health))


@pytest.mark.parametrize("path", ["/gpu/status", "/gpu/status/json", "/v1.0/gpu/health/json"])
async def test_live_routes_answer_503_while_the_driver_is_replaced(make: Make, path: str) -> None:
    client, _, status = await make()
    status.suspend(UPGRADE_IN_PROGRESS)
    resp = await client.get(path)
    assert resp.status == 503
    assert await resp.text() == "driver upgrade in progress\n"
    assert resp.headers["Retry-After"] == "1"
    for still in ("/gpu/info/json", "/docker/cli", "/mesos/cli"):  # the last facts
        assert (await client.get(still)).status == 200


async def test_health_json_healthy_and_unhealthy(make: Make) -> None:
    client, state, _ = await make()
    doc = await (await client.get("/gpu/health/json")).json()
    assert len(doc["Devices"]) == 8
    assert doc["Devices"][0] == {
        "UUID": state.facts.node.devices[0].uuid,
        "Healthy": True,
        "Reason": None,
        "XID": None,
        "Since": None,
    }
    sick(state, 3)
    doc = await (await client.get("/v1.0/gpu/health/json?dev=3")).json()
    assert doc == {
        "Devices": [
            {
                "UUID": state.facts.node.devices[3].uuid,
                "Healthy": False,
                "Reason": "XID 79 (GPU has fallen off the bus)",
                "XID": 79,
                "Since": "2025-11-30T13:37:38Z",
            }
        ]
    }
    text = await (await client.get("/gpu/health?dev=2+3")).text()
    assert text == (
        "Device #2: healthy\n"
        "Device #3: unhealthy since 2025-11-30T13:37:38Z: XID 79 (GPU has fallen off the bus)\n"
    )


async def test_an_unhealthy_gpu_is_left_out_of_the_default_selection(make: Make) -> None:
    client, state, _ = await make()
    info_before = await (await client.get("/gpu/info/json")).read()
    sick(state, 3)
    cli = await (await client.get("/docker/cli/json")).json()
    assert "/dev/nvidia3" not in cli["Devices"]
    assert len([d for d in cli["Devices"] if d[len("/dev/nvidia") :].isdigit()]) == 7
    mesos = await (await client.get("/mesos/cli?format=native")).text()
    assert "--resources=gpus:7 --nvidia_gpu_devices=0,1,2,4,5,6,7" in mesos
    legacy = await (await client.get("/mesos/cli")).text()
    uuid = state.facts.node.devices[3].uuid
    assert uuid is not None
    assert uuid not in legacy.split("--resources=")[1]
    # The node's description is the same: only what is handed out changes.
    assert await (await client.get("/gpu/info/json")).read() == info_before
    assert len(json.loads(await (await client.get("/gpu/status/json")).read())["Devices"]) == 8


@pytest.mark.parametrize("path", ["/docker/cli", "/docker/cli/json", "/mesos/cli"])
async def test_naming_an_unhealthy_gpu_is_refused_with_one_line(make: Make, path: str) -> None:
    client, state, _ = await make()
    sick(state, 3)
    uuid = state.facts.node.devices[3].uuid
    assert uuid is not None
    for entry in ("3", uuid[:12]):
        resp = await client.get(path, params={"dev": f"1 {entry}"})
        assert resp.status == 409
        text = await resp.text()
        assert text == (
            f"unhealthy device: {entry}: GPU 3 ({uuid}) is unhealthy since 2025-11-30T13:37:38Z:"
            " XID 79 (GPU has fallen off the bus); choose another GPU\n"
        )
        assert resp.headers["X-Invalid-Parameter"] == "dev"
        assert resp.headers["X-Invalid-Value"] == entry
    assert (await client.get(path, params={"dev": "1 2"})).status == 200


async def test_a_gpu_that_recovers_is_handed_out_again(make: Make) -> None:
    client, state, _ = await make()
    sick(state, 0)
    assert (await client.get("/docker/cli?dev=0")).status == 409
    sick(state)  # healthy again
    assert (await client.get("/docker/cli?dev=0")).status == 200
    assert "/dev/nvidia0" in (await (await client.get("/docker/cli/json")).json())["Devices"]
