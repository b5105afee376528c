"""Choosing the GPU backend: NVML, or the simulated one only when asked for explicitly."""

from __future__ import annotations

from agent.gpu.backend import GpuBackend, GpuBackendError
from agent.gpu.nodefile import NodeFileError
from agent.gpu.simulated import SimulatedBackend


def open_backend(simulate: str | None) -> GpuBackend:
    """The backend the daemon serves; raises GpuBackendError with one clear line.

    Never falls back to simulation: a node whose driver failed must not advertise fake
    GPUs to Docker or Mesos.
    """
    if simulate is not None:
        try:
            return SimulatedBackend.from_file(simulate)
        except NodeFileError as err:
            raise GpuBackendError(str(err)) from None
    from agent.gpu.nvml_backend import NvmlBackend  # noqa: PLC0415 - pynvml only when needed

    return NvmlBackend.start()
