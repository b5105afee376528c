"""The wrapper and GPU health: an unhealthy GPU is left out by default and refused by name.

The node is the real agent application (``agent.api.routes``) on a loopback port, over the
simulated backend, with one GPU made unhealthy the way the health monitor makes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from agent.api.routes import create_app
from agent.health.rule import HEALTHY, DeviceHealth
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.support.services import serve_on_loopback
from tests.unit.agent.conftest import CONTROL, CountingBackend
from tests.unit.controller.test_wrapper import GPU_LABELS, Docker, docker, nvidia_docker

__all__ = ["docker"]  # the fixture, used by name

SICK = DeviceHealth(False, "XID 79 (GPU has fallen off the bus)", 79, 1764509858.0)


@pytest.fixture
async def node() -> AsyncIterator[tuple[int, NodeState]]:
    backend = CountingBackend("h200x2")
    info = backend.node_info()
    status = StatusService(backend, info, pcie_interval_s=60)
    state = NodeState(NodeFacts(info, CONTROL, (HEALTHY, SICK)))
    try:
        async with serve_on_loopback(create_app(state, status)) as port:
            yield port, state
    finally:
        await status.close()


async def test_the_default_selection_leaves_the_unhealthy_gpu_out(
    docker: Docker, node: tuple[int, NodeState]
) -> None:
    port, _ = node
    docker.image("cuda", GPU_LABELS)
    env = {"NV_HOST": f"http://127.0.0.1:{port}", "DOCKER_HOST": "tcp://h:1"}
    result = await nvidia_docker(docker, "run", "cuda", **env)
    assert result.code == 0, result.stderr
    assert result.executed is not None
    gpus = [a for a in result.executed if a.startswith("--device=/dev/nvidia") and a[-1].isdigit()]
    assert gpus == ["--device=/dev/nvidia0"]


async def test_naming_the_unhealthy_gpu_is_one_line_with_the_reason(
    docker: Docker, node: tuple[int, NodeState]
) -> None:
    port, state = node
    uuid = state.facts.node.devices[1].uuid
    docker.image("cuda", GPU_LABELS)
    env = {"NV_HOST": f"http://127.0.0.1:{port}", "DOCKER_HOST": "tcp://h:1"}
    result = await nvidia_docker(docker, "run", "cuda", NV_GPU="0,1", **env)
    assert result.code == 1
    assert result.executed is None
    assert result.error() == (
        f"NV_GPU names a GPU that http://127.0.0.1:{port} does not hand out now: unhealthy "
        f"device: 1: GPU 1 ({uuid}) is unhealthy since 2025-11-30T13:37:38Z: XID 79 (GPU has "
        "fallen off the bus); choose another GPU"
    )
