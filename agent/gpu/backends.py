"""Choosing the GPU backend: NVML, or the simulated one only when asked for explicitly."""

from __future__ import annotations

from agent.gpu.backend import GpuBackend, GpuBackendError


def open_backend(simulate: str | None) -> GpuBackend:
    """The backend the daemon serves; raises GpuBackendError with one clear line.

    Never falls back to simulation: a node whose driver failed must not advertise fake
    GPUs to Docker or Mesos. Used by the GPU worker (the daemon's NVML) and ``--dump-node``.
    """
    if simulate is not None:
        from agent.gpu.nodefile import NodeFileError  # noqa: PLC0415 - simulation only
        from agent.gpu.simulated import SimulatedBackend  # noqa: PLC0415

        try:
            return SimulatedBackend.from_file(simulate)
        except NodeFileError as err:
            raise GpuBackendError(str(err)) from None
    from agent.gpu.nvml_backend import NvmlBackend  # noqa: PLC0415 - pynvml only when needed

    return NvmlBackend.start()
