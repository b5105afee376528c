"""/metrics end to end: a real container's GPU process named by a private dockerd, a host
process, a process gone before it could be placed, and a real Prometheus scraping it all.

The simulated node reports the PIDs the test chose (a node file written here); everything
else is real: the agent process, /proc, the container's cgroup, the Docker engine API on
its unix socket, and Prometheus.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.dockerd import DockerEngine
from tests.support.node_files import with_processes
from tests.support.prometheus import start_prometheus, stop_prometheus
from tests.support.services import free_port, port_open, stop_process, wait_until

pytestmark = pytest.mark.e2e

MIB = 2**20
IMAGE = "nvd-metrics-trainer:1"
NAME = "nvd-gpu-trainer"


@dataclass
class Container:
    id: str
    name: str
    image: str
    pid: int


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as resp:
            body: bytes = resp.read()
            return body


@pytest.fixture(scope="module")
def container(docker_engine: DockerEngine) -> Iterator[Container]:
    docker_engine.import_busybox(IMAGE)
    docker_engine.docker("rm", "-f", NAME, check=False)
    cid = docker_engine.docker("run", "-d", "--name", NAME, IMAGE, "sleep", "600").stdout.strip()
    try:
        pid = int(docker_engine.docker("inspect", "-f", "{{.State.Pid}}", cid).stdout)
        yield Container(cid, NAME, IMAGE, pid)
    finally:
        docker_engine.docker("rm", "-f", cid, check=False)


@pytest.fixture(scope="module")
def host_process() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _exited_pid() -> int:
    """The PID of a process that ran and was reaped: what NVML listed a moment ago."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory,
    docker_engine: DockerEngine,
    container: Container,
    host_process: int,
) -> Iterator[Agent]:
    root = tmp_path_factory.mktemp("metrics-agent")
    gone = _exited_pid()
    node = with_processes(
        "hgx-h200-8",
        {
            0: [(container.pid, "sleep", 4321)],  # GPU 0: the container alone
            1: [(host_process, "sleep", 1000)],  # GPU 1: a host process
            4: [(gone, "python3", 77), (container.pid, "sleep", 5)],  # GPU 4: shared
        },
        root / "node.json",
    )
    port = free_port()
    log_path = root / "agent.log"
    socket_path = docker_engine.host.removeprefix("unix://")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "agent.daemon",
                "-l", f"127.0.0.1:{port}", "-s", str(root / "plugins"), "-d", str(root / "vol"),
                "--simulate", str(node), "--docker-socket", socket_path,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: port_open(port), what=f"agent (log {log_path})", proc=proc)
        yield Agent(proc, port, log_path)
    finally:
        stop_process(proc)


def test_processes_are_attributed(agent: Agent, container: Container, host_process: int) -> None:
    devices = json.loads(agent.get("/gpu/processes/json"))["Devices"]
    (in_container,) = devices[0]["Processes"]
    assert in_container == {
        "PID": container.pid, "Name": "sleep", "MemoryUsed": 4321, "Owner": "docker",
        "ContainerID": container.id, "ContainerName": NAME, "Image": IMAGE,
        "MesosContainer": None,
    }  # fmt: skip
    (host,) = devices[1]["Processes"]
    assert (host["PID"], host["Owner"], host["ContainerID"]) == (host_process, "host", None)
    gone, shared = devices[4]["Processes"]
    assert gone["Owner"] == "unknown"  # exited between the "NVML" read and its cgroup read
    assert gone["MemoryUsed"] == 77
    assert shared["ContainerName"] == NAME
    assert "Traceback" not in agent.log_path.read_text()


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_gpu_metrics_carry_the_container_that_owns_the_gpu(
    agent: Agent, container: Container
) -> None:
    text = agent.get("/metrics").decode()
    (gpu0,) = [s for s in _series(text, "DCGM_FI_DEV_GPU_UTIL") if 'gpu="0"' in s]
    assert f'container="{NAME}"' in gpu0
    assert f'container_id="{container.id}"' in gpu0
    assert f'image="{IMAGE}"' in gpu0
    for gpu in ("1", "4"):  # a host process; a container sharing with another process
        (line,) = [s for s in _series(text, "DCGM_FI_DEV_GPU_UTIL") if f'gpu="{gpu}"' in s]
        assert "container=" not in line
    memory = _series(text, "nvidia_docker_gpu_process_memory_used_bytes")
    (trainer,) = [s for s in memory if 'gpu="0"' in s]
    assert f'pid="{container.pid}"' in trainer
    assert 'owner="docker"' in trainer
    assert float(trainer.rpartition(" ")[2]) == 4321 * MIB


def test_container_facts_are_cached(agent: Agent) -> None:
    for _ in range(3):
        agent.get("/metrics")
    text = agent.get("/metrics").decode()
    (answered,) = [s for s in _series(text, "nvidia_docker_container_lookups_total")
                   if 'outcome="answered"' in s]  # fmt: skip
    assert float(answered.rpartition(" ")[2]) == 1  # one container, asked once for 4 scrapes


def test_prometheus_scrapes_the_agent(agent: Agent, container: Container) -> None:
    server = start_prometheus([f"127.0.0.1:{agent.port}"], interval_s=1)
    try:
        server.wait_for('up{job="nvidia-docker"} == 1')
        (util,) = server.wait_for('DCGM_FI_DEV_GPU_UTIL{gpu="2"}')
        assert util["value"][1] == "97"  # what the simulated node holds
        assert util["metric"]["modelName"] == "NVIDIA H200"
        assert util["metric"]["UUID"] == "GPU-2f70ba43-2df1-51a2-a6ab-95502c99433a"
        (used,) = server.wait_for(
            f'nvidia_docker_gpu_process_memory_used_bytes{{container="{NAME}",gpu="0"}}'
        )
        assert float(used["value"][1]) == 4321 * MIB
        assert used["metric"]["image"] == IMAGE
        assert used["metric"]["container_id"] == container.id
        (power,) = server.wait_for(f'DCGM_FI_DEV_POWER_USAGE{{container="{NAME}"}}')
        assert float(power["value"][1]) == 76.25  # GPU 0, labelled with its one container
        # the GPU health watch is the source: every GPU watched, no XID seen yet
        xids = server.wait_for("DCGM_FI_DEV_XID_ERRORS")
        assert sorted(x["metric"]["gpu"] for x in xids) == [str(i) for i in range(len(xids))]
        assert {x["value"][1] for x in xids} == {"0"}
        healthy = server.wait_for("nvidia_docker_gpu_healthy")
        assert {h["value"][1] for h in healthy} == {"1"}
    finally:
        stop_prometheus(server)


def test_fleet_status_shows_who_uses_each_gpu(
    agent: Agent, container: Container, host_process: int
) -> None:
    node = f"http://127.0.0.1:{agent.port}"
    proc = subprocess.run(
        [sys.executable, "-m", "controller.ctl.main", "status", "--processes", node],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[1]: line for line in proc.stdout.splitlines()[1:]}
    assert proc.stdout.splitlines()[0].split()[-2:] == ["USED", "BY"]
    assert rows["0"].endswith(f"13.0  {NAME}")
    assert rows["1"].endswith(f"13.0  host:sleep({host_process})")
    assert rows["4"].rsplit("  ", 1)[1].startswith("unknown:python3(")
    assert rows["4"].endswith(f", {NAME}")
    assert rows["5"].endswith("13.0  -")
