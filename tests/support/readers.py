"""A GPU backend read as the daemon reads its GPU worker: every device at once, as coroutines.

The daemon's status service reads a ``GpuReader`` (``agent.node.status``): in the agent that
is the GPU worker's client. Tests and benchmarks that serve the REST API in-process, without
a worker process, wrap a backend (the simulated one) in ``ThreadReader``: each device is
read in a thread of its own, all at once, and a device whose read fails shows null values
(``LOST_DEVICE_STATUS``), as the worker does with its pool.
"""

from __future__ import annotations

import asyncio

from agent.gpu.backend import GpuBackend
from agent.gpu.model import (
    LOST_DEVICE_STATUS,
    UNKNOWN_THROUGHPUT,
    DeviceStatus,
    PcieThroughput,
)


class ThreadReader:
    """``backend`` as a ``GpuReader``."""

    def __init__(self, backend: GpuBackend) -> None:
        self.backend = backend
        self._count = len(backend.node_info().devices)

    async def read_statuses(self) -> tuple[DeviceStatus, ...]:
        return tuple(
            await asyncio.gather(*(asyncio.to_thread(self._status, i) for i in range(self._count)))
        )

    async def read_throughputs(self) -> tuple[PcieThroughput, ...]:
        return tuple(
            await asyncio.gather(
                *(asyncio.to_thread(self._throughput, i) for i in range(self._count))
            )
        )

    def _status(self, index: int) -> DeviceStatus:
        try:
            return self.backend.device_status(index)
        except Exception:
            return LOST_DEVICE_STATUS

    def _throughput(self, index: int) -> PcieThroughput:
        try:
            return self.backend.pcie_throughput(index)
        except Exception:
            return UNKNOWN_THROUGHPUT
