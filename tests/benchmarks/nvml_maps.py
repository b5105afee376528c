"""Which step of the NVML backend's start maps ``libcuda`` into the process, on a real GPU.

The GPU worker keeps ``libcuda`` mapped for as long as it lives (docs/performance.md, "The
house in order"); the CUDA facts themselves come from a short-lived child. This starts the
NVML backend step by step in this process and says, after each, whether ``libcuda`` is
mapped and the resident memory. On the H200 machine (driver 580.159.04) ``nvmlInit`` itself
maps it (+18 MB), so no choice of NVML calls keeps it out of the worker.

    python -m tests.benchmarks.nvml_maps          # the backend as the worker starts it
    python -m tests.benchmarks.nvml_maps steps    # NVML's calls one by one
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _state() -> str:
    maps = Path("/proc/self/maps").read_text()
    rss = next(
        line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )  # fmt: skip
    return (
        f"libcuda {'MAPPED' if 'libcuda' in maps else 'not mapped'}, RSS {int(rss) / 1024:.1f} MB"
    )


def backend() -> None:
    from agent.gpu.nvml_backend import NvmlBackend  # noqa: PLC0415

    print(f"start: {_state()}")
    started = NvmlBackend.start()
    print(f"after NvmlBackend.start (the CUDA probe in a child): {_state()}")
    started.device_status(0)
    started.pcie_throughput(0)
    print(f"after a status read and a PCIe sample: {_state()}")
    started.close()


def steps() -> None:
    from agent.gpu import nvml_query as nvml  # noqa: PLC0415

    print(f"start: {_state()}")
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("nvmlInit", lambda: nvml.call("nvmlInit")),
        ("nvmlSystemGetDriverVersion", lambda: nvml.call("nvmlSystemGetDriverVersion")),
        ("nvmlDeviceGetHandleByIndex(0)", lambda: nvml.call("nvmlDeviceGetHandleByIndex", 0)),
    ]
    handle = None
    for name, step in steps:
        value = step()
        handle = value if name.startswith("nvmlDeviceGetHandle") else handle
        print(f"after {name}: {_state()}")
    for name in ("nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetNumGpuCores"):
        nvml.attempt(name, handle)
        print(f"after {name}: {_state()}")
    nvml.attempt("nvmlSystemGetCudaDriverVersion_v2")
    print(f"after nvmlSystemGetCudaDriverVersion_v2: {_state()}")
    nvml.call("nvmlShutdown")


if __name__ == "__main__":
    steps() if sys.argv[1:] == ["steps"] else backend()
