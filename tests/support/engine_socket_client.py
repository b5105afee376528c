"""A Docker client of an agent's GPU-aware engine socket (``--engine-socket``,
``--podman-engine-socket``), with the agent's lease table beside it: the docker CLI with
``DOCKER_HOST`` naming the socket, and what the tests read back (the leases bound to
containers, the GPU device nodes a container was given)."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_process import AgentProcess
from tests.support.services import wait_until

COMPOSE = (
    Path(__file__).resolve().parents[2]
    / ".cache" / "compose" / "usr" / "libexec" / "docker" / "cli-plugins" / "docker-compose"
)  # fmt: skip


def compose_project(folder: Path, text: str) -> Path:
    """``folder`` with ``text`` as its compose.yaml; skips the test where Compose v2 is not
    here (``COMPOSE``: scripts/test-all fetches Debian 13's)."""
    if not COMPOSE.exists():
        pytest.skip(f"no Docker Compose v2 at {COMPOSE} (scripts/test-all fetches Debian 13's)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "compose.yaml").write_text(text)
    return folder


@dataclass(kw_only=True)
class EngineSocketClient:
    agent: AgentProcess
    engine_socket: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.agent.port}"

    def table(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/leases/json", timeout=10) as resp:
            table: dict[str, Any] = json.loads(resp.read())
        return table

    def bound(self) -> dict[str, str]:
        """Container id -> its lease, for the leases bound to a container."""
        return {
            lease["Container"]: lease["Lease"]
            for lease in self.table()["Leases"]
            if lease["Container"] is not None
        }

    def client_env(self) -> dict[str, str]:
        """This environment for a Docker client of the agent's socket (no other DOCKER_*)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        env["DOCKER_HOST"] = f"unix://{self.engine_socket}"
        return env

    def docker(
        self, *args: str, stdin: bytes | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[bytes]:
        """The docker CLI through the agent's engine socket."""
        return subprocess.run(
            ["docker", *args],
            env=self.client_env(),
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )

    def ok(self, *args: str, stdin: bytes | None = None) -> str:
        run = self.docker(*args, stdin=stdin)
        assert run.returncode == 0, (args, run.stderr.decode())
        return run.stdout.decode()

    def compose(self, project: Path, name: str, *args: str) -> subprocess.CompletedProcess[bytes]:
        """Compose v2 on the project in ``project`` (``compose_project``), named ``name``,
        through the agent's socket."""
        return subprocess.run(
            [str(COMPOSE), "-p", name, *args],
            cwd=project,
            env=self.client_env(),
            capture_output=True,
            timeout=120,
            check=False,
        )

    def compose_up(self, project: Path, name: str, replicas: int) -> set[str]:
        """``compose up -d`` of ``project``, whose ``replicas`` replicas ask for a GPU each:
        checked that each got a GPU no other has and that their leases are bound; the
        containers' full ids."""
        up = self.compose(project, name, "up", "-d")
        assert up.returncode == 0, up.stderr.decode()
        ids = self.ok("ps", "-q", "--filter", f"label=com.docker.compose.project={name}").split()
        assert len(ids) == replicas
        gpus = [gpu for cid in ids for gpu in self.gpus_of(cid)]
        assert len(set(gpus)) == len(gpus) == replicas, gpus
        full = {self.ok("inspect", "-f", "{{.Id}}", cid).strip() for cid in ids}
        wait_until(lambda: set(self.bound()) == full, what=f"{replicas} leases bound",
                   timeout_s=30)  # fmt: skip
        return full

    def compose_down(self, project: Path, name: str) -> None:
        """``compose down`` of ``project``: checked that every lease is freed."""
        down = self.compose(project, name, "down")
        assert down.returncode == 0, down.stderr.decode()
        wait_until(lambda: not self.table()["Leases"], what="the leases freed", timeout_s=10)

    def gpus_of(self, container_id: str) -> list[str]:
        """The /dev/nvidiaN nodes the container was given, sorted."""
        raw = self.ok("inspect", "-f", "{{json .HostConfig.Devices}}", container_id)
        return sorted(
            d["PathOnHost"]
            for d in json.loads(raw)
            if d["PathOnHost"].removeprefix("/dev/nvidia").isdigit()
        )
