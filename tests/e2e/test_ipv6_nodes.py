"""A real agent reached at IPv6 addresses: ``[::1]``, and this machine's link-local address
with its zone, as ``ip`` writes it (``[fe80::...%eth0]``) and as RFC 6874 writes it in URLs
(``[fe80::...%25eth0]``), a URL's trailing ``/`` included. Through what users run:
``nvidia-docker`` (plain HTTP, HTTPS), ``nvidia-docker-ctl info`` (the fleet client: HTTP,
HTTPS, and SSH through a real sshd) and ``nvidia-docker-ctl mesos flags`` (aiohttp).

The agent listens on every address (``-l :PORT``: it cannot bind a zoned address itself).
On a machine without a link-local address the link-local tests are skipped; the ``[::1]``
ones run everywhere.
"""

from __future__ import annotations

import ipaddress
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
from tests.support.prerequisites import require_root
from tests.support.services import free_port
from tests.support.sshd import SshServer, start_sshd, stop_sshd

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
FAKE_DOCKER = REPO / "tests" / "unit" / "controller" / "fake_docker.py"
GPU_LABELS = {"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}
_LINK_SCOPE = 0x20  # /proc/net/if_inet6: scope of a link-local address
_NOT_READY = 0x40 | 0x08  # IFA_F_TENTATIVE, IFA_F_DADFAILED: not usable yet, or never


@dataclass(frozen=True)
class LinkLocal:
    address: str  # fe80::fc:ff:fe00:1
    interface: str  # eth0

    def host(self, spelling: str) -> str:
        """``[address%interface]`` with ``%`` or RFC 6874's ``%25``."""
        return f"[{self.address}{spelling}{self.interface}]"


def _link_local() -> LinkLocal | None:
    """This machine's first usable link-local IPv6 address and its interface, if any."""
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hexed, _index, _prefix, scope, flags, name = line.split()
        if int(scope, 16) == _LINK_SCOPE and not int(flags, 16) & _NOT_READY:
            return LinkLocal(str(ipaddress.IPv6Address(int(hexed, 16))), name)
    return None


@pytest.fixture(scope="module")
def link_local() -> LinkLocal:
    found = _link_local()
    if found is None:
        pytest.skip("no usable link-local IPv6 address on this machine (/proc/net/if_inet6)")
    return found


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The agent's certificate names ::1 and the link-local address (without its zone)."""
    found = _link_local()
    names = "IP:::1" + (f",IP:{found.address}" if found else "")
    return make_pki(tmp_path_factory.mktemp("ipv6-pki"), server_names=names)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    port = free_port()
    base = tmp_path_factory.mktemp("ipv6-agent")
    with running_agent(base, "-l", f":{port}", port=port) as started:
        yield started


@pytest.fixture(scope="module")
def tls_agent(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[AgentProcess]:
    port = free_port()
    base = tmp_path_factory.mktemp("ipv6-tls-agent")
    tls = ("--tls-cert", str(pki.pem("server")), "--tls-key", str(pki.key("server")))
    with running_agent(base, "-l", f":{port}", *tls, port=port) as started:
        yield started


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
    agent: AgentProcess, tls_agent: AgentProcess, pki: Pki, link_local: LinkLocal, spelling: str
) -> None:
    host = link_local.host(spelling)
    nodes = [
        f"http://{host}:{agent.port}",
        f"{host}:{agent.port}/",
        f"https://{host}:{tls_agent.port}/",
    ]
    _answered(ctl("info", *nodes, "--ca", str(pki.pem("ca"))), nodes)


@pytest.mark.parametrize("spelling", ["%", "%25"])
def test_mesos_flags_over_https(
    tls_agent: AgentProcess, pki: Pki, link_local: LinkLocal, spelling: str
) -> None:
    """``mesos flags`` asks with aiohttp's client: NV_HOST as the node."""
    nv_host = f"https://{link_local.host(spelling)}:{tls_agent.port}/"
    done = ctl("mesos", "flags", NV_HOST=nv_host, NV_TLS_CA=str(pki.pem("ca")))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("--attributes=gpus:")


@pytest.mark.parametrize("spelling", ["%", "%25"])
def test_wrapper_over_http_and_https(
    agent: AgentProcess,
    tls_agent: AgentProcess,
    pki: Pki,
    link_local: LinkLocal,
    spelling: str,
    tmp_path: Path,
) -> None:
    host = link_local.host(spelling)
    _gpu_arguments(nvidia_docker(tmp_path, f"http://{host}:{agent.port}"))
    https = f"https://{host}:{tls_agent.port}/"
    _gpu_arguments(nvidia_docker(tmp_path, https, NV_TLS_CA=str(pki.pem("ca"))))


@pytest.fixture(scope="module")
def sshd_everywhere() -> Iterator[SshServer]:
    """A real sshd on 127.0.0.1 and every IPv6 address, the link-local one included."""
    require_root()
    server, proc = start_sshd(extra_config=("ListenAddress ::",))
    try:
        yield server
    finally:
        stop_sshd(server, proc)


def test_fleet_over_ssh(
    agent: AgentProcess, sshd_everywhere: SshServer, link_local: LinkLocal, tmp_path: Path
) -> None:
    """The zone reaches SSH as ``ssh`` takes it; known_hosts names the node as ``ssh`` and
    ``ssh-keyscan`` write it: ``[fe80::...%eth0]:PORT``."""
    server = sshd_everywhere
    home = server.client_home(tmp_path, knows_host=False)
    key_type, key = server.host_key_pub.read_text().split()[:2]
    known = f"{link_local.host('%')}:{server.port} {key_type} {key}\n"
    (home / ".ssh" / "known_hosts").write_text(known)
    nodes = [
        f"ssh://{server.user}@{link_local.host(spelling)}:{server.port}:{agent.port}{slash}"
        for spelling, slash in (("%", ""), ("%25", "/"))
    ]
    _answered(ctl("info", *nodes, HOME=str(home)), nodes)
