"""GPU leases end to end with Podman: ``NV_DOCKER=podman nvidia-docker`` (Debian 12's 4.3),
Podman's API service on a socket of the test, and a real agent process serving the
simulated ``hgx-h200-8`` node (eight H200s), following that service's events
(``--podman-socket``) and keeping its state in a directory of the test (``--state-dir``).

Podman reads CDI, so the wrapper gives each container its leased GPU as a CDI name
(``nvidia.com/gpu=<UUID>``) of the agent's spec. Podman 4.3 reads specs from
``/var/run/cdi`` only: the agent writes its spec there, under the machine-wide CDI lock,
and the test removes it afterwards. The device nodes the spec names are made with mknod in
a private dev root (``--cdi-dev-root``): nothing is made under /dev, nothing opens them.
Podman 4 does not show a container's CDI devices in its inspect answer: the agent knows a
Podman container's GPUs from its lease labels alone.

Checked, as tests/e2e/test_leases_docker.py checks them with dockerd: eight concurrent
``NV_GPU=auto:1`` runs each get a GPU of their own (as its CDI name, and only it) and the
agent binds each lease to its Podman container; a ninth is refused in one line naming the
holders, and with ``NV_GPU_WAIT`` gets the GPU that a ``podman rm -f`` frees; that removal
frees the GPU within a second, while a ``podman stop`` keeps it for the grace time; the
leases survive a ``kill -9`` of the agent (its state file, or without it the containers'
labels), a container removed while it was down loses its lease, and no GPU is given twice
afterwards; while Podman's API service is down (its event stream dropped) the agent keeps
the leases, and when the service answers again the agent resyncs: a container removed
meanwhile loses its lease, one stopped meanwhile keeps it for the grace time, and new
events are followed. On a node with a Docker engine too (a private dockerd), an agent
restarted (``kill -9``) while Podman's API service is down and its socket gone keeps the
leases of Podman's containers through dockerd's list, and their GPUs are not leased again;
once the service answers, its list ends the lease of the container removed meanwhile, and
only that one (each lease is its container's engine's: the state file names it). Podman's
start gate (``nvidia-docker-start-hook``, the packaged hook file) runs at every container
start of the module: the wrapper's runs pass it, a hand-made run naming a leased GPU's CDI
name does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess, launch_agent, wait_ready
from tests.support.dockerd import start_engine, stop_engine
from tests.support.lease_node import LeaseNode, one_line
from tests.support.podman import (
    CDI_LOCK,
    RUN_LIMITS,
    ApiService,
    gated_api_service,
    podman_plugin_dir,
)
from tests.support.prerequisites import require_root
from tests.support.services import machine_lock, stop_process, wait_until
from tests.support.wrapper import wrapper_command

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
IMAGE = "nvd-leases/busybox:1"
GPUS = 8
NVIDIA_MAJOR, UVM_MAJOR = 195, 510  # any free majors do for nodes never opened
CDI_DIR = Path("/var/run/cdi")
SPEC = CDI_DIR / "nvidia-docker.json"
FREED_WITHIN_S = 1.0  # podman rm -f returned -> its lease gone from GET /leases/json
LEASE_LABEL = "nvidia-docker.lease"
LEASE_DEVICES = "nvidia-docker.lease.devices"


@pytest.fixture(scope="module")
def podman_service() -> Iterator[ApiService]:
    """A private Podman with the busybox image, and its API service on a socket; its
    containers run Podman's start gate (the packaged hook file), which asks the agent of
    the test on its plugin socket (``podman_plugin_dir``): every wrapper run below passes
    it."""
    require_root()
    with gated_api_service(IMAGE) as service:
        yield service


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
class Node(LeaseNode):
    """The agent of the simulated node, following ``service``; restartable."""

    service: ApiService = field(kw_only=True)

    engine_name = "Podman's API service"
    follow_timeout_s = 60.0
    bind_timeout_s = 30.0

    def gpu_names(self) -> dict[str, str]:
        """Unit UUID -> its name (``0`` .. ``7``)."""
        return {unit["UUID"]: unit["Name"] for unit in self.table()["Units"]}

    def wrapper_env(self, **env: str) -> dict[str, str]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "DOCKER_"))}
        environ.update(
            NV_DOCKER=" ".join(self.service.podman.command),
            NV_HOST=self.url,
            NV_GPU="auto:1",
            PYTHONPATH=str(REPO),
            XDG_CACHE_HOME=str(self.base / "wrapper-cache"),  # what it remembers: gone with it
            **env,
        )
        return environ

    def wrapper_args(self) -> list[str]:
        return [*wrapper_command(), "run", "-d", *RUN_LIMITS, IMAGE, "sleep", "600"]

    def run_leased(self, **env: str) -> subprocess.CompletedProcess[str]:
        """``NV_DOCKER=podman NV_GPU=auto:1 nvidia-docker run -d IMAGE sleep 600``."""
        return subprocess.run(
            self.wrapper_args(),
            env=self.wrapper_env(**env),
            capture_output=True,
            text=True,
            timeout=90,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def run_leased_many(self, count: int) -> list[str]:
        """``count`` leased containers started at once; their ids."""
        with ThreadPoolExecutor(max_workers=count) as pool:
            runs = list(pool.map(lambda _: self.run_leased(), range(count)))
        for run in runs:
            assert run.returncode == 0, run.stderr
        return [run.stdout.strip() for run in runs]

    def podman(self, *args: str) -> str:
        return self.service.podman(*args).stdout.strip()

    def labels(self, container_id: str) -> tuple[str, str, list[str]]:
        """(its lease label, its lease's device UUID, the --device values it was created
        with)."""
        (found,) = json.loads(self.podman("inspect", container_id))
        config = found["Config"]
        given = [arg for arg in config["CreateCommand"] if arg.startswith("--device")]
        return config["Labels"][LEASE_LABEL], config["Labels"][LEASE_DEVICES], given

    def containers(self) -> list[str]:
        """Every container of the Podman store, full ids."""
        return self.podman("ps", "-aq", "--no-trunc").split()

    def follows(self) -> int:
        """How many times the agent has followed the service's events (at start, and once
        more after each reconnection, each time with the containers listed: a resync)."""
        log = self.log()
        return log.count("Following the container events of Podman") + log.count(
            "answers again: following its container events"
        )

    def launch(self) -> AgentProcess:
        return _launch(self.service, self.base)


def _launch(service: ApiService, base: Path, docker_socket: Path | None = None) -> AgentProcess:
    """The agent of the node, following ``service`` and the Docker engine at
    ``docker_socket`` (None: none, a socket path that is not there)."""
    return launch_agent(
        base,
        "--podman-socket", str(service.socket_path),
        "--docker-socket", str(docker_socket or base / "no-docker.sock"),
        "--state-dir", str(base / "state"),
        "--cdi-spec-dir", str(CDI_DIR),
        "--cdi-dev-root", str(base / "devroot"),
        simulate="hgx-h200-8",
        socket_dir=podman_plugin_dir(service.podman.base),
    )  # fmt: skip


@pytest.fixture
def node(podman_service: ApiService) -> Iterator[Node]:
    """An agent following the Podman service, its CDI spec in /var/run/cdi; afterwards every
    container removed, the agent stopped, the spec removed."""
    with machine_lock(CDI_LOCK):
        if _foreign_specs():
            pytest.skip(f"another CDI spec of kind nvidia.com/gpu is here: {_foreign_specs()}")
        made_dir = not CDI_DIR.exists()
        base = Path(tempfile.mkdtemp(prefix="nvd-leases-podman-"))
        _make_dev_root(base / "devroot")
        node = Node(base, _launch(podman_service, base), service=podman_service)
        try:
            wait_ready(node.agent)
            wait_until(
                lambda: SPEC.exists() and node.follows() > 0,
                what=f"the agent's CDI spec and its following Podman (log: {node.agent.log_path})",
                timeout_s=30,
                proc=node.agent.proc,
            )
            yield node
        finally:
            podman_service.start()  # a test that stopped it: back for the next one
            podman_service.podman("rm", "--all", "--force", "--time", "0", check=False)
            stop_process(node.agent.proc)
            SPEC.unlink(missing_ok=True)
            if made_dir:
                with contextlib.suppress(OSError):
                    CDI_DIR.rmdir()
            shutil.rmtree(base, ignore_errors=True)


def test_eight_concurrent_podman_runs_get_a_gpu_each_and_a_ninth_waits_for_one(
    node: Node,
) -> None:
    containers = node.run_leased_many(GPUS)

    leases = {cid: node.labels(cid) for cid in containers}
    for _, uuid, given in leases.values():
        assert given == [f"--device=nvidia.com/gpu={uuid}"]  # the leased GPU, and only it
    assert len({lease for lease, _, _ in leases.values()}) == GPUS
    assert len({uuid for _, uuid, _ in leases.values()}) == GPUS
    node.wait_bound(containers, "8 leases bound to their Podman containers")
    assert node.bound() == {cid: lease for cid, (lease, _, _) in leases.items()}
    assert {u["State"] for u in node.table()["Units"]} == {"leased"}

    refused = node.run_leased()
    assert refused.returncode != 0
    line = one_line(refused.stderr)
    assert "has no lease for 1 GPU now" in line, line
    assert "NV_GPU_WAIT" in line, line
    print(f"the ninth: {line}")
    names = node.gpu_names()
    for cid, (lease, uuid, _) in leases.items():  # who holds what: GPU N by container C (lease)
        # "..., not running, since" follows for one whose start event the agent has not
        # applied yet (bound at its create event), as on a loaded machine in CI
        assert f"GPU {names[uuid]} by container {cid[:12]} ({lease})" in line, line
    assert sorted(node.containers()) == sorted(containers)  # none for the refused one

    waiter = subprocess.Popen(
        node.wrapper_args(),
        env=node.wrapper_env(NV_GPU_WAIT="60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait_until(
            lambda: len(node.table()["Waiting"]) == 1,
            what="the ninth ask waiting in the queue",
            timeout_s=30,
        )
        freed = containers[3]
        node.podman("rm", "--force", "--time", "0", freed)
        out, err = waiter.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            waiter.kill()
        waiter.wait(timeout=10)
    assert waiter.returncode == 0, err
    ninth = out.strip()
    assert node.labels(ninth)[1] == leases[freed][1]  # the GPU the removal freed
    node.wait_bound([*(c for c in containers if c != freed), ninth], "the ninth lease bound")
    assert node.table()["Waiting"] == []


def test_the_start_hook_refuses_a_hand_made_run_of_a_leased_gpus_cdi_name(node: Node) -> None:
    """The wrapper's runs pass Podman's start gate (their lease annotations); a ``podman
    run`` by hand naming a leased GPU's CDI name is refused by the hook with the table's
    line, and once that GPU is free it runs."""
    (leased,) = node.run_leased_many(1)
    node.wait_bound([leased], "the lease bound")
    lease, uuid, _ = node.labels(leased)
    by_hand = node.service.podman(
        "run", "--rm", *RUN_LIMITS, f"--device=nvidia.com/gpu={uuid}", IMAGE, "echo", "ran",
        check=False,
    )  # fmt: skip
    assert by_hand.returncode != 0
    assert "nvidia-docker: container " in by_hand.stderr, by_hand.stderr
    assert "may not start: it names GPUs leased to others" in by_hand.stderr, by_hand.stderr
    # followed by ", not running" where the agent has not applied its start event yet
    assert f"by container {leased[:12]} ({lease})" in by_hand.stderr, by_hand.stderr

    node.podman("rm", "--force", "--time", "0", leased)
    wait_until(lambda: not node.bound(), what="the lease gone")
    again = node.service.podman(
        "run", "--rm", *RUN_LIMITS, f"--device=nvidia.com/gpu={uuid}", IMAGE, "echo", "ran",
        check=False,
    )  # fmt: skip
    assert (again.returncode, again.stdout.strip()) == (0, "ran"), again.stderr


def test_podman_rm_f_frees_the_gpu_within_a_second(node: Node) -> None:
    kept, gone = node.run_leased_many(2)
    node.wait_bound([kept, gone], "2 leases bound")

    started = time.monotonic()
    node.podman("rm", "--force", "--time", "0", gone)
    returned = time.monotonic()
    wait_until(lambda: gone not in node.bound(), what="the removed one's lease gone")
    freed = time.monotonic()

    print(  # the figure, for `pytest -s`
        f"podman rm -f took {returned - started:.3f} s; its lease was gone "
        f"{freed - returned:.3f} s after it returned"
    )
    assert freed - returned < FREED_WITHIN_S
    assert set(node.bound()) == {kept}
    states = [u["State"] for u in node.table()["Units"]]
    assert states.count("leased") == 1
    assert states.count("free") == GPUS - 1

    # Stopped (Podman's "died"), the lease is kept for the grace time; started, it runs.
    node.podman("stop", "--time", "0", kept)
    wait_until(lambda: node.leases()[kept]["State"] == "stopped", what="the lease stopped")
    node.podman("start", kept)
    wait_until(lambda: node.leases()[kept]["State"] == "running", what="the lease running")


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
    gone, *alive = containers  # removed while the agent is down: no event tells it
    freed_gpu = node.labels(gone)[1]
    node.podman("rm", "--force", "--time", "0", gone)
    if state_file == "deleted":
        node.state_file.unlink()
    node.start()

    node.wait_bound(alive, "7 leases back after the restart, the removed one's gone")
    assert node.bound() == {cid: before[cid] for cid in alive}
    leases = node.leases()
    assert {lease["State"] for lease in leases.values()} == {"running"}
    # each GPU once, and each the one its container's labels name
    names = node.gpu_names()
    assert {cid: lease["Units"] for cid, lease in leases.items()} == {
        cid: [names[node.labels(cid)[1]]] for cid in alive
    }
    if state_file == "kept":
        assert "restored 8 leases and 0 foreign holders from the snapshot" in node.log()
    else:  # rebuilt from the labels by the resync; a missing file is no error
        assert node.log().count("leased again to container") == GPUS - 1
        assert "cannot be used" not in node.log()

    # The restarted table follows the service; the one free GPU is the removed one's, given
    # once, under an id after every id it knew; then nothing is left to give.
    (newcomer,) = node.run_leased_many(1)
    assert node.labels(newcomer)[1] == freed_gpu
    node.wait_bound([*alive, newcomer], "the newcomer's lease bound")
    # (without the state file it knows the ids of the live containers' labels only)
    known = before if state_file == "kept" else {cid: before[cid] for cid in alive}
    assert node.bound()[newcomer] not in known.values()
    refused = node.run_leased()
    assert refused.returncode != 0
    assert "not enough free GPUs" in one_line(refused.stderr)


def test_a_restart_of_podmans_api_service_resyncs_the_leases(node: Node) -> None:
    removed, stopped, kept = node.run_leased_many(3)
    node.wait_bound([removed, stopped, kept], "3 leases bound")
    before = node.bound()
    follows = node.follows()

    node.service.stop()  # the event stream drops; the containers run on
    wait_until(
        lambda: "Container events stopped" in node.log(),
        what="the agent seeing the event stream end",
        timeout_s=30,
        proc=node.agent.proc,
    )
    node.podman("rm", "--force", "--time", "0", removed)  # the CLI, not the service:
    node.podman("stop", "--time", "0", stopped)  # no event reaches the agent
    assert node.bound() == before  # nothing told it yet: it holds rather than frees

    node.service.start()
    node.wait_following(follows)  # listed again, and resynced
    leases = node.leases()
    assert set(leases) == {stopped, kept}
    assert leases[stopped]["State"] == "stopped"  # for the grace time
    assert leases[kept]["State"] == "running"
    assert node.bound() == {cid: before[cid] for cid in (stopped, kept)}

    # The new stream's events are followed: a new run is bound, a removal frees at once.
    (newcomer,) = node.run_leased_many(1)
    node.wait_bound([stopped, kept, newcomer], "the newcomer's lease bound after the restart")
    node.podman("rm", "--force", "--time", "0", kept)
    returned = time.monotonic()
    wait_until(lambda: kept not in node.bound(), what="the removed one's lease gone")
    assert time.monotonic() - returned < FREED_WITHIN_S


def test_a_restart_while_podmans_service_is_down_keeps_its_leases_through_dockers_list(
    node: Node,
) -> None:
    """The agent also follows a (private, real) dockerd, and is restarted while Podman's
    API service is down and its socket gone: dockerd lists at once (binding the lease of
    its own container, run meanwhile), Podman only once its service is back. Before,
    dockerd's list ended the leases of Podman's containers and their GPUs could be leased a
    second time."""
    docker, dockerd_proc = start_engine()
    try:
        docker.import_busybox(IMAGE)
        docker_socket = Path(docker.host.removeprefix("unix://"))
        containers = node.run_leased_many(3)
        node.wait_bound(containers, "3 leases bound")
        podmans = node.bound()
        podman_socket = str(node.service.socket_path)

        def saved() -> dict[str, tuple[str, str | None]]:
            snapshot = json.loads(node.state_file.read_text())
            return {
                x["container_id"]: (x["state"], x.get("engine"))
                for x in snapshot["leases"]
                if x["container_id"] is not None
            }

        expected = dict.fromkeys(containers, ("running", podman_socket))
        wait_until(lambda: saved() == expected, what="the state file: 3 leases, Podman's")
        grant = node.ask({"count": 1})  # for a Docker container, run while the agent is down

        node.kill9()
        node.service.stop()  # Podman run without podman.socket: the socket is gone
        assert not node.service.socket_path.exists()
        gone, *alive = containers
        node.podman("rm", "--force", "--time", "0", gone)  # the CLI needs no service
        labels = [arg for k, v in grant["Labels"].items() for arg in ("--label", f"{k}={v}")]
        dockers = docker.docker("run", "-d", *labels, IMAGE, "sleep", "600").stdout.strip()

        node.agent = _launch(node.service, node.base, docker_socket)
        wait_ready(node.agent)
        # dockerd's list binds its container's lease (the resync is applied) ...
        wait_until(
            lambda: node.bound().get(dockers) == grant["Lease"],
            what=f"dockerd's list binding its container's lease (log: {node.agent.log_path})",
            timeout_s=60,
            proc=node.agent.proc,
        )
        assert not node.service.socket_path.exists()  # Podman has not listed
        # ... and leaves Podman's three leases as they were: none of their GPUs is free.
        assert node.bound() == {**podmans, dockers: grant["Lease"]}
        states = [u["State"] for u in node.table()["Units"]]
        assert (states.count("leased"), states.count("free")) == (4, GPUS - 4)
        refused = node.ask({"count": GPUS - 3}, status=409)
        assert refused["Refusal"] == "not_enough"
        assert f"by container {gone[:12]} ({podmans[gone]})" in refused["Error"]

        follows = node.follows()
        node.service.start()
        node.wait_following(follows)  # Podman's list, once its service answers
        node.wait_bound([*alive, dockers], "the removed container's lease ended, no other")
        assert node.bound() == {**{cid: podmans[cid] for cid in alive}, dockers: grant["Lease"]}
        states = [u["State"] for u in node.table()["Units"]]
        assert (states.count("leased"), states.count("free")) == (3, GPUS - 3)
    finally:
        stop_engine(docker, dockerd_proc)
