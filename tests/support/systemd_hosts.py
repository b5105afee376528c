"""Hosts whose init is systemd, reached over SSH: the targets of the Ansible tests.

This machine has no systemd as PID 1, so the hosts are containers of the private dockerd
(``tests.support.dockerd``) that boot ``/sbin/init`` from a minimal Debian root filesystem
made with ``debootstrap`` (systemd, dbus, python3, python3-venv, openssh-server).

- The image is built once per recipe and cached as a tarball under
  ``/var/cache/nvidia-docker-tests/`` (``NVD_TEST_CACHE`` overrides), keyed by a hash of the
  recipe; every fresh dockerd ``docker import``s it (a few seconds).
- Each host runs with ``--cap-add SYS_ADMIN --security-opt seccomp=unconfined``, tmpfs on
  ``/run`` and ``/run/lock`` and the host's cgroup tree: enough for systemd to boot and run
  hardened units (mount namespaces, seccomp filters) without ``--privileged``.
- The hosts share a user-defined network; sshd is published on a loopback port chosen by
  docker, and a throw-away key is put in root's ``authorized_keys`` before the host starts.
  Host keys come from the image through ``docker exec`` (a trusted path), so SSH clients
  verify them against a ``known_hosts`` file instead of trusting on first use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.dockerd import DockerEngine
from tests.support.services import wait_until

SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
CACHE_DIR = Path(os.environ.get("NVD_TEST_CACHE", "/var/cache/nvidia-docker-tests"))

# What the hosts need, beyond debootstrap's minbase variant.
IMAGE_PACKAGES = (
    "systemd",  # init, journald, the units under test
    "systemd-sysv",  # /sbin/init -> systemd
    "dbus",  # systemctl talks to PID 1 over the bus
    "python3",  # Ansible's modules run on the target
    "python3-venv",  # the role installs the agent into its own virtual environment
    "openssh-server",  # Ansible reaches the host over SSH
)

# Steps applied to the debootstrap tree; part of the recipe hash, so edit them with care.
SSHD_CONFIG = "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUseDNS no\n"
PRUNED_DIRS = ("var/lib/apt/lists", "var/cache/apt", "usr/share/doc", "usr/share/man")
RECIPE_VERSION = 1


@dataclass(frozen=True)
class SystemdHost:
    """One running host: its name on the docker network and its loopback SSH port."""

    name: str
    container: str
    ssh_port: int
    host_key: str  # "ssh-ed25519 AAAA..." from /etc/ssh/ssh_host_ed25519_key.pub


def debian_mirror(sources: Sequence[Path] | None = None) -> str:
    """The Debian archive this machine's apt uses (deb822 or one-line sources)."""
    if sources is None:
        listed = sorted(Path("/etc/apt/sources.list.d").glob("*"))
        sources = [Path("/etc/apt/sources.list"), *listed]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for match in re.finditer(r"^URIs:\s*(\S+)\s*$", text, flags=re.MULTILINE):
            if match.group(1).rstrip("/").endswith("/debian"):
                return match.group(1).rstrip("/")
        for match in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+", text, flags=re.MULTILINE):
            if match.group(1).rstrip("/").endswith("/debian"):
                return match.group(1).rstrip("/")
    return DEFAULT_MIRROR


def recipe_key() -> str:
    """A hash of everything that decides the image's content (not the mirror it came from)."""
    recipe = {
        "suite": SUITE,
        "variant": "minbase",
        "packages": IMAGE_PACKAGES,
        "sshd_config": SSHD_CONFIG,
        "pruned": PRUNED_DIRS,
        "version": RECIPE_VERSION,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def ensure_image(engine: DockerEngine) -> str:
    """The systemd host image's tag in ``engine``: imported from the cache, built if missing."""
    key = recipe_key()[:16]
    tag = f"nvd-systemd-host:{key}"
    if engine.docker("image", "inspect", tag, check=False).returncode == 0:
        return tag
    tarball = ensure_rootfs_tarball()
    engine.docker(
        "import",
        "--change",
        'CMD ["/sbin/init"]',
        "--change",
        "ENV container=docker",
        str(tarball),
        tag,
        timeout_s=300,
    )
    return tag


def ensure_rootfs_tarball() -> Path:
    """The cached Debian root filesystem of the hosts (built with debootstrap if missing),
    also what other engines import (the Podman tests: it has python3 and glibc's ldconfig)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tarball = CACHE_DIR / f"systemd-host-{SUITE}-{recipe_key()[:16]}.tar.gz"
    with locked(CACHE_DIR / "systemd-host.lock"):
        if not tarball.exists():
            _build_rootfs_tarball(tarball)
    return tarball


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Serialise image builds between concurrent test runs."""
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_rootfs_tarball(tarball: Path) -> None:
    if shutil.which("debootstrap") is None:
        raise RuntimeError(
            "debootstrap is not installed: apt-get install debootstrap "
            "(scripts/test-all installs it)"
        )
    with tempfile.TemporaryDirectory(prefix="build-", dir=tarball.parent) as tmp:
        rootfs = Path(tmp) / "rootfs"
        try:
            proc = subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    "--include=" + ",".join(IMAGE_PACKAGES),
                    SUITE,
                    str(rootfs),
                    debian_mirror(),
                ],
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
        finally:  # a debootstrap that failed or was killed leaves its /proc mounted there
            _unmount_below(rootfs)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"debootstrap of the systemd host image failed:\n{tail}")
        _prepare_rootfs(rootfs)
        partial = Path(tmp) / "rootfs.tar.gz"
        compressor = ["-I", "pigz"] if shutil.which("pigz") else ["-z"]
        subprocess.run(
            ["tar", "-C", str(rootfs), "--numeric-owner", *compressor, "-cf", str(partial), "."],
            check=True,
            timeout=600,
        )
        partial.rename(tarball)  # complete tarballs only: a crash leaves nothing behind


def _unmount_below(root: Path) -> None:
    """Detach every mount under ``root``, deepest first, so that removing it removes files
    only (and the error that stopped the build is the one raised)."""
    below = [
        line.split()[1]
        for line in Path("/proc/self/mounts").read_text().splitlines()
        if line.split()[1].startswith(f"{root}/")
    ]
    for point in sorted(below, key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


def _prepare_rootfs(rootfs: Path) -> None:
    # An empty machine-id: each host makes its own at boot.
    (rootfs / "etc" / "machine-id").write_text("")
    (rootfs / "etc" / "ssh" / "sshd_config.d" / "nvd-test.conf").write_text(SSHD_CONFIG)
    for relative in PRUNED_DIRS:
        target = rootfs / relative
        for child in target.iterdir() if target.is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


class SystemdFleet:
    """Start hosts on a private network; ``close`` removes every container and the network."""

    def __init__(self, engine: DockerEngine, image: str, authorized_key: str) -> None:
        self.engine = engine
        self.image = image
        self.authorized_key = authorized_key
        self.prefix = f"nvd-{secrets.token_hex(3)}"
        self.network = f"{self.prefix}-net"
        self.hosts: list[SystemdHost] = []
        self._containers: list[str] = []
        self._network_created = False

    def start(self, names: Sequence[str], *, timeout_s: float = 90) -> list[SystemdHost]:
        self.engine.docker("network", "create", self.network)
        self._network_created = True
        with tempfile.TemporaryDirectory(prefix="nvd-ssh-") as tmp:
            ssh_dir = Path(tmp) / "ssh"
            ssh_dir.mkdir(mode=0o700)
            keys = ssh_dir / "authorized_keys"
            keys.write_text(self.authorized_key.strip() + "\n")
            keys.chmod(0o600)
            for name in names:
                container = self._create(name)
                self.engine.docker("cp", f"{ssh_dir}/.", f"{container}:/root/.ssh")
        for container in self._containers:
            self._start_container(container)
        for name, container in zip(names, self._containers, strict=True):
            self.hosts.append(self._await_boot(name, container, timeout_s))
        return self.hosts

    def _start_container(self, container: str, attempts: int = 5) -> None:
        """``docker start``, again when the loopback port docker chose for sshd was taken
        meanwhile (private engines of concurrent test runs allocate from the same range)."""
        for attempt in range(attempts):
            done = self.engine.docker("start", container, check=False)
            if done.returncode == 0:
                return
            if "address already in use" not in done.stderr or attempt == attempts - 1:
                raise AssertionError(f"docker start {container}: {done.stderr.strip()}")

    def _create(self, name: str) -> str:
        container = f"{self.prefix}-{name}"
        self.engine.docker(
            "create",
            "--name",
            container,
            "--hostname",
            name,
            "--network",
            self.network,
            "--network-alias",
            name,
            "--cap-add",
            "SYS_ADMIN",
            "--security-opt",
            "seccomp=unconfined",
            "--tmpfs",
            "/run",
            "--tmpfs",
            "/run/lock",
            "--volume",
            "/sys/fs/cgroup:/sys/fs/cgroup:rw",
            "--stop-signal",
            "SIGRTMIN+3",
            "--env",
            "container=docker",
            "--publish",
            "127.0.0.1::22",
            self.image,
            "/sbin/init",
        )
        self._containers.append(container)
        return container

    def _await_boot(self, name: str, container: str, timeout_s: float) -> SystemdHost:
        # systemctl fails at once ("Failed to connect to bus") until PID 1 has made its
        # private socket, which a fast docker exec can come before.
        wait_until(
            lambda: self.exec(container, "test", "-S", "/run/systemd/private").returncode == 0,
            what=f"systemd's socket on {name}",
            timeout_s=timeout_s,
            interval_s=0.2,
        )
        state = self.engine.docker(
            "exec",
            container,
            "timeout",
            str(int(timeout_s)),
            "systemctl",
            "is-system-running",
            "--wait",
            check=False,
            timeout_s=timeout_s + 10,
        ).stdout.strip()
        if state not in ("running", "degraded"):
            failed = self.exec(container, "systemctl", "--failed", "--no-legend").stdout
            raise RuntimeError(f"{name}: systemd did not boot (state {state!r}); failed: {failed}")
        port_line = self.engine.docker("port", container, "22/tcp").stdout.strip().splitlines()[0]
        ssh_port = int(port_line.rsplit(":", 1)[1])
        host_key = self.exec(container, "cat", "/etc/ssh/ssh_host_ed25519_key.pub").stdout
        host = SystemdHost(name, container, ssh_port, " ".join(host_key.split()[:2]))

        def sshd_active() -> bool:
            return self.exec(container, "systemctl", "is-active", "ssh").stdout.strip() == "active"

        wait_until(sshd_active, what=f"sshd on {name}", timeout_s=timeout_s, interval_s=0.2)
        return host

    def reboot(self, name: str, *, timeout_s: float = 120) -> SystemdHost:
        """Restart a host's container (systemd shuts down, then boots again) and wait for
        the boot; its loopback SSH port may change, so the host is looked up again."""
        index = next(i for i, host in enumerate(self.hosts) if host.name == name)
        container = self.hosts[index].container
        self.engine.docker("stop", container, timeout_s=timeout_s)
        self._start_container(container)
        host = self._await_boot(name, container, timeout_s)
        self.hosts[index] = host
        return host

    def exec(self, container: str, *command: str) -> subprocess.CompletedProcess[str]:
        """Run a command on a host through docker exec (not SSH): the test's own view."""
        return self.engine.docker("exec", container, *command, check=False, timeout_s=120)

    def known_hosts(self) -> str:
        """known_hosts lines for the hosts' loopback SSH ports."""
        return "".join(f"[127.0.0.1]:{h.ssh_port} {h.host_key}\n" for h in self.hosts)

    def close(self) -> None:
        if self._containers:
            self.engine.docker("rm", "--force", "--volumes", *self._containers, check=False)
            self._containers.clear()
        if self._network_created:
            self.engine.docker("network", "rm", self.network, check=False)
            self._network_created = False
