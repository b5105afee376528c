"""An agent that may not use the Docker engine's socket refuses GPU leases, and says why.

A real agent on the simulated 8-GPU node, its ``--docker-socket`` a real unix socket of mode
0444 (a connect needs write permission), the agent started as root without
``CAP_DAC_OVERRIDE`` (the capability that lets root past a file's mode): every connect fails
with EACCES, as for an agent outside Docker's group. Without the engine's container events
a lease would never bind to its container, its pending time would end while the container
runs, and its GPUs would go to the next ask (docs/leases.md, "How it fails safe").

Checked: ``POST /leases`` answers 503, ``Refusal`` ``no_engine_access``, one line naming
the socket and what to do, and the table stays empty; once the socket's mode lets the agent
in (the engine is then only down: nothing listens), asks are granted again.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess, running_agent
from tests.support.services import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE = 1
CAP_DAC_READ_SEARCH = 2


def _drop_dac_override() -> None:
    """A ``preexec_fn``: the agent execs as root without the capabilities that pass by a
    file's mode (dropped from the bounding set, so its exec cannot get them back)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _may_drop_capabilities() -> bool:
    pid = os.fork()
    if pid == 0:
        try:
            _drop_dac_override()
        except OSError:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def engine_socket(tmp_path: Path) -> Path:
    """A unix socket file nobody may connect to (mode 0444: read, as the agent's flag checks,
    but no write, which a connect needs); nothing listens on it."""
    if os.geteuid() != 0 or not _may_drop_capabilities():
        pytest.skip("needs root that may drop CAP_DAC_OVERRIDE from a child's bounding set")
    path = tmp_path / "docker.sock"
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound.bind(str(path))
    bound.close()
    path.chmod(0o444)
    return path


@pytest.fixture
def agent(tmp_path: Path, engine_socket: Path) -> Iterator[AgentProcess]:
    with running_agent(
        tmp_path / "agent",
        "--docker-socket", str(engine_socket),
        "--podman-socket", str(tmp_path / "no-podman.sock"),
        "--state-dir", str(tmp_path / "state"),
        "--no-usage-ledger",
        simulate="hgx-h200-8",
        preexec=_drop_dac_override,
    ) as agent:  # fmt: skip
        yield agent


def test_an_agent_refused_by_the_engines_socket_grants_no_lease_and_says_why(
    agent: AgentProcess, engine_socket: Path
) -> None:
    wait_until(
        lambda: "Permission denied" in agent.log(),
        what=f"the agent's first attempt at the engine (log: {agent.log_path})",
        timeout_s=30,
        proc=agent.proc,
    )
    status, answer = agent.call("POST", "/leases", {"count": 1})
    assert status == 503, answer
    assert answer["Refusal"] == "no_engine_access"
    text = answer["Error"]
    assert "\n" not in text
    assert text.startswith(
        f"no GPU leases: the agent cannot reach the Docker engine at unix://{engine_socket}: "
        "[Errno 13] Permission denied (this user may not use the socket: give it the "
        "socket's group"
    )
    assert "could be given twice" in text
    assert agent.call("GET", "/leases/json")[1]["Leases"] == []

    engine_socket.chmod(0o666)  # the agent may connect now; nothing listens: engine down

    def granted() -> bool:
        return agent.call("POST", "/leases", {"count": 1})[0] == 201

    wait_until(granted, what="a lease once the socket lets the agent in", timeout_s=60)
    assert "no_engine_access" not in json.dumps(agent.call("GET", "/leases/json")[1])
