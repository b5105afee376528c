"""A private Docker engine for end-to-end tests.

Starts Debian's ``dockerd`` with its own socket, data root, exec root and pid file
(``--iptables=false --bridge=none``), waits until it answers, and stops it at the end.
Images are made with ``docker import`` of a busybox root filesystem: nothing is pulled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tests.support.services import stop_process, wait_until

BUSYBOX = Path("/bin/busybox")


@dataclass
class DockerEngine:
    host: str  # "unix:///.../docker.sock"
    root: Path  # private directory of this engine

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


def start_engine(base: Path | None = None) -> tuple[DockerEngine, subprocess.Popen[bytes]]:
    """Start a private dockerd; the caller stops it with ``stop_engine``."""
    if shutil.which("dockerd") is None:
        raise RuntimeError("dockerd is not installed: apt-get install docker.io")
    root = Path(tempfile.mkdtemp(prefix="nvd-docker-", dir=base))
    sock = root / "docker.sock"
    env = dict(os.environ)
    # dockerd finds volume plugins only in the fixed places /run/docker/plugins and
    # /etc/docker/plugins (not configurable): plugin tests write a spec file there.
    with (root / "dockerd.log").open("wb") as log:
        proc = _spawn_dockerd(root, sock, log, env)
    engine = DockerEngine(host=f"unix://{sock}", root=root)
    return _await_engine(engine, proc)


def _spawn_dockerd(
    root: Path, sock: Path, log: BinaryIO, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            "dockerd",
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
        return engine.docker("info", "--format", "{{.ServerVersion}}", check=False).returncode == 0

    try:
        wait_until(answers, what="dockerd", timeout_s=60, proc=proc, interval_s=0.2)
    except Exception:
        stop_process(proc)
        raise RuntimeError(f"dockerd did not start; see {root / 'dockerd.log'}") from None
    return engine, proc


def stop_engine(engine: DockerEngine, proc: subprocess.Popen[bytes]) -> None:
    """Remove every container, stop dockerd, delete its directory."""
    ids = engine.docker("ps", "-aq", check=False).stdout.split()
    if ids:
        engine.docker("rm", "-f", *ids, check=False)
    stop_process(proc, timeout_s=30)
    # dockerd leaves mounts behind (overlays under data/, the network namespace under
    # exec/netns/): unmount everything below the engine's root, deepest first.
    mounts = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(f"{engine.root}/")
    ]
    for mount in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
    shutil.rmtree(engine.root, ignore_errors=True)
