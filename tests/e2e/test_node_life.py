"""The real daemon following a node's life: health events, recovery, a driver change, SIGHUP.

The daemon serves a node file (``--simulate FILE``) that the tests change as the simulation
contract says (docs/node-file.md): a new version renamed into place.
"""

from __future__ import annotations

import functools
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.node_life import Agent, NodeFile, StatusLoad, start_agent
from tests.support.services import wait_until

pytestmark = pytest.mark.e2e

NEW = "590.48.01"


@pytest.fixture
def node(tmp_path: Path) -> NodeFile:
    return NodeFile(tmp_path / "node.json", "hgx-h200-8")


@pytest.fixture
def agent(tmp_path: Path, node: NodeFile) -> Iterator[Agent]:
    with start_agent(tmp_path, node) as running:
        yield running
    assert "Traceback" not in running.log()


def health(agent: Agent) -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = agent.get_json("/gpu/health/json")["Devices"]
    return devices


def gpus_handed_out(agent: Agent) -> list[str]:
    devices = agent.get_json("/docker/cli/json")["Devices"]
    return [d for d in devices if d[len("/dev/nvidia") :].isdigit()]


def test_an_xid_79_makes_a_gpu_unhealthy_until_it_answers_again(
    agent: Agent, node: NodeFile
) -> None:
    assert all(d["Healthy"] for d in health(agent))
    node.event(3, "xid", 79)
    wait_until(lambda: not health(agent)[3]["Healthy"], what="GPU 3 unhealthy", timeout_s=10)
    entry = health(agent)[3]
    assert entry["Reason"] == "XID 79 (GPU has fallen off the bus)"
    assert entry["XID"] == 79
    assert entry["Since"].endswith("Z")
    assert "/dev/nvidia3" not in gpus_handed_out(agent)
    assert len(gpus_handed_out(agent)) == 7
    status, body = agent.get("/docker/cli?dev=3")
    assert status == 409
    assert body.decode().startswith("unhealthy device: 3: GPU 3 (GPU-")
    assert body.count(b"\n") == 1
    # NVML's view of a GPU that fell off the bus: its live values are null.
    assert agent.get_json("/gpu/status/json")["Devices"][3]["Power"] is None

    node.event(3, "answers_again")
    wait_until(lambda: health(agent)[3]["Healthy"], what="GPU 3 healthy again", timeout_s=10)
    assert "/dev/nvidia3" in gpus_handed_out(agent)
    assert "GPU 3 answers again after a reset, with no new critical event" in agent.log()


def test_double_bit_ecc_is_unhealthy_an_application_xid_is_not(
    agent: Agent, node: NodeFile
) -> None:
    node.event(1, "xid", 13)
    node.event(0, "double_bit_ecc")
    wait_until(lambda: not health(agent)[0]["Healthy"], what="GPU 0 unhealthy", timeout_s=10)
    assert health(agent)[0]["Reason"] == "double-bit ECC error"
    assert health(agent)[1]["Healthy"] is True
    assert "GPU 1: XID 13 (graphics engine exception): an application's error" in agent.log()
    mesos = agent.get("/mesos/cli?format=native")[1].decode()
    assert "--resources=gpus:7 --nvidia_gpu_devices=1,2,3,4,5,6,7" in mesos


def test_a_pending_row_remap_holds_while_the_check_finds_it(agent: Agent, node: NodeFile) -> None:
    node.flag(5, "row_remap_pending", True)
    wait_until(lambda: not health(agent)[5]["Healthy"], what="GPU 5 unhealthy", timeout_s=10)
    assert health(agent)[5]["Reason"] == "row remapping pending (needs a GPU reset)"
    node.flag(5, "row_remap_pending", False)
    wait_until(lambda: health(agent)[5]["Healthy"], what="GPU 5 healthy", timeout_s=10)


def test_another_driver_in_the_node_file_is_picked_up_without_a_restart(
    agent: Agent, node: NodeFile
) -> None:
    old = node.driver_version
    pid = agent.proc.pid
    node.load_driver(NEW)
    started = time.monotonic()
    wait_until(lambda: agent.driver_version() == NEW, what="the new driver", timeout_s=10)
    took = time.monotonic() - started
    assert took < 5, f"picked up after {took:.1f} s"
    assert agent.proc.pid == pid
    assert agent.proc.poll() is None
    cli = agent.get("/docker/cli")[1].decode()
    assert f"--volume=nvidia_driver_{NEW}:/usr/local/nvidia:ro" in cli
    mesos = agent.get("/mesos/cli")[1].decode()
    assert mesos.startswith("--attributes=gpus:")
    log = agent.log()
    assert f"The loaded NVIDIA kernel module is {NEW}, not {old}: released the GPUs" in log
    assert f"Driver {NEW} picked up (was {old})" in log


def _rereads_at_least(agent: Agent, count: int) -> bool:
    return agent.log().count("Reload: driver") >= count


def _more_requests(load: StatusLoad, before: int) -> bool:
    return load.count() > before + 20


def test_sighup_with_nothing_changed_disturbs_no_request(agent: Agent) -> None:
    load = StatusLoad(agent.port, clients=8).start()
    try:
        for number in range(1, 6):
            before = load.count()
            agent.proc.send_signal(signal.SIGHUP)
            wait_until(
                functools.partial(_rereads_at_least, agent, number),
                what=f"re-read {number}",
                timeout_s=10,
            )
            wait_until(functools.partial(_more_requests, load, before), what="load", timeout_s=10)
    finally:
        outcomes = load.stop()
    assert outcomes
    bad = [o for o in outcomes if o.status != 200]
    assert bad == []
    assert "Reload: driver 580.159.04, unchanged" in agent.log()
    assert json.loads(outcomes[-1].body)["Devices"]
