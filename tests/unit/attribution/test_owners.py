"""The attributor's bookkeeping: kinds from cgroups, the engine asked only when needed.

The Docker engine's answers themselves are tested against a real dockerd
(tests/e2e/test_attribution.py); here the engine is absent or unreachable.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from agent.attribution.cgroup import OwnerKind
from agent.attribution.docker_engine import DockerEngine
from agent.attribution.owners import Attributor, ProcessOwner, mesos_container_of

ID = "8f3c2b1a" * 8


def _proc(tmp_path: Path, cgroups: dict[int, str]) -> Path:
    root = tmp_path / "proc"
    for pid, text in cgroups.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cgroup").write_text(text)
    return root


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_kinds_without_an_engine(tmp_path: Path) -> None:
    proc = _proc(
        tmp_path,
        {
            10: f"0::/system.slice/docker-{ID}.scope\n",
            11: "4:memory:/mesos/abc/mesos/def\n",
            12: "0::/user.slice/session-2.scope\n",
        },
    )
    owners = await Attributor(None, proc=proc).owners([10, 11, 12, 13, 10])
    assert owners == {
        10: ProcessOwner(OwnerKind.DOCKER, container_id=ID),
        11: ProcessOwner(OwnerKind.MESOS, mesos_container="abc.def"),
        12: ProcessOwner(OwnerKind.HOST),
        13: ProcessOwner(OwnerKind.UNKNOWN),  # listed by NVML, gone before its cgroup read
    }
    assert owners[10].in_container
    assert owners[11].in_container
    assert not owners[12].in_container


async def test_unreachable_engine_is_logged_once_and_retried_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = _proc(tmp_path, {10: f"0::/docker/{ID}\n"})
    clock = Clock()
    engine = DockerEngine(tmp_path / "no-docker.sock", timeout_s=1)
    attributor = Attributor(engine, proc=proc, retry_s=30, clock=clock)
    try:
        for _ in range(3):
            owners = await attributor.owners([10])
            assert owners[10] == ProcessOwner(OwnerKind.DOCKER, container_id=ID)
        assert (attributor.lookups, attributor.lookup_failures) == (1, 1)
        clock.now += 31
        await attributor.owners([10])
        assert (attributor.lookups, attributor.lookup_failures) == (2, 2)
    finally:
        await attributor.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert f"cannot reach the Docker engine at unix://{tmp_path / 'no-docker.sock'}" in warnings[0]
    assert "container id only" in warnings[0]


async def test_each_engine_has_its_own_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No Podman service on a Docker node: Podman containers by id, Docker's still asked."""
    podman_id = "b" * 64
    proc = _proc(
        tmp_path, {10: f"0::/docker/{ID}\n", 11: f"0::/libpod_parent/libpod-{podman_id}\n"}
    )
    docker = DockerEngine(tmp_path / "no-docker.sock", timeout_s=1)
    podman = DockerEngine(tmp_path / "no-podman.sock", timeout_s=1, what="Podman's API service")
    attributor = Attributor(docker, podman=podman, proc=proc, retry_s=30, clock=Clock())
    try:
        owners = await attributor.owners([10, 11])
        assert owners[11] == ProcessOwner(OwnerKind.PODMAN, container_id=podman_id)
        assert (attributor.lookups, attributor.lookup_failures) == (2, 2)
        await attributor.owners([10, 11])
        assert attributor.lookups == 2  # both engines wait for retry_s
    finally:
        await attributor.close()
    warnings = sorted(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert len(warnings) == 2
    assert "Podman's API service at unix://" in warnings[0]
    assert "GPU processes in Podman containers are shown with their container id" in warnings[0]
    assert "GPU processes in Docker containers" in warnings[1]


@pytest.mark.parametrize(
    ("name", "container"),
    [
        ("mesos-6b4a3f7e-2d1c-4e9a-9c1b-6f0d2a7e5c31", "6b4a3f7e-2d1c-4e9a-9c1b-6f0d2a7e5c31"),
        ("mesos-a9b8-S3.6b4a3f7e", "6b4a3f7e"),  # Mesos before 1.0: <agent id>.<container id>
        ("mesos-a9b8-S3.6b4a3f7e.executor", "6b4a3f7e"),  # its executor's container
        ("trainer", None),
        ("mesos-", None),
    ],
)
def test_mesos_docker_containerizer_names(name: str, container: str | None) -> None:
    assert mesos_container_of(name) == container


async def test_answered_lookups_never_go_down_while_one_is_in_flight(tmp_path: Path) -> None:
    """``nvidia_docker_container_lookups_total{outcome="answered"}`` is lookups less failures:
    a lookup the engine is slow to fail must not count as answered first and as failed
    later, or Prometheus reads the counter going down as a reset."""
    accepted = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read()  # never answers; the engine's timeout ends the lookup
        writer.close()

    socket_path = tmp_path / "silent.sock"
    server = await asyncio.start_unix_server(silent, path=str(socket_path))
    proc = _proc(tmp_path, {10: f"0::/docker/{ID}\n"})
    attributor = Attributor(
        DockerEngine(socket_path, timeout_s=0.5), proc=proc, retry_s=30, clock=Clock()
    )
    try:
        asking = asyncio.ensure_future(attributor.owners([10]))
        await asyncio.wait_for(accepted.wait(), 10)
        in_flight = attributor.lookups - attributor.lookup_failures
        await asyncio.wait_for(asking, 10)
        assert attributor.lookup_failures == 1
        assert in_flight == 0
        assert attributor.lookups - attributor.lookup_failures == 0
    finally:
        await attributor.close()
        server.close()
        await server.wait_closed()
