"""The node's life: release on a driver change, pick-up of the new one, worker restarts.

The worker is the real ``agent.gpu.worker`` served in a thread over a simulated node whose
driver version is the "loaded module" of the test; the installed and loaded versions are
set by the test. Each test drives the daemon's look at the driver with ``reread()`` (what
SIGHUP does), so nothing waits for the once-a-second watch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agent.gpu import nodefile, worker
from agent.gpu.simulated import SimulatedBackend
from agent.gpu.worker_client import WorkerClient, WorkerFailed
from agent.node.facts import NodeFacts
from agent.node.life import UPGRADE_IN_PROGRESS, WORKER_RESTARTING, DriverWatch, NodeLife
from agent.node.state import NodeState
from agent.node.status import StatusService, StatusUnavailable
from plugin.discovery import DriverFiles
from plugin.volumes import VolumeStore
from tests.support.fake_driver import FakeDriver

OLD, NEW = "580.159.04", "590.48.01"


class Version:
    """A version source the test sets (the linker cache, the kernel module)."""

    def __init__(self, value: str | None) -> None:
        self.value = value
        self.looks = 0

    def version(self, *, force: bool = False) -> str | None:
        self.looks += 1
        return self.value


class ThreadWorkers:
    """``spawn`` for NodeLife: a worker thread serving the node at the loaded version."""

    def __init__(self, loaded: Version) -> None:
        self.loaded = loaded
        self.started: list[tuple[WorkerClient, threading.Thread]] = []
        self.refusals: list[Exception] = []  # raised by the next spawns, in order

    async def spawn(self) -> WorkerClient:
        if self.refusals:
            raise self.refusals.pop(0)
        node = nodefile.load("h200")
        version = self.loaded.value or OLD
        node = dataclasses.replace(
            node, info=dataclasses.replace(node.info, driver_version=version)
        )
        backend = SimulatedBackend(node, f"test node, driver {version}")
        ours, theirs = socket.socketpair()
        thread = threading.Thread(
            target=worker.run, args=(theirs, lambda: backend), kwargs={"health_interval_s": 0.05}
        )
        thread.start()
        client = await WorkerClient.attach(ours)
        self.started.append((client, thread))
        return client


@dataclasses.dataclass
class Node:
    life: NodeLife
    installed: Version
    loaded: Version
    workers: ThreadWorkers
    status: StatusService
    state: NodeState
    store: VolumeStore


@pytest.fixture
async def node(tmp_path: Path, fake_driver: FakeDriver) -> AsyncIterator[Node]:
    installed, loaded = Version(OLD), Version(OLD)
    workers = ThreadWorkers(loaded)
    watch = DriverWatch(
        spawn=workers.spawn,
        installed=installed,
        loaded=loaded,
        ldcache=fake_driver.ldcache,
        simulated=True,
        poll_interval_s=3600,  # the test looks with reread()
    )
    first = await watch.spawn()
    status = StatusService(first, first.node_info(), pcie_interval_s=3600)
    state = NodeState(NodeFacts(first.node_info(), ("/dev/nvidiactl",)))
    store = VolumeStore(tmp_path / "volumes", DriverFiles(driver_version=OLD))
    life = NodeLife(watch, first, status=status, state=state, store=store)
    await life.start()
    yield Node(life, installed, loaded, workers, status, state, store)
    await life.close()
    await status.close()
    for _, thread in workers.started:
        await asyncio.to_thread(thread.join, 10)


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


async def test_an_upgrade_releases_the_gpus_then_picks_the_new_driver_up(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    old_worker, old_thread = node.workers.started[0]
    assert (await node.status.sweep()).statuses

    # The package manager installs the new files: the old worker must let go.
    node.installed.value = NEW
    await node.life.reread()
    assert node.life.released
    assert old_worker.closed.is_set()
    await asyncio.to_thread(old_thread.join, 10)
    assert not old_thread.is_alive()  # NVML shut down: no device file held
    with pytest.raises(StatusUnavailable, match=UPGRADE_IN_PROGRESS):
        await node.status.sweep()
    assert node.state.facts.node.driver_version == OLD  # /gpu/info: the last facts
    (released,) = [m for m in messages(caplog) if "released the GPUs" in m]
    assert released.startswith(f"The installed NVIDIA driver changed ({OLD} -> {NEW})")

    # The old module is still loaded: nothing to pick up yet.
    await node.life.reread()
    assert node.life.released
    assert len(node.workers.started) == 1

    # The new module is loaded.
    node.loaded.value = NEW
    await node.life.reread()
    assert not node.life.released
    assert node.state.facts.node.driver_version == NEW
    assert (await node.status.sweep()).statuses
    assert node.store.driver_version == NEW  # nvidia_driver_<new> can be created
    assert b'"Driver":"590.48.01"' in node.state.facts.info_json
    assert node.state.facts.docker_cli(None, None, True).count(f"nvidia_driver_{NEW}".encode())
    assert any(f"Driver {NEW} picked up (was {OLD})" in m for m in messages(caplog))


async def test_another_module_alone_is_an_upgrade_when_files_are_not_tracked(
    node: Node,
) -> None:
    """A simulated node without a fake driver root: the node file is the whole driver."""
    node.life._tracked = False
    node.installed.value = None
    node.loaded.value = NEW
    await node.life.reread()  # release and pick-up in one look
    assert not node.life.released
    assert node.state.facts.node.driver_version == NEW
    assert len(node.workers.started) == 2


@pytest.mark.parametrize(("code", "words"), [(18, "versions differ"), (9, "not loaded")])
async def test_nvml_not_ready_is_waited_for(
    node: Node, caplog: pytest.LogCaptureFixture, code: int, words: str
) -> None:
    caplog.set_level(logging.INFO)
    node.workers.refusals = [
        WorkerFailed(f"NVIDIA driver {words}", nvml_code=code),
        WorkerFailed(f"NVIDIA driver {words}", nvml_code=code),
    ]
    node.installed.value = node.loaded.value = NEW
    await node.life.reread()
    await node.life.reread()
    assert node.life.released
    with pytest.raises(StatusUnavailable):
        await node.status.sweep()
    waiting = [m for m in messages(caplog) if m.startswith("Waiting for the driver")]
    assert waiting == [
        f"Waiting for the driver: NVML is not ready (NVIDIA driver {words}); looking again "
        "every 3600 s"
    ]  # once, however often it looks
    await node.life.reread()
    assert node.state.facts.node.driver_version == NEW


async def test_a_reread_with_no_change_disturbs_nothing(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    facts, first = node.state.facts, node.life.worker
    sweeps = [node.status.sweep() for _ in range(20)]
    results = await asyncio.gather(*sweeps, node.life.reread())
    assert all(r is None or r.statuses for r in results)
    assert node.state.facts is facts
    assert node.life.worker is first
    assert f"Reload: driver {OLD}, unchanged" in messages(caplog)


async def test_a_driver_error_from_nvml_releases_the_gpus(node: Node) -> None:
    worker_client, _ = node.workers.started[0]
    assert node.life.health is not None
    node.life._on_driver_error(9)  # what the push of the worker does
    await node.life.reread()
    # The module answers with the same version again: the worker comes back.
    assert not node.life.released
    assert node.life.worker is not worker_client
    assert worker_client.closed.is_set()


async def test_a_worker_that_dies_is_restarted_with_the_same_facts(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    facts_before = node.state.facts.node
    first, _ = node.workers.started[0]
    await first.stop()  # as if it had exited
    await node.life.reread()
    assert not node.life.released
    assert node.life.worker is not first
    assert node.state.facts.node == facts_before
    assert any("GPU worker restarted" in m for m in messages(caplog))
    assert any("restarting it" in m for m in messages(caplog))


async def test_while_restarting_status_says_so(node: Node) -> None:
    first, _ = node.workers.started[0]
    node.workers.refusals = [WorkerFailed("boom")]
    await first.stop()
    await node.life.reread()
    with pytest.raises(StatusUnavailable, match=WORKER_RESTARTING):
        await node.status.sweep()
    await node.life.reread()
    assert (await node.status.sweep()).statuses


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_a_worker_that_keeps_exiting_is_started_after_a_growing_pause(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """NVML crashing in a loop: the first exit is restarted at once, the next ones (each
    within a minute of the start) after 1 s, then 2 s, ..., one log line per exit."""
    caplog.set_level(logging.INFO)
    node.life._watch = dataclasses.replace(node.life._watch, poll_interval_s=0.05)

    def exits() -> list[str]:
        return [m for m in messages(caplog) if "restarting it" in m]

    first, _ = node.workers.started[0]
    await first.stop()
    await _until(lambda: node.life.worker is not None and node.life.worker is not first)
    assert exits()[-1].endswith(": restarting it")  # once: at once

    second = node.life.worker
    assert second is not None
    await second.stop()
    await _until(lambda: len(exits()) == 2)
    assert exits()[-1].endswith(
        "restarting it in 1 s (2 workers in a row exited within 60 s of their start)"
    )
    paused = time.monotonic()
    await asyncio.sleep(0.5)  # ten looks of the watch
    assert node.life.released
    assert len(node.workers.started) == 2
    with pytest.raises(StatusUnavailable, match=WORKER_RESTARTING):
        await node.status.sweep()
    await _until(lambda: node.life.worker is not None)
    assert time.monotonic() - paused >= 0.9

    third = node.life.worker
    assert third is not None
    await third.stop()
    await _until(lambda: len(exits()) == 3)
    assert exits()[-1].endswith(
        "restarting it in 2 s (3 workers in a row exited within 60 s of their start)"
    )
    assert len([m for m in messages(caplog) if "GPU worker restarted" in m]) == 2
