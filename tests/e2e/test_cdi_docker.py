"""The agent's CDI spec with a real Docker 25+ engine (Debian 13's dockerd 26), end to end.

Debian 12's own engine (20.10) has no CDI, so ``scripts/test-all`` fetches Debian 13's
``docker.io`` package and unpacks its ``dockerd`` into ``.cache/docker-cdi`` (it runs on
Debian 12's libraries, containerd and runc); ``NVD_DOCKERD_CDI`` names another build. The
engine is private (``tests.support.dockerd``) with CDI on (``"features": {"cdi": true}``)
and ``--cdi-spec-dir`` a directory of this test, where a real agent writes its spec for the
simulated ``h200x2-mig`` node against the fake driver root; device nodes are made with
mknod in a private dev root. Nothing machine-wide is written.

Checked: ``docker run --device nvidia.com/gpu=...`` gives the container exactly the
selected nodes; the CDI hook (run by runc for dockerd) lets a Debian image without
LD_LIBRARY_PATH load ``libcuda.so.1`` by soname; ``nvidia-docker run`` sees that the
engine reads CDI and gives a labelled image its GPUs that way, taking the answer from the
node's agent (``GET /engines/json``: no question to dockerd; read again at a ``SIGHUP``'s
``daemon reload``), also for a run with a lease; the agent's engine socket
(docs/engine-socket.md) gives ``docker run --gpus``, ``--gpus '"device=0:1"'`` and ``--gpus
count=2,options=mig-profile=1g.18gb`` (two MIG devices of that profile) leased GPUs as CDI
devices (the device-node form would name the host's ``/dev``, where these nodes do
not exist), and with every GPU leased refuses a third in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from controller.wrapper.docker_args import scan
from controller.wrapper.engine_cdi import AGENT_ENGINES, CLI_VERSION, ask_engine
from controller.wrapper.go_build_info import linked_value
from tests.support.cdi_node import (
    CONTROL,
    GPU1,
    LABELS,
    LIST_NODES,
    MIGS,
    PROGRAM,
    caps_of,
    nodes_seen,
    running_cdi_agent,
)
from tests.support.dockerd import (
    RUN_HELP_HINTS,
    DockerEngine,
    newer_dockerd,
    start_engine,
    stop_engine,
)
from tests.support.fake_driver import FakeDriver
from tests.support.local_agent import local_agent_port
from tests.support.prerequisites import require_root
from tests.support.services import wait_until
from tests.support.systemd_hosts import ensure_rootfs_tarball

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]  # the first test starts the engine

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Setup:
    engine: DockerEngine
    agent_port: int
    spec_dir: Path
    engine_socket: Path  # the agent's (--engine-socket), forwarding to the engine
    dockerd: subprocess.Popen[bytes]


@pytest.fixture(scope="module")
def setup(fake_driver: FakeDriver) -> Iterator[Setup]:
    require_root()
    dockerd = newer_dockerd()
    base = Path(tempfile.mkdtemp(prefix="nvd-cdi-docker-"))
    spec_dir = base / "cdi"
    spec_dir.mkdir()
    # The agent starts first (its spec is there before the engine reads the directory) and
    # follows the engine through a link made once the engine's socket exists.
    engine_link, engine_socket = base / "engine-link.sock", base / "engine" / "docker.sock"
    sockets = (
        "--docker-socket", str(engine_link),
        "--engine-socket", str(engine_socket),
        "--podman-socket", str(base / "no-podman.sock"),
        "--state-dir", str(base / "state"),
    )  # fmt: skip
    try:
        with running_cdi_agent(base, fake_driver, spec_dir, extra_args=sockets) as agent:
            engine, proc = start_engine(
                base,
                dockerd=dockerd,
                extra_args=["--cdi-spec-dir", str(spec_dir)],
                daemon_json={"features": {"cdi": True}},
            )
            engine_link.symlink_to(engine.host.removeprefix("unix://"))
            try:  # the agent follows the engine (its retries were paused meanwhile)
                wait_until(
                    lambda: _engines_row(agent.port, str(engine_link)) is not None,
                    what="the agent to follow the engine's events",
                    timeout_s=90,
                )
                yield Setup(engine, agent.port, spec_dir, engine_socket, proc)
            finally:
                stop_engine(engine, proc)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def busybox(setup: Setup) -> str:
    return setup.engine.import_busybox("nvd-cdi/busybox-cuda:12.4", LABELS)


@pytest.fixture(scope="module")
def debian(setup: Setup) -> str:
    tag = "nvd-cdi/debian:12"
    args = ["import", *(f"--change=LABEL {k}={v}" for k, v in LABELS.items())]
    setup.engine.docker(*args, str(ensure_rootfs_tarball()), tag, timeout_s=600)
    return tag


def run(setup: Setup, image: str, *command: str, devices: tuple[str, ...] = ()) -> str:
    device_args = [f"--device={device}" for device in devices]
    done = setup.engine.docker("run", "--rm", "--network", "none", *device_args, image, *command)
    return done.stdout


def test_the_engine_reads_cdi_from_the_agents_directory(setup: Setup) -> None:
    version = setup.engine.docker("version", "--format", "{{.Server.Version}}").stdout
    assert int(version.split(".")[0]) >= 25, version
    dirs = setup.engine.docker("info", "--format", "{{json .CDISpecDirs}}").stdout.strip()
    assert dirs == f'["{setup.spec_dir}"]'


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("nvidia.com/gpu=1", {"/dev/nvidia1"}),
        (f"nvidia.com/gpu={GPU1.uuid}", {"/dev/nvidia1"}),
        ("nvidia.com/gpu=0:1", {"/dev/nvidia0", *caps_of(1)}),
        (f"nvidia.com/gpu={MIGS[3].uuid}", {"/dev/nvidia0", *caps_of(3)}),
        ("nvidia.com/gpu=all", {"/dev/nvidia0", "/dev/nvidia1", *caps_of(0, 1, 2, 3)}),
    ],
)
def test_docker_gives_exactly_the_selected_nodes(
    setup: Setup, busybox: str, device: str, expected: set[str]
) -> None:
    seen = run(setup, busybox, "sh", "-c", LIST_NODES, devices=(device,))
    assert nodes_seen(seen) == CONTROL | expected


def test_python_loads_libcuda_by_soname_under_docker(
    setup: Setup, debian: str, fake_driver: FakeDriver
) -> None:
    out = run(setup, debian, "python3", "-c", PROGRAM, devices=("nvidia.com/gpu=1",))
    assert out.splitlines() == [
        f"cuInit 0 driver {fake_driver.version}",
        f"/usr/local/nvidia/lib64/libcuda.so.{fake_driver.version}",
    ]


def wrapper_run(
    setup: Setup, image: str, cache: Path, *, remembered: bool = False, **env: str
) -> subprocess.CompletedProcess[str]:
    """``nvidia-docker run`` of ``image`` listing its device nodes, on this engine, with
    ``env`` and ``NV_DEBUG``: it gets GPU 1 and the control nodes in the CDI form (the volume
    form would name the host's /dev, where these nodes do not exist, and the run would fail),
    and the engine check asked the agent (on loopback, following this engine) and the docker
    CLI's file for its version (where that file does not record it, ``docker --version``
    once, remembered under ``cache`` for the next run: ``remembered``)."""
    script = Path(sys.executable).with_name("nvidia-docker")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "controller.wrapper.cli"]
    environ = {k: v for k, v in setup.engine.env().items() if not k.startswith("NV_")}
    environ.update(NV_DEBUG="1", PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(cache), **env)
    done = subprocess.run(
        [*command, "run", "--rm", "--network", "none", image, "sh", "-c", LIST_NODES],
        env=environ, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert nodes_seen(done.stdout) == CONTROL | {"/dev/nvidia1"}
    assert "nvidia-docker | engine: Docker " in done.stderr
    assert f"CDI: yes (CDI spec dirs {setup.spec_dir};" in done.stderr, done.stderr
    cli = shutil.which("docker", path=environ["PATH"])
    assert cli is not None
    asked = f"{AGENT_ENGINES}, the docker CLI's build information"
    if linked_value(cli, CLI_VERSION) is None:  # -trimpath: asked once, then remembered
        asked += ", docker --version" + (", remembered" if remembered else "")
    assert f" ms: {asked})\n" in done.stderr, done.stderr
    return done


def test_nvidia_docker_uses_cdi_with_this_engine(
    setup: Setup, busybox: str, tmp_path: Path
) -> None:
    agent = f"http://127.0.0.1:{setup.agent_port}"
    for remembered in (False, True):
        wrapper_run(setup, busybox, tmp_path, remembered=remembered, NV_HOST=agent, NV_GPU="1")


def _docker_clis() -> list[str]:
    """The docker CLIs of this machine (the one on PATH, Debian's), once each."""
    found = {shutil.which("docker"), "/usr/bin/docker", "/usr/local/bin/docker"}
    return sorted({os.path.realpath(p) for p in found if p and os.access(p, os.X_OK)})


@pytest.mark.parametrize("cli", _docker_clis())
def test_the_wrapper_s_cdi_question_on_the_socket_is_the_cli_s(
    setup: Setup, cli: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``nvidia-docker``'s question (``ask_engine``) on this engine's socket says what the
    docker CLI says, with each docker CLI here: 25 or later passes CDI devices on, an older
    one (Debian 12's 20.10) cannot and knows no ``CDISpecDirs`` (no CDI)."""
    (tmp_path / "docker").symlink_to(cli)
    # this process's PATH too: the docker CLI is started as execvp finds it (os.posix_spawnp)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    environ = {**setup.engine.env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    printed = subprocess.run(
        [cli, "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout  # "Docker version 28.2.2, build e6534b4"
    new_cli = int(printed.removeprefix("Docker version ").split(".", 1)[0]) >= 25
    command = scan(["run", "--rm", "nvd-cdi/busybox-cuda:12.4", "true"])
    socket_path = setup.engine.host.removeprefix("unix://")
    by_socket = ask_engine(("docker",), command, environ, socket_path)
    by_cli = ask_engine(("docker",), command, environ)
    assert by_cli.asked == ("docker version", "docker info")
    assert by_socket.asked[:2] == ("GET /_ping", "GET /info")
    assert (by_socket.engine, by_socket.reads_cdi) == (by_cli.engine, by_cli.reads_cdi)
    assert by_socket.reads_cdi is new_cli, (by_socket, by_cli)
    if new_cli:
        assert by_socket.reason == by_cli.reason == f"CDI spec dirs {setup.spec_dir}"


def through_socket(setup: Setup, *args: str) -> subprocess.CompletedProcess[str]:
    environ = {**setup.engine.env(), "DOCKER_HOST": f"unix://{setup.engine_socket}"}
    return subprocess.run(
        ["docker", *args], env=environ, capture_output=True, text=True, timeout=120, check=False
    )


def inspected(setup: Setup, container: str, field: str) -> Any:
    return json.loads(
        setup.engine.docker("inspect", "-f", f"{{{{json {field}}}}}", container).stdout
    )


def cdi_request(name: str) -> dict[str, Any]:
    """The device request of one CDI device, as the docker CLI sends ``--device NAME``."""
    return {"Driver": "cdi", "Count": 0, "DeviceIDs": [name], "Capabilities": None, "Options": {}}


def test_the_engine_socket_gives_leased_gpus_as_cdi_devices(setup: Setup, busybox: str) -> None:
    started: list[str] = []
    listing = f"{LIST_NODES}; sleep 600"
    try:
        for gpus in ("1", '"device=0:1"', "count=2,options=mig-profile=1g.18gb"):
            done = through_socket(
                setup,
                "run",
                "-d",
                "--network",
                "none",
                "--gpus",
                gpus,
                busybox,
                "sh",
                "-c",
                listing,
            )
            assert done.returncode == 0, done.stderr
            started.append(done.stdout.strip())
        requests = [inspected(setup, cid, ".HostConfig.DeviceRequests") for cid in started]
        by_profile = requests[2][0].pop("DeviceIDs")  # the two 1g.18gb MIG devices, any order
        assert sorted(by_profile) == sorted(f"nvidia.com/gpu={MIGS[i].uuid}" for i in (2, 3))
        assert [MIGS[i].profile for i in (2, 3)] == ["1g.18gb"] * 2
        assert requests == [
            [cdi_request(f"nvidia.com/gpu={GPU1.uuid}")],
            [cdi_request(f"nvidia.com/gpu={MIGS[1].uuid}")],
            [{k: v for k, v in cdi_request("").items() if k != "DeviceIDs"}],
        ]
        seen = [wait_for_output(setup, cid) for cid in started]
        assert seen == [
            CONTROL | {"/dev/nvidia1"},
            CONTROL | {"/dev/nvidia0", *caps_of(1)},
            CONTROL | {"/dev/nvidia0", *caps_of(2, 3)},
        ]
        for cid in started:  # each container is labelled with its lease
            labels = inspected(setup, cid, ".Config.Labels")
            assert labels["nvidia-docker.lease"].startswith("lease-"), labels
        refused = through_socket(setup, "run", "--rm", "--gpus", '"device=0:1"', busybox, "true")
        assert refused.returncode != 0
        line, *rest = [line for line in refused.stderr.splitlines() if line.strip()]
        assert rest in RUN_HELP_HINTS  # the CLI's own
        assert "nvidia-docker:" in line, line
        assert started[1][:12] in line, line
    finally:
        if started:
            setup.engine.docker("rm", "-f", *started, check=False)


def wait_for_output(setup: Setup, container: str) -> set[str]:
    """What the container's ``LIST_NODES`` printed, once it has (it then sleeps)."""
    found: set[str] = set()

    def printed() -> bool:
        found.update(nodes_seen(setup.engine.docker("logs", container).stdout))
        return bool(found)

    wait_until(printed, what=f"the output of container {container[:12]}", timeout_s=60)
    return found


def _engines_row(port: int, socket_path: str) -> dict[str, Any] | None:
    """The agent's ``/engines/json`` row of the engine at ``socket_path``, while it follows."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/engines/json", timeout=10) as answer:
        rows = json.loads(answer.read())["Engines"]
    return next((r for r in rows if r["Socket"] == socket_path and r["Following"]), None)


def test_the_node_s_agent_answers_the_wrapper_s_cdi_question(
    setup: Setup, busybox: str, fake_driver: FakeDriver, tmp_path: Path
) -> None:
    """The node's agent (localhost:3476, ``NV_HOST`` unset) follows this engine and says
    what it answered to ``GET /version`` and ``GET /info``: ``nvidia-docker run`` with a
    lease takes the CDI answer from it and asks dockerd nothing about it; ``SIGHUP`` to
    dockerd (its ``daemon reload`` event) has the agent read the answers again."""
    socket_path = setup.engine.host.removeprefix("unix://")
    (tmp_path / "cdi").mkdir()
    sockets = (
        "--docker-socket", socket_path,
        "--podman-socket", str(tmp_path / "no-podman.sock"),
        "--state-dir", str(tmp_path / "state"),
    )  # fmt: skip
    with (
        local_agent_port() as port,
        running_cdi_agent(tmp_path, fake_driver, tmp_path / "cdi", extra_args=sockets, port=port),
    ):
        found: list[dict[str, Any]] = []

        def followed() -> bool:
            row = _engines_row(port, socket_path)
            found[:] = [row] if row is not None else []
            return bool(found)

        wait_until(followed, what="the agent to follow the engine", timeout_s=60)
        assert found[0]["CDISpecDirs"] == [str(setup.spec_dir)]
        done = wrapper_run(setup, busybox, tmp_path / "cache", NV_GPU="auto:1")  # NV_HOST unset
        assert "nvidia-docker | lease: " in done.stderr, done.stderr
        setup.dockerd.send_signal(signal.SIGHUP)  # dockerd reads its settings again
        wait_until(
            lambda: (_engines_row(port, socket_path) or found[0])["ReadAt"] > found[0]["ReadAt"],
            what="the agent to read the engine's answers again after its reload",
            timeout_s=60,
        )
