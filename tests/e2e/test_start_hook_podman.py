"""Podman's start gate end to end: a private Podman whose containers run the OCI hooks of a
directory of the test (``--hooks-dir``), holding the hook file the package ships
(``packaging/podman/nvidia-docker-start-hook.json``) pointed at this checkout's
``nvidia-docker-start-hook`` and at a real agent's plugin socket
(``tests.support.podman.write_start_hook``); the agent serves the
simulated ``hgx-h200-8`` node (eight H200s) and follows Podman's API service
(``--podman-socket``) with a grace time of 2 s (docs/leases.md, "Refusing a start with
Podman: the start hook").

Podman's ``--device`` needs the host's device node and this machine has no GPU: the module
makes /dev/nvidia3 (and nvidiactl) with mknod where missing, under the machine-wide device
lock the Docker end-to-end tests take, and removes exactly those afterwards. Nothing opens
them: the containers run busybox.

Checked, as tests/e2e/test_authz_docker.py checks dockerd's authorization plugin: a container
run with a lease's labels and annotations (as the wrapper gives Podman's containers) and
``--device /dev/nvidia3`` starts and binds its lease; another ``podman run --device
/dev/nvidia3`` is refused by the hook with the table's line naming the lease; a container
without GPUs runs, the agent not asked; a container stopped longer than the grace time,
whose GPU has been leased to another since, is refused a ``podman start`` with the line of
its ended lease; a container given a grant's labels but no annotations starts (its GPU held
by its own pending lease only) and binds it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from controller.wrapper.leases import annotation_args
from tests.support.agent_leases import AgentLeases
from tests.support.agent_process import AgentProcess, launch_agent, wait_ready
from tests.support.device_nodes import nvidia_nodes, wanted_nodes
from tests.support.podman import (
    RUN_LIMITS,
    ApiService,
    api_service,
    private_podman,
    write_start_hook,
)
from tests.support.prerequisites import require_root
from tests.support.services import stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

IMAGE = "nvd-start-hook/busybox:1"
GPU = 3
DEVICE = ("--device", f"/dev/nvidia{GPU}")
GRACE_S = 2.0  # a stopped container's lease ends this long after it stopped


def podman_agent(base: Path, service: ApiService, socket_dir: Path, *args: str) -> AgentProcess:
    """An agent of the simulated 8-GPU node following ``service`` alone, its plugin socket
    in ``socket_dir``, its files under ``base``; ready."""
    agent = launch_agent(
        base / "agent",
        "--podman-socket", str(service.socket_path),
        "--docker-socket", str(base / "no-docker.sock"),
        "--state-dir", str(base / "state"),
        "--cdi-spec-dir", "",
        *args,
        simulate="hgx-h200-8",
        socket_dir=socket_dir,
    )  # fmt: skip
    try:
        wait_ready(agent)
    except BaseException:
        stop_process(agent.proc)
        raise
    return agent


@dataclass
class Node(AgentLeases):
    service: ApiService
    agent: AgentProcess

    def podman(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.service.podman(*args, check=False, timeout_s=60)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.podman("run", *RUN_LIMITS, *args)

    def leased_run(self, *, annotations: bool = True) -> tuple[str, str]:
        """A lease of GPU 3 and a container running with its labels (and annotations) and
        ``--device``: (the lease's id, the container's id), once the lease is bound to it and
        the agent has seen it start."""
        grant = self.ask({"devices": str(GPU)})
        assert [d["GPU"] for d in grant["Devices"]] == [GPU]
        pairs = [f"{k}={v}" for k, v in grant["Labels"].items()]
        labels = [a for pair in pairs for a in ("--label", pair)]
        notes = annotation_args(grant["Labels"].items()) if annotations else []
        run = self.run("-d", *labels, *notes, *DEVICE, IMAGE, "sleep", "600")
        assert run.returncode == 0, run.stderr
        lease_id, container = grant["Lease"], run.stdout.strip()
        wait_until(
            lambda: self.bound_and_running(lease_id, container),
            what=f"{lease_id} bound to its container, running",
            timeout_s=30,
            proc=self.agent.proc,
        )
        return lease_id, container

    def running(self, container: str) -> str:
        return self.podman("inspect", "-f", "{{.State.Running}}", container).stdout.strip()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """The agent and a Podman whose containers ask it through the start hook."""
    require_root()
    base = tmp_path_factory.mktemp("start-hook")
    socket_dir = base / "plugins"
    write_start_hook(base / "hooks.d", socket_dir / "nvidia-docker.sock")
    with (
        nvidia_nodes(wanted_nodes([GPU], uvm=False)),
        private_podman(hooks_dir=base / "hooks.d") as podman,
    ):
        podman.import_busybox(IMAGE, {})
        with api_service(podman) as service:
            agent = podman_agent(base, service, socket_dir, "--lease-grace", f"{GRACE_S:g}")
            try:
                wait_until(
                    lambda: (
                        f"Podman's API service at unix://{service.socket_path} (" in agent.log()
                    ),
                    what=f"the agent following Podman (log: {agent.log_path})",
                    timeout_s=60,
                    proc=agent.proc,
                )
                yield Node(service, agent)
            finally:
                podman("rm", "--all", "--force", check=False)
                stop_process(agent.proc)


@pytest.fixture(autouse=True)
def clean_node(node: Node) -> Iterator[None]:
    """Each test starts on a node without containers or leases, whatever the last left."""
    yield
    node.podman("rm", "--all", "--force", "--time", "0")
    for lease in node.table()["Leases"]:
        if lease["State"] == "pending":  # granted, its container never made
            node.release(lease["Lease"])
    wait_until(
        lambda: node.table()["Leases"] == [],
        what="no lease left after the test",
        timeout_s=30,
        proc=node.agent.proc,
    )


def test_a_run_naming_a_gpu_leased_to_another_is_refused_with_the_tables_line(
    node: Node,
) -> None:
    lease_id, holder = node.leased_run()
    assert node.running(holder) == "true"

    other = node.run("--rm", *DEVICE, IMAGE, "true")
    assert other.returncode != 0
    assert "nvidia-docker: container " in other.stderr, other.stderr
    assert "may not start: it names GPUs leased to others" in other.stderr, other.stderr
    assert f"GPU {GPU} by container {holder[:12]} ({lease_id})" in other.stderr, other.stderr
    assert "Start hook: refused:" in node.agent.log()

    plain = node.run("--rm", IMAGE, "echo", "no GPUs")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "no GPUs"

    assert node.podman("rm", "-f", holder).returncode == 0
    wait_until(lambda: node.holder(lease_id) == "", what=f"{lease_id} ended", timeout_s=10)


def test_a_start_after_the_gpus_went_elsewhere_is_refused(node: Node) -> None:
    first_lease, first = node.leased_run()
    assert node.podman("stop", "-t", "0", first).returncode == 0
    wait_until(
        lambda: node.holder(first_lease) == "",
        what=f"{first_lease} ended {GRACE_S:g} s after its container stopped",
        timeout_s=20,
        proc=node.agent.proc,
    )
    second_lease, second = node.leased_run()

    again = node.podman("start", first)
    assert again.returncode != 0
    assert f"container {first[:12]} may not start: its {first_lease} has ended" in again.stderr
    assert f"GPU {GPU} by container {second[:12]} ({second_lease})" in again.stderr
    assert node.running(first) == "false"

    assert node.podman("rm", "-f", second).returncode == 0
    wait_until(lambda: node.holder(second_lease) == "", what="the GPU free", timeout_s=10)
    relet = node.podman("start", first)  # its GPU free again: leased to it again
    assert relet.returncode == 0, relet.stderr
    wait_until(
        lambda: node.holder(first_lease) == first,
        what=f"{first_lease} leased to {first[:12]} again",
        timeout_s=30,
        proc=node.agent.proc,
    )
    assert node.podman("rm", "-f", first).returncode == 0
    wait_until(lambda: node.holder(first_lease) == "", what="the GPU free", timeout_s=10)


def test_a_grant_given_as_labels_alone_starts_and_binds_its_pending_lease(node: Node) -> None:
    lease_id, container = node.leased_run(annotations=False)  # bound: it waits for that
    assert node.running(container) == "true"
    assert node.podman("rm", "-f", container).returncode == 0
    wait_until(lambda: node.holder(lease_id) == "", what=f"{lease_id} ended", timeout_s=10)
