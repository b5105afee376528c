"""A container that is starting is named at once (dockerd), or soon without an outage
(Podman), by a real engine with a slow runtime.

dockerd holds a container's lock for as long as the container starts (its runtime creating
it), and ``docker inspect`` waits for that lock: Docker 20.10 and 26 alike. Where a start
takes seconds (a slow runtime hook, a large image), the agent's inspect timed out, the
agent took the whole engine as unreachable for ``retry_s`` (30 s), logged so, and showed
every new container's GPU processes and usage by id alone, without its labels. Here the
runtime is runc behind a script that sleeps before it creates the container; the agent asks
the container list when the inspect does not answer in time, which dockerd answers at once.
Podman's list waits for the container too; its API service still answers a ping, so the
container is asked again a few seconds later and the engine is not taken as down.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.attribution.cgroup import OwnerKind
from agent.attribution.docker_engine import ContainerFacts, DockerEngine
from agent.attribution.owners import BUSY_RETRY_S, Attributor
from agent.engines.containers import list_containers
from agent.engines.http import EngineClient
from agent.leases.containers import Container
from agent.leases.labels import LABEL_DEVICES, LABEL_ID, read_label
from tests.support.device_nodes import nvidia_nodes, wanted_nodes
from tests.support.dockerd import DockerEngine as Engine
from tests.support.dockerd import newer_dockerd, start_engine, stop_engine
from tests.support.podman import RUN_LIMITS, api_service, private_podman
from tests.support.prerequisites import require_root
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SLOW_S = 8.0  # how long the runtime takes to create a container
PROJECT = "com.docker.compose.project"


def _dockerd(which: str) -> str:
    """Debian 12's dockerd (20.10), or Debian 13's (26) that scripts/test-all unpacks."""
    return "dockerd" if which == "20.10" else newer_dockerd()


def slow_runc(directory: Path) -> tuple[Path, Path]:
    """(a runtime: runc after a marker file and a ``SLOW_S`` sleep at create, the marker)."""
    marker = directory / "creating"
    runtime = directory / "slow-runc"
    runtime.write_text(
        "#!/bin/sh\n"
        'for arg in "$@"; do\n'
        f'  if [ "$arg" = create ]; then touch {marker}; sleep {SLOW_S:g}; fi\n'
        "done\n"
        'exec runc "$@"\n'
    )
    runtime.chmod(0o755)
    return runtime, marker


@pytest.fixture(scope="module", params=["20.10", "26"])
def slow_engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Path]]:
    """A private dockerd with a runtime ``slow``: runc, after a marker file and a sleep."""
    require_root()
    dockerd = _dockerd(request.param)
    runtime, marker = slow_runc(tmp_path_factory.mktemp("slow-runtime"))
    engine, proc = start_engine(
        dockerd=dockerd, daemon_json={"runtimes": {"slow": {"path": str(runtime)}}}
    )
    try:
        engine.import_busybox("nvd-busy:1")
        yield engine, marker
    finally:
        stop_engine(engine, proc)


@dataclass(frozen=True)
class Starting:
    cid: str
    start: threading.Thread  # alive while dockerd holds the container


@contextlib.contextmanager
def starting(engine: Engine, marker: Path, *create_args: str) -> Iterator[Starting]:
    """A container (``docker create`` with ``create_args``) that the slow runtime is
    creating: its start runs in a thread; at the end the start is waited for and the
    container removed."""
    marker.unlink(missing_ok=True)
    cid = engine.docker(
        "create", "--runtime", "slow", *create_args, "nvd-busy:1", "sleep", "600"
    ).stdout.strip()  # fmt: skip
    start = threading.Thread(target=engine.docker, args=("start", cid), daemon=True)
    try:
        start.start()
        wait_until(marker.exists, what="the slow runtime creating the container")
        yield Starting(cid, start)
    finally:
        start.join(timeout=SLOW_S + 30)
        engine.docker("rm", "-f", cid, check=False)


async def test_a_starting_container_is_named_while_dockerd_holds_it(
    slow_engine: tuple[Engine, Path], caplog: pytest.LogCaptureFixture
) -> None:
    engine, marker = slow_engine
    started = engine.docker(
        "run", "-d", "--name", "warm", "--label", f"{PROJECT}=other", "nvd-busy:1", "sleep", "600"
    ).stdout.strip()  # the default runtime: started at once
    client = DockerEngine(Path(engine.host.removeprefix("unix://")), timeout_s=1.0)
    client.wanted_labels = frozenset({PROJECT})
    attributor = Attributor(client, retry_s=30)
    try:
        with starting(
            engine, marker, "--name", "starting-trainer", "--label", f"{PROJECT}=nvdbusy"
        ) as slow:
            cid = slow.cid
            began = time.monotonic()
            found = await attributor.container(cid)
            took_s = time.monotonic() - began
            assert slow.start.is_alive(), (
                "the start ended before the lookup: the runtime was not slow"
            )
            assert found == (
                OwnerKind.DOCKER,
                ContainerFacts(cid, "starting-trainer", "nvd-busy:1", ((PROJECT, "nvdbusy"),)),
            )
            assert took_s < SLOW_S / 2  # the inspect's 1 s, then the list: not the whole start
            # the engine was not taken as down: another container is asked, and named
            other = await attributor.container(started)
            assert other is not None
            assert other[1].name == "warm"
            assert attributor.lookup_failures == 0
            warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert warnings == []
    finally:
        await attributor.close()
        engine.docker("rm", "-f", started, check=False)


async def test_a_resync_while_a_container_starts_takes_it_from_the_list(
    slow_engine: tuple[Engine, Path],
) -> None:
    """The container list a resync applies (at the agent's start, when an event stream
    reopens) inspects every container; a leased one that is starting is taken as dockerd's
    list shows it (not running, its lease label) instead of failing the whole list until the
    start is done. A running container beside it is inspected: its devices count."""
    engine, marker = slow_engine
    with nvidia_nodes(wanted_nodes([3], uvm=False)):
        held = engine.docker(
            "run", "-d", "--device", "/dev/nvidia3", "nvd-busy:1", "sleep", "600"
        ).stdout.strip()
    lease = {LABEL_ID: "lease-41", LABEL_DEVICES: "GPU-9f1c0b1e-0000-4000-8000-000000000002"}
    client = EngineClient(Path(engine.host.removeprefix("unix://")), timeout_s=1.0)
    try:
        with starting(engine, marker, *(f"--label={k}={v}" for k, v in lease.items())) as slow:
            began = time.monotonic()
            listed = {c.id: c for c in await list_containers(client)}
            took_s = time.monotonic() - began
            assert slow.start.is_alive(), (
                "the start ended before the list: the runtime was not slow"
            )
            assert took_s < SLOW_S / 2  # the inspect's 1 s, then the list: not the whole start
            assert listed[slow.cid] == Container(slow.cid, False, read_label(lease))
            assert listed[held].running
            assert listed[held].how == "--device /dev/nvidia3"
    finally:
        engine.docker("rm", "-f", held, check=False)


def podman_with(command: list[str], *args: str) -> str:
    """``command`` (podman and its global options) with ``args``: its output."""
    done = subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=SLOW_S + 120, check=True
    )
    return done.stdout.strip()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_starting_podman_container_is_named_soon_and_podman_is_not_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    require_root()
    runtime, marker = slow_runc(tmp_path)
    with private_podman() as podman, api_service(podman) as service:
        podman.import_busybox("nvd-busy:1", {})
        warm = podman("run", "-d", *RUN_LIMITS, "--name", "warm", "nvd-busy:1", "sleep", "600")
        command = list(podman.command)
        if "--runtime" in command:  # the machine's runtime (runc on hybrid cgroups)
            at = command.index("--runtime")
            del command[at : at + 2]
        slow = [*command, "--runtime", str(runtime)]
        cid = podman_with(
            slow, "create", *RUN_LIMITS, "--name", "starting-trainer",
            "--label", f"{PROJECT}=nvdbusy", "nvd-busy:1", "sleep", "600",
        )  # fmt: skip
        start = threading.Thread(target=podman_with, args=(slow, "start", cid), daemon=True)
        client = DockerEngine(service.socket_path, timeout_s=1.0, what="Podman's API service")
        client.wanted_labels = frozenset({PROJECT})
        clock = Clock()
        attributor = Attributor(None, podman=client, retry_s=30, clock=clock)
        try:
            start.start()
            wait_until(marker.exists, what="the slow runtime creating the container")
            first = await attributor.container(cid)
            assert start.is_alive(), "the start ended before the lookup: the runtime was not slow"
            # Podman's inspect and list both wait for the container; named now or soon
            assert first is None or first[1].name == "starting-trainer", first
            # Podman was not taken as down: another container is asked at once, and named
            other = await attributor.container(warm.stdout.strip())
            assert other is not None
            assert other[1].name == "warm"
            start.join(timeout=SLOW_S + 60)
            clock.now += BUSY_RETRY_S + 0.1
            later = await attributor.container(cid)
            assert later == (
                OwnerKind.PODMAN,
                ContainerFacts(cid, "starting-trainer", "localhost/nvd-busy:1",
                               ((PROJECT, "nvdbusy"),)),
            )  # fmt: skip
            warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert warnings == []
        finally:
            await attributor.close()
            start.join(timeout=SLOW_S + 60)
