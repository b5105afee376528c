"""A Podman container's GPU process named by Podman's own API service, end to end.

A real Podman (private store, ``tests.support.podman``) runs a container and serves its API
(``podman system service`` on a unix socket of this test, as the ``podman.socket`` unit
does on a node); the simulated node reports the container's PID as a GPU process. The agent
finds the container in the process's cgroup (``libpod-<id>``) and asks Podman for its name
and image, on the Docker-compatible endpoint it asks dockerd.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.node_files import with_processes
from tests.support.podman import RUN_LIMITS, Podman, private_podman
from tests.support.services import free_port, port_open, stop_process, wait_until

pytestmark = pytest.mark.e2e

NAME = "nvd-podman-trainer"
TAG = "nvd-podman-metrics:1"


@dataclass
class PodmanContainer:
    id: str
    pid: int
    image: str


@pytest.fixture(scope="module")
def podman() -> Iterator[Podman]:
    with private_podman() as podman:
        yield podman


@pytest.fixture(scope="module")
def podman_socket(podman: Podman) -> Iterator[Path]:
    """Podman's API service on a socket of this test (what podman.socket gives a node)."""
    socket_path = podman.base / "podman.sock"
    service = subprocess.Popen(
        [*podman.command, "system", "service", "--time=0", f"unix://{socket_path}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _pings(socket_path), what="podman system service", proc=service)
        yield socket_path
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


@pytest.fixture(scope="module")
def container(podman: Podman) -> Iterator[PodmanContainer]:
    podman.import_busybox(TAG, {})
    cid = podman("run", "-d", "--name", NAME, *RUN_LIMITS, TAG, "sleep", "600").stdout.strip()
    try:
        pid = int(podman("inspect", "-f", "{{.State.Pid}}", cid).stdout)
        image = podman("inspect", "-f", "{{.ImageName}}", cid).stdout.strip()
        yield PodmanContainer(cid, pid, image)
    finally:
        podman("rm", "-f", cid, check=False)


@pytest.fixture(scope="module")
def agent_port(
    tmp_path_factory: pytest.TempPathFactory, podman_socket: Path, container: PodmanContainer
) -> Iterator[int]:
    root = tmp_path_factory.mktemp("podman-agent")
    node = with_processes("h200x2", {1: [(container.pid, "sleep", 2048)]}, root / "node.json")
    port = free_port()
    log_path = root / "agent.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "agent.daemon",
                "-l", f"127.0.0.1:{port}", "-s", str(root / "plugins"), "-d", str(root / "vol"),
                "--simulate", str(node), "--cdi-spec-dir", "",
                "--docker-socket", str(root / "no-docker.sock"),
                "--podman-socket", str(podman_socket),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: port_open(port), what=f"agent (log {log_path})", proc=proc)
        yield port
    finally:
        stop_process(proc)
    assert "Traceback" not in log_path.read_text()


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
        return str(answer.read().decode())


def test_a_podman_container_is_named_by_podman(agent_port: int, container: PodmanContainer) -> None:
    devices = json.loads(_get(agent_port, "/gpu/processes/json"))["Devices"]
    (process,) = devices[1]["Processes"]
    assert process == {
        "PID": container.pid, "Name": "sleep", "MemoryUsed": 2048, "Owner": "podman",
        "ContainerID": container.id, "ContainerName": NAME, "Image": container.image,
        "MesosContainer": None,
    }  # fmt: skip
    assert container.image.endswith(TAG)  # localhost/nvd-podman-metrics:1
    metrics = _get(agent_port, "/metrics")
    (gpu1,) = [
        line for line in metrics.splitlines()
        if line.startswith("DCGM_FI_DEV_GPU_UTIL{") and 'gpu="1"' in line
    ]  # fmt: skip
    assert f'container="{NAME}"' in gpu1
    assert f'image="{container.image}"' in gpu1
