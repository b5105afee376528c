"""The agent's CDI spec beside a spec of NVIDIA's toolkit, with real engines.

NVIDIA's toolkit (1.18+: ``nvidia-cdi-refresh``) writes ``/var/run/cdi/nvidia.yaml``, kind
``nvidia.com/gpu``, with the same device names as ours. Here a spec of that shape (YAML; the
devices by index and UUID, and ``all``; no MIG names; an ``NVD_TEST_PRODUCER`` variable
that tells which spec served a container) is put beside the agent's, for the simulated
``h200x2-mig`` node with device nodes in a private dev root.

With Docker 26 (Debian 13's dockerd, private, CDI on, reading a private spec directory):
two specs of one kind in one directory lose the devices they both define, the fact the
agent's behaviour rests on; the agent started beside such a spec writes none and the
toolkit's serves ``--device nvidia.com/gpu=0``; when it goes, the agent's spec comes back.

With Podman 4.3 (``/var/run/cdi``, under the machine's CDI lock; every file made there is
removed): the agent steps aside when the toolkit's spec appears while it runs, says so once,
answers ``/cdi/spec`` with 409 and ``/docker/cli?format=cdi`` with names the toolkit's spec
has, and writes its spec again when that one goes; with ``--cdi-kind nvidia-docker.com/gpu``
both specs serve, each under its kind.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cdi_node import (
    CDI_DIR,
    GPU0,
    GPU1,
    LABELS,
    SPEC_NAME,
    machine_cdi_agent,
    make_dev_root,
    place_spec,
    running_cdi_agent,
)
from tests.support.dockerd import DockerEngine, newer_dockerd, start_engine, stop_engine
from tests.support.fake_driver import FakeDriver
from tests.support.podman import Podman, private_podman
from tests.support.prerequisites import require_root
from tests.support.services import wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOOLKIT = "nvidia.yaml"  # the name nvidia-cdi-refresh writes
MARK = "NVD_TEST_PRODUCER"
SHOW = f'echo "{MARK}=${{{MARK}-ours}}"; ls /dev | grep "^nvidia[0-9]" | sort'
ASIDE = "in the directory engines read ours from"  # the agent's warning line says this
BACK = "no longer defines nvidia.com/gpu devices beside ours"


def toolkit_spec(devroot: Path) -> str:
    """A spec shaped as ``nvidia-ctk cdi generate`` writes it, naming the test's nodes."""

    def node(path: str) -> dict[str, str]:
        return {"path": path, "hostPath": str(devroot / path.lstrip("/"))}

    gpus = {"0": GPU0, "1": GPU1}
    devices: list[dict[str, Any]] = []
    for index, gpu in gpus.items():
        edits = {"deviceNodes": [node(str(gpu.path))]}
        devices += [{"name": name, "containerEdits": edits} for name in (index, gpu.uuid)]
    everything = [node(str(gpu.path)) for gpu in gpus.values()]
    devices.append({"name": "all", "containerEdits": {"deviceNodes": everything}})
    document = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": devices,
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void", f"{MARK}=toolkit"],
            "deviceNodes": [node("/dev/nvidiactl"), node("/dev/nvidia-uvm")],
        },
    }
    return yaml.safe_dump(document, explicit_start=True, sort_keys=False)


def get(agent_port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{agent_port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


# --- Docker 26, in private directories -------------------------------------------------


@dataclass
class Docker:
    engine: DockerEngine
    spec_dir: Path
    base: Path
    busybox: str


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    require_root()
    dockerd = newer_dockerd()
    base = Path(tempfile.mkdtemp(prefix="nvd-cdi-beside-docker-"))
    spec_dir = base / "cdi"
    spec_dir.mkdir()
    try:
        engine, proc = start_engine(
            base,
            dockerd=dockerd,
            extra_args=["--cdi-spec-dir", str(spec_dir)],
            daemon_json={"features": {"cdi": True}},
        )
        try:
            busybox = engine.import_busybox("nvd-cdi-beside/busybox", LABELS)
            yield Docker(engine, spec_dir, base, busybox)
        finally:
            stop_engine(engine, proc)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def docker_run(docker: Docker, device: str) -> tuple[int, str]:
    done = docker.engine.docker(
        "run", "--rm", "--network", "none", f"--device={device}", docker.busybox,
        "sh", "-c", SHOW, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout if done.returncode == 0 else done.stderr


def test_two_specs_of_one_kind_in_one_directory_lose_their_devices(docker: Docker) -> None:
    """The CDI library's rule, with Docker's copy of it: a device both define is dropped;
    with one of the two gone, it resolves again."""
    devroot = docker.base / "devroot-fact"
    make_dev_root(devroot)
    first, second = docker.spec_dir / TOOLKIT, docker.spec_dir / "copy.yaml"
    place_spec(first, toolkit_spec(devroot))
    place_spec(second, toolkit_spec(devroot))
    try:
        status, error = docker_run(docker, "nvidia.com/gpu=0")
        assert status != 0
        assert "unresolvable CDI devices nvidia.com/gpu=0" in error
        second.unlink()
        status, out = docker_run(docker, "nvidia.com/gpu=0")
        assert (status, out) == (0, f"{MARK}=toolkit\nnvidia0\n")
    finally:
        first.unlink(missing_ok=True)
        second.unlink(missing_ok=True)


def test_docker_the_agent_started_beside_the_toolkits_spec_leaves_it_the_kind(
    docker: Docker, fake_driver: FakeDriver
) -> None:
    agent_base = docker.base / "agent"
    agent_base.mkdir()
    toolkit = docker.spec_dir / TOOLKIT
    place_spec(toolkit, toolkit_spec(agent_base / "devroot"))
    ours = docker.spec_dir / SPEC_NAME
    try:
        with running_cdi_agent(
            agent_base, fake_driver, docker.spec_dir, expect_spec=False
        ) as agent:
            assert not ours.exists()
            assert docker_run(docker, "nvidia.com/gpu=0") == (0, f"{MARK}=toolkit\nnvidia0\n")
            toolkit.unlink()  # nvidia-cdi-refresh disabled and its spec removed
            wait_until(ours.exists, what="the agent's spec back", timeout_s=30)
            assert docker_run(docker, "nvidia.com/gpu=0") == (0, f"{MARK}=ours\nnvidia0\n")
            log = agent.log.read_text()
            assert log.count(ASIDE) == 1
            assert BACK in log
    finally:
        toolkit.unlink(missing_ok=True)
        ours.unlink(missing_ok=True)


# --- Podman 4.3, in /var/run/cdi ------------------------------------------------------


def test_podman_the_agent_steps_aside_and_comes_back(fake_driver: FakeDriver) -> None:
    # the CDI lock (the agent's) before Podman's, as everywhere
    with machine_cdi_agent(fake_driver) as agent, private_podman() as podman:
        image = podman.import_busybox("nvd-cdi-beside/busybox", LABELS)
        ours, toolkit = CDI_DIR / SPEC_NAME, CDI_DIR / TOOLKIT
        assert podman_run(podman, image, "nvidia.com/gpu=0") == (0, f"{MARK}=ours\nnvidia0\n")
        try:
            place_spec(toolkit, toolkit_spec(agent.node_file.parent / "devroot"))
            wait_until(lambda: not ours.exists(), what="the agent stepping aside", timeout_s=30)
            assert podman_run(podman, image, "nvidia.com/gpu=0") == (
                0,
                f"{MARK}=toolkit\nnvidia0\n",
            )
            status, text = get(agent.port, "/cdi/spec")
            assert status == 409
            assert f"the agent stepped aside: {toolkit} defines nvidia.com/gpu devices" in text
            assert get(agent.port, "/docker/cli?format=cdi&dev=1") == (
                200,
                f"--device=nvidia.com/gpu={GPU1.uuid}\n",  # a name the toolkit's spec has
            )
            status, text = get(agent.port, "/docker/cli?format=cdi&dev=0:1")
            assert status == 400
            assert f"the CDI spec in force, {toolkit}, has no device for it" in text
            (line,) = [line for line in agent.log.read_text().splitlines() if ASIDE in line]
            assert f"CDI spec {toolkit} defines nvidia.com/gpu devices (0, 1, all, ...)" in line
            assert "systemctl disable --now nvidia-cdi-refresh.path" in line
            assert "--cdi-kind nvidia-docker.com/gpu" in line
        finally:
            toolkit.unlink(missing_ok=True)
        wait_until(ours.exists, what="the agent's spec back", timeout_s=30)
        assert podman_run(podman, image, "nvidia.com/gpu=0") == (0, f"{MARK}=ours\nnvidia0\n")
        assert get(agent.port, "/cdi/spec")[0] == 200
        assert BACK in agent.log.read_text()


def test_podman_another_kind_lives_beside_the_toolkits_spec(fake_driver: FakeDriver) -> None:
    kind = "nvidia-docker.com/gpu"
    with (
        machine_cdi_agent(
            fake_driver,
            extra_args=("--cdi-kind", kind),
            beside=lambda devroot: {TOOLKIT: toolkit_spec(devroot)},
        ) as agent,
        private_podman() as podman,
    ):
        image = podman.import_busybox("nvd-cdi-beside/busybox", LABELS)
        document = json.loads((CDI_DIR / SPEC_NAME).read_text())
        assert document["kind"] == kind
        assert podman_run(podman, image, "nvidia.com/gpu=1") == (0, f"{MARK}=toolkit\nnvidia1\n")
        assert podman_run(podman, image, f"{kind}=1") == (0, f"{MARK}=ours\nnvidia1\n")
        assert get(agent.port, "/docker/cli?format=cdi&dev=0:1") == (
            200,
            f"--device={kind}={GPU0.mig_devices[1].uuid}\n",
        )
        assert ASIDE not in agent.log.read_text()


def podman_run(podman: Podman, image: str, device: str) -> tuple[int, str]:
    done = podman.run(image, "sh", "-c", SHOW, devices=[device])
    return done.returncode, done.stdout if done.returncode == 0 else done.stderr
