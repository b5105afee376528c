"""The GPUs' loads reach the lease table through the usage ledger's sweeps: a real ledger
tick (status service, attribution, lease service) on the simulated ``hgx-h200-8``, whose
GPUs 2 and 3 run a training job (97 %, 84 % of their memory), and a fake GPU reader at the
NVML boundary that answers what the node file says (or what a test changes it to)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.attribution.owners import Attributor
from agent.gpu import nodefile
from agent.gpu.model import DeviceStatus, PcieThroughput, Utilization
from agent.leases.answers import Granted
from agent.leases.asks import Ask
from agent.leases.settings import LeaseSettings
from agent.leasing.service import LeaseService
from agent.node.status import StatusService
from agent.usage.ledger import UsageLedger, UsageSettings
from tests.unit.leases.nodes import healthy

FILE = nodefile.load("hgx-h200-8")


class NodeFileReader:
    """The GPU worker's answers, from the node file; ``statuses`` may be changed."""

    def __init__(self) -> None:
        self.statuses = tuple(d.status for d in FILE.devices)

    async def read_statuses(self) -> tuple[DeviceStatus, ...]:
        return self.statuses

    async def read_throughputs(self) -> tuple[PcieThroughput, ...]:
        return tuple(d.throughput for d in FILE.devices)


@dataclasses.dataclass
class Agent:
    reader: NodeFileReader
    leases: LeaseService
    ledger: UsageLedger

    async def picks(self, count: int) -> list[int]:
        """The GPUs an ask for ``count`` gets, given back at once."""
        answer = await self.leases.ask(Ask(count=count))
        assert isinstance(answer, Granted), answer
        self.leases.release(answer.lease.id)
        return [unit.gpu for unit in answer.units]


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    reader = NodeFileReader()
    status = StatusService(reader, FILE.info, shared_s=0.0)
    leases = LeaseService.open(FILE.info, healthy(FILE.info), LeaseSettings(), None)
    attributor = Attributor(None, proc=tmp_path / "proc")  # no process is placed
    ledger = UsageLedger(UsageSettings(tmp_path / "usage.db"), status, leases, attributor, None)
    yield Agent(reader, leases, ledger)
    await leases.close()


async def test_a_tick_gives_the_table_the_loads_and_picks_go_by_them(agent: Agent) -> None:
    assert await agent.picks(4) == [0, 1, 2, 3]  # no sweep yet: by index
    await agent.ledger.tick()
    assert await agent.picks(4) == [4, 5, 6, 7]  # socket 1: idle; socket 0 holds 2 and 3
    assert await agent.picks(2) == [0, 1]  # an idle NVLink pair of socket 0 equals socket 1's
    assert await agent.picks(5) == [0, 4, 5, 6, 7]  # four on one socket, the idle one's


async def test_each_tick_replaces_the_last_ones_loads(agent: Agent) -> None:
    await agent.ledger.tick()
    assert await agent.picks(1) == [0]
    busy = dataclasses.replace(
        agent.reader.statuses[0], utilization=Utilization(100, 80, 0, 0), memory_used_mib=90_000
    )
    idle = agent.reader.statuses[0]
    agent.reader.statuses = (busy, idle, idle, *agent.reader.statuses[3:])
    await agent.ledger.tick()
    assert await agent.picks(1) == [1]  # GPU 0 is busy now
    assert await agent.picks(2) == [1, 2]  # and GPU 2 idle again


async def test_a_ledger_whose_file_cannot_be_opened_still_feeds_the_table(
    agent: Agent, tmp_path: Path
) -> None:
    """The usage ledger's file is only its record: without it (another agent holds it, a
    read-only disk) the sweeps still give the table each GPU's load and GPU processes."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    settings = UsageSettings(blocker / "usage.db", interval_s=0.05)
    ledger = UsageLedger.for_agent(
        settings, agent.ledger.status, agent.leases, agent.ledger.attributor
    )
    ledger.start()
    try:
        for _ in range(200):  # the store given up, then a tick: well within 10 s
            if ledger.off_reason is not None and await agent.picks(4) == [4, 5, 6, 7]:
                break
            await asyncio.sleep(0.05)
        assert ledger.off_reason is not None
        assert str(blocker) in ledger.off_reason
        assert await agent.picks(4) == [4, 5, 6, 7]  # socket 0's busy GPUs avoided
    finally:
        await ledger.close()
