"""The node's facts as the CDI spec builder's plain values (``cdi.spec``), and the CDI names
of a selection (``/docker/cli?format=cdi``, the wrapper's CDI mode).

Device nodes are named by their path in the container (``/dev/nvidia0``); with a dev root
other than ``/`` (a driver container that makes its nodes under, say, ``/run/nvidia/driver``)
the spec also says where each is on the host.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.gpu.model import DeviceInfo, NodeInfo
from agent.node.selection import Target
from cdi import spec

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
UVM_TOOLS = "/dev/nvidia-uvm-tools"  # only where it exists, as for /docker/cli
ROOT = Path("/")


def device_node(path: str, dev_root: Path = ROOT) -> spec.DeviceNode:
    """``path`` in the container, and where it is on the host under ``dev_root``."""
    if dev_root == ROOT:
        return spec.DeviceNode(path)
    return spec.DeviceNode(path, str(dev_root / path.lstrip("/")))


def control_nodes(
    dev_root: Path = ROOT, exists: Callable[[str], bool] = os.path.exists
) -> tuple[spec.DeviceNode, ...]:
    """The nodes every GPU container needs, as present under ``dev_root``."""
    paths = list(CONTROL_NODES)
    if exists(str(dev_root / UVM_TOOLS.lstrip("/"))):
        paths.append(UVM_TOOLS)
    return tuple(device_node(path, dev_root) for path in paths)


def cdi_gpu(device: DeviceInfo, dev_root: Path = ROOT, *, healthy: bool = True) -> spec.Gpu:
    return spec.Gpu(
        index=device.index,
        uuid=device.uuid,
        node=device_node(device.path, dev_root) if device.path else None,
        healthy=healthy,
        mig=tuple(
            spec.MigInstance(
                index=mig.index,
                uuid=mig.uuid,
                nodes=tuple(device_node(cap, dev_root) for cap in mig.capabilities),
            )
            for mig in device.mig_devices
        ),
    )


def spec_inputs(
    node: NodeInfo,
    *,
    unhealthy: frozenset[int] = frozenset(),
    driver_volume: Path | None,
    hook: spec.LinkerCacheHook | None,
    dev_root: Path = ROOT,
    exists: Callable[[str], bool] = os.path.exists,
) -> spec.SpecInputs:
    return spec.SpecInputs(
        gpus=tuple(
            cdi_gpu(dev, dev_root, healthy=dev.index not in unhealthy) for dev in node.devices
        ),
        control_nodes=control_nodes(dev_root, exists),
        driver_volume=None if driver_volume is None else str(driver_volume),
        hook=hook,
    )


def cdi_names(targets: Sequence[Target]) -> tuple[str, ...]:
    """``nvidia.com/gpu=<name>`` for each target the spec has a device for, in order, each
    once: GPUs and MIG devices by UUID (stable across reboots), by index when they have
    none."""
    names: list[str] = []
    for target in targets:
        gpu = cdi_gpu(target.gpu)
        if target.mig is None:
            name = spec.gpu_name(gpu)
        else:
            mig = next(m for m in gpu.mig if m.index == target.mig.index)
            name = spec.mig_name(gpu, mig)
        if name is not None and spec.qualified(name) not in names:
            names.append(spec.qualified(name))
    return tuple(names)
