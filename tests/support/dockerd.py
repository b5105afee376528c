"""A private Docker engine for end-to-end tests.

Starts Debian's ``dockerd`` with its own socket, data root, exec root and pid file
(``--iptables=false --bridge=none``), waits until it answers, and stops it at the end.
Images are made with ``docker import`` of a busybox root filesystem: nothing is pulled.

dockerd also writes fixed machine-wide paths that no flag moves: its identity key
``/etc/docker/key.json``, ``/run/docker/plugins`` and containerd's shim sockets under
``/run/containerd/s``; and it looks for plugin spec files only in ``/etc/docker/plugins``.
So it runs in a mount namespace of its own (``unshare --mount``: mounts made there are not
seen outside) in which a fresh tmpfs is ``/run`` and the engine's ``etc-docker/`` directory
is ``/etc/docker``. Everything it writes stays under the engine's root and goes with it,
its mounts (overlays, network namespaces) vanish with the namespace when it stops, and a
test gives it a volume plugin by writing a spec file into ``DockerEngine.plugin_specs``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tests.support.prerequisites import unavailable
from tests.support.services import stop_process, wait_until

BUSYBOX = Path("/bin/busybox")
REPO = Path(__file__).resolve().parents[2]
# Debian 13's dockerd (26), which scripts/test-all unpacks (Debian 12's engine is 20.10)
FETCHED_DOCKERD = REPO / ".cache" / "docker-cdi" / "usr" / "sbin" / "dockerd"
# What the docker CLI prints under an error of ``docker run``, by version: Docker 28's (the
# development machines'), and older ones' (Debian 12's 20.10, Debian 13's docker-cli 26).
RUN_HELP_HINTS = (
    ["Run 'docker run --help' for more information"],
    ["See 'docker run --help'."],
)


# Run inside the new mount namespace by ``sh -c``: $0 is the engine's /etc/docker, "$@" dockerd.
_PRIVATE_PATHS = (
    'mount -t tmpfs -o mode=0755 nvd-docker-run /run && mount --bind "$0" /etc/docker && exec "$@"'
)


@dataclass
class DockerEngine:
    host: str  # "unix:///.../docker.sock"
    root: Path  # private directory of this engine

    @property
    def plugin_specs(self) -> Path:
        """Where this engine finds plugin spec files: its ``/etc/docker/plugins``."""
        return self.root / "etc-docker" / "plugins"

    def env(self) -> dict[str, str]:
        """Environment for a docker client talking to this engine."""
        env = dict(os.environ)
        env["DOCKER_HOST"] = self.host
        env.pop("DOCKER_CONTEXT", None)
        return env

    def docker(
        self,
        *args: str,
        check: bool = True,
        input_bytes: bytes | None = None,
        timeout_s: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run the docker CLI against this engine; stdout and stderr captured as text."""
        proc = subprocess.run(
            ["docker", *args],
            env=self.env(),
            input=input_bytes.decode() if input_bytes is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"docker {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}"
            )
        return proc

    def import_busybox(self, tag: str, labels: dict[str, str] | None = None) -> str:
        """Make an image from a busybox root filesystem (``docker import``), with labels."""
        with tempfile.TemporaryDirectory(prefix="nvd-rootfs-") as tmp:
            rootfs = Path(tmp) / "rootfs"
            (rootfs / "bin").mkdir(parents=True)
            for name in ("tmp", "etc", "proc", "sys", "dev", "usr/local"):
                (rootfs / name).mkdir(parents=True, exist_ok=True)
            shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
            for applet in ("sh", "ls", "cat", "echo", "readlink", "find", "test", "sleep", "stat"):
                (rootfs / "bin" / applet).symlink_to("busybox")
            tarball = Path(tmp) / "rootfs.tar"
            subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
            args = ["import"]
            for key, value in (labels or {}).items():
                args += ["-c", f"LABEL {key}={value}"]
            args += [str(tarball), tag]
            self.docker(*args)
        return tag


def newer_dockerd() -> str:
    """The path of a dockerd 25 or newer: ``NVD_DOCKERD_CDI``, else the one scripts/test-all
    unpacks; the test is unavailable (skipped, or failed in CI) without one."""
    path = os.environ.get("NVD_DOCKERD_CDI") or str(FETCHED_DOCKERD)
    if not os.access(path, os.X_OK):
        unavailable(f"needs a dockerd 25 or newer at {path} (scripts/test-all unpacks it)")
    return path


def start_engine(
    base: Path | None = None,
    *,
    dockerd: str = "dockerd",
    extra_args: Sequence[str] = (),
    daemon_json: Mapping[str, object] | None = None,
    before_start: Callable[[DockerEngine], None] | None = None,
) -> tuple[DockerEngine, subprocess.Popen[bytes]]:
    """Start a private dockerd (another build: ``dockerd``; ``daemon_json`` becomes its
    ``/etc/docker/daemon.json``); the caller stops it with ``stop_engine``. ``before_start``
    is called with the engine once its directory exists, before dockerd starts (to serve a
    plugin that dockerd needs at start, such as an authorization plugin)."""
    if shutil.which(dockerd) is None:
        raise RuntimeError(f"{dockerd} is not installed: apt-get install docker.io")
    if not Path("/etc/docker").is_dir():
        raise RuntimeError(
            "/etc/docker is missing (docker.io installs it): apt-get install docker.io"
        )
    root = Path(tempfile.mkdtemp(prefix="nvd-docker-", dir=base))
    sock = root / "docker.sock"
    engine = DockerEngine(host=f"unix://{sock}", root=root)
    engine.plugin_specs.mkdir(parents=True)
    if daemon_json is not None:
        (root / "etc-docker" / "daemon.json").write_text(json.dumps(daemon_json))
    if before_start is not None:
        try:
            before_start(engine)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
    with (root / "dockerd.log").open("wb") as log:
        proc = _spawn_dockerd(root, sock, log, dict(os.environ), dockerd, extra_args)
    return _await_engine(engine, proc)


def _spawn_dockerd(
    root: Path,
    sock: Path,
    log: BinaryIO,
    env: dict[str, str],
    dockerd: str = "dockerd",
    extra_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    # unshare and sh exec in place: the pid is dockerd's, so signals reach it directly.
    return subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            _PRIVATE_PATHS,
            str(root / "etc-docker"),
            dockerd,
            "--host",
            f"unix://{sock}",
            "--data-root",
            str(root / "data"),
            "--exec-root",
            str(root / "exec"),
            "--pidfile",
            str(root / "dockerd.pid"),
            "--iptables=false",
            "--bridge=none",
            *extra_args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )


def _await_engine(
    engine: DockerEngine, proc: subprocess.Popen[bytes]
) -> tuple[DockerEngine, subprocess.Popen[bytes]]:
    root = engine.root

    def answers() -> bool:
        # `docker version`, not `docker info`: Debian 13's CLI (26) exits 0 from `docker info`
        # with no daemon behind the socket
        done = engine.docker("version", "--format", "{{.Server.Version}}", check=False)
        return done.returncode == 0 and bool(done.stdout.strip())

    try:
        wait_until(answers, what="dockerd", timeout_s=60, proc=proc, interval_s=0.2)
    except Exception:
        stop_process(proc)
        raise RuntimeError(f"dockerd did not start; see {root / 'dockerd.log'}") from None
    return engine, proc


def restart_engine(
    engine: DockerEngine,
    proc: subprocess.Popen[bytes],
    *,
    dockerd: str = "dockerd",
    extra_args: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """Stop dockerd and start it again on the same directory (data root, socket, containers
    and images kept: containers that ran are stopped); the new process, which the caller
    stops with ``stop_engine``."""
    stop_process(proc, timeout_s=30)
    sock = Path(engine.host.removeprefix("unix://"))
    with (engine.root / "dockerd.log").open("ab") as log:
        new = _spawn_dockerd(engine.root, sock, log, dict(os.environ), dockerd, extra_args)
    return _await_engine(engine, new)[1]


def stop_engine(engine: DockerEngine, proc: subprocess.Popen[bytes]) -> None:
    """Remove every container, stop dockerd, delete its directory.

    dockerd's mounts (overlays under data/, network namespaces under exec/netns/) live in its
    own mount namespace, which the kernel tears down with its last process: once dockerd and
    its containers are gone, the directory holds plain files only.
    """
    ids = engine.docker("ps", "-aq", check=False).stdout.split()
    if ids:
        engine.docker("rm", "-f", *ids, check=False)
    stop_process(proc, timeout_s=30)
    shutil.rmtree(engine.root, ignore_errors=True)
