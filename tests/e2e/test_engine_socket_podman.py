"""The GPU-aware engine socket in front of Podman's Docker-compatible service
(``--podman-engine-socket``, docs/engine-socket.md): the Docker 28 CLI and Debian 13's
Compose with ``DOCKER_HOST=unix://<the agent's socket>``, Podman's API service of a private
Podman store, and a real agent serving the simulated ``hgx-h200-8`` node and following that
service's events (``--podman-socket``).

Podman's service ignores ``HostConfig.DeviceRequests`` (``docker run --gpus``, Compose's
GPU reservations: podman #19338), so without the agent such a container runs with no GPU at
all; through the socket it gets its leased GPUs' device nodes and the driver volume's
directory bound read-only at /usr/local/nvidia. Checked: two ``docker run --gpus 2`` get four
distinct GPUs, exactly those device nodes inside, the driver's files read-only, and their
leases bound to the containers; Podman's start gate (the packaged hook file, asking the
agent) lets them start and stops a container made on Podman's own socket that names one of
their device nodes; a run asking for more than is free fails in one line and makes no
container; ``docker rm -f`` frees the lease, and so does the end of a short ``--rm`` run
(three in a row, each asking for all eight GPUs); Compose's ``count: 1`` replicas get a
GPU each and ``down`` frees them. Docker's CLI 28 cannot run containers on Podman 4's
service at all ("unknown server OS"): the module runs Podman 5, the machine's where it is
one, else the Debian 13 Podman that scripts/test-all unpacks into ``.cache/podman5``.

The device nodes /dev/nvidia0..7, nvidiactl and nvidia-uvm come from test_leases_docker's
fixture (mknod where missing, under the machine-wide device lock).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.test_leases_docker import nvidia_devices
from tests.support.agent_process import launch_agent, wait_ready
from tests.support.engine_socket_client import EngineSocketClient, compose_project
from tests.support.podman import ApiService, gated_api_service, podman_plugin_dir
from tests.support.prerequisites import require_root
from tests.support.services import stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

__all__ = ["nvidia_devices"]  # a module fixture, shared

IMAGE = "nvd-engine-podman/busybox:1"


PODMAN5 = Path(__file__).resolve().parents[2] / ".cache" / "podman5" / "bin"


def _podman_major(podman: str | None) -> int | None:
    if podman is None:
        return None
    out = subprocess.run([podman, "--version"], capture_output=True, text=True, check=False)
    found = re.search(r"(\d+)\.\d+", out.stdout)
    return int(found.group(1)) if found else None


@pytest.fixture(scope="module")
def podman5_first() -> Iterator[None]:
    """Podman 5 or later first on ``PATH`` for the module: the machine's ``podman`` where it
    is one, else scripts/test-all's Debian 13 Podman (``.cache/podman5``). Docker's CLI 28
    cannot run containers on Podman 4's service at all ('unknown server OS')."""
    found = _podman_major(shutil.which("podman"))
    if found is not None and found >= 5:
        yield
        return
    unpacked = PODMAN5 / "podman"
    if not unpacked.exists() or (_podman_major(str(unpacked)) or 0) < 5:
        pytest.skip(
            f"needs Podman 5 (the machine's is {found or 'not there'}): Docker's CLI 28 cannot "
            f"run containers on Podman 4's service; scripts/test-all unpacks one into {PODMAN5}"
        )
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{PODMAN5}{os.pathsep}{path}"
    try:
        yield
    finally:
        os.environ["PATH"] = path


@pytest.fixture(scope="module")
def service(nvidia_devices: None, podman5_first: None) -> Iterator[ApiService]:
    """Podman 5's service, its containers run through Podman's start gate, which asks the
    agent of the test on its plugin socket (``podman_plugin_dir``)."""
    require_root()
    with gated_api_service(IMAGE) as running:
        yield running


@dataclass(kw_only=True)
class Served(EngineSocketClient):
    service: ApiService


@pytest.fixture
def served(service: ApiService, tmp_path: Path) -> Iterator[Served]:
    base = tmp_path / "agent"
    engine_socket = tmp_path / "engine" / "podman.sock"
    agent = launch_agent(
        base,
        "--docker-socket", str(base / "no-docker.sock"),
        "--podman-socket", str(service.socket_path),
        "--state-dir", str(base / "state"),
        "--cdi-spec-dir", "",
        "--podman-engine-socket", str(engine_socket),
        simulate="hgx-h200-8",
        socket_dir=podman_plugin_dir(service.podman.base),
    )  # fmt: skip
    try:
        wait_ready(agent)
        wait_until(engine_socket.exists, what="the engine socket", timeout_s=20)
        yield Served(service=service, agent=agent, engine_socket=engine_socket)
    finally:
        service.podman("rm", "--all", "--force", check=False)
        stop_process(agent.proc)
    assert not engine_socket.exists()  # removed at a graceful stop


def test_two_runs_of_two_gpus_get_four_distinct_gpus_bound_with_the_drivers_files(
    served: Served,
) -> None:
    script = (
        "ls /dev | grep nvidia | sort | tr '\\n' ' '; ls /usr/local/nvidia >/dev/null && "
        "(touch /usr/local/nvidia/x 2>/dev/null && echo writable || echo read-only); sleep 600"
    )
    first = served.ok("run", "-d", "--gpus", "2", IMAGE, "sh", "-c", script).strip()
    second = served.ok(
        "run", "-d", "--gpus", "2", "--name", "second", IMAGE, "sh", "-c", script
    ).strip()
    gpus = served.gpus_of(first) + served.gpus_of(second)
    assert len(set(gpus)) == len(gpus) == 4, gpus
    wait_until(
        lambda: set(served.bound()) == {first, second}, what="both leases bound", timeout_s=30
    )
    for container in (first, second):
        wanted = sorted(p.removeprefix("/dev/") for p in served.gpus_of(container))
        wanted = sorted([*wanted, "nvidia-uvm", "nvidiactl"])

        def said(container: str = container) -> str:
            return served.ok("logs", container)

        wait_until(lambda: "read-only" in said() or "writable" in said(), what="the script")
        seen, verdict = said().strip().rsplit(" ", 1)
        assert sorted(seen.split()) == wanted  # exactly its GPUs, no other
        assert verdict == "read-only"
    inspect = json.loads(served.ok("inspect", first))[0]
    labels, env = inspect["Config"]["Labels"], inspect["Config"]["Env"]
    assert labels["nvidia-docker.lease"] == served.bound()[first]
    assert any(e.startswith("NVIDIA_VISIBLE_DEVICES=GPU-") for e in env), env
    mounts = [m for m in inspect["Mounts"] if m["Destination"] == "/usr/local/nvidia"]
    assert len(mounts) == 1, inspect["Mounts"]
    assert mounts[0]["Type"] == "bind"
    assert mounts[0]["RW"] is False
    owners = {lease["Container"]: lease["Owner"] for lease in served.table()["Leases"]}
    assert owners[second] == {"via": "engine-socket", "name": "second"}

    # Podman's start gate lets these containers start (they carry their lease), and stops
    # one made on Podman's own socket that names a leased GPU's node
    taken = served.gpus_of(first)[0]
    around = subprocess.run(
        ["docker", "run", "-d", "--device", taken, IMAGE, "sleep", "600"],
        env={**served.client_env(), "DOCKER_HOST": f"unix://{served.service.socket_path}"},
        stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert around.returncode != 0
    assert "nvidia-docker: container" in around.stderr.decode(), around.stderr.decode()
    assert "it names GPUs leased to others" in around.stderr.decode()

    # four of the eight GPUs are taken: an ask for five is refused in one line, and no
    # container is made
    refused = served.docker("run", "-d", "--gpus", "5", "--name", "third", IMAGE, "sleep", "1")
    assert refused.returncode != 0
    line = refused.stderr.decode().strip()
    assert "nvidia-docker: not enough free GPUs: asked for 5, 4 free" in line, line
    assert "third" not in served.ok("ps", "-a", "--format", "{{.Names}}").split()

    served.ok("rm", "-f", first)
    wait_until(lambda: set(served.bound()) == {second}, what="the lease freed", timeout_s=5)


COMPOSE_FILE = """\
services:
  trainer:
    image: {image}
    command: ["sleep", "600"]
    network_mode: none
    deploy:
      replicas: 3
      resources:
        reservations:
          devices: [{{driver: nvidia, count: 1, capabilities: [gpu]}}]
"""


def test_compose_replicas_get_a_gpu_each_and_down_frees_them(
    served: Served, tmp_path: Path
) -> None:
    project = compose_project(tmp_path / "project", COMPOSE_FILE.format(image=IMAGE))
    served.compose_up(project, "nvdpodman", 3)
    served.compose_down(project, "nvdpodman")


def test_a_short_run_with_rm_frees_its_gpus_as_it_is_removed(served: Served) -> None:
    """Podman's inspects and list wait while a container starts, so a short ``--rm`` job
    was gone before any of its events could be read: its lease stayed pending until its
    expiry (60 s), and its GPUs with it. The socket binds the lease from the create's
    answer, so the removal's event frees them."""
    for _ in range(3):
        served.ok("run", "--rm", "--gpus", "8", IMAGE, "sh", "-c", "true")
        wait_until(lambda: not served.table()["Leases"], what="the GPUs freed", timeout_s=5)
