"""The interface every GPU backend offers to the agent.

The GPU worker (``agent.gpu.worker``) runs one; its methods block (NVML calls, file reads)
and are called from the worker's threads, so they must be safe to call concurrently for
different devices. A failing call for one
device never raises: the affected values are ``None`` (see ``model.LOST_DEVICE_STATUS``).
"""

from __future__ import annotations

from typing import Protocol

from agent.gpu.model import DeviceStatus, NodeInfo, PcieThroughput


class GpuBackendError(Exception):
    """The backend cannot start (no driver, NVML failed, bad node file): one clear line.

    ``nvml_code`` is NVML's return code when NVML itself refused (``nvmlInit``): during a
    driver upgrade "driver not loaded" (9) and "library and kernel module versions differ"
    (18) mean "not yet", not "broken".
    """

    def __init__(self, message: str, *, nvml_code: int | None = None) -> None:
        super().__init__(message)
        self.nvml_code = nvml_code


class BackendGone(Exception):
    """The backend cannot answer at all any more (the GPU worker's process ended): nothing
    can be read until it is replaced. Per-device failures never raise this."""


class GpuBackend(Protocol):
    """Source of GPU facts for one node."""

    @property
    def name(self) -> str:
        """Short description for the log: ``NVML 13.580.159.04``, ``simulated (h200.json)``."""
        ...

    def node_info(self) -> NodeInfo:
        """Static facts: driver, CUDA version, devices. Read once; cheap to call again."""
        ...

    def device_status(self, index: int) -> DeviceStatus:
        """Live status of one device, without PCIe throughput. Fast (well under 1 ms)."""
        ...

    def pcie_throughput(self, index: int) -> PcieThroughput:
        """PCIe RX/TX of one device. Slow: NVML samples each direction for about 20 ms.

        In the daemon only the background sampler calls this, about once a second per device
        (``--dump-node`` also times a few samples), so it is also where a backend refreshes its
        other slow values (the NVML backend reads BAR1 usage here, and ``device_status``
        serves that sample).
        """
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown). Idempotent."""
        ...
