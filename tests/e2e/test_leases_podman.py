"""GPU leases end to end with Podman: ``NV_DOCKER=podman nvidia-docker`` (Debian 12's 4.3),
Podman's API service on a socket of the test, and a real agent process serving the
simulated ``hgx-h200-8`` node, following that service's events (``--podman-socket``).

Podman reads CDI, so the wrapper gives each container its leased GPU as a CDI name
(``nvidia.com/gpu=<UUID>``) of the agent's spec. Podman 4.3 reads specs from
``/var/run/cdi`` only: the agent writes its spec there, under the machine-wide CDI lock,
and the test removes it afterwards. The device nodes the spec names are made with mknod in
a private dev root (``--cdi-dev-root``): nothing is made under /dev, nothing opens them.

Checked: concurrent ``NV_GPU=auto:1`` runs each get a GPU of their own, the agent binds
each lease to its Podman container, and ``podman rm -f`` frees the GPU within a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_process import AgentProcess, launch_agent, wait_ready
from tests.support.podman import CDI_LOCK, RUN_LIMITS, Podman, private_podman
from tests.support.prerequisites import require_command, require_root
from tests.support.services import machine_lock, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
IMAGE = "nvd-leases/busybox:1"
GPUS = 8
RUNS = 3  # concurrent leased containers
NVIDIA_MAJOR, UVM_MAJOR = 195, 510  # any free majors do for nodes never opened
CDI_DIR = Path("/var/run/cdi")
SPEC = CDI_DIR / "nvidia-docker.json"
FREED_WITHIN_S = 1.0  # podman rm -f returned -> its lease gone from GET /leases/json
LEASE_LABEL = "nvidia-docker.lease"
LEASE_DEVICES = "nvidia-docker.lease.devices"


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


@dataclass
class PodmanService:
    podman: Podman
    socket_path: Path


@pytest.fixture(scope="module")
def podman_service() -> Iterator[PodmanService]:
    """A private Podman with the busybox image, and its API service on a socket."""
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


def _foreign_specs() -> list[str]:
    """Specs of kind nvidia.com/gpu that are not ours: Podman would see two devices "0"."""
    found = []
    for directory in (Path("/etc/cdi"), CDI_DIR):
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            if path.name != SPEC.name and '"nvidia.com/gpu"' in path.read_text(errors="replace"):
                found.append(str(path))
    return found


def _make_dev_root(root: Path) -> None:
    dev = root / "dev"
    dev.mkdir(parents=True)
    nodes = {"nvidiactl": (NVIDIA_MAJOR, 255), "nvidia-uvm": (UVM_MAJOR, 0)}
    nodes |= {f"nvidia{i}": (NVIDIA_MAJOR, i) for i in range(GPUS)}
    for name, (major, minor) in nodes.items():
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


@dataclass
class Node:
    service: PodmanService
    agent: AgentProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.agent.port}"

    def table(self) -> dict[str, Any]:
        """GET /leases/json."""
        with urllib.request.urlopen(f"{self.url}/leases/json", timeout=10) as resp:
            table: dict[str, Any] = json.loads(resp.read())
        return table

    def bound(self) -> dict[str, str]:
        """Container id -> lease id, of every lease bound to a container."""
        return {
            lease["Container"]: lease["Lease"]
            for lease in self.table()["Leases"]
            if lease["Container"] is not None
        }

    def run_leased(self) -> subprocess.CompletedProcess[str]:
        """``NV_DOCKER=podman NV_GPU=auto:1 nvidia-docker run -d IMAGE sleep 600``."""
        script = Path(sys.executable).with_name("nvidia-docker")
        module = [sys.executable, "-m", "controller.wrapper.cli"]
        command = [str(script)] if script.exists() else module
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "DOCKER_"))}
        environ.update(
            NV_DOCKER=" ".join(self.service.podman.command),
            NV_HOST=self.url,
            NV_GPU="auto:1",
            PYTHONPATH=str(REPO),
        )
        return subprocess.run(
            [*command, "run", "-d", *RUN_LIMITS, IMAGE, "sleep", "600"],
            env=environ,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def inspect(self, container_id: str) -> dict[str, Any]:
        done = self.service.podman("inspect", container_id)
        (found,) = json.loads(done.stdout)
        return dict(found)


@pytest.fixture
def node(podman_service: PodmanService) -> Iterator[Node]:
    """An agent following the Podman service, its CDI spec in /var/run/cdi; afterwards every
    container removed, the agent stopped, the spec removed."""
    with machine_lock(CDI_LOCK):
        if _foreign_specs():
            pytest.skip(f"another CDI spec of kind nvidia.com/gpu is here: {_foreign_specs()}")
        made_dir = not CDI_DIR.exists()
        base = Path(tempfile.mkdtemp(prefix="nvd-leases-podman-"))
        _make_dev_root(base / "devroot")
        agent = launch_agent(
            base,
            "--podman-socket", str(podman_service.socket_path),
            "--docker-socket", str(base / "no-docker.sock"),
            "--state-dir", str(base / "state"),
            "--cdi-spec-dir", str(CDI_DIR),
            "--cdi-dev-root", str(base / "devroot"),
            simulate="hgx-h200-8",
        )  # fmt: skip
        try:
            wait_ready(agent)
            following = "Following the container events of Podman"
            wait_until(
                lambda: SPEC.exists() and following in agent.log(),
                what=f"the agent's CDI spec and its following Podman (log: {agent.log_path})",
                timeout_s=30,
                proc=agent.proc,
            )
            yield Node(podman_service, agent)
        finally:
            podman_service.podman("rm", "--all", "--force", "--time", "0", check=False)
            stop_process(agent.proc)
            SPEC.unlink(missing_ok=True)
            if made_dir:
                with contextlib.suppress(OSError):
                    CDI_DIR.rmdir()
            shutil.rmtree(base, ignore_errors=True)


def test_concurrent_podman_runs_get_a_gpu_each_and_rm_f_frees_it(node: Node) -> None:
    with ThreadPoolExecutor(max_workers=RUNS) as pool:
        runs = list(pool.map(lambda _: node.run_leased(), range(RUNS)))
    for run in runs:
        assert run.returncode == 0, run.stderr
    containers = [run.stdout.strip() for run in runs]

    leases = {}
    for cid in containers:
        config = node.inspect(cid)["Config"]
        labels = config["Labels"]
        leases[cid] = (labels[LEASE_LABEL], labels[LEASE_DEVICES])
        # The leased GPU, and only it, as the CDI name of the agent's spec.
        given = [arg for arg in config["CreateCommand"] if arg.startswith("--device")]
        assert given == [f"--device=nvidia.com/gpu={labels[LEASE_DEVICES]}"]
    assert len({lease for lease, _ in leases.values()}) == RUNS
    assert len({uuid for _, uuid in leases.values()}) == RUNS
    wait_until(
        lambda: node.bound() == {cid: lease for cid, (lease, _) in leases.items()},
        what="each lease bound to its Podman container",
        timeout_s=20,
    )
    held = {u["UUID"] for u in node.table()["Units"] if u["State"] == "leased"}
    assert held == {uuid for _, uuid in leases.values()}

    gone = containers[0]
    node.service.podman("rm", "--force", "--time", "0", gone)
    returned = time.monotonic()
    wait_until(lambda: gone not in node.bound(), what="the removed one's lease gone")
    freed_s = time.monotonic() - returned
    print(f"podman rm -f: its lease was gone {freed_s:.3f} s after it returned")
    assert freed_s < FREED_WITHIN_S
    assert set(node.bound()) == set(containers[1:])
