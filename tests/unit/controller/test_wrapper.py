"""The nvidia-docker wrapper as a process: NV_DOCKER is a recording stand-in for docker and
the node's agent an aiohttp server answering as docs/api.md says (tests/e2e has the real
dockerd, sshd and agent)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest
from aiohttp import web

from agent.api.docker_cli import control_devices
from tests.support.services import free_port, port_open
from tests.unit.gpu.fake_nvml import load_capture

FAKE_DOCKER = Path(__file__).with_name("fake_docker.py")
REPO = Path(__file__).resolve().parents[3]
ERROR_LINE = re.compile(r"^nvidia-docker \| \d{4}/\d\d/\d\d \d\d:\d\d:\d\d Error: (.+)$")
UUIDS = ("GPU-1a2b3c4d-0000-0000-0000-000000000000", "GPU-9f8e7d6c-0000-0000-0000-000000000000")
GPU_LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}


@dataclass
class Agent:
    port: int
    cuda: str = "13.0"
    queries: list[dict[str, str]] = field(default_factory=list)
    old: bool = False  # answer 400s as 1.0.1 did, without the X-Invalid-* headers
    cdi: bool = True  # writes a CDI spec: answers format=cdi (an old agent ignores format)


def _info(agent: Agent) -> dict[str, object]:
    devices = [{"UUID": uuid, "Path": f"/dev/nvidia{i}"} for i, uuid in enumerate(UUIDS)]
    return {"Version": {"Driver": "580.159.04", "CUDA": agent.cuda}, "Devices": devices}


def _cli(agent: Agent, query: dict[str, str]) -> web.Response:
    chosen: list[int] = []
    for entry in query.get("dev", "").split() or ["0", "1"]:
        matches = [
            i for i, u in enumerate(UUIDS) if entry.startswith("GPU-") and u.startswith(entry)
        ]
        if entry.isdigit() and int(entry) < len(UUIDS):
            chosen.append(int(entry))
        elif len(matches) == 1:
            chosen.append(matches[0])
        else:
            headers = {"X-Invalid-Parameter": "dev", "X-Invalid-Value": quote(entry, safe="")}
            if agent.old:  # nvidia-docker-plugin 1.0.1 said it in the text only
                headers = {}
            gpu, colon, _ = entry.partition(":")  # a MIG device of a GPU not in MIG mode
            why = f" (GPU {gpu} is not in MIG mode)" if colon and gpu.isdigit() else ""
            text = f"invalid device: {entry}{why}\n"
            return web.Response(status=400, text=text, headers=headers)
    if query.get("format") == "cdi" and not agent.old:
        if not agent.cdi:
            return web.Response(
                status=400,
                text="invalid format: cdi (this agent writes no CDI spec)\n",
                headers={"X-Invalid-Parameter": "format", "X-Invalid-Value": "cdi"},
            )
        cdi = [f"--device=nvidia.com/gpu={UUIDS[i]}" for i in sorted(chosen)]
        return web.Response(text=" ".join(cdi) + "\n")
    devices = ["/dev/nvidiactl", "/dev/nvidia-uvm"] + [f"/dev/nvidia{i}" for i in sorted(chosen)]
    args = [
        "--volume-driver=nvidia-docker",
        "--volume=nvidia_driver_580.159.04:/usr/local/nvidia:ro",
        *(f"--device={d}" for d in devices),
    ]
    return web.Response(text=" ".join(args) + "\n")


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    state = Agent(port=free_port())

    async def info(_: web.Request) -> web.Response:
        return web.Response(text=json.dumps(_info(state)) + "\n", content_type="application/json")

    async def cli(request: web.Request) -> web.Response:
        state.queries.append(dict(request.query))
        return _cli(state, dict(request.query))

    app = web.Application()
    app.router.add_get("/gpu/info/json", info)
    app.router.add_get("/docker/cli", cli)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", state.port).start()
    try:
        yield state
    finally:
        await runner.cleanup()


@dataclass
class Docker:
    """The recording docker: images, registry, volumes, and the calls it saw."""

    root: Path

    def image(self, name: str, labels: dict[str, str] | None, *, in_registry: bool = False) -> str:
        where = "registry" if in_registry else "images"
        key = name.replace("/", "_").replace(":", "_")
        (self.root / where / f"{key}.json").write_text(json.dumps(labels))
        return name

    def volume(self, name: str) -> None:
        (self.root / "volumes" / name).touch()

    def engine(self, version: Mapping[str, object], cdi_spec_dirs: list[str] | None = None) -> None:
        """What ``version --format`` and ``info --format`` answer (default: Docker 20.10)."""
        engine = {"version": version, "cdi_spec_dirs": cdi_spec_dirs}
        (self.root / "engine.json").write_text(json.dumps(engine))

    def calls(self) -> list[list[str]]:
        path = self.root / "calls"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines]


@pytest.fixture
def docker(tmp_path: Path) -> Docker:
    for sub in ("images", "registry", "volumes"):
        (tmp_path / sub).mkdir()
    return Docker(tmp_path)


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def executed(self) -> list[str] | None:
        """The argv docker was finally exec'd with (None: the wrapper stopped before)."""
        for line in self.stdout.splitlines():
            if line.startswith("EXEC "):
                argv: list[str] = json.loads(line[5:])
                return argv
        return None

    @property
    def cuda_environment(self) -> dict[str, str] | None:
        """The CUDA_* variables docker was exec'd with."""
        for line in self.stdout.splitlines():
            if line.startswith("ENV "):
                env: dict[str, str] = json.loads(line[4:])
                return env
        return None

    def error(self) -> str:
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1, self.stderr
        match = ERROR_LINE.match(lines[0])
        assert match, lines[0]
        return match.group(1)


async def nvidia_docker(docker: Docker, *args: str, **env: str) -> Result:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NV_", "DOCKER_")) and k != "SSH_AUTH_SOCK"
    }
    environ.update(
        FAKE_DOCKER_DIR=str(docker.root),
        NV_DOCKER=f"{sys.executable} {FAKE_DOCKER}",
        PYTHONPATH=str(REPO),
    )
    environ.update(env)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "controller.wrapper.cli",
        *args,
        env=environ,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


# --- pass-through ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["ps", "-a"],
        ["inspect", "run"],
        ["logs", "-f", "mesos-abc"],
        ["stop", "-t", "3", "c"],
        ["rm", "-f", "c"],
        ["--version"],
        ["-H", "unix:///x.sock", "build", "-t", "run", "."],
        ["run", "--help"],
    ],
)
async def test_pass_through_is_untouched(docker: Docker, args: list[str]) -> None:
    result = await nvidia_docker(docker, *args)
    assert result.code == 0
    assert result.executed == args
    assert docker.calls() == [args]  # nothing asked of docker before
    assert result.stderr == ""


async def test_version_prints_ours_first(docker: Docker) -> None:
    result = await nvidia_docker(docker, "version")
    assert result.stdout.startswith("NVIDIA Docker: 2.0.0\n\nEXEC ")
    assert result.executed == ["version"]


@pytest.mark.parametrize(
    "args",
    [
        ["--format", "{{.Server.Version}}"],
        ["--format={{json .}}"],
        ["-f", "{{json .}}"],
        ["-fjson"],
    ],
)
async def test_version_with_a_format_is_docker_s_alone(docker: Docker, args: list[str]) -> None:
    """A script reads ``version --format``'s output: nothing of ours comes before it."""
    result = await nvidia_docker(docker, "version", *args)
    assert result.code == 0, result.stderr
    assert "NVIDIA Docker" not in result.stdout
    assert docker.calls() == [["version", *args]]


async def test_nv_docker_is_split_on_white_space(docker: Docker) -> None:
    result = await nvidia_docker(docker, "ps", NV_DOCKER=f"  {sys.executable}\t{FAKE_DOCKER}  -D  ")
    assert result.executed == ["-D", "ps"]


async def test_docker_missing(docker: Docker) -> None:
    result = await nvidia_docker(docker, "ps", NV_DOCKER="/nonexistent/docker")
    assert result.code == 1
    assert "the docker command '/nonexistent/docker' was not found" in result.error()


async def test_docker_gets_sigpipe_and_sigxfsz_at_their_defaults(docker: Docker) -> None:
    """Python ignores both at start; docker must not inherit that (a docker writing into a
    closed pipe dies of SIGPIPE, as it does when the shell starts it)."""
    result = await nvidia_docker(docker, "SigIgn", "/proc/self/status", NV_DOCKER="grep")
    assert result.code == 0, result.stderr
    ignored = int(result.stdout.split()[1], 16)
    assert ignored & (1 << (13 - 1)) == 0  # SIGPIPE
    assert ignored & (1 << (25 - 1)) == 0  # SIGXFSZ


# --- run/create -----------------------------------------------------------------------------


async def test_image_without_label_runs_unchanged(docker: Docker) -> None:
    docker.image("busybox", {"maintainer": "x"})
    args = ["run", "--rm", "-it", "busybox", "sh", "-c", "echo run"]
    result = await nvidia_docker(docker, *args)
    assert result.executed == args
    docker.image("nolabels", None)
    assert (await nvidia_docker(docker, "create", "nolabels")).executed == ["create", "nolabels"]


async def test_remote_http_gpu_arguments_after_run(docker: Docker, agent: Agent) -> None:
    docker.image("nvidia/cuda:12.4", GPU_LABELS)
    result = await nvidia_docker(
        docker,
        "run",
        "--rm",
        "nvidia/cuda:12.4",
        "nvidia-smi",
        NV_HOST=f"http://127.0.0.1:{agent.port}:",
        DOCKER_HOST="tcp://127.0.0.1:2375",
    )
    assert result.code == 0, result.stderr
    assert result.executed == [
        "run",
        "--volume-driver=nvidia-docker",
        "--volume=nvidia_driver_580.159.04:/usr/local/nvidia:ro",
        "--device=/dev/nvidiactl",
        "--device=/dev/nvidia-uvm",
        "--device=/dev/nvidia0",
        "--device=/dev/nvidia1",
        "--rm",
        "nvidia/cuda:12.4",
        "nvidia-smi",
    ]
    assert agent.queries == [{"vol": "nvidia_driver", "dev": ""}]
    assert result.stderr == ""


async def test_nv_gpu_by_index_and_uuid_prefix(docker: Docker, agent: Agent) -> None:
    docker.image("cuda", GPU_LABELS)
    env = {"NV_HOST": f"http://127.0.0.1:{agent.port}", "DOCKER_HOST": "tcp://h:1"}
    by_index = await nvidia_docker(docker, "container", "create", "cuda", NV_GPU="1", **env)
    assert by_index.executed is not None
    assert by_index.executed[:2] == ["container", "create"]
    assert [
        a for a in by_index.executed if a.startswith("--device=/dev/nvidia") and a[-1].isdigit()
    ] == ["--device=/dev/nvidia1"]
    by_uuid = await nvidia_docker(docker, "run", "cuda", NV_GPU="GPU-9f8e, 0", **env)
    assert by_uuid.executed is not None
    assert "--device=/dev/nvidia0" in by_uuid.executed
    assert "--device=/dev/nvidia1" in by_uuid.executed
    assert agent.queries[-1]["dev"] == "GPU-9f8e 0"


async def test_unknown_gpu(docker: Docker, agent: Agent) -> None:
    docker.image("cuda", GPU_LABELS)
    result = await nvidia_docker(
        docker, "run", "cuda", NV_GPU="7", NV_HOST=f"127.0.0.1:{agent.port}", DOCKER_HOST="h:"
    )
    assert result.code == 1
    assert result.executed is None
    assert result.error() == (
        f"NV_GPU names an unknown GPU: 7 (http://127.0.0.1:{agent.port} has GPUs 0 to 1; "
        "use indices or UUID prefixes starting GPU-, as nvidia-smi -L lists them, or for MIG "
        "devices <gpu>:<mig> or UUID prefixes starting MIG-)"
    )


async def test_unknown_gpu_on_an_old_agent(docker: Docker, agent: Agent) -> None:
    """An agent that does not name the refused parameter: its own words, not a guess."""
    agent.old = True
    docker.image("cuda", GPU_LABELS)
    result = await nvidia_docker(
        docker, "run", "cuda", NV_GPU="7", NV_HOST=f"127.0.0.1:{agent.port}", DOCKER_HOST="h:"
    )
    assert result.code == 1
    assert result.error() == (
        f"http://127.0.0.1:{agent.port}: the agent answered 400 to GET /docker/cli: "
        "invalid device: 7"
    )


@pytest.mark.parametrize(
    ("driver", "image", "ok"),
    [
        ("13.0", "9.2", True),
        ("13.0", "13.0", True),
        ("7.0", "7.5", False),
        ("13.0", "13.1", False),
        ("12.10", "12.9", True),
    ],
)
async def test_cuda_check_is_numeric(
    docker: Docker, agent: Agent, driver: str, image: str, ok: bool
) -> None:
    agent.cuda = driver
    docker.image(
        "cuda", {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": image}
    )
    result = await nvidia_docker(
        docker, "run", "cuda", NV_HOST=f"127.0.0.1:{agent.port}", DOCKER_HOST="h:"
    )
    if ok:
        assert result.code == 0, result.stderr
        assert result.executed is not None
    else:
        assert result.code == 1
        assert result.executed is None
        assert result.error() == f"unsupported CUDA version: driver {driver} < image {image}"
        assert agent.queries == []  # refused before asking for devices


async def test_missing_image_is_pulled_to_stderr(docker: Docker, agent: Agent) -> None:
    docker.image("nvidia/cuda", GPU_LABELS, in_registry=True)
    result = await nvidia_docker(
        docker,
        "-H",
        "tcp://127.0.0.1:2375",
        "run",
        "--platform=linux/amd64",
        "nvidia/cuda",
        NV_HOST=f"127.0.0.1:{agent.port}",
    )
    assert result.code == 0, result.stderr
    assert "pulling nvidia/cuda: done" in result.stderr
    assert "pulling" not in result.stdout
    calls = docker.calls()
    # the wrapper's own docker calls keep the global options
    assert ["-H", "tcp://127.0.0.1:2375", "pull", "--platform", "linux/amd64", "nvidia/cuda"] in (
        calls
    )
    assert result.executed is not None
    assert result.executed[:3] == ["-H", "tcp://127.0.0.1:2375", "run"]


async def test_pull_failure(docker: Docker) -> None:
    result = await nvidia_docker(docker, "run", "nosuch/image")
    assert result.code == 1
    assert result.executed is None
    assert "cannot pull the image nosuch/image" in result.stderr.splitlines()[-1]


async def test_pull_never_leaves_it_to_docker(docker: Docker) -> None:
    result = await nvidia_docker(docker, "run", "--pull", "never", "absent")
    assert result.executed == ["run", "--pull", "never", "absent"]


async def test_warns_when_nv_host_set_without_docker_host(docker: Docker, agent: Agent) -> None:
    docker.image("cuda", GPU_LABELS)
    result = await nvidia_docker(docker, "run", "cuda", NV_HOST=f"127.0.0.1:{agent.port}")
    assert result.code == 0
    assert re.match(
        r"^nvidia-docker \| \S+ \S+ Warning: NV_HOST is set but DOCKER_HOST is not", result.stderr
    )


async def test_docker_s_config_option_names_where_its_contexts_are(
    docker: Docker, agent: Agent, tmp_path: Path
) -> None:
    """``docker --config DIR`` reads config.json and the contexts in DIR, not ~/.docker."""
    config = tmp_path / "elsewhere"
    meta = config / "contexts" / "meta" / hashlib.sha256(b"gpu7").hexdigest()
    meta.mkdir(parents=True)
    endpoints = {"docker": {"Host": "tcp://127.0.0.1:2375"}}
    (meta / "meta.json").write_text(json.dumps({"Name": "gpu7", "Endpoints": endpoints}))
    (config / "config.json").write_text(json.dumps({"currentContext": "gpu7"}))
    docker.image("cuda", GPU_LABELS)
    env = {"NV_HOST": f"127.0.0.1:{agent.port}", "HOME": str(tmp_path)}
    for options in (["--context=gpu7"], []):  # the context named, or docker context use
        result = await nvidia_docker(docker, f"--config={config}", *options, "run", "cuda", **env)
        assert (result.code, result.stderr) == (0, "")  # no NV_HOST-without-docker warning
        assert result.executed is not None
        assert "--device=/dev/nvidia0" in result.executed


async def test_a_mig_device_of_a_gpu_without_mig_names_the_agents_reason(
    docker: Docker, agent: Agent
) -> None:
    """Not "unknown GPU: 0:1": the agent said why it refused (GPU 0 is not in MIG mode)."""
    docker.image("cuda", GPU_LABELS)
    result = await nvidia_docker(
        docker, "run", "cuda", NV_GPU="0:1", NV_HOST=f"127.0.0.1:{agent.port}", DOCKER_HOST="h:"
    )
    assert result.code == 1
    assert result.error() == (
        f"NV_GPU names a GPU that http://127.0.0.1:{agent.port} cannot give: 0:1 (GPU 0 is not "
        "in MIG mode; it has GPUs 0 to 1; use indices or UUID prefixes starting GPU-, as "
        "nvidia-smi -L lists them, or for MIG devices <gpu>:<mig> or UUID prefixes starting MIG-)"
    )


async def test_a_bad_nv_host_is_said_before_docker_is_asked(docker: Docker) -> None:
    """A bad NV_HOST used to hide behind docker's "Cannot connect to the Docker daemon"."""
    docker.image("cuda", GPU_LABELS)
    result = await nvidia_docker(docker, "run", "cuda", NV_HOST="bogus://x")
    assert result.code == 1
    assert result.error().startswith("invalid remote host URI 'bogus://x' (NV_HOST)")
    assert docker.calls() == []  # no docker image inspect, no pull


async def test_podman_gets_no_docker_host_warning(
    docker: Docker, agent: Agent, tmp_path: Path
) -> None:
    """Podman takes its engine from its own settings, not DOCKER_HOST: nothing to warn of."""
    podman = tmp_path / "bin" / "podman"
    podman.parent.mkdir()
    podman.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_DOCKER} "$@"\n')
    podman.chmod(0o755)
    docker.image("cuda", GPU_LABELS)
    env = {"NV_HOST": f"127.0.0.1:{agent.port}", "NV_CDI": "no"}
    as_podman = await nvidia_docker(docker, "run", "cuda", NV_DOCKER=str(podman), **env)
    assert as_podman.code == 0, as_podman.stderr
    assert as_podman.stderr == ""
    as_docker = await nvidia_docker(docker, "run", "cuda", **env)
    assert "Warning: NV_HOST is set but DOCKER_HOST is not" in as_docker.stderr


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["help"], []])
async def test_help_says_what_the_wrapper_adds_then_docker_s_help(
    docker: Docker, args: list[str]
) -> None:
    result = await nvidia_docker(docker, *args)
    assert result.code == 0, result.stderr
    ours, _, rest = result.stdout.partition("Docker's own help follows.\n\n")
    assert ours.startswith("nvidia-docker: docker, with GPUs for the containers of images")
    for word in ("NV_GPU", "NV_HOST", "NV_DOCKER", "NV_CDI", "CDI", "docs/nvidia-docker.md"):
        assert word in ours, word
    assert rest.startswith("EXEC ")  # then docker itself, with the same arguments
    assert result.executed == args
    assert (await nvidia_docker(docker, "run", "--help")).stdout.startswith("EXEC ")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NV_HOST": "ftp://10.0.0.1:"}, "invalid remote host URI 'ftp://10.0.0.1:' (NV_HOST)"),
        ({"DOCKER_HOST": "fd://"}, "invalid remote host URI 'fd://' (DOCKER_HOST)"),
    ],
)
async def test_bad_endpoint(docker: Docker, env: dict[str, str], message: str) -> None:
    docker.image("cuda", GPU_LABELS)
    result = await nvidia_docker(docker, "run", "cuda", **env)
    assert result.code == 1
    assert result.executed is None
    assert result.error().startswith(message)
    assert "Traceback" not in result.stderr


async def test_agent_down(docker: Docker) -> None:
    docker.image("cuda", GPU_LABELS)
    # A port bound but never listened on refuses connections, and no other process (another
    # test run on this machine) can start a server there while the test runs.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as down:
        down.bind(("127.0.0.1", 0))
        port = down.getsockname()[1]
        result = await nvidia_docker(
            docker, "run", "cuda", NV_HOST=f"127.0.0.1:{port}", DOCKER_HOST="h:"
        )
    assert result.code == 1
    assert result.executed is None
    assert "(connection refused): is nvidia-docker-plugin running there" in result.error()


PODMAN5_WARNING = (
    'time="2026-12-06T05:23:36Z" level=warning msg="Using cgroups-v1 which is deprecated in '
    'favor of cgroups-v2 with Podman v5 and will be removed in a future version."\n'
)


async def test_a_cli_s_warnings_neither_hide_its_error_nor_break_a_run(
    docker: Docker, agent: Agent
) -> None:
    docker.image("cuda", GPU_LABELS)
    (docker.root / "warning").write_text(PODMAN5_WARNING)
    ran = await nvidia_docker(docker, "run", "cuda", NV_HOST=f"127.0.0.1:{agent.port}")
    assert ran.code == 0, ran.stderr
    assert ran.executed is not None
    assert "--device=/dev/nvidia0" in ran.executed
    (docker.root / "inspect-error").write_text(
        "Error: reading the image store: permission denied\n"
    )
    failed = await nvidia_docker(docker, "run", "cuda", NV_HOST=f"127.0.0.1:{agent.port}")
    assert failed.code == 1
    assert failed.error().endswith(
        "docker image inspect cuda failed: Error: reading the image store: permission denied"
    )


async def test_nv_debug_shows_the_traceback(docker: Docker) -> None:
    docker.image("cuda", GPU_LABELS)
    result = await nvidia_docker(docker, "run", "cuda", NV_HOST="ftp://x", NV_DEBUG="1")
    assert result.code == 1
    assert "Traceback" in result.stderr
    assert ERROR_LINE.match(result.stderr.strip().splitlines()[-1])


async def test_docker_daemon_down(docker: Docker) -> None:
    result = await nvidia_docker(
        docker, "run", "cuda", NV_DOCKER="docker", DOCKER_HOST="unix:///nonexistent.sock"
    )
    assert result.code == 1
    assert "docker image inspect cuda failed: " in result.error()
    # pass-through still works with the daemon down (docker's own answer)
    version = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "controller.wrapper.cli", "--version"],
        env={**os.environ, "PYTHONPATH": str(REPO), "DOCKER_HOST": "unix:///nonexistent.sock"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert version.returncode == 0
    assert version.stdout.startswith("Docker version")


# --- the local node without an agent: NVML read in-process ----------------------------------

# Loaded by the wrapper's interpreter at start (sitecustomize): NVML answers from the real
# one-H200 capture instead of a driver.
FAKE_NVML_SITE = """
from agent.gpu import nvml_query
from tests.unit.gpu.fake_nvml import FakeNvml, load_capture
nvml_query.pynvml = FakeNvml(load_capture("h200")).module
"""


async def test_local_nvml_path_gives_gpus_and_keeps_the_users_environment(
    docker: Docker, tmp_path: Path
) -> None:
    """No agent on localhost:3476: the GPU facts come from NVML in the wrapper's process, and
    docker still receives the user's CUDA_VISIBLE_DEVICES and CUDA_CACHE_DISABLE as given."""
    if port_open(3476, "localhost"):
        pytest.skip("an agent listens on localhost:3476 here: the NVML path would not be taken")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_NVML_SITE)
    capture = load_capture("h200")
    minor = capture["devices"][0]["minor"]
    image = docker.image("cuda", GPU_LABELS)
    result = await nvidia_docker(
        docker,
        "run",
        "-e",
        "CUDA_VISIBLE_DEVICES",
        image,
        "nvidia-smi",
        CUDA_VISIBLE_DEVICES="3",
        CUDA_CACHE_DISABLE="0",
        PYTHONPATH=f"{site}:{REPO}",
    )
    assert result.code == 0, result.stderr
    driver = capture["driver"]
    control = [f"--device={device}" for device in control_devices()]
    assert result.executed is not None
    assert result.executed == [
        "run",
        "--volume-driver=nvidia-docker",
        f"--volume=nvidia_driver_{driver}:/usr/local/nvidia:ro",
        *control,
        f"--device=/dev/nvidia{minor}",
        "-e",
        "CUDA_VISIBLE_DEVICES",
        "cuda",
        "nvidia-smi",
    ]
    assert result.cuda_environment == {"CUDA_VISIBLE_DEVICES": "3", "CUDA_CACHE_DISABLE": "0"}


async def test_local_nvml_path_unknown_gpu_and_volume(docker: Docker, tmp_path: Path) -> None:
    """NV_GPU and the image's volume label are told apart when the local node refuses them."""
    if port_open(3476, "localhost"):
        pytest.skip("an agent listens on localhost:3476 here: the NVML path would not be taken")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_NVML_SITE)
    image = docker.image("cuda", GPU_LABELS)
    gpu = await nvidia_docker(docker, "run", image, NV_GPU="5", PYTHONPATH=f"{site}:{REPO}")
    assert gpu.code == 1
    assert gpu.error().startswith("NV_GPU names an unknown GPU: 5 (this node has GPUs 0 to 0;")
    odd = docker.image("odd", {"com.nvidia.volumes.needed": "nvidia_driver nvidia_extra"})
    vol = await nvidia_docker(docker, "run", odd, PYTHONPATH=f"{site}:{REPO}")
    assert vol.code == 1
    assert vol.error().startswith(
        "the image's label com.nvidia.volumes.needed names an unknown volume: nvidia_extra"
    )


# --- speed: the pass-through imports nothing heavy ------------------------------------------


def test_pass_through_imports_nothing_heavy() -> None:
    probe = (
        "import os, sys\n"
        "before = set(sys.modules)\n"
        "from controller.wrapper import cli as wrapper\n"
        "os.execvp = lambda *a: (_ for _ in ()).throw(SystemExit(0))\n"
        "for args in (['ps'], ['inspect', 'x'], ['logs', 'x'], ['stop', 'x'], ['rm', 'x'],"
        " ['--version'], ['version']):\n"
        "    try:\n"
        "        wrapper.main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ('aiohttp', 'paramiko', 'pynvml', 'click', 'asyncio', 'json', 'dataclasses',"
        " 'controller.wrapper.gpu_args', 'controller.wrapper.engine_cdi',"
        " 'controller.transport.client', 'subprocess', 'enum', 're', 'socket')\n"
        "new = set(sys.modules) - before\n"
        "sys.stderr.write(repr(sorted(m for m in new if m.split('.')[0] in heavy or m in heavy)))"
        "\n"
    )
    done = subprocess.run(  # -S: nothing imported before (site may import enum and re)
        [sys.executable, "-S", "-c", probe],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stderr == "[]"


# --- CDI: engines that read CDI specs get --device=nvidia.com/gpu=<UUID> ---------------------

PODMAN: dict[str, object] = {
    "Client": {"APIVersion": "4.3.1", "Version": "4.3.1", "OsArch": "linux/amd64"}
}
DOCKER_28: dict[str, dict[str, str]] = {
    "Client": {"Version": "28.2.2", "ApiVersion": "1.50", "Os": "linux", "Arch": "amd64"},
    "Server": {"Version": "28.2.2", "ApiVersion": "1.50"},
}
VERSION_PROBE = ["version", "--format", "{{json .}}"]
INFO_PROBE = ["info", "--format", "{{json .CDISpecDirs}}"]
CDI_ARGS = [f"--device=nvidia.com/gpu={uuid}" for uuid in UUIDS]


async def run_gpu_image(docker: Docker, agent: Agent, **env: str) -> Result:
    docker.image("nvidia/cuda:12.4", GPU_LABELS)
    return await nvidia_docker(
        docker,
        "run",
        "--rm",
        "nvidia/cuda:12.4",
        "nvidia-smi",
        NV_HOST=f"http://127.0.0.1:{agent.port}:",
        DOCKER_HOST="tcp://127.0.0.1:2375",
        **env,
    )


async def test_podman_gets_cdi_devices_by_uuid(docker: Docker, agent: Agent) -> None:
    docker.engine(PODMAN)
    result = await run_gpu_image(docker, agent)
    assert result.code == 0, result.stderr
    assert result.executed == ["run", *CDI_ARGS, "--rm", "nvidia/cuda:12.4", "nvidia-smi"]
    assert result.stderr == ""
    assert agent.queries == [{"vol": "nvidia_driver", "dev": "", "format": "cdi"}]
    probes = [call for call in docker.calls() if call[:1] in (["version"], ["info"])]
    assert probes == [VERSION_PROBE]  # Podman: one cheap question


async def test_nv_gpu_selects_cdi_devices(docker: Docker, agent: Agent) -> None:
    docker.engine(PODMAN)
    result = await run_gpu_image(docker, agent, NV_GPU="1")
    assert result.executed == ["run", CDI_ARGS[1], "--rm", "nvidia/cuda:12.4", "nvidia-smi"]


@pytest.mark.parametrize(
    ("dirs", "cdi"), [(["/etc/cdi", "/var/run/cdi"], True), ([], False), (None, False)]
)
async def test_docker_25_and_later_reads_cdi_when_its_engine_lists_spec_dirs(
    docker: Docker, agent: Agent, dirs: list[str] | None, cdi: bool
) -> None:
    docker.engine(DOCKER_28, dirs)
    result = await run_gpu_image(docker, agent)
    assert result.executed is not None
    assert (result.executed[1] == CDI_ARGS[0]) is cdi
    probes = [call for call in docker.calls() if call[:1] in (["version"], ["info"])]
    assert probes == [VERSION_PROBE, INFO_PROBE]


async def test_docker_20_10_gets_the_volume_form_after_one_question(
    docker: Docker, agent: Agent
) -> None:
    result = await run_gpu_image(docker, agent)  # the fake's default engine: Docker 20.10
    assert result.executed is not None
    assert result.executed[1] == "--volume-driver=nvidia-docker"
    probes = [call for call in docker.calls() if call[:1] in (["version"], ["info"])]
    assert probes == [VERSION_PROBE]
    assert "format" not in agent.queries[0]


@pytest.mark.parametrize(("value", "cdi"), [("yes", True), ("no", False), ("1", True)])
async def test_nv_cdi_decides_without_asking(
    docker: Docker, agent: Agent, value: str, cdi: bool
) -> None:
    result = await run_gpu_image(docker, agent, NV_CDI=value)
    assert result.executed is not None
    assert (result.executed[1] == CDI_ARGS[0]) is cdi
    assert [c for c in docker.calls() if c[:1] in (["version"], ["info"])] == []


async def test_a_bad_nv_cdi_is_one_line(docker: Docker, agent: Agent) -> None:
    result = await run_gpu_image(docker, agent, NV_CDI="maybe")
    assert result.code == 1
    assert result.error() == (
        "NV_CDI='maybe' cannot be used: give yes, no or auto (or unset it to ask the engine)"
    )


async def test_an_agent_without_a_spec_gives_the_volume_form_and_a_warning(
    docker: Docker, agent: Agent
) -> None:
    docker.engine(PODMAN)
    agent.cdi = False
    result = await run_gpu_image(docker, agent)
    assert result.executed is not None
    assert result.executed[1] == "--volume-driver=nvidia-docker"
    (line,) = result.stderr.strip().splitlines()
    assert "Warning: the engine reads CDI but the agent of http://127.0.0.1" in line
    assert "writes no CDI spec: using the volume form" in line


async def test_an_agent_that_predates_cdi_gives_the_volume_form(
    docker: Docker, agent: Agent
) -> None:
    docker.engine(PODMAN)
    agent.old = True  # nvidia-docker-plugin 1.0.1 ignores format=cdi
    result = await run_gpu_image(docker, agent)
    assert result.executed is not None
    assert result.executed[1] == "--volume-driver=nvidia-docker"
    assert "predates CDI: using the volume form" in result.stderr


async def test_an_unlabelled_image_runs_unchanged_without_asking_the_engine(
    docker: Docker,
) -> None:
    docker.engine(PODMAN)
    docker.image("busybox", {"maintainer": "x"})
    result = await nvidia_docker(docker, "run", "--rm", "busybox", "true")
    assert result.executed == ["run", "--rm", "busybox", "true"]
    assert [c for c in docker.calls() if c[:1] in (["version"], ["info"])] == []


async def test_nv_debug_says_what_the_engine_check_found_and_cost(
    docker: Docker, agent: Agent
) -> None:
    docker.engine(PODMAN)
    result = await run_gpu_image(docker, agent, NV_DEBUG="1")
    assert re.search(
        r"^nvidia-docker \| engine: Podman 4\.3\.1, CDI: yes \(Podman reads CDI; asked in "
        r"\d+\.\d ms: docker version\)$",  # what it cost, and whom it asked
        result.stderr,
        flags=re.MULTILINE,
    )


@pytest.mark.parametrize(
    "version",
    [
        {"Client": {"Version": "3.4.4", "OsArch": "linux/amd64"}},  # Podman before CDI
        {"Client": DOCKER_28["Client"], "Server": None},  # the daemon does not answer
        {"unexpected": True},
    ],
)
async def test_engines_that_cannot_read_cdi_get_the_volume_form(
    docker: Docker, agent: Agent, version: dict[str, object]
) -> None:
    docker.engine(version)
    result = await run_gpu_image(docker, agent)
    assert result.executed is not None
    assert result.executed[1] == "--volume-driver=nvidia-docker"
