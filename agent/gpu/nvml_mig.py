"""MIG devices through NVML, and the capability device nodes that grant access to them.

A GPU in MIG mode is split into MIG devices (a GPU instance with a compute instance). A
process sees one only with its GPU's node (``/dev/nvidiaN``) *and* the capability nodes of
its GPU instance and compute instance: ``/dev/nvidia-caps/nvidia-cap<minor>``. The driver
lists every capability's minor in ``/proc/driver/nvidia-caps/mig-minors``, one per line::

    config 1
    monitor 2
    gpu0/gi0/access 3
    gpu0/gi0/ci0/access 4

where ``gpu<N>`` is the GPU's *minor number* (``/dev/nvidia<N>``), not its NVML index.

Only reads: nothing here changes a GPU's MIG mode or its instances.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from agent.gpu import nvml_query as nvml
from agent.gpu.model import MigDevice

log = logging.getLogger(__name__)

MIG_MINORS = "driver/nvidia-caps/mig-minors"  # under /proc
CAPS_DIR = "/dev/nvidia-caps"
DEVICE_MIG_ENABLE = 1  # nvmlDeviceGetMigMode: NVML_DEVICE_MIG_ENABLE
MIB = 1024 * 1024


def read_mig_minors(proc: str | os.PathLike[str]) -> dict[str, int]:
    """The capability minors, ``{"gpu0/gi1/access": 12, ...}``; empty when the file is
    missing (a driver without MIG support) or unreadable. Malformed lines are skipped."""
    try:
        with open(os.path.join(proc, MIG_MINORS), encoding="utf-8", errors="replace") as file:
            text = file.read()
    except OSError:
        return {}
    minors: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            minors[parts[0]] = int(parts[1])
    return minors


def capability_nodes(
    gpu_minor: int | None, gi: int | None, ci: int | None, minors: Mapping[str, int]
) -> tuple[str, ...]:
    """The nodes of GPU instance ``gi`` and its compute instance ``ci``; empty if unknown."""
    if gpu_minor is None or gi is None or ci is None:
        return ()
    keys = (f"gpu{gpu_minor}/gi{gi}/access", f"gpu{gpu_minor}/gi{gi}/ci{ci}/access")
    if not all(key in minors for key in keys):
        return ()
    return tuple(f"{CAPS_DIR}/nvidia-cap{minors[key]}" for key in keys)


def profile_of(name: str | None) -> str | None:
    """``1g.18gb`` from the MIG device name NVML gives (``NVIDIA H200 MIG 1g.18gb``)."""
    if not name or " MIG " not in name:
        return None
    return name.rsplit(" MIG ", 1)[1].strip() or None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def mig_state(
    handle: Any, gpu_index: int, gpu_minor: int | None, minors: Mapping[str, int]
) -> tuple[bool | None, tuple[MigDevice, ...]]:
    """Whether MIG mode is on for the GPU of ``handle`` now, and its MIG devices.

    ``None`` when the GPU cannot do MIG (or NVML cannot say); a GPU in MIG mode without
    instances has no devices.
    """
    mode = nvml.query("nvmlDeviceGetMigMode", handle)
    if not isinstance(mode, list | tuple) or not mode or _int(mode[0]) is None:
        return None, ()
    if mode[0] != DEVICE_MIG_ENABLE:
        return False, ()
    count = _int(nvml.query("nvmlDeviceGetMaxMigDeviceCount", handle)) or 0
    devices = []
    for index in range(count):
        mig = nvml.attempt("nvmlDeviceGetMigDeviceHandleByIndex", handle, index).value
        if mig is None:  # an empty slot: NVML answers "not found"
            continue
        device = _mig_device(index, mig, gpu_minor, minors)
        if not device.capabilities:
            log.warning(
                "GPU %d, MIG device %d: its capability minors are not in /proc/%s: "
                "containers cannot be given it (is the nvidia-caps module loaded?)",
                gpu_index,
                index,
                MIG_MINORS,
            )
        devices.append(device)
    return True, tuple(devices)


def _mig_device(
    index: int, handle: Any, gpu_minor: int | None, minors: Mapping[str, int]
) -> MigDevice:
    gi = _int(nvml.query("nvmlDeviceGetGpuInstanceId", handle))
    ci = _int(nvml.query("nvmlDeviceGetComputeInstanceId", handle))
    memory = nvml.query("nvmlDeviceGetMemoryInfo", handle)
    total = _int(getattr(memory, "total", None)) if memory is not None else None
    return MigDevice(
        index=index,
        uuid=_text(nvml.query("nvmlDeviceGetUUID", handle)),
        profile=profile_of(_text(nvml.query("nvmlDeviceGetName", handle))),
        memory_mib=None if total is None else total // MIB,
        gpu_instance_id=gi,
        compute_instance_id=ci,
        capabilities=capability_nodes(gpu_minor, gi, ci, minors),
    )
