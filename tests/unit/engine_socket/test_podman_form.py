"""The engine socket in front of an engine without Docker's volume plugins (Podman's
Docker-compatible service, ``--podman-engine-socket``): a GPU create gets the leased GPUs'
device nodes and the driver volume's directory bound read-only, the volume made first; a
volume that cannot be made answers the create in one line, gives the lease back, and sends
nothing to the engine; the container the engine made is bound to its lease as soon as the
engine answers, before its client could start it (so that its removal frees the GPUs even
when no event told of it while it lived). Against an in-process fake engine on a unix
socket."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.api.leases import Cpusets
from agent.engine_socket.gpus import GpuCreates
from agent.engine_socket.site import EngineSocket, serve_engine_socket
from agent.leases.settings import LeaseSettings
from agent.leasing.service import LeaseService
from agent.node.facts import NodeFacts
from plugin.volumes import NO_SUCH_VOLUME, VolumeError
from tests.support.unix_server import serving
from tests.unit.engine_socket.test_proxy import GPUS_2, create, read_request
from tests.unit.leases.nodes import build_node, healthy

NODE = build_node([0, 0, 1, 1])


class Volumes:
    """The driver volumes asked for, by name; each a directory under ``root``, or a
    ``VolumeError`` while ``broken``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.asked: list[str] = []
        self.broken = False

    def __call__(self, name: str) -> Path:
        self.asked.append(name)
        if self.broken:
            raise VolumeError(NO_SUCH_VOLUME, name)
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path


class World:
    def __init__(self, site: EngineSocket, leases: LeaseService, volumes: Volumes) -> None:
        self.site = site
        self.leases = leases
        self.volumes = volumes
        self.bodies: list[dict[str, object]] = []  # the creates the engine was sent
        self.made_id: object = "a"  # the id the engine answers a create with


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    bodies: list[dict[str, object]] = []
    made: list[World] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, body = await read_request(reader)
        bodies.append(json.loads(body))
        answer = json.dumps({"Id": made[0].made_id, "Warnings": []}).encode()
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer)
        await writer.drain()

    async with serving(tmp_path / "podman.sock", engine):
        leases = LeaseService.open(NODE, healthy(NODE), LeaseSettings(), None)
        facts = NodeFacts(NODE, ("/dev/nvidiactl", "/dev/nvidia-uvm"))
        volumes = Volumes(tmp_path / "volumes")
        creates = GpuCreates(
            leases,
            lambda: facts,
            Cpusets(tmp_path / "no-sysfs"),
            driver_volumes=volumes,
            engine="/run/podman/podman.sock",
        )
        site = await serve_engine_socket(
            tmp_path / "ours.sock",
            tmp_path / "podman.sock",
            creates,
            head_timeout_s=2.0,
            max_connections=64,
            flag="--podman-engine-socket",
        )
        world = World(site, leases, volumes)
        world.bodies = bodies
        made.append(world)
        yield world
        await site.close()
        await leases.close()


async def exchange(site: EngineSocket, data: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(site.path))
    writer.write(data)
    writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


async def test_a_gpu_create_gets_device_nodes_and_the_driver_directory_bound(
    world: World,
) -> None:
    answer = await exchange(world.site, create(GPUS_2))
    assert answer.startswith(b"HTTP/1.1 201 ")
    (lease,) = world.leases.view().leases
    (body,) = world.bodies
    host = body["HostConfig"]
    assert isinstance(host, dict)
    assert host["DeviceRequests"] is None
    devices = [d["PathOnHost"] for d in host["Devices"]]
    assert devices[:2] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert len(devices) == 4
    name = f"nvidia_driver_{NODE.driver_version}"
    assert world.volumes.asked == [name]
    assert host["Mounts"] == [
        {
            "Type": "bind",
            "Source": str(world.volumes.root / name),
            "Target": "/usr/local/nvidia",
            "ReadOnly": True,
        }
    ]
    assert body["Labels"]["nvidia-docker.lease"] == lease.id  # type: ignore[index]


async def test_a_driver_volume_that_cannot_be_made_answers_the_create_in_one_line(
    world: World,
) -> None:
    world.volumes.broken = True
    answer = await exchange(world.site, create(GPUS_2))
    assert answer.startswith(b"HTTP/1.1 500 ")
    message = json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
    assert message.startswith("nvidia-docker: the driver's files cannot be given (")
    assert f"nvidia_driver_{NODE.driver_version}" in message
    assert "\n" not in message
    assert not world.leases.view().leases  # given back at once
    assert not world.bodies  # nothing reached the engine


async def test_the_made_container_is_bound_to_its_lease_before_any_event(world: World) -> None:
    world.made_id = "3f2a1b9c0d4e" * 5 + "abcd"  # 64 hex digits, as engines make them
    answer = await exchange(world.site, create(GPUS_2))
    assert answer.startswith(b"HTTP/1.1 201 ")
    assert answer.endswith(json.dumps({"Id": world.made_id, "Warnings": []}).encode())
    (lease,) = world.leases.view().leases
    assert lease.container_id == world.made_id
    assert lease.engine == "/run/podman/podman.sock"
    # its removal's event frees the GPUs at once (before, the lease stayed pending until
    # its expiry when the engine's events came too late to bind it)
    world.leases.destroyed(world.made_id)
    assert not world.leases.view().leases


async def test_an_answer_without_a_container_id_leaves_the_lease_to_the_events(
    world: World,
) -> None:
    world.made_id = None  # no container id
    answer = await exchange(world.site, create(GPUS_2))
    assert answer.startswith(b"HTTP/1.1 201 ")
    (lease,) = world.leases.view().leases
    assert lease.container_id is None  # pending: the engine's created event binds it
