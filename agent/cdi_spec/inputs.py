"""The node's facts as the CDI spec builder's plain values (``cdi.spec``), and the CDI names
of a selection (``/docker/cli?format=cdi``, the wrapper's CDI mode).

Device nodes are named by their path in the container (``/dev/nvidia0``); with a dev root
other than ``/`` (a driver container that makes its nodes under, say, ``/run/nvidia/driver``)
the spec also says where each is on the host. The names a selection gets are those of the
spec in force (``CdiNaming``): ours, or, while the agent steps aside for another producer's
spec (``agent.cdi_spec.writer``), that spec's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.gpu.model import DeviceInfo, NodeInfo
from agent.node.selection import InvalidParameter, Target
from cdi import spec
from cdi.host_files import HostMount

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
# Only where they exist: uvm-tools as for /docker/cli, modeset (display and DRM) as the
# toolkit gives it.
OPTIONAL_CONTROL_NODES = ("/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
ROOT = Path("/")


@dataclass(frozen=True, slots=True)
class CdiNaming:
    """The CDI spec in force: its kind, and its device names when it is not ours (None:
    ours, whose names follow from the facts)."""

    kind: str = spec.KIND
    names: frozenset[str] | None = None
    source: str | None = None  # the other spec's path, when it is not ours


OWN_NAMING = CdiNaming()


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
    paths += [path for path in OPTIONAL_CONTROL_NODES if exists(str(dev_root / path.lstrip("/")))]
    return tuple(device_node(path, dev_root) for path in paths)


def cdi_gpu(
    device: DeviceInfo,
    dev_root: Path = ROOT,
    *,
    healthy: bool = True,
    drm: tuple[spec.DeviceNode, ...] = (),
    sick_migs: frozenset[int] = frozenset(),
) -> spec.Gpu:
    return spec.Gpu(
        index=device.index,
        uuid=device.uuid,
        node=device_node(device.path, dev_root) if device.path else None,
        healthy=healthy,
        drm=drm,
        mig=tuple(
            spec.MigInstance(
                index=mig.index,
                uuid=mig.uuid,
                nodes=tuple(device_node(cap, dev_root) for cap in mig.capabilities),
                healthy=mig.index not in sick_migs,
            )
            for mig in device.mig_devices
        ),
    )


def _sick_migs(unhealthy: frozenset[int | tuple[int, int]], gpu: int) -> frozenset[int]:
    """The MIG devices of GPU ``gpu`` withdrawn on their own."""
    return frozenset(item[1] for item in unhealthy if isinstance(item, tuple) and item[0] == gpu)


def spec_inputs(
    node: NodeInfo,
    *,
    unhealthy: frozenset[int | tuple[int, int]] = frozenset(),
    driver_volume: Path | None,
    hook: spec.LinkerCacheHook | None,
    dev_root: Path = ROOT,
    exists: Callable[[str], bool] = os.path.exists,
    kind: str = spec.KIND,
    host_files: tuple[HostMount, ...] = (),
    drm: Mapping[int, tuple[spec.DeviceNode, ...]] | None = None,
) -> spec.SpecInputs:
    """The builder's inputs: every GPU (with its DRM nodes from ``drm``), the control nodes
    under ``dev_root``, the driver volume, the host files found, and the environment every
    container gets (``NVIDIA_VISIBLE_DEVICES=void``)."""
    drm = drm or {}
    return spec.SpecInputs(
        gpus=tuple(
            cdi_gpu(
                dev,
                dev_root,
                healthy=dev.index not in unhealthy,
                drm=drm.get(dev.index, ()),
                sick_migs=_sick_migs(unhealthy, dev.index),
            )
            for dev in node.devices
        ),
        control_nodes=control_nodes(dev_root, exists),
        driver_volume=None if driver_volume is None else str(driver_volume),
        hook=hook,
        kind=kind,
        env=(spec.VOID_VISIBLE_DEVICES,),
        host_files=host_files,
        driver_version=node.driver_version,
    )


def cdi_names(targets: Sequence[Target], naming: CdiNaming = OWN_NAMING) -> tuple[str, ...]:
    """``<kind>=<name>`` for each target the spec in force has a device for, in order, each
    once: GPUs and MIG devices by UUID (stable across reboots), by index when they have
    none or the spec in force does not name them so. ``InvalidParameter`` for a target that
    another producer's spec in force has no device for."""
    names: list[str] = []
    for target in targets:
        gpu = cdi_gpu(target.gpu)
        if target.mig is None:
            choices = [spec.gpu_name(gpu), str(gpu.index)]
            label = str(gpu.index)
        else:
            mig = next(m for m in gpu.mig if m.index == target.mig.index)
            choices = [spec.mig_name(gpu, mig), f"{gpu.index}:{mig.index}"]
            label = f"{gpu.index}:{mig.index}"
        name = choices[0]
        if naming.names is not None:
            name = next((c for c in choices if c is not None and c in naming.names), None)
            if name is None:
                hint = f" (the CDI spec in force, {naming.source}, has no device for it)"
                raise InvalidParameter("dev", label, hint)
        if name is not None and spec.qualified(name, naming.kind) not in names:
            names.append(spec.qualified(name, naming.kind))
    return tuple(names)
