"""Simulated backend: a node described by a node file, selected only with ``--simulate FILE``.

It is a real backend with the same model and the same threading contract as NVML, so the
whole agent (REST API, plugin, Mesos flags) runs on machines without a GPU. It can mimic
NVML's call costs (``timing`` in the node file) so that benchmarks see realistic latencies.
"""

from __future__ import annotations

import time

from agent.gpu import nodefile
from agent.gpu.model import (
    LOST_DEVICE_STATUS,
    UNKNOWN_THROUGHPUT,
    DeviceStatus,
    NodeInfo,
    PcieThroughput,
)


class SimulatedBackend:
    def __init__(self, node: nodefile.NodeFile, source: str) -> None:
        self._node = node
        self._source = source

    @classmethod
    def from_file(cls, name_or_path: str) -> SimulatedBackend:
        """Load a node file (or a built-in node name); raises ``NodeFileError``."""
        return cls(nodefile.load(name_or_path), str(nodefile.resolve(name_or_path)))

    @property
    def name(self) -> str:
        return f"simulated ({self._source})"

    def node_info(self) -> NodeInfo:
        return self._node.info

    def device_status(self, index: int) -> DeviceStatus:
        if self._node.status_call_s:
            time.sleep(self._node.status_call_s)
        device = self._node.devices[index]
        return LOST_DEVICE_STATUS if device.lost else device.status

    def pcie_throughput(self, index: int) -> PcieThroughput:
        if self._node.pcie_sample_s:
            time.sleep(self._node.pcie_sample_s)
        device = self._node.devices[index]
        return UNKNOWN_THROUGHPUT if device.lost else device.throughput

    def close(self) -> None:
        return None
