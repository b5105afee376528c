"""A real agent process serving the volume plugin to a private dockerd.

dockerd finds volume plugins in ``/etc/docker/plugins``; the private dockerd's is a directory
of its own (``DockerEngine.plugin_specs``, see tests.support.dockerd), so the agent writes its
spec file there (``--spec-file``) and nothing machine-wide is touched: concurrent test runs
each have their own engine and plugin. The spec file is removed afterwards even if the agent
died. The agent runs ``--simulate h200`` against a fake driver root (its ``--ldcache`` and a
PATH with the fake binaries).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.dockerd import DockerEngine
from tests.support.fake_driver import FakeDriver
from tests.support.services import free_port, listens_on, stop_process, wait_until


@dataclass
class PluginAgent:
    proc: subprocess.Popen[bytes]
    port: int  # REST API on 127.0.0.1
    socket_dir: Path
    volume_dir: Path
    log_path: Path
    engine: DockerEngine
    driver: FakeDriver

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / "nvidia-docker.sock"

    @property
    def spec_file(self) -> Path:
        """The plugin spec file the agent wrote, where the engine looks for it."""
        return self.engine.plugin_specs / "nvidia-docker.spec"

    @property
    def volume_name(self) -> str:
        return f"nvidia_driver_{self.driver.version}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as resp:
            body: bytes = resp.read()
            return body


@contextlib.contextmanager
def running_plugin_agent(engine: DockerEngine, driver: FakeDriver) -> Iterator[PluginAgent]:
    """Start the agent (plugin + REST API), yield it, then stop it and clean everything."""
    base = Path(tempfile.mkdtemp(prefix="nvd-plugin-agent-"))
    spec_file = engine.plugin_specs / "nvidia-docker.spec"
    port = free_port()
    socket_dir, volume_dir = base / "plugins", base / "volumes"
    log_path = base / "agent.log"
    env = dict(os.environ, PATH=driver.search_path)
    env.pop("NV_DEBUG", None)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "agent.daemon",
                "-l", f"127.0.0.1:{port}",
                "-s", str(socket_dir),
                "-d", str(volume_dir),
                "--simulate", "h200",
                "--ldcache", str(driver.ldcache),
                "--spec-file", str(spec_file),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    agent = PluginAgent(proc, port, socket_dir, volume_dir, log_path, engine, driver)
    try:
        wait_until(
            lambda: (
                listens_on(proc.pid, port) and spec_file.exists() and agent.socket_path.exists()
            ),
            what=f"agent (log: {log_path})",
            timeout_s=60,
            proc=proc,
        )
        yield agent
    finally:
        names = engine.docker(
            "volume", "ls", "-q", "--filter", "driver=nvidia-docker", check=False
        ).stdout.split()
        if names:
            engine.docker("volume", "rm", "-f", *names, check=False)
        stop_process(proc)
        spec_file.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)
