"""Idle GPUs as the ledger's ticks find them (agent.usage.ledger, agent.usage.idle): a real
status service, lease service and attribution over a simulated node, a fake GPU reader at
the NVML boundary, and the ledger's clocks set by the test. A leased GPU is idle only when
the sweeps show it doing nothing; a sweep that cannot tell never counts as idle time."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.attribution.owners import Attributor
from agent.gpu import nodefile
from agent.gpu.model import LOST_DEVICE_STATUS, DeviceStatus, GpuProcess, PcieThroughput
from agent.leases.answers import Granted
from agent.leases.asks import Ask
from agent.leases.settings import LeaseSettings
from agent.leasing.service import LeaseService
from agent.node.status import StatusService
from agent.usage.ledger import UsageLedger, UsageSettings
from tests.unit.leases.nodes import healthy

INTERVAL = 10.0
IDLE_AFTER = 60.0
WALL0 = 1_796_000_000.0


class Reader:
    """The GPU worker's answers, from a node file; ``statuses`` may be changed."""

    def __init__(self, node: nodefile.NodeFile) -> None:
        self.node = node
        self.statuses = tuple(d.status for d in node.devices)

    async def read_statuses(self) -> tuple[DeviceStatus, ...]:
        return self.statuses

    async def read_throughputs(self) -> tuple[PcieThroughput, ...]:
        return tuple(d.throughput for d in self.node.devices)


@dataclasses.dataclass
class Node:
    reader: Reader
    leases: LeaseService
    ledger: UsageLedger
    wall: float = WALL0
    mono: float = 1000.0

    async def ticks(self, count: int, *, wall_step: float = INTERVAL) -> None:
        """``count`` ticks ``INTERVAL`` monotonic seconds apart (the wall clock moves by
        ``wall_step`` each)."""
        for _ in range(count):
            self.wall += wall_step
            self.mono += INTERVAL
            await self.ledger.tick()


async def node_of(name: str, tmp_path: Path) -> AsyncIterator[Node]:
    node_file = nodefile.load(name)
    reader = Reader(node_file)
    status = StatusService(reader, node_file.info, shared_s=0.0)
    leases = LeaseService.open(node_file.info, healthy(node_file.info), LeaseSettings(), None)
    attributor = Attributor(None, proc=tmp_path / "proc")  # no process is placed
    settings = UsageSettings(tmp_path / "usage.db", interval_s=INTERVAL, idle_after_s=IDLE_AFTER)
    made = Node(reader, leases, None)  # type: ignore[arg-type]
    made.ledger = UsageLedger(
        settings, status, leases, attributor, None,
        clock=lambda: made.wall, monotonic=lambda: made.mono,
    )  # fmt: skip
    yield made
    await leases.close()


@pytest.fixture
async def h200(tmp_path: Path) -> AsyncIterator[Node]:
    async for made in node_of("h200", tmp_path):
        yield made


@pytest.fixture
async def mig(tmp_path: Path) -> AsyncIterator[Node]:
    async for made in node_of("h200x2-mig", tmp_path):
        yield made


async def lease(node: Node, ask: Ask) -> str:
    answer = await node.leases.ask(ask)
    assert isinstance(answer, Granted), answer
    return answer.lease.id


async def test_a_leased_gpu_doing_nothing_is_idle_and_said_in_one_line(
    h200: Node, caplog: pytest.LogCaptureFixture
) -> None:
    lease_id = await lease(h200, Ask(count=1))
    caplog.set_level(logging.WARNING, "nvidia-docker-plugin.usage")
    await h200.ticks(7)  # the first sweep starts the spell; 60 s later it is idle
    (found,) = h200.ledger.idle.idle
    assert (found.holder.lease_id, found.idle_s) == (lease_id, IDLE_AFTER)
    assert [r.getMessage() for r in caplog.records] == [
        f"GPU 0 has been idle for 1 min 00 s, held by {lease_id}; policy notify: nothing done"
    ]


async def test_a_gpu_that_does_not_answer_is_never_idle(h200: Node) -> None:
    await lease(h200, Ask(count=1))
    h200.reader.statuses = (LOST_DEVICE_STATUS,)  # the worker's null values: NVML failed
    await h200.ticks(30)
    assert list(h200.ledger.idle.idle) == []
    h200.reader.statuses = tuple(d.status for d in h200.reader.node.devices)
    await h200.ticks(6)
    assert list(h200.ledger.idle.idle) == []  # the unknown time did not count
    await h200.ticks(1)
    assert len(h200.ledger.idle.idle) == 1


async def test_sweeps_missed_for_long_start_the_idle_time_afresh(h200: Node) -> None:
    await lease(h200, Ask(count=1))
    await h200.ticks(3)
    h200.wall += 600  # ten minutes without a sweep (the driver being replaced)
    h200.mono += 600
    await h200.ticks(5)
    assert list(h200.ledger.idle.idle) == []
    await h200.ticks(2)
    assert len(h200.ledger.idle.idle) == 1


async def test_a_wall_clock_set_back_neither_delays_nor_hastens_idle(h200: Node) -> None:
    await lease(h200, Ask(count=1))
    await h200.ticks(3)
    await h200.ticks(1, wall_step=-7200 + INTERVAL)  # an NTP step two hours back
    await h200.ticks(2)
    assert list(h200.ledger.idle.idle) == []
    await h200.ticks(1)
    (found,) = h200.ledger.idle.idle
    assert found.idle_s == IDLE_AFTER
    assert found.idle_since_s == h200.wall - IDLE_AFTER  # on the wall clock now


async def test_a_process_on_a_mig_gpu_the_attribution_cannot_place_keeps_its_devices_busy(
    mig: Node,
) -> None:
    await lease(mig, Ask(count=1, mig_profile="1g.18gb"))
    first = mig.reader.statuses[0]
    # a job of the lease's container whose PID the agent cannot see (another PID namespace)
    working = dataclasses.replace(first, processes=(GpuProcess(4242, "python", 8000),))
    mig.reader.statuses = (working, *mig.reader.statuses[1:])
    await mig.ticks(30)
    assert list(mig.ledger.idle.idle) == []
    mig.reader.statuses = (first, *mig.reader.statuses[1:])
    await mig.ticks(7)
    assert [f.unit for f in mig.ledger.idle.idle] == ["0:2"]


async def test_what_was_done_is_kept_only_while_its_holder_is_idle(h200: Node) -> None:
    """The ledger's record of its actions does not grow with every holder that was ever
    idle: a lease released is forgotten at the next sweep."""
    lease_id = await lease(h200, Ask(count=1))
    await h200.ticks(7)
    (found,) = h200.ledger.idle.idle
    assert h200.ledger.action_of(found) == "notified"
    h200.leases.release(lease_id)
    await h200.ticks(1)
    assert list(h200.ledger.idle.idle) == []
    assert h200.ledger.actions == {}
    lease_id = await lease(h200, Ask(count=1))  # a new holder: acted on anew once idle
    await h200.ticks(7)
    (found,) = h200.ledger.idle.idle
    assert h200.ledger.action_of(found) == "notified"
