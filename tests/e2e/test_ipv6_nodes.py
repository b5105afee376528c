"""A real agent reached at IPv6 addresses: ``[::1]``, and a link-local address
with its zone, as ``ip`` writes it (``[fe80::...%lo]``) and as RFC 6874 writes it in URLs
(``[fe80::...%25lo]``), a URL's trailing ``/`` included. Through what users run:
``nvidia-docker`` (plain HTTP, HTTPS), ``nvidia-docker-ctl info`` (the fleet client: HTTP,
HTTPS, and SSH through a real sshd) and ``nvidia-docker-ctl mesos flags`` (aiohttp).

The link-local address is the tests' own, added to the loopback interface for the module
(``fe80::d0c:3476%lo``), so the traffic stays on this machine whatever its network; the
link-local agents listen on it alone, their zone in ``-l``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess, running_agent
from tests.support.certs import Pki, make_pki
from tests.support.prerequisites import require_command, require_root
from tests.support.services import free_port
from tests.support.sshd import SshServer, start_sshd, stop_sshd

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
FAKE_DOCKER = REPO / "tests" / "unit" / "controller" / "fake_docker.py"
GPU_LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}
LINK_LOCAL = "fe80::d0c:3476"  # the tests' own link-local address, on the loopback interface


@dataclass(frozen=True)
class LinkLocal:
    address: str  # fe80::d0c:3476
    interface: str  # lo

    def host(self, spelling: str) -> str:
        """``[address%interface]`` with ``%`` or RFC 6874's ``%25``."""
        return f"[{self.address}{spelling}{self.interface}]"


def _has_address(ip: str, address: str) -> bool:
    shown = subprocess.run(
        [ip, "-6", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=True
    ).stdout
    return f"inet6 {address}/" in shown


@pytest.fixture(scope="module")
def link_local() -> Iterator[LinkLocal]:
    """A link-local address on the loopback interface (``ip -6 addr add ... dev lo``) for the
    module, so that the tests' traffic stays on this machine whatever its network; removed
    afterwards unless it was there before."""
    require_root()
    ip = require_command("ip", "apt-get install iproute2")
    added = not _has_address(ip, LINK_LOCAL)
    if added:
        subprocess.run(
            [ip, "-6", "addr", "add", f"{LINK_LOCAL}/128", "dev", "lo", "nodad"], check=True
        )
    try:
        yield LinkLocal(LINK_LOCAL, "lo")
    finally:
        if added:
            subprocess.run([ip, "-6", "addr", "del", f"{LINK_LOCAL}/128", "dev", "lo"], check=False)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The agents' certificate names ::1 and the link-local address (without its zone)."""
    names = f"IP:::1,IP:{LINK_LOCAL}"
    return make_pki(tmp_path_factory.mktemp("ipv6-pki"), server_names=names)


def _agent(base: Path, host: str, *args: str) -> Iterator[AgentProcess]:
    """An agent listening on ``host`` alone (an IPv6 address, its zone after ``%``), ready
    once it answers there."""
    port = free_port()
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with running_agent(base, "-l", listen, *args, port=port, ready_host=host) as started:
        yield started


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """An agent on [::1]."""
    yield from _agent(tmp_path_factory.mktemp("ipv6-agent"), "::1")


@pytest.fixture(scope="module")
def tls_agent(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[AgentProcess]:
    tls = ("--tls-cert", str(pki.pem("server")), "--tls-key", str(pki.key("server")))
    yield from _agent(tmp_path_factory.mktemp("ipv6-tls-agent"), "::1", *tls)


@pytest.fixture(scope="module")
def loopback_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """An agent on 127.0.0.1: what an SSH node's tunnel reaches (its ``localhost``)."""
    yield from _agent(tmp_path_factory.mktemp("loopback-agent"), "127.0.0.1")


@pytest.fixture(scope="module")
def link_agent(
    tmp_path_factory: pytest.TempPathFactory, link_local: LinkLocal
) -> Iterator[AgentProcess]:
    """An agent listening on the link-local address alone, its zone in ``-l``."""
    host = f"{link_local.address}%{link_local.interface}"
    yield from _agent(tmp_path_factory.mktemp("link-agent"), host)


@pytest.fixture(scope="module")
def link_tls_agent(
    tmp_path_factory: pytest.TempPathFactory, pki: Pki, link_local: LinkLocal
) -> Iterator[AgentProcess]:
    tls = ("--tls-cert", str(pki.pem("server")), "--tls-key", str(pki.key("server")))
    host = f"{link_local.address}%{link_local.interface}"
    yield from _agent(tmp_path_factory.mktemp("link-tls-agent"), host, *tls)


def _environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NV_", "DOCKER_", "SSH_AUTH")) and k != "COLUMNS"
    }
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def ctl(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controller.ctl.main", *args],
        env=_environment(**extra),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _answered(done: subprocess.CompletedProcess[str], nodes: list[str]) -> None:
    """Every node answered, each named in the table as written."""
    assert done.returncode == 0, done.stdout + done.stderr
    named = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert named == nodes, done.stdout
    assert f"{len(nodes)} node{'s' if len(nodes) > 1 else ''}, {len(nodes)} answered" in (
        done.stderr
    )


def nvidia_docker(tmp_path: Path, nv_host: str, **extra: str) -> list[str]:
    """``nvidia-docker run --rm cuda true`` with NV_HOST; the docker argv it ends with."""
    for sub in ("images", "registry", "volumes"):
        (tmp_path / sub).mkdir(exist_ok=True)
    (tmp_path / "images" / "cuda.json").write_text(json.dumps(GPU_LABELS))
    env = _environment(
        FAKE_DOCKER_DIR=str(tmp_path),
        NV_DOCKER=f"{sys.executable} {FAKE_DOCKER}",
        NV_HOST=nv_host,
        DOCKER_HOST="tcp://gpu-node:2375",
        **extra,
    )
    done = subprocess.run(
        [sys.executable, "-m", "controller.wrapper.cli", "run", "--rm", "cuda", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    executed = [line for line in done.stdout.splitlines() if line.startswith("EXEC ")]
    assert len(executed) == 1, done.stdout
    argv: list[str] = json.loads(executed[0][5:])
    return argv


def _gpu_arguments(argv: list[str]) -> None:
    assert argv[0] == "run"
    assert "--device=/dev/nvidia0" in argv
    assert "--volume=nvidia_driver_580.159.04:/usr/local/nvidia:ro" in argv


# --- [::1] ----------------------------------------------------------------------------------


def test_ipv6_loopback(agent: AgentProcess, tls_agent: AgentProcess, pki: Pki) -> None:
    nodes = [
        f"http://[::1]:{agent.port}",
        f"[::1]:{agent.port}/",
        f"https://[::1]:{tls_agent.port}/",
    ]
    _answered(ctl("info", *nodes, "--ca", str(pki.pem("ca"))), nodes)
    flags = ctl("mesos", "flags", f"https://[::1]:{tls_agent.port}", "--ca", str(pki.pem("ca")))
    assert flags.returncode == 0, flags.stderr
    assert flags.stdout.startswith("--attributes=gpus:")


def test_wrapper_on_ipv6_loopback(agent: AgentProcess, tmp_path: Path) -> None:
    _gpu_arguments(nvidia_docker(tmp_path, f"http://[::1]:{agent.port}/"))


# --- link-local, with a zone ------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["%", "%25"])
def test_fleet_over_http_and_https(
    link_agent: AgentProcess,
    link_tls_agent: AgentProcess,
    pki: Pki,
    link_local: LinkLocal,
    spelling: str,
) -> None:
    host = link_local.host(spelling)
    nodes = [
        f"http://{host}:{link_agent.port}",
        f"{host}:{link_agent.port}/",
        f"https://{host}:{link_tls_agent.port}/",
    ]
    _answered(ctl("info", *nodes, "--ca", str(pki.pem("ca"))), nodes)


@pytest.mark.parametrize("spelling", ["%", "%25"])
def test_mesos_flags_over_https(
    link_tls_agent: AgentProcess, pki: Pki, link_local: LinkLocal, spelling: str
) -> None:
    """``mesos flags`` asks with aiohttp's client: NV_HOST as the node."""
    nv_host = f"https://{link_local.host(spelling)}:{link_tls_agent.port}/"
    done = ctl("mesos", "flags", NV_HOST=nv_host, NV_TLS_CA=str(pki.pem("ca")))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("--attributes=gpus:")


@pytest.mark.parametrize("spelling", ["%", "%25"])
def test_wrapper_over_http_and_https(
    link_agent: AgentProcess,
    link_tls_agent: AgentProcess,
    pki: Pki,
    link_local: LinkLocal,
    spelling: str,
    tmp_path: Path,
) -> None:
    host = link_local.host(spelling)
    _gpu_arguments(nvidia_docker(tmp_path, f"http://{host}:{link_agent.port}"))
    https = f"https://{host}:{link_tls_agent.port}/"
    _gpu_arguments(nvidia_docker(tmp_path, https, NV_TLS_CA=str(pki.pem("ca"))))


@pytest.fixture(scope="module")
def sshd_everywhere(link_local: LinkLocal) -> Iterator[SshServer]:
    """A real sshd on 127.0.0.1 and on the link-local address."""
    require_root()
    listen = f"ListenAddress {link_local.address}%{link_local.interface}"
    server, proc = start_sshd(extra_config=(listen,))
    try:
        yield server
    finally:
        stop_sshd(server, proc)


def test_fleet_over_ssh(
    loopback_agent: AgentProcess, sshd_everywhere: SshServer, link_local: LinkLocal, tmp_path: Path
) -> None:
    """The zone reaches SSH as ``ssh`` takes it; known_hosts names the node as ``ssh`` and
    ``ssh-keyscan`` write it: ``[fe80::...%eth0]:PORT``."""
    server = sshd_everywhere
    home = server.client_home(tmp_path, knows_host=False)
    key_type, key = server.host_key_pub.read_text().split()[:2]
    known = f"{link_local.host('%')}:{server.port} {key_type} {key}\n"
    (home / ".ssh" / "known_hosts").write_text(known)
    nodes = [
        f"ssh://{server.user}@{link_local.host(spelling)}:{server.port}:{loopback_agent.port}{slash}"
        for spelling, slash in (("%", ""), ("%25", "/"))
    ]
    _answered(ctl("info", *nodes, HOME=str(home)), nodes)
