"""The start gate: the lease table's verdict on a start (the container as a fake engine,
tests.support.fake_engine, inspects it), a create (its body) or a Podman start hook's ask (its
runtime config, never asked of the engine), and failing open on the agent's own trouble,
with one log line per kind and interval."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.engines.containers import created_container
from agent.engines.http import EngineClient
from agent.leases.answers import Granted
from agent.leases.asks import Ask
from agent.leases.containers import Container
from agent.leases.holders import Lease
from agent.leases.labels import labels_for, read_label
from agent.leases.settings import LeaseSettings
from agent.leasing.service import LeaseService
from agent.leasing.start_gate import StartGate, hooked_container
from plugin.authz import CreateAsk, HookAsk, HookDevice, StartAsk
from tests.support.fake_engine import FakeEngine
from tests.unit.leases.nodes import build_node, cid, healthy

LOGGER = "nvidia-docker-plugin.leases"
NODE = build_node([0, 0])
GPU1 = {"Devices": [{"PathOnHost": "/dev/nvidia1", "PathInContainer": "/dev/nvidia1"}]}


@pytest.fixture
async def service() -> AsyncIterator[LeaseService]:
    leases = LeaseService.open(NODE, healthy(NODE), LeaseSettings(), None)
    yield leases
    await leases.close()


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(tmp_path / "docker.sock")
    await fake.start()
    yield fake
    await fake.stop()


def gate_of(engine: FakeEngine, service: LeaseService | None, timeout_s: float = 5) -> StartGate:
    table: asyncio.Future[LeaseService] = asyncio.get_running_loop().create_future()
    if service is not None:
        table.set_result(service)
    return StartGate(EngineClient(engine.socket_path, timeout_s=timeout_s), table)


async def gpu1_leased(service: LeaseService) -> Lease:
    answer = await service.ask(Ask(devices="1"))
    assert isinstance(answer, Granted), answer
    return answer.lease


async def test_a_start_naming_a_gpu_leased_to_another_is_refused(
    engine: FakeEngine, service: LeaseService
) -> None:
    lease = await gpu1_leased(service)
    engine.add(cid(2), host_config=GPU1)
    engine.add(cid(3))
    gate = gate_of(engine, service)
    refusal = await gate(StartAsk(cid(2)))
    assert refusal is not None
    assert refusal.startswith(f"container {cid(2)[:12]} may not start: it names GPUs leased")
    assert lease.id in refusal
    assert await gate(StartAsk(cid(3))) is None
    assert await gate(StartAsk(cid(9))) is None  # the engine has none: it answers 404 itself
    assert await gate(StartAsk("no/such")) is None


async def test_a_create_is_judged_by_its_body(engine: FakeEngine, service: LeaseService) -> None:
    lease = await gpu1_leased(service)
    gate = gate_of(engine, service)
    refusal = await gate(CreateAsk("web-1", {"HostConfig": GPU1}))
    assert refusal is not None
    assert refusal.startswith("container web-1 may not start: it names GPUs leased to others")
    body = {"Labels": labels_for(lease), "HostConfig": GPU1}
    assert await gate(CreateAsk(None, body)) is None  # its own lease: it binds it
    assert await gate(CreateAsk(None, {"Image": "busybox"})) is None
    assert engine.requests == []  # a create asks the engine nothing


def test_a_create_body_reads_as_an_inspect_answer() -> None:
    body = {
        "Labels": {"a": "b"},
        "Env": ["NVIDIA_VISIBLE_DEVICES=0"],
        "HostConfig": {
            "Runtime": "nvidia",
            "Devices": [{"PathOnHost": "/dev/nvidia3"}],
            "DeviceRequests": [{"Driver": "nvidia", "Count": -1}],
        },
    }
    container = created_container("web-1", body)
    assert (container.id, container.running, container.lease) == ("web-1", False, None)
    assert container.devices == ("/dev/nvidia3", "all")
    assert created_container(None, {}).id == "new"
    assert created_container(cid(1), {}).id == "new"  # no name that looks like another's id
    assert created_container("bad name", {}).id == "new"


async def test_an_engine_that_does_not_answer_is_an_allow_with_one_line(
    engine: FakeEngine, service: LeaseService, caplog: pytest.LogCaptureFixture
) -> None:
    await gpu1_leased(service)
    path = f"/containers/{cid(2)}/json"
    engine.answers[path] = b""
    engine.hold_open.add(path)
    gate = gate_of(engine, service, timeout_s=0.1)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert await gate(StartAsk(cid(2))) is None
        assert await gate(StartAsk(cid(2))) is None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    assert lines[0].startswith("Authorization: allowed without the lease table's answer: ")
    assert "did not answer within 0.1 s" in lines[0]


async def test_a_bug_is_an_allow_and_before_the_table_everything_is(
    engine: FakeEngine,
    service: LeaseService,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine.add(cid(2), host_config=GPU1)
    assert await gate_of(engine, None)(StartAsk(cid(2))) is None
    assert engine.requests == []

    def broken(container: object) -> None:
        raise KeyError("oops")

    monkeypatch.setattr(service, "may_start", broken)
    with caplog.at_level(logging.WARNING, LOGGER):
        assert await gate_of(engine, service)(StartAsk(cid(2))) is None
    assert "allowed without the lease table's answer: KeyError: 'oops'" in caplog.text


GPU1_NODE = HookDevice("/dev/gpu0", 195, 1)  # --device /dev/nvidia1:/dev/gpu0


async def test_a_hook_ask_is_judged_from_the_table_and_the_engine_is_never_asked(
    engine: FakeEngine, service: LeaseService, caplog: pytest.LogCaptureFixture
) -> None:
    lease = await gpu1_leased(service)
    gate = gate_of(engine, service)
    with caplog.at_level(logging.INFO, LOGGER):  # pending: most likely its own container
        assert await gate(HookAsk(cid(2), (GPU1_NODE,), {})) is None
    assert f"Start hook: allowed: container {cid(2)[:12]} has no lease label" in caplog.text
    assert f"GPU 1 pending for {lease.id}" in caplog.text

    labels = labels_for(lease)
    assert await gate(HookAsk(cid(3), (GPU1_NODE,), labels)) is None  # it binds the lease
    service.created(Container(cid(3), lease=read_label(labels), devices=("/dev/nvidia1",)))
    service.started(
        Container(cid(3), running=True, lease=read_label(labels), devices=("/dev/nvidia1",))
    )
    assert await gate(HookAsk(cid(3), (GPU1_NODE,), {})) is None  # bound: the table knows
    with caplog.at_level(logging.INFO, LOGGER):
        refusal = await gate(HookAsk(cid(2), (GPU1_NODE,), {}))
    assert refusal is not None
    assert refusal.startswith(f"container {cid(2)[:12]} may not start: it names GPUs leased")
    assert f"GPU 1 by container {cid(3)[:12]} ({lease.id})" in refusal
    assert f"Start hook: refused: {refusal}" in caplog.text
    assert await gate(HookAsk(cid(4), (HookDevice("/dev/nvidia0", 195, 0),), {})) is None
    assert engine.requests == []  # Podman holds the container's lock while the hook runs


def test_a_hooked_containers_gpus_are_its_nodes_numbers_and_its_label_its_annotations() -> None:
    ask = HookAsk(
        cid(5),
        (
            GPU1_NODE,
            HookDevice("/dev/nvidiactl", 195, 255),
            HookDevice("/dev/nvidia-caps/nvidia-cap12", 237, 12),
            HookDevice("/dev/nvidia7"),
        ),
        {"nvidia-docker.lease": "lease-4", "nvidia-docker.lease.devices": "1;0"},
    )
    container = hooked_container(ask)
    assert (container.id, container.running) == (cid(5), False)
    assert container.devices == (
        "/dev/nvidia1",
        "/dev/nvidia-caps/nvidia-cap12",
        "/dev/nvidia7",
    )  # the control node names no GPU: not a device of the container's GPUs
    assert container.lease is not None
    assert (container.lease.lease_id, container.lease.units) == ("lease-4", ("1", "0"))
