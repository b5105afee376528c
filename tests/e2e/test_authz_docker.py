"""The authorization plugin end to end: a private dockerd run with
``--authorization-plugin=nvidia-docker`` asks a real agent (simulated ``hgx-h200-8``, eight
H200s, following that dockerd) before every create and start (docs/leases.md, "Refusing a
start: the authorization plugin").

dockerd looks its authorization plugins up when it starts and refuses to start without
them, so the agent is started first: it serves its plugin socket in the engine's directory
and writes its spec file into the engine's own /etc/docker/plugins (``--spec-file``,
tests.support.dockerd), and dockerd starts after it; at the end dockerd stops first (it
refuses every request while its authorization plugin is gone, ``docker rm`` included).
Docker's ``--device`` needs the host's device node and this machine has no GPU: the module
makes /dev/nvidia3 (and nvidiactl) with mknod where missing, under the machine-wide device
lock the other Docker end-to-end tests take, and removes exactly those afterwards. Nothing
opens them: the containers run busybox.

Checked: a container created with the labels of a lease of GPU 3 (and ``--device
/dev/nvidia3``) is created and started; another ``docker run --device /dev/nvidia3`` is
refused by dockerd with the table's line naming the lease; a container without GPUs runs;
a container stopped longer than the grace time, whose GPU has been leased to another since,
is refused a ``docker start`` instead of sharing it silently.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support.agent_leases import AgentLeases
from tests.support.agent_process import AgentProcess, launch_agent, wait_ready
from tests.support.device_nodes import nvidia_nodes, wanted_nodes
from tests.support.dockerd import DockerEngine, start_engine, stop_engine
from tests.support.services import stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

IMAGE = "nvd-authz/busybox:1"
GPU = 3
DEVICE = ("--device", f"/dev/nvidia{GPU}")
REFUSED = "authorization denied by plugin nvidia-docker"
GRACE_S = 2.0  # a stopped container's lease ends this long after it stopped


@pytest.fixture(scope="module")
def nvidia_devices() -> Iterator[None]:
    """Character device nodes /dev/nvidia3 and /dev/nvidiactl where missing."""
    with nvidia_nodes(wanted_nodes([GPU], uvm=False)):
        yield


@dataclass
class Node(AgentLeases):
    engine: DockerEngine
    agent: AgentProcess

    def docker(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.engine.docker(*args, check=False, timeout_s=60)

    def leased_run(self) -> tuple[str, str]:
        """A lease of GPU 3 and a container running with its labels and ``--device``:
        (the lease's id, the container's id), once the lease is bound to it."""
        grant = self.ask({"devices": str(GPU)})
        assert [d["GPU"] for d in grant["Devices"]] == [GPU]
        labels = [a for k, v in grant["Labels"].items() for a in ("--label", f"{k}={v}")]
        run = self.docker("run", "-d", *labels, *DEVICE, IMAGE, "sleep", "600")
        assert run.returncode == 0, run.stderr
        lease_id, container = grant["Lease"], run.stdout.strip()
        wait_until(
            lambda: self.holder(lease_id) == container,
            what=f"{lease_id} bound to its container",
            timeout_s=20,
            proc=self.agent.proc,
        )
        return lease_id, container


@pytest.fixture(scope="module")
def node(nvidia_devices: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """An agent, then a dockerd that uses it as its authorization plugin; dockerd stops
    first (it needs the plugin for every request), then the agent."""
    base = tmp_path_factory.mktemp("authz-agent")
    agents: list[AgentProcess] = []

    def serve_plugin(engine: DockerEngine) -> None:
        agent = launch_agent(
            base,
            "--docker-socket", engine.host.removeprefix("unix://"),
            "--podman-socket", str(base / "no-podman.sock"),
            "--state-dir", str(base / "state"),
            "--spec-file", str(engine.plugin_specs / "nvidia-docker.spec"),
            "--cdi-spec-dir", "",
            "--lease-grace", f"{GRACE_S:g}",
            simulate="hgx-h200-8",
            socket_dir=engine.root / "nvidia-docker-plugin",
        )  # fmt: skip
        agents.append(agent)
        wait_ready(agent)
        wait_until(
            (engine.plugin_specs / "nvidia-docker.spec").exists,
            what="the agent's spec file",
            timeout_s=10,
            proc=agent.proc,
        )

    try:
        engine, proc = start_engine(
            extra_args=("--authorization-plugin=nvidia-docker", "--shutdown-timeout", "1"),
            before_start=serve_plugin,
        )
        try:
            engine.import_busybox(IMAGE)
            served = Node(engine, agents[0])
            wait_until(
                lambda: f"{engine.host} answers again: following" in served.agent.log(),
                what=f"the agent following dockerd (log: {served.agent.log_path})",
                timeout_s=60,
                proc=served.agent.proc,
            )
            yield served
        finally:
            stop_engine(engine, proc)
    finally:
        for agent in agents:
            stop_process(agent.proc)  # it removes its socket and spec file


def test_a_create_naming_gpus_leased_to_another_is_refused_with_the_tables_line(
    node: Node,
) -> None:
    lease_id, holder_id = node.leased_run()

    other = node.docker("run", "--rm", *DEVICE, IMAGE, "true")
    assert other.returncode != 0
    assert REFUSED in other.stderr, other.stderr
    assert "may not start: it names GPUs leased to others" in other.stderr, other.stderr
    assert lease_id in other.stderr, other.stderr
    assert f"GPU {GPU}" in other.stderr, other.stderr
    assert "Authorization: refused:" in node.agent.log()

    plain = node.docker("run", "--rm", IMAGE, "echo", "no GPUs")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "no GPUs"

    assert node.docker("rm", "-f", holder_id).returncode == 0


def test_a_start_after_the_gpus_went_elsewhere_is_refused(node: Node) -> None:
    first_lease, first = node.leased_run()
    assert node.docker("stop", "-t", "0", first).returncode == 0
    wait_until(
        lambda: node.holder(first_lease) == "",
        what=f"{first_lease} ended {GRACE_S:g} s after its container stopped",
        timeout_s=20,
        proc=node.agent.proc,
    )
    second_lease, second = node.leased_run()

    again = node.docker("start", first)
    assert again.returncode != 0
    assert REFUSED in again.stderr, again.stderr
    assert f"container {first[:12]} may not start: its {first_lease} has ended" in again.stderr
    assert f"GPU {GPU} by container {second[:12]} ({second_lease})" in again.stderr
    assert node.docker("inspect", "-f", "{{.State.Running}}", first).stdout.strip() == "false"
    restarted = node.docker("restart", "-t", "0", first)  # docker restart asks too
    assert restarted.returncode != 0
    assert f"container {first[:12]} may not start: its {first_lease} has ended" in (
        restarted.stderr
    )
    assert node.docker("inspect", "-f", "{{.State.Running}}", first).stdout.strip() == "false"
    again = node.docker("restart", "-t", "0", second)  # its own lease: restarted
    assert again.returncode == 0, again.stderr

    assert node.docker("rm", "-f", first, second).returncode == 0
