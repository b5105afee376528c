"""``nvidia-docker`` end to end: the real docker CLI and a private dockerd, real agent processes
(simulated GPUs, fake driver root, the volume plugin), and a real OpenSSH sshd.

This machine has no GPU, so ``/dev/nvidia*`` do not exist; docker's ``--device`` needs the
host node to exist, so a module fixture makes character device nodes with the real numbers
(195:N, 195:255 for nvidiactl) for the names that are missing, and removes exactly those
afterwards, under a machine-wide lock. Nothing opens them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.certs import make_pki
from tests.support.device_nodes import nvidia_nodes, wanted_nodes
from tests.support.dockerd import DockerEngine
from tests.support.fake_driver import FakeDriver
from tests.support.local_agent import local_agent_port as local_port
from tests.support.plugin_agent import PluginAgent
from tests.support.services import (
    free_port,
    listens_on,
    stop_process,
    wait_until,
)
from tests.support.sshd import SshServer, start_sshd, stop_sshd
from tests.support.wrapper import wrapper_command

# Above pyproject's 60 s: the first test may wait for another test run on this machine to
# give back the device nodes or port 3476 (machine-wide locks, held for a module's run).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
GPU_LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}
ERROR_PREFIX = "nvidia-docker | "


@pytest.fixture(scope="module")
def nvidia_devices() -> Iterator[None]:
    """Character device nodes /dev/nvidia0..7, nvidiactl, nvidia-uvm where missing."""
    with nvidia_nodes(wanted_nodes(range(8))):
        yield


@pytest.fixture(scope="module")
def images(docker_engine: DockerEngine) -> dict[str, str]:
    return {
        "gpu": docker_engine.import_busybox("nvd-wrapper/cuda:12.4", GPU_LABELS),
        "plain": docker_engine.import_busybox("nvd-wrapper/plain", {"maintainer": "tests"}),
        "future": docker_engine.import_busybox(
            "nvd-wrapper/cuda:99.0",
            {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "99.0"},
        ),
    }


@dataclass
class Agent:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def _agent(driver: FakeDriver, simulate: str, port: int, *extra: str) -> Iterator[Agent]:
    """A REST-only agent process (its plugin socket is private: dockerd uses plugin_agent's)."""
    base = Path(tempfile.mkdtemp(prefix="nvd-wrapper-agent-"))
    log = base / "agent.log"
    env = {**os.environ, "PATH": driver.search_path, "PYTHONPATH": str(REPO)}
    env.pop("NV_DEBUG", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "agent.daemon",
                "-l", f"127.0.0.1:{port}",
                "-s", str(base / "plugins"),
                "-d", str(base / "volumes"),
                "--simulate", simulate,
                "--ldcache", str(driver.ldcache), *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    try:
        wait_until(
            lambda: listens_on(proc.pid, port), what=f"agent (log: {log})", timeout_s=60, proc=proc
        )
        yield Agent(port, proc, log)
    finally:
        stop_process(proc)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def hgx_agent(fake_driver: FakeDriver) -> Iterator[Agent]:
    """An agent with eight simulated H200s."""
    with _agent(fake_driver, "hgx-h200-8", free_port()) as agent:
        yield agent


@pytest.fixture
def local_agent_port() -> Iterator[int]:
    """Port 3476 of this machine, for this test only (``tests.support.local_agent``)."""
    with local_port() as port:
        yield port


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    argv: list[str] | None  # what docker was exec'd with (recording NV_DOCKER), if it was

    def error_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1, self.stderr
        assert lines[0].startswith(ERROR_PREFIX), lines[0]
        assert " Error: " in lines[0]
        return lines[0].split(" Error: ", 1)[1]


def _run_wrapper(
    args: tuple[str, ...], environ: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``nvidia-docker ARGS`` as installed, in ``environ``, its outputs captured."""
    return subprocess.run(
        [*wrapper_command(), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def nvidia_docker(engine: DockerEngine, tmp_path: Path, *args: str, **env: str) -> Result:
    """Run the wrapper with NV_DOCKER recording the final argv, then exec'ing real docker."""
    record = tmp_path / f"argv-{time.monotonic_ns()}"
    recorder = tmp_path / "record-docker"
    if not recorder.exists():
        # The wrapper's own questions (image and volume inspect, the engine's CDI check:
        # version/info --format) are not what it finally executes: not recorded.
        recorder.write_text(
            "#!/bin/sh\n"
            'case "$1 $2" in image\\ *|volume\\ *|"version --format"|"info --format") ;;\n'
            '*) [ -n "$NVD_RECORD" ] && printf \'%s\\0\' "$@" > "$NVD_RECORD";;\nesac\n'
            'exec docker "$@"\n'
        )
        recorder.chmod(0o755)
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NV_", "DOCKER_")) and k != "SSH_AUTH_SOCK"
    }
    environ.update(
        DOCKER_HOST=engine.host,
        NV_DOCKER=str(recorder),
        NVD_RECORD=str(record),
        PYTHONPATH=str(REPO),
    )
    environ.update(env)
    done = _run_wrapper(args, environ)
    argv = record.read_text().split("\0")[:-1] if record.exists() else None
    return Result(done.returncode, done.stdout, done.stderr, argv)


def containers(engine: DockerEngine) -> list[str]:
    return engine.docker("ps", "-aq").stdout.split()


def gpu_args_of(argv: list[str], after: int) -> list[str]:
    """The arguments the wrapper inserted at ``after``."""
    out = []
    for arg in argv[after:]:
        if not arg.startswith(("--volume-driver=", "--volume=nvidia_driver", "--device=/dev/nv")):
            break
        out.append(arg)
    return out


# --- working runs -------------------------------------------------------------------------


def test_local_node(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    fake_driver: FakeDriver,
    nvidia_devices: None,
    images: dict[str, str],
    local_agent_port: int,
    tmp_path: Path,
) -> None:
    with _agent(fake_driver, "h200", local_agent_port):
        first = nvidia_docker(
            docker_engine, tmp_path, "run", "--rm", images["gpu"], "ls", "/usr/local/nvidia/lib64"
        )
        assert first.code == 0, first.stderr
        assert "libcuda.so.580.159.04" in first.stdout.split()
        assert first.argv is not None
        volume = "--volume=nvidia_driver_580.159.04:/usr/local/nvidia:ro"
        # the volume now exists: the second run names it without the volume driver
        second = nvidia_docker(
            docker_engine, tmp_path, "run", "--rm", images["gpu"], "ls", "/usr/local/nvidia/lib64"
        )
        assert second.code == 0, second.stderr
        assert second.argv is not None
        assert gpu_args_of(second.argv, 1) == [
            volume,
            "--device=/dev/nvidiactl",
            "--device=/dev/nvidia-uvm",
            "--device=/dev/nvidia0",
        ]
        assert second.stdout == first.stdout


def test_local_node_without_agent_or_nvml(
    docker_engine: DockerEngine, images: dict[str, str], local_agent_port: int, tmp_path: Path
) -> None:
    before = containers(docker_engine)
    result = nvidia_docker(docker_engine, tmp_path, "run", "--rm", images["gpu"], "true")
    assert result.code == 1
    message = result.error_line()
    assert message.startswith("no GPU facts: no agent answers on localhost:3476")
    # what a wrapper user can do; not the daemon's own --simulate FILE
    assert message.endswith(
        "start the agent on this node (nvidia-docker-plugin), or name a GPU node's agent in "
        "NV_HOST (e.g. NV_HOST=ssh://user@gpu-node:)"
    )
    assert "--simulate" not in message
    assert containers(docker_engine) == before


def test_http_node(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    nvidia_devices: None,
    images: dict[str, str],
    tmp_path: Path,
) -> None:
    result = nvidia_docker(
        docker_engine,
        tmp_path,
        "run",
        "--rm",
        images["gpu"],
        "ls",
        "/usr/local/nvidia/lib64",
        NV_HOST=f"http://127.0.0.1:{plugin_agent.port}:",
    )
    assert result.code == 0, result.stderr
    assert "libcuda.so.580.159.04" in result.stdout.split()
    assert result.argv is not None
    assert gpu_args_of(result.argv, 1)[0] == "--volume-driver=nvidia-docker"  # the agent's answer


def test_ssh_node(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    sshd_server: SshServer,
    nvidia_devices: None,
    images: dict[str, str],
    tmp_path: Path,
) -> None:
    home = sshd_server.client_home(tmp_path / "home")
    result = nvidia_docker(
        docker_engine,
        tmp_path,
        "run",
        "--rm",
        images["gpu"],
        "ls",
        "/usr/local/nvidia/lib64",
        HOME=str(home),
        NV_HOST=f"ssh://{sshd_server.user}@127.0.0.1:{sshd_server.port}:{plugin_agent.port}",
    )
    assert result.code == 0, result.stderr
    assert "libcuda.so.580.159.04" in result.stdout.split()


def test_https_node_with_client_certificate_and_token(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    fake_driver: FakeDriver,
    nvidia_devices: None,
    images: dict[str, str],
    tmp_path: Path,
) -> None:
    """The agent serves TLS with mutual TLS and a token; the wrapper runs a real container."""
    pki = make_pki(tmp_path / "pki")
    token = tmp_path / "token"
    token.write_text("wrapper-test-token-0123456789\n")
    token.chmod(0o600)
    tls_args = (
        "--tls-cert", str(pki.pem("server")), "--tls-key", str(pki.key("server")),
        "--tls-client-ca", str(pki.pem("ca")), "--token-file", str(token),
    )  # fmt: skip
    client = {
        "NV_TLS_CA": str(pki.pem("ca")),
        "NV_TLS_CERT": str(pki.pem("client")),
        "NV_TLS_KEY": str(pki.key("client")),
        "NV_TOKEN_FILE": str(token),
    }
    with _agent(fake_driver, "h200", free_port(), *tls_args) as agent:
        nv_host = f"https://127.0.0.1:{agent.port}"
        result = nvidia_docker(
            docker_engine, tmp_path, "run", "--rm", images["gpu"], "ls", "/usr/local/nvidia/lib64",
            NV_HOST=nv_host, **client,
        )  # fmt: skip
        assert result.code == 0, result.stderr
        assert "libcuda.so.580.159.04" in result.stdout.split()
        assert result.argv is not None
        assert "--device=/dev/nvidia0" in gpu_args_of(result.argv, 1)

        before = containers(docker_engine)
        wrong = tmp_path / "wrong-token"
        wrong.write_text("not-the-agents-token-0123456789\n")
        refused = nvidia_docker(
            docker_engine, tmp_path, "run", "--rm", images["gpu"], "true",
            NV_HOST=nv_host, **{**client, "NV_TOKEN_FILE": str(wrong)},
        )  # fmt: skip
        assert refused.code == 1
        assert f"the agent refused the token of {wrong} (401" in refused.error_line()
        untrusted = nvidia_docker(
            docker_engine, tmp_path, "run", "--rm", images["gpu"], "true",
            NV_HOST=nv_host, **{**client, "NV_TLS_CA": str(pki.pem("other-ca"))},
        )  # fmt: skip
        assert untrusted.code == 1
        assert "the agent's certificate is not trusted" in untrusted.error_line()
        assert refused.argv is None
        assert untrusted.argv is None
        assert containers(docker_engine) == before


def test_docker_context_over_ssh_resolves_to_its_node(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    fake_driver: FakeDriver,
    nvidia_devices: None,
    images: dict[str, str],
    local_agent_port: int,
    tmp_path: Path,
) -> None:
    """``nvidia-docker --context gpu-node run``: docker reaches its daemon over SSH through the
    context, and the wrapper asks the agent of that same node (its localhost:3476) through
    SSH, both through the ``Host gpu-node`` alias of the user's ``~/.ssh/config``."""
    server, proc = start_sshd(tmp_path, extra_config=(f"SetEnv DOCKER_HOST={docker_engine.host}",))
    try:
        home = server.client_home(tmp_path / "home")
        ssh_dir = home / ".ssh"
        (ssh_dir / "config").write_text(
            f"Host gpu-node\n  HostName 127.0.0.1\n  Port {server.port}\n  User {server.user}\n"
        )
        # OpenSSH's ssh reads the passwd entry's home, not $HOME: a shim gives docker's ssh
        # the same files the user's own ~/.ssh would hold
        shims = tmp_path / "bin"
        shims.mkdir()
        (shims / "ssh").write_text(
            "#!/bin/sh\n"
            f'exec /usr/bin/ssh -F "{ssh_dir}/config" -o "UserKnownHostsFile={ssh_dir}/known_hosts"'
            f' -i "{ssh_dir}/id_ed25519" -o BatchMode=yes "$@"\n'
        )
        (shims / "ssh").chmod(0o755)
        docker_config = tmp_path / "docker-config"
        env = {
            "HOME": str(home),
            "DOCKER_CONFIG": str(docker_config),
            "DOCKER_HOST": "",
            "PATH": f"{shims}:{os.environ['PATH']}",
        }
        subprocess.run(
            ["docker", "context", "create", "gpu-node", "--docker", "host=ssh://gpu-node"],
            env={**os.environ, **env},
            check=True,
            capture_output=True,
            timeout=60,
        )
        logins_before = server.log.read_text(errors="replace").count("Accepted publickey")
        with _agent(fake_driver, "h200", local_agent_port):
            result = nvidia_docker(
                docker_engine, tmp_path, "--context", "gpu-node", "run", "--rm", images["gpu"],
                "ls", "/usr/local/nvidia/lib64", **env,
            )  # fmt: skip
        assert result.code == 0, result.stderr
        assert "libcuda.so.580.159.04" in result.stdout.split()
        assert result.stderr == ""  # the context is docker's address: no NV_HOST warning
        assert result.argv is not None
        assert "--device=/dev/nvidia0" in gpu_args_of(result.argv, 3)
        # docker's logins and the wrapper's own, all to the node's sshd
        log = server.log.read_text(errors="replace")
        assert log.count("Accepted publickey") >= logins_before + 2
    finally:
        stop_sshd(server, proc)


def _nvidia_nodes(listing: str) -> list[str]:
    return sorted(name for name in listing.split() if name.startswith("nvidia"))


def test_nv_gpu_by_index_and_uuid_prefix(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    hgx_agent: Agent,
    nvidia_devices: None,
    images: dict[str, str],
    tmp_path: Path,
) -> None:
    nv_host = f"http://127.0.0.1:{hgx_agent.port}"
    every = nvidia_docker(
        docker_engine, tmp_path, "run", "--rm", images["gpu"], "ls", "/dev", NV_HOST=nv_host
    )
    assert every.code == 0, every.stderr
    assert _nvidia_nodes(every.stdout) == sorted(
        [f"nvidia{i}" for i in range(8)] + ["nvidia-uvm", "nvidiactl"]
    )
    by_index = nvidia_docker(
        docker_engine, tmp_path, "run", "--rm", images["gpu"], "ls", "/dev",
        NV_HOST=nv_host, NV_GPU="6,1",
    )  # fmt: skip
    assert by_index.code == 0, by_index.stderr
    assert _nvidia_nodes(by_index.stdout) == ["nvidia-uvm", "nvidia1", "nvidia6", "nvidiactl"]

    info = json.loads(
        subprocess.run(
            ["curl", "-sf", f"{nv_host}/gpu/info/json"], capture_output=True, check=True
        ).stdout
    )
    prefix = info["Devices"][3]["UUID"][:13]  # "GPU-" + 9 characters
    by_uuid = nvidia_docker(
        docker_engine, tmp_path, "run", "--rm", images["gpu"], "ls", "/dev",
        NV_HOST=nv_host, NV_GPU=f"{prefix} 0",
    )  # fmt: skip
    assert by_uuid.code == 0, by_uuid.stderr
    assert _nvidia_nodes(by_uuid.stdout) == ["nvidia-uvm", "nvidia0", "nvidia3", "nvidiactl"]


def test_image_without_label_is_unchanged(
    docker_engine: DockerEngine, images: dict[str, str], tmp_path: Path
) -> None:
    args = ["run", "--rm", "-e", "X=1", images["plain"], "sh", "-c", "echo $X; ls /usr/local"]
    # no agent anywhere: the label alone decides that none is needed
    result = nvidia_docker(docker_engine, tmp_path, *args, NV_HOST=f"127.0.0.1:{free_port()}")
    assert result.code == 0, result.stderr
    assert result.argv == args
    assert result.stdout.split() == ["1"]  # /usr/local is empty: no driver volume


def test_newer_cuda_is_refused_before_any_container(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    images: dict[str, str],
    tmp_path: Path,
) -> None:
    before = containers(docker_engine)
    result = nvidia_docker(
        docker_engine, tmp_path, "run", "--name", "nvd-too-new", images["future"], "true",
        NV_HOST=f"http://127.0.0.1:{plugin_agent.port}",
    )  # fmt: skip
    assert result.code == 1
    assert result.error_line() == "unsupported CUDA version: driver 13.0 < image 99.0"
    assert result.argv is None
    assert containers(docker_engine) == before


def test_mesos_command_line(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    nvidia_devices: None,
    images: dict[str, str],
    tmp_path: Path,
) -> None:
    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    (sandbox / "task.txt").write_text("from the sandbox\n")
    socket_path = docker_engine.host
    args = [
        "-H", socket_path, "run",
        "--cpu-shares", "1024", "--memory", "256m", "-e", "A=B",
        "-v", f"{sandbox}:/mnt/mesos/sandbox", "--net", "host",
        "--entrypoint", "/bin/sh", "--name", "mesos-abc", images["gpu"],
        "-c", "echo A=$A; cat /mnt/mesos/sandbox/task.txt; ls /usr/local/nvidia/lib64; ls /dev",
    ]  # fmt: skip
    try:
        result = nvidia_docker(
            docker_engine, tmp_path, *args,
            NV_HOST=f"http://127.0.0.1:{plugin_agent.port}", DOCKER_HOST="",
        )  # fmt: skip
        assert result.code == 0, result.stderr
        assert result.stderr == ""  # -H counts as the docker address: no warning
        assert result.argv is not None
        inserted = gpu_args_of(result.argv, 3)
        assert inserted == [
            "--volume-driver=nvidia-docker",
            "--volume=nvidia_driver_580.159.04:/usr/local/nvidia:ro",
            "--device=/dev/nvidiactl",
            "--device=/dev/nvidia-uvm",
            "--device=/dev/nvidia0",
        ]
        assert result.argv == [*args[:3], *inserted, *args[3:]]
        out = result.stdout.split()
        assert out[:4] == ["A=B", "from", "the", "sandbox"]
        assert "libcuda.so.580.159.04" in out
        assert {"nvidia0", "nvidiactl", "nvidia-uvm"} <= set(out)
        state = json.loads(docker_engine.docker("inspect", "mesos-abc").stdout)[0]
        assert state["Config"]["Entrypoint"] == ["/bin/sh"]
        assert state["HostConfig"]["CpuShares"] == 1024
        assert state["HostConfig"]["Memory"] == 256 * 1024 * 1024
        assert state["HostConfig"]["NetworkMode"] == "host"
    finally:
        docker_engine.docker("rm", "-f", "mesos-abc", check=False)


# --- bad input: one line, exit 1, no traceback, no container ----------------------------------


@pytest.mark.parametrize("case", ["malformed", "unknown_gpu", "agent_down", "ssh_refused",
                                  "unknown_host_key"])  # fmt: skip
def test_bad_input(
    case: str,
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    sshd_server: SshServer,
    images: dict[str, str],
    tmp_path: Path,
) -> None:
    ssh = f"ssh://{sshd_server.user}@127.0.0.1"
    env, expected = {
        "malformed": (
            {"NV_HOST": "ssh://user@10.0.0.1:22:80:90"},
            "invalid remote host URI 'ssh://user@10.0.0.1:22:80:90' (NV_HOST): at most two",
        ),
        "unknown_gpu": (
            {"NV_HOST": f"127.0.0.1:{plugin_agent.port}", "NV_GPU": "0,5"},
            "NV_GPU names an unknown GPU: 5 (",
        ),
        "agent_down": (
            {"NV_HOST": f"http://127.0.0.1:{free_port()}"},
            "(connection refused): is nvidia-docker-plugin running there",
        ),
        "ssh_refused": (
            {"NV_HOST": f"{ssh}:{free_port()}:{plugin_agent.port}"},
            "refused: is sshd running on the node",
        ),
        "unknown_host_key": (
            {"NV_HOST": f"{ssh}:{sshd_server.port}:{plugin_agent.port}"},
            "unknown SSH host key ssh-ed25519 SHA256:",
        ),
    }[case]
    home = sshd_server.client_home(tmp_path / "home", knows_host=False)
    before = containers(docker_engine)
    result = nvidia_docker(
        docker_engine, tmp_path, "run", "--rm", images["gpu"], "true", HOME=str(home), **env
    )
    assert result.code == 1
    assert expected in result.error_line()
    assert "Traceback" not in result.stderr
    assert result.argv is None
    assert containers(docker_engine) == before


def test_wrong_password_on_a_terminal(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    sshd_server: SshServer,
    images: dict[str, str],
    tmp_path: Path,
) -> None:
    """No key anywhere: the wrapper asks for a password on its terminal (a pty here)."""
    home = sshd_server.client_home(tmp_path / "home", with_key=False)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NV_", "DOCKER_")) and k != "SSH_AUTH_SOCK"
    }
    env.update(
        HOME=str(home),
        DOCKER_HOST=docker_engine.host,
        PYTHONPATH=str(REPO),
        NV_HOST=f"ssh://{sshd_server.user}@127.0.0.1:{sshd_server.port}:{plugin_agent.port}",
    )
    before = containers(docker_engine)
    master, slave = pty.openpty()

    def controlling_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [*wrapper_command(), "run", "--rm", images["gpu"], "true"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        preexec_fn=controlling_terminal,  # noqa: PLW1509 (a test: the child needs a tty)
    )
    os.close(slave)
    output = b""
    answered = False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            if not answered and b"password: " in output:
                os.write(master, b"certainly-not-the-password\n")
                answered = True
            if proc.poll() is not None and not ready:
                break
        code = proc.wait(timeout=30)
    finally:
        stop_process(proc)
        os.close(master)
    text = output.decode(errors="replace")
    assert answered, text
    assert f"{sshd_server.user}@127.0.0.1's password: " in text
    assert code == 1
    lines = [line for line in text.replace("\r", "").splitlines() if line.strip()]
    assert lines[-1].startswith(ERROR_PREFIX)
    assert "SSH login failed: wrong password" in lines[-1]
    assert "Traceback" not in text
    assert containers(docker_engine) == before


# --- the engine's own socket: the CLI's answers without starting it -------------------------


def plain_docker(engine: DockerEngine, tmp_path: Path, *args: str, **env: str) -> Result:
    """The wrapper as most users run it: NV_DOCKER unset, the docker CLI on PATH, the engine
    on a unix socket; it asks that socket itself (controller.wrapper.engine_api)."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NV_", "DOCKER_")) and k != "SSH_AUTH_SOCK"
    }
    environ.update(DOCKER_HOST=engine.host, PYTHONPATH=str(REPO), HOME=str(tmp_path))
    environ.update(env)
    done = _run_wrapper(args, environ)
    return Result(done.returncode, done.stdout, done.stderr, None)


def _asked(result: Result) -> str:
    """Who told the image's labels (the NV_DEBUG line)."""
    lines = [line for line in result.stderr.splitlines() if "'s labels from " in line]
    assert len(lines) == 1, result.stderr
    return lines[0].split("'s labels from ", 1)[1].split(" (in ", 1)[0]


def _engine_line(result: Result) -> str:
    """The NV_DEBUG line of the CDI question, without its time and whom it asked."""
    lines = [line for line in result.stderr.splitlines() if "| engine: " in line]
    return lines[0].split("; asked in ")[0] if lines else ""


def _engine_asked(result: Result) -> str:
    """Whom the CDI question asked (the end of its NV_DEBUG line)."""
    lines = [line for line in result.stderr.splitlines() if "| engine: " in line]
    return lines[0].split(" ms: ", 1)[1].removesuffix(")") if lines else ""


def test_the_engine_s_socket_tells_the_labels_the_cli_would(
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    nvidia_devices: None,
    images: dict[str, str],
    tmp_path: Path,
) -> None:
    node = {"NV_HOST": f"http://127.0.0.1:{plugin_agent.port}", "NV_DEBUG": "1"}
    socket_path = docker_engine.host.removeprefix("unix://")
    for image, listing, expected in [
        (images["gpu"], "/usr/local/nvidia/lib64", "libcuda.so.580.159.04"),
        (images["gpu"], "/dev", "nvidia0"),
        (images["plain"], "/usr/local", None),  # no label: no GPU, an empty /usr/local
    ]:
        args = ["run", "--rm", image, "ls", listing]
        by_cli = nvidia_docker(docker_engine, tmp_path, *args, **node)
        by_engine = plain_docker(docker_engine, tmp_path, *args, **node)
        assert by_cli.code == by_engine.code == 0, (by_cli.stderr, by_engine.stderr)
        assert by_engine.stdout == by_cli.stdout
        assert (expected in by_engine.stdout.split()) if expected else not by_engine.stdout
        assert _asked(by_cli) == "docker image inspect"
        assert _asked(by_engine) == f"the engine's API on {socket_path}"
        # NV_CDI unset: the engine's version from its socket, the same answer as the CLI's;
        # dockerd 20.10 is older than CDI, so its GET /_ping is the whole question
        assert _engine_line(by_engine) == _engine_line(by_cli)
        assert bool(_engine_line(by_engine)) is (image == images["gpu"])  # GPUs wanted: asked
        if image == images["gpu"]:
            assert _engine_line(by_engine).endswith("CDI: no (Docker reads CDI from 25.0 on")
            assert (_engine_asked(by_engine), _engine_asked(by_cli)) == (
                "GET /_ping",
                "docker version",
            )


@pytest.mark.parametrize("case", ["missing", "missing_pull_never", "bad_name", "engine_down"])
def test_the_engine_s_socket_fails_in_the_cli_s_words(
    case: str,
    docker_engine: DockerEngine,
    plugin_agent: PluginAgent,
    tmp_path: Path,
) -> None:
    env = {"NV_HOST": f"http://127.0.0.1:{plugin_agent.port}"}
    args = {
        "missing": ["run", "--rm", "nvd-wrapper/absent:1", "true"],
        "missing_pull_never": ["run", "--pull", "never", "--rm", "nvd-wrapper/absent:1", "true"],
        "bad_name": ["run", "--rm", "Nvd-Wrapper/Upper:1", "true"],
        "engine_down": ["run", "--rm", "nvd-wrapper/cuda:12.4", "true"],
    }[case]
    if case == "engine_down":
        env["DOCKER_HOST"] = f"unix://{tmp_path}/no-engine.sock"
    before = containers(docker_engine)
    by_cli = nvidia_docker(docker_engine, tmp_path, *args, **env)
    by_engine = plain_docker(docker_engine, tmp_path, *args, **env)
    assert by_engine.code == by_cli.code != 0
    if case == "missing_pull_never":  # docker runs and says it itself
        assert by_engine.code == 125
        assert by_engine.stderr == by_cli.stderr
        assert "No such image: nvd-wrapper/absent:1" in by_engine.stderr
    else:  # the wrapper's one line (after what a failed pull printed itself)
        said = _last_error(by_engine)
        assert said == _last_error(by_cli), (by_engine.stderr, by_cli.stderr)
        assert said.startswith(
            "cannot pull the image " if case != "engine_down" else "docker image inspect "
        )
    assert containers(docker_engine) == before


def _last_error(result: Result) -> str:
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(ERROR_PREFIX), result.stderr
    return last.split(" Error: ", 1)[1]


def test_the_engine_s_socket_knows_its_volumes(docker_engine: DockerEngine, tmp_path: Path) -> None:
    from controller.wrapper.engine_api import volume_exists  # noqa: PLC0415

    socket_path = docker_engine.host.removeprefix("unix://")
    name = f"nvd-wrapper-{tmp_path.name[-12:]}".lower()
    assert volume_exists(socket_path, name) is False
    docker_engine.docker("volume", "create", name)
    try:
        assert volume_exists(socket_path, name) is True
    finally:
        docker_engine.docker("volume", "rm", name)
    assert volume_exists(f"{tmp_path}/no-engine.sock", name) is None
