"""The CDI spec over the daemon's life: written at start with the driver volume it mounts,
left in place when the agent stops, kept (not rewritten) when it starts again, off when
asked. A real agent process, the simulated h200 node and the fake driver root; the spec
directory is private (no engine reads it here: tests/e2e/test_cdi_podman.py has Podman)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cdi_schema import schema_errors
from tests.support.fake_driver import FakeDriver
from tests.support.services import free_port, port_open, stop_process, wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


StartAgent = Callable[..., Agent]


@pytest.fixture
def start(tmp_path: Path, fake_driver: FakeDriver) -> Iterator[StartAgent]:
    started: list[Agent] = []

    def start_agent(*args: str) -> Agent:
        port = free_port()
        log = tmp_path / f"agent-{len(started)}.log"
        env = {**os.environ, "PATH": fake_driver.search_path, "PYTHONPATH": str(REPO)}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "agent.daemon",
                    "-l", f"127.0.0.1:{port}",
                    "-s", str(tmp_path / "plugins"),
                    "-d", str(tmp_path / "volumes"),
                    "--simulate", "h200",
                    "--ldcache", str(fake_driver.ldcache),
                    *args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )  # fmt: skip
        agent = Agent(proc, port, log)
        started.append(agent)
        wait_until(lambda: port_open(port), what=f"agent (log: {log})", timeout_s=60, proc=proc)
        return agent

    yield start_agent
    for agent in started:
        stop_process(agent.proc)


def test_written_at_start_kept_at_stop_and_not_rewritten_at_restart(
    start: StartAgent, tmp_path: Path, fake_driver: FakeDriver
) -> None:
    spec = tmp_path / "cdi" / "nvidia-docker.json"
    agent = start("--cdi-spec-dir", str(spec.parent))
    document = json.loads(spec.read_text())
    assert schema_errors(document) == []
    mounts = document["containerEdits"]["mounts"]
    (mount,) = [m for m in mounts if m["containerPath"] == "/usr/local/nvidia"]  # and host files
    volume = tmp_path / "volumes" / "nvidia_driver" / fake_driver.version
    assert Path(mount["hostPath"]) == volume.resolve()
    assert (volume / "lib64" / "libcuda.so.1").exists()  # built before the spec was written
    hook = document["containerEdits"]["hooks"][0]["path"]
    assert Path(hook).name == "nvidia-docker-cdi-hook"
    assert os.access(hook, os.X_OK)
    assert agent.get("/cdi/spec") == (200, spec.read_bytes())
    status, body = agent.get("/docker/cli?format=cdi")
    assert (status, body.decode()) == (
        200,
        f"--device=nvidia.com/gpu={document['devices'][1]['name']}\n",
    )
    log = agent.text()
    assert f"Wrote the CDI spec {spec} (CDI 0.5.0, driver 580.159.04): 3 device names" in log
    assert "link /var/run/cdi/nvidia-docker.json to it" in log  # a private dir: said so
    assert "MIG mode: off for every GPU" in log

    inode = spec.stat().st_ino
    assert agent.stop() == 0
    assert spec.stat().st_ino == inode  # still there, for containers that restart meanwhile
    assert f"Leaving the CDI spec {spec} in place" in agent.text()

    again = start("--cdi-spec-dir", str(spec.parent))
    assert f"Kept the CDI spec {spec}" in again.text()
    assert spec.stat().st_ino == inode


@pytest.mark.parametrize(
    "args",
    [
        (),  # NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR="" in the environment (tests/conftest.py)
        ("--cdi-spec-dir", ""),
    ],
)
def test_off_when_the_spec_dir_is_empty(
    start: StartAgent, tmp_path: Path, args: tuple[str, ...]
) -> None:
    assert os.environ["NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR"] == ""
    agent = start(*args)
    assert "CDI spec" not in agent.text()
    assert agent.get("/cdi/spec")[0] == 404
    status, body = agent.get("/docker/cli?format=cdi")
    assert status == 400
    assert b"this agent writes no CDI spec" in body
    assert not (tmp_path / "volumes" / "nvidia_driver").exists()  # built on demand, as before


def test_a_spec_dir_that_cannot_be_written_is_logged_and_the_agent_serves(
    start: StartAgent, tmp_path: Path
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the spec directory should be\n")
    agent = start("--cdi-spec-dir", str(blocked))
    assert agent.get("/gpu/info/json")[0] == 200
    status, body = agent.get("/cdi/spec")
    assert status == 503
    assert b"could not be written" in body
    assert f"CDI spec {blocked}/nvidia-docker.json not written" in agent.text()
