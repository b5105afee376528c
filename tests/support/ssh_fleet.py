"""Many SSH nodes on a few real OpenSSH servers: the fleet of the SSH scale test and benchmark.

An sshd listens on at most 16 sockets (``MAX_LISTEN_SOCKS``), so ``start_ssh_fleet(base,
servers=4)`` starts ``servers`` sshds on 16 loopback ports each, all accepting one user key.
A node is an SSH port *and* an agent port behind it (``ssh://user@127.0.0.1:SSH:AGENT``), so
a thousand nodes can share 64 SSH ports: each is still its own SSH connection and login, as
a thousand machines would be, while the machine's process count stays small. sshd's
``MaxStartups`` is raised (``tests.support.sshd``) since many logins reach one sshd at once.

``SshFleet.home(base)`` makes a client HOME: the key as ``~/.ssh/id_ed25519`` and every port's
host key in ``~/.ssh/known_hosts``; ``nodes(agent_ports)`` deals the agents out over the ports.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.sshd import MAX_EXTRA_PORTS, SshServer, start_sshd, stop_sshd


@dataclass
class SshFleet:
    servers: list[tuple[SshServer, subprocess.Popen[bytes]]]

    @property
    def user(self) -> str:
        return self.servers[0][0].user

    @property
    def ports(self) -> list[int]:
        return [p for server, _ in self.servers for p in (server.port, *server.extra_ports)]

    def accepted_logins(self) -> int:
        return sum(
            s.log.read_text(errors="replace").count("Accepted publickey for")
            for s, _ in self.servers
        )

    def home(self, base: Path) -> Path:
        """A HOME with the user key and every sshd's host key on every port in known_hosts."""
        self.servers[0][0].client_home(base, knows_host=False)
        lines = []
        for server, _ in self.servers:
            key = " ".join(server.host_key_pub.read_text().split()[:2])
            lines += [f"[127.0.0.1]:{p} {key}\n" for p in (server.port, *server.extra_ports)]
        (base / ".ssh" / "known_hosts").write_text("".join(lines))
        return base

    def nodes(self, agent_ports: list[int]) -> list[str]:
        """One ``ssh://`` node per agent, the agents dealt out over the SSH ports in turn."""
        ports = self.ports
        return [
            f"ssh://{self.user}@127.0.0.1:{ports[i % len(ports)]}:{agent}"
            for i, agent in enumerate(agent_ports)
        ]

    def stop(self) -> None:
        for server, proc in self.servers:
            stop_sshd(server, proc)


def start_ssh_fleet(base: Path, servers: int = 4, log_level: str = "VERBOSE") -> SshFleet:
    """``servers`` sshds of 16 ports each, sharing one authorized user key."""
    started: list[tuple[SshServer, subprocess.Popen[bytes]]] = []
    try:
        for _ in range(servers):
            started.append(start_sshd(base, extra_ports=MAX_EXTRA_PORTS, log_level=log_level))
    except BaseException:
        SshFleet(started).stop()
        raise
    key = started[0][0].user_key
    public = key.with_name(key.name + ".pub").read_text()
    for server, _ in started[1:]:
        (server.root / "authorized_keys").write_text(public)
    return SshFleet(started)
