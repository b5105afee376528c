"""The lease wiring's engine edge against real engines: a private dockerd (Debian 12's 20.10,
``tests.support.dockerd``) and Podman's API service (``tests.support.podman``).

Checked: a container's create, start, die and destroy reach ``on_event`` in that order,
each within a second of the command that made it; ``list_containers`` shows each
container's lease label, whether it runs and the GPUs it was given (``--device
/dev/nvidiaN`` of a device node made with mknod in /dev for the test, ``--gpus``, a CDI
name), as those engines say them; a dockerd restarted on the same data root is followed
again after two log lines, with a resync that has the containers still there, and the
events after it. The containers given GPUs are created, not started: this machine has no
GPU and dockerd 20.10 no NVIDIA runtime, so only their inspect answers are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.engines.containers import inspect_container, list_containers
from agent.engines.events import EngineEvents, EventKind
from agent.engines.http import EngineClient
from agent.leases.containers import Container
from agent.leases.labels import LeaseLabel
from tests.support.dockerd import DockerEngine, restart_engine, start_engine, stop_engine
from tests.support.fake_engine import eventually
from tests.support.podman import RUN_LIMITS, Podman, private_podman
from tests.support.prerequisites import require_command, require_root
from tests.support.services import machine_lock, stop_process, wait_until

# A private dockerd (restarted by a test) and Podman start within the first test's time.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

IMAGE = "nvd-engine-events:1"
DEVICE_LOCK = "devices"  # the machine-wide lock of device nodes made in /dev by tests
NVIDIA_MAJOR = 195
UUID = "GPU-8f6a2c1e-0b7d-4e39-a1c2-3d4e5f607182"
LABELS = {
    "nvidia-docker.lease": "lease-3",
    "nvidia-docker.lease.devices": UUID,
    "nvidia-docker.lease.mode": "exclusive",
    "nvidia-docker.lease.owner": '{"user":"alice"}',
}
LEASE = LeaseLabel("lease-3", (UUID,), True, (("user", "alice"),))
EVENT_WITHIN_S = 1.0  # from the command's return to on_event
FOLLOWING_WITHIN_S = 30.0  # the stream opened and resynced (dockerd restarted: its backoff)


@dataclass
class Calls:
    events: list[tuple[EventKind, str]] = field(default_factory=list)
    resyncs: list[list[Container]] = field(default_factory=list)

    def on_event(self, kind: EventKind, container_id: str) -> None:
        self.events.append((kind, container_id))

    def on_resync(self, containers: list[Container]) -> None:
        self.resyncs.append(containers)

    def of(self, container_id: str) -> list[EventKind]:
        return [kind for kind, cid in self.events if cid == container_id]


@contextlib.asynccontextmanager
async def followed(client: EngineClient) -> AsyncIterator[tuple[EngineEvents, Calls]]:
    calls = Calls()
    events = EngineEvents(client, calls.on_event, calls.on_resync)
    events.start()
    try:
        await eventually(lambda: events.following, "the events followed", FOLLOWING_WITHIN_S)
        yield events, calls
    finally:
        await events.close()


@pytest.fixture(scope="module")
def device_node() -> Iterator[str]:
    """A character device node /dev/nvidia<N> for an N no GPU of this machine has, made
    for the module under the machine-wide device lock and removed afterwards."""
    require_root()
    with machine_lock(DEVICE_LOCK):
        minor = next(n for n in range(9, 250) if not os.path.lexists(f"/dev/nvidia{n}"))
        path = f"/dev/nvidia{minor}"
        rdev = os.makedev(NVIDIA_MAJOR, minor)
        os.mknod(path, 0o666 | stat.S_IFCHR, rdev)
        try:
            yield path
        finally:
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(path).st_rdev == rdev:
                    os.unlink(path)


@dataclass
class Dockerd:
    engine: DockerEngine
    proc: subprocess.Popen[bytes]

    @property
    def client(self) -> EngineClient:
        return EngineClient(Path(self.engine.host.removeprefix("unix://")))

    async def docker(self, *args: str) -> str:
        done = await asyncio.to_thread(self.engine.docker, *args)
        return done.stdout.strip()


@pytest.fixture(scope="module")
def dockerd() -> Iterator[Dockerd]:
    """A private dockerd of this module's own: a test restarts it."""
    require_root()
    engine, proc = start_engine()
    running = Dockerd(engine, proc)
    try:
        engine.import_busybox(IMAGE)
        yield running
    finally:
        stop_engine(engine, running.proc)


def label_args() -> list[str]:
    return [arg for key, value in LABELS.items() for arg in ("--label", f"{key}={value}")]


async def test_a_containers_life_reaches_on_event_in_order(dockerd: Dockerd) -> None:
    async with followed(dockerd.client) as (_events, calls):
        cid = await dockerd.docker("create", IMAGE, "sleep", "600")
        try:
            steps = [
                (EventKind.CREATED, None),
                (EventKind.STARTED, ("start", cid)),
                (EventKind.DIED, ("kill", cid)),
                (EventKind.DESTROYED, ("rm", cid)),
            ]
            for n, (kind, command) in enumerate(steps, start=1):
                if command is not None:
                    await dockerd.docker(*command)
                await eventually(
                    lambda: len(calls.of(cid)) >= n,  # noqa: B023
                    f"the {kind} event of {cid[:12]}",
                    EVENT_WITHIN_S,
                )
            assert calls.of(cid) == [kind for kind, _ in steps]
        finally:
            await dockerd.docker("rm", "-f", cid)


async def test_the_list_shows_labels_state_and_gpus(dockerd: Dockerd, device_node: str) -> None:
    created = {
        "leased": await dockerd.docker("create", *label_args(), IMAGE, "sleep", "600"),
        "device": await dockerd.docker("create", "--device", device_node, IMAGE, "true"),
        "gpus": await dockerd.docker("create", "--gpus", "all", IMAGE, "true"),
        "cdi": await dockerd.docker("create", "--device", "nvidia.com/gpu=0", IMAGE, "true"),
    }
    try:
        await dockerd.docker("start", created["leased"])
        listed = {c.id: c for c in await list_containers(dockerd.client)}
        assert listed[created["leased"]] == Container(created["leased"], True, LEASE)
        assert listed[created["device"]] == Container(
            created["device"], False, None, (device_node,), f"--device {device_node}"
        )
        assert listed[created["gpus"]] == Container(
            created["gpus"], False, None, ("all",), "--gpus all"
        )
        assert listed[created["cdi"]] == Container(
            created["cdi"], False, None, ("nvidia.com/gpu=0",), "--device nvidia.com/gpu=0"
        )
        inspected = await inspect_container(dockerd.client, created["leased"])
        assert inspected == listed[created["leased"]]
    finally:
        await dockerd.docker("rm", "-f", *created.values())
    assert await inspect_container(dockerd.client, created["leased"]) is None


async def test_a_restarted_engine_is_followed_again_with_a_resync(
    dockerd: Dockerd, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nvidia-docker-plugin.engines")
    kept = await dockerd.docker("create", *label_args(), IMAGE, "sleep", "600")
    ran = await dockerd.docker("run", "-d", "--stop-timeout", "1", IMAGE, "sleep", "600")
    try:
        async with followed(dockerd.client) as (events, calls):
            assert {c.id for c in calls.resyncs[0]} >= {kept, ran}
            dockerd.proc = await asyncio.to_thread(restart_engine, dockerd.engine, dockerd.proc)
            await eventually(lambda: len(calls.resyncs) == 2, "a resync", FOLLOWING_WITHIN_S)
            await eventually(lambda: events.following, "followed again", FOLLOWING_WITHIN_S)
            after = {c.id: c for c in calls.resyncs[1]}
            assert after[kept] == Container(kept, False, LEASE)
            assert after[ran].running is False  # the restart stopped it
            fresh = await dockerd.docker("create", IMAGE, "true")
            await eventually(
                lambda: calls.of(fresh) == [EventKind.CREATED], "an event after it", 10
            )
            await dockerd.docker("rm", fresh)
        lines = [r for r in caplog.records if r.name == "nvidia-docker-plugin.engines"]
        warnings = [r.getMessage() for r in lines if r.levelno >= logging.WARNING]
        assert len(warnings) == 1
        assert warnings[0].startswith("Container events stopped: the Docker engine at ")
        back = [r.getMessage() for r in lines if "answers again" in r.getMessage()]
        assert len(back) == 1
        assert all(r.exc_info is None for r in lines)
    finally:
        await dockerd.docker("rm", "-f", kept, ran)


# -- Podman's API service -------------------------------------------------------------------


@dataclass
class PodmanService:
    podman: Podman
    socket_path: Path

    @property
    def client(self) -> EngineClient:
        return EngineClient(self.socket_path, what="Podman's API service")

    async def __call__(self, *args: str) -> str:
        done = await asyncio.to_thread(self.podman, *args)
        return done.stdout.strip()


@pytest.fixture(scope="module")
def podman_service() -> Iterator[PodmanService]:
    """A private Podman and its API service on a socket of this test (podman.socket's)."""
    require_root()
    require_command("curl", "apt-get install curl: to see the service answer")
    with private_podman() as podman:
        podman.import_busybox(IMAGE, {})
        socket_path = podman.base / "podman.sock"
        service = subprocess.Popen(
            [*podman.command, "system", "service", "--time=0", f"unix://{socket_path}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: _pings(socket_path), what="podman system service", proc=service)
            yield PodmanService(podman, socket_path)
        finally:
            stop_process(service)


def _pings(socket_path: Path) -> bool:
    if not socket_path.exists():
        return False
    done = subprocess.run(
        ["curl", "-sf", "--max-time", "5", "--unix-socket", str(socket_path), "http://d/_ping"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return done.returncode == 0


async def test_podman_events_and_list(podman_service: PodmanService, device_node: str) -> None:
    podman = podman_service
    async with followed(podman.client) as (_events, calls):
        create = ["create", *RUN_LIMITS, *label_args(), "--device", device_node]
        cid = await podman(*create, IMAGE, "sleep", "600")
        try:
            await eventually(
                lambda: calls.of(cid) == [EventKind.CREATED], "created", EVENT_WITHIN_S
            )
            (listed,) = [c for c in await list_containers(podman.client) if c.id == cid]
            assert listed == Container(cid, False, LEASE, (device_node,), f"--device {device_node}")
            await podman("start", cid)
            await eventually(lambda: len(calls.of(cid)) == 2, "started", EVENT_WITHIN_S)
            assert (await inspect_container(podman.client, cid) or listed).running
            await podman("kill", cid)
            await eventually(lambda: len(calls.of(cid)) == 3, "died", EVENT_WITHIN_S)
            await podman("rm", cid)
            await eventually(lambda: len(calls.of(cid)) == 4, "destroyed", EVENT_WITHIN_S)
            assert calls.of(cid) == [
                EventKind.CREATED,
                EventKind.STARTED,
                EventKind.DIED,
                EventKind.DESTROYED,
            ]
        finally:
            await podman("rm", "-f", cid)
