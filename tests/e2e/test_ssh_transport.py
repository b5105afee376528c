"""AgentClient through a real OpenSSH sshd: login, host keys, the direct-tcpip tunnel."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from controller.errors import NodeError
from controller.options import Options
from controller.transport.client import AgentClient
from controller.transport.endpoint import Endpoint, parse_endpoint
from controller.transport.ssh_tunnel import SshOptions
from tests.support.services import free_port, serve_on_loopback, stop_process, wait_until
from tests.support.sshd import SshServer

pytestmark = pytest.mark.e2e

INFO = {"Version": {"Driver": "580.159.04", "CUDA": "13.0"}, "Devices": []}


async def _info(request: web.Request) -> web.Response:
    # the tunnel ends on the node's localhost: the agent sees a loopback peer
    assert request.remote in ("127.0.0.1", "::1")
    return web.json_response(INFO)


@pytest.fixture
async def agent_port() -> AsyncIterator[int]:
    """A stand-in agent on 127.0.0.1 (this test is about the transport, not the agent)."""
    app = web.Application()
    app.router.add_get("/gpu/info/json", _info)
    async with serve_on_loopback(app) as port:
        yield port


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME, no ssh-agent: each test adds what the user would have."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.delenv("NV_SSH_STRICT_HOST_KEY_CHECKING", raising=False)
    monkeypatch.delenv("NV_SSH_KNOWN_HOSTS", raising=False)
    monkeypatch.delenv("NV_SSH_IDENTITY", raising=False)
    return tmp_path


def ssh_options() -> SshOptions:
    """What the commands' edge takes from this (monkeypatched) environment."""
    return SshOptions.from_options(Options.build(os.environ))


def endpoint(server: SshServer, http_port: int, ssh_port: int | None = None) -> Endpoint:
    port = ssh_port or server.port
    return parse_endpoint(f"ssh://{server.user}@{server.host}:{port}:{http_port}")


def accepted_logins(server: SshServer) -> int:
    return server.log.read_text(errors="replace").count("Accepted publickey for")


async def test_key_file_and_known_hosts(
    sshd_server: SshServer, agent_port: int, home: Path
) -> None:
    sshd_server.client_home(home)
    before = accepted_logins(sshd_server)
    async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
        answers = await asyncio.gather(*(agent.get_json("/gpu/info/json") for _ in range(40)))
    assert answers == [INFO] * 40
    # forty requests, one SSH login
    wait_until(lambda: accepted_logins(sshd_server) >= before + 1, what="sshd log", timeout_s=5)
    assert accepted_logins(sshd_server) == before + 1


async def test_many_nodes_concurrently(sshd_server: SshServer, agent_port: int, home: Path) -> None:
    sshd_server.client_home(home)

    async def ask() -> object:
        async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
            return await agent.get_json("/gpu/info/json")

    assert await asyncio.gather(*(ask() for _ in range(12))) == [INFO] * 12


@pytest.fixture
def ssh_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real ssh-agent on a private socket."""
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        wait_until(sock.exists, what="ssh-agent", timeout_s=10, proc=proc)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        yield sock
    finally:
        stop_process(proc)


async def test_ssh_agent_login(
    sshd_server: SshServer, agent_port: int, home: Path, ssh_agent: Path
) -> None:
    sshd_server.client_home(home, with_key=False)
    env = {**os.environ, "SSH_AUTH_SOCK": str(ssh_agent)}
    await asyncio.to_thread(
        subprocess.run,
        ["ssh-add", str(sshd_server.user_key)],
        env=env,
        check=True,
        capture_output=True,
    )
    async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
        assert await agent.get_json("/gpu/info/json") == INFO


async def test_identity_file_from_environment(
    sshd_server: SshServer, agent_port: int, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sshd_server.client_home(home, with_key=False)
    monkeypatch.setenv("NV_SSH_IDENTITY", str(sshd_server.user_key))
    async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
        assert await agent.get_json("/gpu/info/json") == INFO


async def test_unknown_host_key_is_refused_with_its_fingerprint(
    sshd_server: SshServer, agent_port: int, home: Path
) -> None:
    sshd_server.client_home(home, knows_host=False)
    team_hosts = home / ".ssh" / "team_known_hosts"  # checked too, so the line names it
    (home / ".ssh" / "config").write_text(f"Host 127.0.0.1\n  UserKnownHostsFile {team_hosts}\n")
    listing = await asyncio.to_thread(
        subprocess.run,
        ["ssh-keygen", "-lf", str(sshd_server.host_key_pub)],
        capture_output=True,
        text=True,
        check=True,
    )
    fingerprint = listing.stdout.split()[1]
    with pytest.raises(NodeError) as info:
        async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
            await agent.get("/gpu/info/json")
    message = str(info.value)
    assert f"unknown SSH host key ssh-ed25519 {fingerprint}" in message
    assert f"ssh-keyscan -p {sshd_server.port} 127.0.0.1 >> ~/.ssh/known_hosts" in message
    assert "NV_SSH_STRICT_HOST_KEY_CHECKING=no" in message
    assert f"known_hosts, {team_hosts})" in message


async def test_opt_out_of_host_key_checking(
    sshd_server: SshServer, agent_port: int, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sshd_server.client_home(home, knows_host=False)
    monkeypatch.setenv("NV_SSH_STRICT_HOST_KEY_CHECKING", "no")
    async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
        assert await agent.get_json("/gpu/info/json") == INFO
    assert not (home / ".ssh" / "known_hosts").exists()  # nothing written


async def test_changed_host_key_is_refused(
    sshd_server: SshServer, agent_port: int, home: Path, tmp_path: Path
) -> None:
    sshd_server.client_home(home, knows_host=False)
    other = tmp_path / "other"
    await asyncio.to_thread(
        subprocess.run,
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)],
        check=True,
        capture_output=True,
    )
    key_type, key = (tmp_path / "other.pub").read_text().split()[:2]
    known = home / ".ssh" / "known_hosts"
    known.write_text(f"[{sshd_server.host}]:{sshd_server.port} {key_type} {key}\n")
    with pytest.raises(NodeError, match="has CHANGED") as info:
        async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
            await agent.get("/gpu/info/json")
    assert "ssh-keygen -R" in str(info.value)


async def test_system_known_hosts_file(
    sshd_server: SshServer,
    agent_port: int,
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sshd_server.client_home(home, knows_host=False)
    system = tmp_path / "ssh_known_hosts"
    system.write_text(sshd_server.known_hosts_line())
    monkeypatch.setenv("NV_SSH_KNOWN_HOSTS", f"{home}/.ssh/known_hosts:{system}")
    async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
        assert await agent.get_json("/gpu/info/json") == INFO


async def test_agent_not_listening_on_the_node(sshd_server: SshServer, home: Path) -> None:
    sshd_server.client_home(home)
    port = free_port()
    with pytest.raises(NodeError) as info:
        async with AgentClient(endpoint(sshd_server, port), ssh=ssh_options()) as agent:
            await agent.get("/gpu/info/json")
    assert f"the agent does not answer on localhost:{port} of the node" in str(info.value)


async def test_ssh_refused(sshd_server: SshServer, home: Path) -> None:
    sshd_server.client_home(home)
    port = free_port()
    with pytest.raises(NodeError) as info:
        async with AgentClient(
            endpoint(sshd_server, 3476, ssh_port=port), ssh=ssh_options()
        ) as agent:
            await agent.get("/gpu/info/json")
    assert f"SSH connection to 127.0.0.1:{port} refused: is sshd running" in str(info.value)


async def test_no_key_and_no_terminal(sshd_server: SshServer, home: Path) -> None:
    sshd_server.client_home(home, with_key=False)
    # a password may be asked for, but stdin is not a terminal
    options = SshOptions.from_options(Options.build(os.environ, password_prompt=True), prompt=True)
    with pytest.raises(NodeError) as info:
        async with AgentClient(endpoint(sshd_server, 3476), ssh=options) as agent:
            await agent.get("/gpu/info/json")
    message = str(info.value)
    assert "no terminal to ask for a password" in message
    assert "ssh-add" in message


async def test_known_hosts_with_cert_authority_and_revoked_lines(
    sshd_server: SshServer, agent_port: int, home: Path, tmp_path: Path
) -> None:
    """OpenSSH's marker lines: @cert-authority is skipped (the node's own line still
    counts), and a key on a @revoked line is refused even where another line lists it."""
    sshd_server.client_home(home, knows_host=False)
    await asyncio.to_thread(
        subprocess.run,
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "ca")],
        check=True,
        capture_output=True,
    )
    ca_type, ca_key = (tmp_path / "ca.pub").read_text().split()[:2]
    known = home / ".ssh" / "known_hosts"
    known.write_text(
        f"@cert-authority *.example.com {ca_type} {ca_key}\n" + sshd_server.known_hosts_line()
    )
    async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
        assert await agent.get_json("/gpu/info/json") == INFO

    host_type, host_key = sshd_server.host_key_pub.read_text().split()[:2]
    with known.open("a") as file:
        file.write(f"@revoked * {host_type} {host_key}\n")
    with pytest.raises(NodeError, match="is marked @revoked in known_hosts"):
        async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
            await agent.get("/gpu/info/json")


async def test_hashed_known_hosts_entry(
    sshd_server: SshServer, agent_port: int, home: Path
) -> None:
    """HashKnownHosts' form (``ssh-keygen -H``): the ``[host]:port`` name hashed."""
    sshd_server.client_home(home)
    known = home / ".ssh" / "known_hosts"
    await asyncio.to_thread(
        subprocess.run, ["ssh-keygen", "-H", "-f", str(known)], check=True, capture_output=True
    )
    assert known.read_text().startswith("|1|")
    async with AgentClient(endpoint(sshd_server, agent_port), ssh=ssh_options()) as agent:
        assert await agent.get_json("/gpu/info/json") == INFO
