"""GPU leases end to end with Docker: the real ``nvidia-docker`` wrapper, a private dockerd
and a real agent process serving the simulated ``hgx-h200-8`` node (eight H200s) with its
lease table (docs/leases.md, docs/nvidia-docker.md "Leases").

The agent follows this module's own dockerd (``--docker-socket``), serves it the volume
plugin (``--spec-file`` in the engine's own /etc/docker/plugins) and keeps its state in a
directory of the test (``--state-dir``). Docker's ``--device`` needs the host's device node,
and this machine has no GPU: a module fixture makes /dev/nvidia0..7, nvidiactl and
nvidia-uvm with mknod where they are missing (under the machine-wide device lock that
tests/e2e/test_wrapper.py and test_engine_events.py take too) and removes exactly those
afterwards. Nothing opens them: the containers run busybox ``sleep``.

Checked: eight concurrent ``NV_GPU=auto:1`` runs each get a GPU of their own and the agent
binds each lease to its container; a ninth is refused in one line naming the holders, and
with ``NV_GPU_WAIT`` gets the GPU that a ``docker rm -f`` frees; that removal frees the GPU
within a second; the leases survive a ``kill -9`` of the agent (its state file, or without
it the containers' labels); a container given ``--device /dev/nvidia3`` past the wrapper
makes GPU 3 foreign, and no lease gets it; after a dockerd restart stopped containers keep
their leases for the grace time and the agent follows the new dockerd's events; a run on
a second dockerd, which the agent does not follow, is refused before anything is leased
(and the agent's dockerd at a second socket of its own is followed); on a node
of NVLink pairs across two sockets a 2-GPU ask gets a linked pair of one socket, with that
socket's cpuset in ``docker inspect``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess, launch_agent, wait_ready
from tests.support.device_nodes import nvidia_nodes, wanted_nodes
from tests.support.dockerd import DockerEngine, restart_engine, start_engine, stop_engine
from tests.support.lease_node import LeaseNode, one_line
from tests.support.services import free_port, stop_process, wait_until
from tests.support.wrapper import wrapper_command

# The first test may wait for another run on this machine to give back the device nodes.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
IMAGE = "nvd-leases/busybox:1"
GPUS = 8
SHUTDOWN_ARGS = ("--shutdown-timeout", "1")  # dockerd's own wait at a restart
FREED_WITHIN_S = 1.0  # docker rm -f returned -> its lease gone from GET /leases/json
LEASE_LABEL = "nvidia-docker.lease"


@pytest.fixture(scope="module")
def nvidia_devices() -> Iterator[None]:
    """Character device nodes /dev/nvidia0..7, nvidiactl, nvidia-uvm where missing."""
    with nvidia_nodes(wanted_nodes(range(GPUS))):
        yield


@dataclass
class Dockerd:
    """This module's dockerd (a test restarts it: ``proc`` is then the new process)."""

    engine: DockerEngine
    proc: subprocess.Popen[bytes]

    @property
    def plugin_dir(self) -> Path:
        """Where every agent of the module serves the volume plugin: dockerd keeps the
        plugin's address once it has used it, so each agent's socket is at the same path."""
        return self.engine.root / "nvidia-docker-plugin"

    @property
    def socket(self) -> str:
        return self.engine.host.removeprefix("unix://")

    def restart(self) -> None:
        self.proc = restart_engine(self.engine, self.proc, extra_args=SHUTDOWN_ARGS)


@pytest.fixture(scope="module")
def dockerd(nvidia_devices: None) -> Iterator[Dockerd]:
    """A private dockerd of this module's own, with the busybox image."""
    engine, proc = start_engine(extra_args=SHUTDOWN_ARGS)
    served = Dockerd(engine, proc)
    try:
        engine.import_busybox(IMAGE)
        yield served
    finally:
        stop_engine(served.engine, served.proc)


@dataclass
class Node(LeaseNode):
    """The agent of the simulated node, following ``dockerd``; restartable."""

    dockerd: Dockerd = field(kw_only=True)
    grace_s: float = field(kw_only=True)

    engine_name = "dockerd"

    def wrapper_env(self, **env: str) -> dict[str, str]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "DOCKER_"))}
        environ.update(DOCKER_HOST=self.dockerd.engine.host, NV_HOST=self.url, NV_CDI="no")
        environ.update(PYTHONPATH=str(REPO), **env)
        return environ

    def nvidia_docker(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*wrapper_command(), *args],
            env=self.wrapper_env(**env),
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def run_leased(self, *options: str, **env: str) -> subprocess.CompletedProcess[str]:
        """``NV_GPU=auto:1 nvidia-docker run -d OPTIONS IMAGE sleep 600``."""
        return self.nvidia_docker(
            "run", "-d", *options, IMAGE, "sleep", "600", NV_GPU="auto:1", **env
        )

    def run_leased_many(self, count: int, *options: str) -> list[str]:
        """``count`` leased containers started at once; their ids."""
        with ThreadPoolExecutor(max_workers=count) as pool:
            runs = list(pool.map(lambda _: self.run_leased(*options), range(count)))
        for run in runs:
            assert run.returncode == 0, run.stderr
        return [run.stdout.strip() for run in runs]

    def docker(self, *args: str) -> str:
        return self.dockerd.engine.docker(*args).stdout.strip()

    def gpu_of(self, container_id: str) -> tuple[str, str]:
        """(the /dev/nvidiaN docker gave the container, its lease label)."""
        raw = self.docker(
            "inspect", "-f", "{{json .HostConfig.Devices}}\t{{json .Config.Labels}}", container_id
        )
        devices, labels = (json.loads(part) for part in raw.split("\t"))
        gpus = [
            d["PathOnHost"]
            for d in devices
            if d["PathOnHost"].removeprefix("/dev/nvidia").isdigit()
        ]
        assert len(gpus) == 1, devices
        return gpus[0], labels[LEASE_LABEL]

    def follows(self) -> int:
        """How many times the agent has followed dockerd's events (at start, and once more
        after each reconnection, each time with the containers listed: a resync)."""
        log = self.log()
        return log.count(f"container events of the Docker engine at {self.dockerd.engine.host}") + (
            log.count(f"Docker engine at {self.dockerd.engine.host} answers again: following")
        )

    def launch(self) -> AgentProcess:
        return _launch(self.dockerd, self.base, self.grace_s)


def _launch(
    dockerd: Dockerd, base: Path, grace_s: float, simulate: str = "hgx-h200-8"
) -> AgentProcess:
    return launch_agent(
        base,
        "--docker-socket", dockerd.socket,
        "--podman-socket", str(base / "no-podman.sock"),
        "--state-dir", str(base / "state"),
        "--spec-file", str(dockerd.engine.plugin_specs / "nvidia-docker.spec"),
        "--cdi-spec-dir", "",
        "--lease-grace", f"{grace_s:g}",
        simulate=simulate,
        socket_dir=dockerd.plugin_dir,
    )  # fmt: skip


@contextlib.contextmanager
def node_of(
    dockerd: Dockerd, base: Path, grace_s: float = 600, simulate: str = "hgx-h200-8"
) -> Iterator[Node]:
    """A ready agent following ``dockerd``; afterwards every container removed, the agent
    stopped."""
    agent = _launch(dockerd, base, grace_s, simulate)
    node = Node(base, agent, dockerd=dockerd, grace_s=grace_s)
    try:
        wait_ready(node.agent)
        node.wait_following(0)
        yield node
    finally:
        engine = dockerd.engine
        ids = engine.docker("ps", "-aq", check=False).stdout.split()
        if ids:
            engine.docker("rm", "-f", *ids, check=False)
        volumes = engine.docker(
            "volume", "ls", "-q", "--filter", "driver=nvidia-docker", check=False
        ).stdout.split()
        if volumes:
            engine.docker("volume", "rm", "-f", *volumes, check=False)
        stop_process(node.agent.proc)


@pytest.fixture
def node(dockerd: Dockerd, tmp_path: Path) -> Iterator[Node]:
    with node_of(dockerd, tmp_path / "agent") as served:
        yield served


def test_eight_concurrent_runs_get_a_gpu_each_and_a_ninth_waits_for_one(node: Node) -> None:
    containers = node.run_leased_many(GPUS)

    gpus = {cid: node.gpu_of(cid) for cid in containers}
    assert len({dev for dev, _ in gpus.values()}) == GPUS
    assert len({lease for _, lease in gpus.values()}) == GPUS
    node.wait_bound(containers, "8 leases bound to their containers")
    assert node.bound() == {cid: lease for cid, (_, lease) in gpus.items()}
    assert {u["State"] for u in node.table()["Units"]} == {"leased"}

    refused = node.run_leased()
    assert refused.returncode != 0
    line = one_line(refused.stderr)
    assert "has no lease for 1 GPU now" in line, line
    assert "NV_GPU_WAIT" in line, line
    print(f"the ninth: {line}")
    for cid, (dev, lease) in gpus.items():  # who holds what: GPU N by container C (lease-L)
        assert f"GPU {dev.removeprefix('/dev/nvidia')} by container {cid[:12]} ({lease})" in line
    assert len(node.docker("ps", "-aq").split()) == GPUS  # no container for the refused one

    waiter = subprocess.Popen(
        [*wrapper_command(), "run", "-d", IMAGE, "sleep", "600"],
        env=node.wrapper_env(NV_GPU="auto:1", NV_GPU_WAIT="30"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_until(
            lambda: len(node.table()["Waiting"]) == 1,
            what="the ninth ask waiting in the queue",
            timeout_s=20,
        )
        freed, (freed_gpu, _) = containers[3], gpus[containers[3]]
        node.docker("rm", "-f", freed)
        out, err = waiter.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            waiter.kill()
        waiter.wait(timeout=10)
    assert waiter.returncode == 0, err
    ninth = out.strip()
    assert node.gpu_of(ninth)[0] == freed_gpu
    node.wait_bound([*(c for c in containers if c != freed), ninth], "the ninth lease bound")
    assert node.table()["Waiting"] == []


def test_docker_rm_f_frees_the_gpu_within_a_second(node: Node) -> None:
    (container,) = node.run_leased_many(1)
    node.wait_bound([container], "the lease bound")

    started = time.monotonic()
    node.docker("rm", "-f", container)
    returned = time.monotonic()
    wait_until(lambda: not node.table()["Leases"], what="the lease gone", timeout_s=10)
    freed = time.monotonic()

    print(  # the figure, for `pytest -s`
        f"docker rm -f took {returned - started:.3f} s; its lease was gone "
        f"{freed - returned:.3f} s after it returned"
    )
    assert freed - returned < FREED_WITHIN_S
    assert {u["State"] for u in node.table()["Units"]} == {"free"}


GIVEN_BACK_WITHIN_S = 2.0  # docker failed -> its pending lease gone from GET /leases/json


def _wrappers_running(marker: str) -> list[int]:
    """The processes whose command line has ``marker`` (a wrapper's watcher has the
    wrapper's command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize(
    ("form", "env"),
    [
        ("NV_GPU=auto:8", {"NV_GPU": "auto:8"}),
        ("--gpus all", {}),
        ("--gpus 8", {}),
        ('--gpus "device=0,1,2,3,4,5,6,7"', {}),
    ],
)
def test_a_run_docker_refuses_gives_its_gpus_back_at_once(
    node: Node, form: str, env: dict[str, str]
) -> None:
    gpus = [] if form.startswith("NV_GPU") else ["--gpus", form.split(" ", 1)[1].strip('"')]
    failed = node.nvidia_docker("run", "-d", *gpus, "--bad-flag=1", IMAGE, "sleep", "600", **env)
    returned = time.monotonic()
    assert failed.returncode == 125, failed.stderr  # docker's own exit code for a bad flag
    assert "unknown flag: --bad-flag" in failed.stderr
    wait_until(
        lambda: not node.table()["Leases"],
        what=f"the lease of {form} given back",
        timeout_s=GIVEN_BACK_WITHIN_S,
        proc=node.agent.proc,
    )
    print(f"{form}: the lease was gone {time.monotonic() - returned:.3f} s after docker failed")
    again = node.nvidia_docker("run", "-d", *gpus, IMAGE, "sleep", "600", **env)
    assert again.returncode == 0, again.stderr
    node.wait_bound([again.stdout.strip()], "the second run's lease bound")


def test_a_dockerd_the_agent_does_not_follow_gets_no_lease(node: Node, tmp_path: Path) -> None:
    """A second dockerd on the node (as rootless Docker's is): its containers are never
    seen by the agent, so a lease for one would be given back when docker returns while the
    container runs. The run is refused in one line before anything is leased or created.
    The same dockerd reached at a second socket of its own, by an agent that follows it at
    the first, gets its lease: one daemon (``GET /info``'s ID). So does that dockerd reached
    over TCP (``DOCKER_HOST=tcp://127.0.0.1:PORT``: the docker CLI's ``docker info`` says its
    ID), which the agent of the node's own dockerd refuses."""
    second = tmp_path / "second.sock"
    tcp = f"tcp://127.0.0.1:{free_port()}"
    engine, proc = start_engine(
        extra_args=(*SHUTDOWN_ARGS, "--host", f"unix://{second}", "--host", tcp)
    )
    other = Dockerd(engine, proc)
    try:
        # an image it does not have: refused before docker pulls it (no pull is tried)
        absent = node.nvidia_docker(
            "run", "-d", "nvd-leases/absent:1", NV_GPU="auto:1", DOCKER_HOST=engine.host
        )
        assert absent.returncode != 0
        assert "which the node's agent does not follow" in one_line(absent.stderr), absent.stderr
        engine.import_busybox(IMAGE)
        # the node's volume plugin known to it too: only the lease stands in the run's way
        spec = "nvidia-docker.spec"
        shutil.copyfile(node.dockerd.engine.plugin_specs / spec, engine.plugin_specs / spec)
        refused = node.run_leased(DOCKER_HOST=engine.host)
        assert refused.returncode != 0
        line = one_line(refused.stderr)
        assert (
            "Error: NV_GPU=auto:1 asks for a GPU lease, but docker runs its containers on the "
            f"engine at {engine.host}, which the node's agent does not follow (it follows "
            f"{node.dockerd.socket}), so the lease would end as soon as docker returns"
        ) in line, line
        assert f"DOCKER_HOST={node.dockerd.engine.host}" in line, line
        assert node.table()["Leases"] == []
        # NV_DOCKER naming the docker CLI's file, as where the first docker on PATH is the
        # wrapper itself: the same check
        cli = shutil.which("docker")
        assert cli is not None
        by_path = node.run_leased(DOCKER_HOST=engine.host, NV_DOCKER=cli)
        assert by_path.returncode != 0
        assert "which the node's agent does not follow" in one_line(by_path.stderr)
        # and behind a prefix, in the environment it gives docker (sudo's: root's docker)
        prefixed = node.run_leased(NV_DOCKER=f"env DOCKER_HOST={engine.host} docker -D")
        assert prefixed.returncode != 0
        assert "which the node's agent does not follow" in one_line(prefixed.stderr)
        # the same engine named by docker's own -H, DOCKER_HOST the followed one's
        global_host = node.nvidia_docker(
            "-H", engine.host, "run", "-d", IMAGE, "sleep", "600", NV_GPU="auto:1"
        )
        assert global_host.returncode != 0
        assert f"on the engine at {engine.host}, which" in one_line(global_host.stderr)
        assert node.table()["Leases"] == []
        # the same engine over TCP: no socket file to compare, its ID is
        over_tcp = node.run_leased(DOCKER_HOST=tcp)
        assert over_tcp.returncode != 0
        ids = [engine.docker("info", "--format", "{{.ID}}").stdout.strip()]
        ids.append(node.dockerd.engine.docker("info", "--format", "{{.ID}}").stdout.strip())
        line = one_line(over_tcp.stderr)
        assert (f"on the engine at {tcp} (ID {ids[0]}), which the agent of ") in line, line
        assert f"does not follow (it follows {node.dockerd.socket} (ID {ids[1]}))" in line, line
        assert node.table()["Leases"] == []
        assert engine.docker("ps", "-aq").stdout.split() == []
        with node_of(other, tmp_path / "other-agent") as follows_other:
            leased = follows_other.run_leased(DOCKER_HOST=f"unix://{second}")
            assert leased.returncode == 0, leased.stderr
            first = leased.stdout.strip()
            follows_other.wait_bound([first], "the lease bound to its container")
            leased = follows_other.run_leased(DOCKER_HOST=tcp)
            assert leased.returncode == 0, leased.stderr
            follows_other.wait_bound([first, leased.stdout.strip()], "the lease over TCP bound")
    finally:
        stop_engine(other.engine, other.proc)


def test_a_name_in_use_gives_the_gpus_back_and_the_first_run_keeps_its_lease(
    node: Node,
) -> None:
    name = f"watched-{os.getpid()}-{time.monotonic_ns()}"
    first = node.nvidia_docker("run", "-d", "--name", name, IMAGE, "sleep", "600", NV_GPU="auto:4")
    assert first.returncode == 0, first.stderr
    container = first.stdout.strip()
    # the first run's watcher has asked (and been refused: its container holds the lease)
    wait_until(
        lambda: not _wrappers_running(name), what="the first run's watcher ended", timeout_s=10
    )
    assert node.bound() == {container: node.bound().get(container, "?")}
    assert len(node.leases()[container]["Units"]) == 4

    second = node.nvidia_docker("run", "-d", "--name", name, IMAGE, "sleep", "600", NV_GPU="auto:4")
    assert second.returncode == 125, second.stderr
    assert "is already in use" in second.stderr
    wait_until(
        lambda: len(node.table()["Leases"]) == 1,
        what="the second run's lease given back",
        timeout_s=GIVEN_BACK_WITHIN_S,
        proc=node.agent.proc,
    )
    assert set(node.bound()) == {container}
    third = node.nvidia_docker("run", "-d", IMAGE, "sleep", "600", NV_GPU="auto:4")
    assert third.returncode == 0, third.stderr


@pytest.mark.parametrize("state_file", ["kept", "deleted"])
def test_leases_survive_a_kill_9_of_the_agent(node: Node, state_file: str) -> None:
    containers = node.run_leased_many(GPUS)
    node.wait_bound(containers, "8 leases bound")
    before = node.bound()

    def saved() -> set[str]:
        snapshot = json.loads(node.state_file.read_text())
        return {
            lease["container_id"] for lease in snapshot["leases"] if lease["state"] == "running"
        }

    wait_until(lambda: saved() == set(containers), what="the state file: 8 running leases")
    node.kill9()
    if state_file == "deleted":
        node.state_file.unlink()
    node.start()

    node.wait_bound(containers, "8 leases back after the restart")
    assert node.bound() == before
    leases = node.table()["Leases"]
    assert {lease["State"] for lease in leases} == {"running"}
    if state_file == "kept":
        assert "restored 8 leases and 0 foreign holders from the snapshot" in node.log()
    else:  # rebuilt from the labels by the resync; a missing file is no error
        assert node.log().count("leased again to container") == GPUS
        assert "cannot be used" not in node.log()
    refused = node.run_leased()  # every GPU is held again: nothing to give
    assert refused.returncode != 0
    assert "not enough free GPUs" in one_line(refused.stderr)

    # The restarted table follows the engine, and its new ids come after every id it knew.
    node.docker("rm", "-f", containers[0])
    wait_until(lambda: containers[0] not in node.bound(), what="the removed one's lease gone")
    (newcomer,) = node.run_leased_many(1)
    node.wait_bound([*containers[1:], newcomer], "the newcomer's lease bound")
    assert node.bound()[newcomer] not in before.values()


def test_a_container_given_dev_nvidia3_past_the_wrapper_makes_gpu_3_foreign(node: Node) -> None:
    foreign = node.docker("run", "-d", "--device", "/dev/nvidia3", IMAGE, "sleep", "600")
    wait_until(
        lambda: node.table()["Units"][3]["State"] == "foreign",
        what="GPU 3 foreign",
        timeout_s=10,
    )
    units = node.table()["Units"]
    assert [u["State"] for u in units].count("foreign") == 1
    assert units[3]["Holders"][0]["Container"].startswith(foreign[:12])

    containers = node.run_leased_many(GPUS - 1)
    got = {node.gpu_of(cid)[0] for cid in containers}
    assert "/dev/nvidia3" not in got
    assert len(got) == GPUS - 1
    refused = node.run_leased()
    assert refused.returncode != 0
    line = one_line(refused.stderr)
    assert f"GPU 3 by foreign container {foreign[:12]} (--device /dev/nvidia3)" in line, line


def lease_lines(log: str) -> list[str]:
    """The agent's lines about leases and the engines it follows (why a lease ended)."""
    return [line for line in log.splitlines() if "lease" in line.lower() or "follow" in line]


def test_a_dockerd_restart_keeps_stopped_leases_for_the_grace_time(
    dockerd: Dockerd, tmp_path: Path
) -> None:
    grace_s = 20.0  # longer than a dockerd restart on a loaded machine (one took over 8 s)
    with node_of(dockerd, tmp_path / "agent", grace_s=grace_s) as node:
        # busybox sleep as PID 1 ignores dockerd's SIGTERM: killed after 1 s, not 10.
        kept, removed = node.run_leased_many(2, "--stop-timeout", "1")
        node.wait_bound([kept, removed], "2 leases bound")
        follows = node.follows()

        stopped_at = time.monotonic()
        dockerd.restart()
        node.wait_following(follows)  # the new dockerd's events, after a resync
        leases = {lease["Container"]: lease for lease in node.table()["Leases"]}
        restarted_s = time.monotonic() - stopped_at
        assert set(leases) == {kept, removed}, (
            f"the restart and resync took {restarted_s:.1f} s of the {grace_s:g} s grace",
            lease_lines(node.log())[-12:],
        )
        assert {lease["State"] for lease in leases.values()} == {"stopped"}

        node.docker("rm", removed)  # stopped already: no -f
        returned = time.monotonic()
        wait_until(lambda: set(node.bound()) == {kept}, what="the removed one's lease gone")
        assert time.monotonic() - returned < FREED_WITHIN_S

        wait_until(
            lambda: not node.table()["Leases"],
            what="the stopped container's lease ended after the grace time",
            timeout_s=grace_s + 10,
        )
        assert time.monotonic() - stopped_at >= grace_s
        assert node.docker("ps", "-aq") == kept[:12]  # the container is still there


def two_socket_node(path: Path) -> Path:
    """Four H200s on two sockets, joined in NVLink pairs across the index order: GPUs 0 and
    2 on NUMA node 0, GPUs 1 and 3 on node 1; every other pair crosses the sockets."""
    source = json.loads((REPO / "agent" / "gpu" / "nodes" / "hgx-h200-8.json").read_text())
    devices = source["devices"][:4]
    numa = [0, 1, 0, 1]
    buses = [d["pci"]["bus_id"] for d in devices]
    for index, device in enumerate(devices):
        device["cpu_affinity"] = numa[index]
        device["topology"] = [
            {
                "bus_id": buses[other],
                "link": 2 if numa[other] == numa[index] else 1,  # NODE, or SYS
                "nvlinks": 18 if numa[other] == numa[index] else 0,
            }
            for other in range(len(devices))
            if other != index
        ]
    path.write_text(json.dumps({**source, "devices": devices}))
    return path


def host_cpus(numa_node: int) -> str:
    """The CPUs of this host's NUMA node, as docker inspect shows --cpuset-cpus ("" when
    the host has no such node: a simulated GPU's node the host lacks gets no cpuset)."""
    cpulist = Path(f"/sys/devices/system/node/node{numa_node}/cpulist")
    return cpulist.read_text().strip() if cpulist.exists() else ""


def test_two_gpus_are_a_linked_pair_on_one_socket_with_its_cpuset(
    dockerd: Dockerd, tmp_path: Path
) -> None:
    node_file = two_socket_node(tmp_path / "two-sockets.json")
    with node_of(dockerd, tmp_path / "agent", simulate=str(node_file)) as node:
        runs = [
            node.nvidia_docker("run", "-d", IMAGE, "sleep", "600", NV_GPU="auto:2")
            for _ in range(2)
        ]
        for run in runs:
            assert run.returncode == 0, run.stderr
        seen = []
        for run in runs:
            raw = node.docker(
                "inspect",
                "-f",
                "{{json .HostConfig.Devices}}|{{.HostConfig.CpusetCpus}}|"
                "{{.HostConfig.CpusetMems}}|",
                run.stdout.strip(),
            )
            devices, cpus, mems, _ = raw.split("|")
            gpus = sorted(
                d["PathOnHost"]
                for d in json.loads(devices)
                if d["PathOnHost"].removeprefix("/dev/nvidia").isdigit()
            )
            seen.append((gpus, cpus, mems))
    # not docker's "the first two": the NVLink pair of socket 0, then that of socket 1
    expected = [
        (["/dev/nvidia0", "/dev/nvidia2"], host_cpus(0), "0" if host_cpus(0) else ""),
        (["/dev/nvidia1", "/dev/nvidia3"], host_cpus(1), "1" if host_cpus(1) else ""),
    ]
    assert seen == expected, [run.stderr for run in runs]  # docker's warnings, if any
