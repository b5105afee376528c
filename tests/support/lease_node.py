"""A real agent serving GPU leases on a simulated node, as the end-to-end lease suites drive
it (tests/e2e/test_leases_docker.py with dockerd, tests/e2e/test_leases_podman.py with
Podman's API service): its lease table over the REST API, waits on it, and its restart.

``LeaseNode`` holds what both suites share (with ``one_line``); a suite's subclass says
how its agent is launched (``launch``) and how to tell, from the agent's log, that it
follows the suite's engine (``follows``: how many times it did, at start and after each
reconnection).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.agent_leases import AgentLeases
from tests.support.agent_process import AgentProcess, wait_ready
from tests.support.services import wait_until


def one_line(stderr: str) -> str:
    """``stderr``, which must be one line."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@dataclass
class LeaseNode(AgentLeases):
    """The agent of a simulated node (``agent``, its files under ``base``); restartable."""

    base: Path
    agent: AgentProcess

    engine_name = "its engine"  # for the waits' messages
    follow_timeout_s = 30.0
    bind_timeout_s = 20.0

    @property
    def state_file(self) -> Path:
        return self.base / "state" / "leases.json"

    def leases(self) -> dict[str, dict[str, Any]]:
        """Container id -> its lease (as /leases/json shows it), of every bound lease."""
        return {
            lease["Container"]: lease
            for lease in self.table()["Leases"]
            if lease["Container"] is not None
        }

    def bound(self) -> dict[str, str]:
        """Container id -> lease id, of every lease bound to a container."""
        return {cid: lease["Lease"] for cid, lease in self.leases().items()}

    def wait_bound(self, containers: list[str], what: str, timeout_s: float | None = None) -> None:
        """Until every container of ``containers`` (and no other) holds a lease."""
        wait_until(
            lambda: set(self.bound()) == set(containers),
            what=what,
            timeout_s=self.bind_timeout_s if timeout_s is None else timeout_s,
            proc=self.agent.proc,
        )

    def follows(self) -> int:
        """How many times the agent has followed its engine's events, from its log."""
        raise NotImplementedError

    def launch(self) -> AgentProcess:
        """The agent started again, on the same state directory and log."""
        raise NotImplementedError

    def wait_following(self, more_than: int, timeout_s: float | None = None) -> None:
        wait_until(
            lambda: self.follows() > more_than,
            what=f"the agent following {self.engine_name} (log: {self.agent.log_path})",
            timeout_s=self.follow_timeout_s if timeout_s is None else timeout_s,
            proc=self.agent.proc,
        )

    def kill9(self) -> None:
        self.agent.proc.send_signal(signal.SIGKILL)
        self.agent.proc.wait(timeout=10)

    def start(self) -> None:
        """Start the agent again and wait until it follows its engine (ready is the REST
        API; the table follows after it)."""
        follows = self.follows()
        self.agent = self.launch()
        wait_ready(self.agent)
        self.wait_following(follows)

    def log(self) -> str:
        return self.agent.log()
