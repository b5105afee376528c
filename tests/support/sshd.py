"""A real OpenSSH server for end-to-end tests, with throw-away keys, on a loopback port.

``start_sshd()`` generates a host key and a user key with ``ssh-keygen`` in a private
directory, writes an ``sshd_config`` (``AuthorizedKeysFile`` in that directory, ``StrictModes
no``, ``UsePAM no``, TCP forwarding allowed, passwords allowed so that a wrong one can be
tried), starts Debian's ``/usr/sbin/sshd -D -e`` on a free port of 127.0.0.1 and waits until
it sends its banner. ``stop_sshd()`` stops it and removes the directory.

sshd insists on its privilege separation directory ``/run/sshd``; rather than create it on
the machine (and never know when another run's sshd still needs it), sshd runs in a mount
namespace of its own (``unshare --mount``) where a fresh tmpfs is ``/run`` holding it.

Clients get a ``HOME`` of their own (``SshServer.client_home``) holding the user key as
``~/.ssh/id_ed25519`` and, if wanted, the server's key in ``~/.ssh/known_hosts``: that is how
a user's machine looks, and nothing of the real ``~/.ssh`` is touched.
"""

from __future__ import annotations

import functools
import getpass
import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.services import free_port, stop_process, wait_until

SSHD = Path("/usr/sbin/sshd")
MAX_EXTRA_PORTS = 15  # OpenSSH's MAX_LISTEN_SOCKS is 16
# Run by ``sh -c`` inside sshd's mount namespace, then "$0" "$@" is sshd and its arguments.
_PRIVATE_RUN = (
    'mount -t tmpfs -o mode=0755 nvd-sshd-run /run && mkdir -m 0755 /run/sshd && exec "$0" "$@"'
)


@dataclass(frozen=True)
class SshServer:
    host: str  # "127.0.0.1"
    port: int
    user: str  # the user the tests log in as (whoever runs the tests)
    root: Path  # private directory: keys, config, log
    user_key: Path  # private key whose public half is authorized
    host_key_pub: Path
    extra_ports: tuple[int, ...] = ()  # more ports the same sshd listens on (fleet tests)

    @property
    def log(self) -> Path:
        return self.root / "sshd.log"

    def known_hosts_line(self) -> str:
        """The server's key as a known_hosts line (``[host]:port type key``)."""
        key_type, key = self.host_key_pub.read_text().split()[:2]
        return f"[{self.host}]:{self.port} {key_type} {key}\n"

    def client_home(self, base: Path, *, with_key: bool = True, knows_host: bool = True) -> Path:
        """A HOME directory for a client: ``~/.ssh/id_ed25519`` and ``~/.ssh/known_hosts``."""
        ssh_dir = base / ".ssh"
        ssh_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if with_key:
            shutil.copyfile(self.user_key, ssh_dir / "id_ed25519")
            (ssh_dir / "id_ed25519").chmod(0o600)
        if knows_host:
            (ssh_dir / "known_hosts").write_text(self.known_hosts_line())
        return base


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )


def _banner(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=1) as sock:
        return sock.recv(64).startswith(b"SSH-2.0-")


def _free_ports(count: int, taken: set[int]) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken and port not in ports:
            ports.append(port)
    return ports


def start_sshd(
    base: Path | None = None,
    extra_ports: int = 0,
    log_level: str = "VERBOSE",
    extra_config: tuple[str, ...] = (),
) -> tuple[SshServer, subprocess.Popen[bytes]]:
    """Start sshd; the caller stops it with ``stop_sshd``.

    ``extra_ports``: listen on that many more free ports too (each one a node of a fleet test);
    at most 15, since sshd listens on at most 16 sockets (``MAX_LISTEN_SOCKS``).
    ``log_level``: ``DEBUG1`` also logs each forwarded connection (a bastion's test).
    ``extra_config``: more ``sshd_config`` lines (``SetEnv DOCKER_HOST=...``).
    """
    if not 0 <= extra_ports <= MAX_EXTRA_PORTS:
        raise ValueError(f"sshd listens on at most {MAX_EXTRA_PORTS + 1} ports")
    if not SSHD.exists():
        raise RuntimeError("sshd is not installed: apt-get install openssh-server")
    root = Path(tempfile.mkdtemp(prefix="nvd-sshd-", dir=base))
    root.chmod(0o755)
    _keygen(root / "host_ed25519", "nvd-test-host")
    _keygen(root / "user_ed25519", "nvd-test-user")
    shutil.copyfile(root / "user_ed25519.pub", root / "authorized_keys")
    port = free_port()
    more = _free_ports(extra_ports, taken={port})
    config = root / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                *(f"Port {p}" for p in more),
                "ListenAddress 127.0.0.1",
                f"HostKey {root / 'host_ed25519'}",
                f"PidFile {root / 'sshd.pid'}",
                f"AuthorizedKeysFile {root / 'authorized_keys'}",
                "StrictModes no",
                "UsePAM no",
                "PubkeyAuthentication yes",
                "PasswordAuthentication yes",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin yes",
                "AllowTcpForwarding yes",
                "MaxStartups 200:30:300",
                "MaxSessions 100",
                f"LogLevel {log_level}",
                *extra_config,
                "",
            ]
        )
    )
    with (root / "sshd.log").open("wb") as log:
        # unshare and sh exec in place: the pid is sshd's, so signals reach it directly
        proc = subprocess.Popen(
            [
                "unshare", "--mount", "--propagation", "private", "sh", "-c", _PRIVATE_RUN,
                str(SSHD), "-D", "-e", "-f", str(config),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = SshServer(
        host="127.0.0.1",
        port=port,
        user=getpass.getuser(),
        root=root,
        user_key=root / "user_ed25519",
        host_key_pub=root / "host_ed25519.pub",
        extra_ports=tuple(more),
    )
    try:
        wait_until(lambda: _banner(server.host, port), what="sshd", timeout_s=30, proc=proc)
        for extra in more:
            wait_until(
                functools.partial(_banner, server.host, extra), what="sshd", timeout_s=30, proc=proc
            )
    except Exception:
        stop_sshd(server, proc)
        raise RuntimeError(f"sshd did not start; see {root / 'sshd.log'}") from None
    return server, proc


def stop_sshd(server: SshServer, proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc)
    if os.environ.get("NVD_KEEP_SSHD_LOG"):
        return
    shutil.rmtree(server.root, ignore_errors=True)
