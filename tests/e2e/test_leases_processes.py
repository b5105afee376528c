"""A GPU process that no engine shows makes its GPU foreign: a real agent on a simulated
8-GPU node whose GPU 5 lists a real process of this machine (started by the test, outside any
container), its usage ledger ticking every 0.3 s (docs/leases.md, "Foreign holders").

Checked: once a tick has seen the process, an ask for GPU 5 is refused naming ``pid N``, an
ask for all eight finds seven, and an ask for one never gets GPU 5; once the process ends
(the node file still lists it, but the attribution finds no such process), GPU 5 is leased
again. The built-in node's made-up processes on GPUs 2 and 3 are dropped from this node
file: on a machine whose pid_max is large they could be somebody's real pid.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_process import AgentProcess, launch_agent, wait_ready
from tests.support.services import stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
NODE = REPO / "agent" / "gpu" / "nodes" / "hgx-h200-8.json"
BUSY_GPU = 5


@pytest.fixture
def process() -> Iterator[subprocess.Popen[bytes]]:
    """A real process of this machine, outside any container: the GPU program of the node."""
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def agent(tmp_path: Path, process: subprocess.Popen[bytes]) -> Iterator[AgentProcess]:
    node = json.loads(NODE.read_text())
    for device in node["devices"]:
        device["status"]["processes"] = []
    node["devices"][BUSY_GPU]["status"]["processes"] = [
        {"pid": process.pid, "name": "sleep", "memory_used_mib": 4096}
    ]
    node_file = tmp_path / "node.json"
    node_file.write_text(json.dumps(node))
    base = tmp_path / "agent"
    started = launch_agent(
        base, "--state-dir", str(base / "state"), "--cdi-spec-dir", "",
        "--docker-socket", str(base / "no-docker.sock"),
        "--podman-socket", str(base / "no-podman.sock"),
        "--usage-interval", "0.3",
        simulate=str(node_file),
    )  # fmt: skip
    try:
        wait_ready(started)
        yield started
    finally:
        stop_process(started.proc)


def foreign_holders(agent: AgentProcess) -> list[dict[str, Any]]:
    status, table = agent.call("GET", "/leases/json")
    assert status == 200, table
    return list(table["Foreign"])


def test_a_gpu_process_outside_the_engines_holds_its_gpu_until_it_ends(
    agent: AgentProcess, process: subprocess.Popen[bytes]
) -> None:
    holder = f"pid {process.pid}"
    wait_until(
        lambda: any(f["Holder"] == holder for f in foreign_holders(agent)),
        what=f"{holder} a foreign holder",
        timeout_s=30,
    )
    status, refused = agent.call("POST", "/leases", {"devices": str(BUSY_GPU)})
    assert status == 409, refused
    assert f"GPU {BUSY_GPU} by {holder} (a GPU process)" in refused["Error"], refused
    status, refused = agent.call("POST", "/leases", {"count": 8})
    assert status == 409, refused
    assert "asked for 8, 7 free" in refused["Error"], refused
    status, granted = agent.call("POST", "/leases", {"count": 7})
    assert status == 201, granted
    assert sorted(d["GPU"] for d in granted["Devices"]) == [0, 1, 2, 3, 4, 6, 7], granted
    assert agent.call("DELETE", f"/leases/{granted['Lease']}")[0] == 200

    process.kill()
    process.wait(timeout=10)
    wait_until(lambda: not foreign_holders(agent), what="the holder gone", timeout_s=30)
    status, granted = agent.call("POST", "/leases", {"devices": str(BUSY_GPU)})
    assert status == 201, granted
