"""What the lease table hands out: units, each a whole GPU or one MIG device.

A GPU not in MIG mode is one unit; a GPU in MIG mode is its MIG devices, one unit each, and
is not a unit itself: naming it (``0``, ``GPU-…``, ``/dev/nvidia0``) names all its MIG
devices, as a whole-GPU ``dev`` entry does (``agent.node.selection``); its device file names
only the MIG devices whose capability files are named too, when any is (``given``). A GPU
in MIG mode without MIG devices has no unit. A unit's key is its UUID (``GPU-…``, ``MIG-…``),
which a renumbering keeps; without one, its ``dev`` name (``3``, ``0:1``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agent.gpu.model import DeviceInfo, NodeInfo
from agent.node.selection import Target, select_targets

# A CDI name of a GPU kind: NVIDIA's ``nvidia.com/gpu=`` or the agent's own under a
# ``--cdi-kind`` of class ``gpu`` (``nvidia-docker.com/gpu=``): a lowercase vendor (letters,
# digits, ``.-``), then the class ``gpu``. Names of any other kind are not read as GPUs.
CDI_GPU_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?/gpu=(?P<name>.+)")


def cdi_device(entry: str) -> str | None:
    """The device part of a CDI GPU name (``nvidia.com/gpu=0`` -> ``0``), else None."""
    match = CDI_GPU_NAME.fullmatch(entry)
    return match.group("name") if match else None


CAPS_PREFIX = "/dev/nvidia-caps/"


@dataclass(frozen=True, slots=True)
class Unit:
    """One leasable thing: GPU ``gpu`` (``mig`` None), or MIG device ``mig`` of GPU ``gpu``."""

    gpu: int  # the GPU's index on the node
    mig: int | None  # the MIG device's index on its GPU; None: the whole GPU
    uuid: str | None  # "GPU-…" or "MIG-…"
    profile: str | None  # the MIG profile ("1g.18gb"); None for a whole GPU
    numa_node: int | None  # the GPU's NUMA node (DeviceInfo.cpu_affinity)
    path: str | None  # the GPU's device file, "/dev/nvidia<minor>"

    @property
    def name(self) -> str:
        """The ``dev`` entry that names it: ``3``, or ``0:1`` for a MIG device."""
        return str(self.gpu) if self.mig is None else f"{self.gpu}:{self.mig}"

    @property
    def key(self) -> str:
        """How the table and the container labels name it: the UUID, else the ``dev`` name."""
        return self.uuid or self.name

    @property
    def label(self) -> str:
        """``GPU 3`` or ``MIG 0:1``, as the table's lines say it."""
        return f"GPU {self.name}" if self.mig is None else f"MIG {self.name}"


def _units_of(device: DeviceInfo) -> tuple[Unit, ...]:
    if device.mig_enabled:
        return tuple(
            Unit(device.index, m.index, m.uuid, m.profile, device.cpu_affinity, device.path)
            for m in device.mig_devices
        )
    return (Unit(device.index, None, device.uuid, None, device.cpu_affinity, device.path),)


class NodeUnits:
    """The units of one ``NodeInfo``, in GPU then MIG index order, and the ways to name them."""

    def __init__(self, node: NodeInfo) -> None:
        self.node = node
        self._units: dict[str, Unit] = {}
        self._by_gpu: dict[int, tuple[Unit, ...]] = {}
        for device in node.devices:
            units = _units_of(device)
            self._by_gpu[device.index] = units
            for unit in units:
                self._units.setdefault(unit.key, unit)

    def all(self) -> tuple[Unit, ...]:
        return tuple(self._units.values())

    def get(self, key: str) -> Unit | None:
        return self._units.get(key)

    def of_gpu(self, index: int) -> tuple[Unit, ...]:
        return self._by_gpu.get(index, ())

    def whole_gpus(self) -> tuple[Unit, ...]:
        """The units that are whole GPUs (the GPUs not in MIG mode)."""
        return tuple(u for u in self._units.values() if u.mig is None)

    def mig_units(self, profile: str) -> tuple[Unit, ...]:
        return tuple(u for u in self._units.values() if u.mig is not None and u.profile == profile)

    def profiles(self) -> tuple[str, ...]:
        """The MIG profiles the node has, each once, in unit order."""
        seen = dict.fromkeys(u.profile for u in self._units.values() if u.profile)
        return tuple(p for p in seen if p)

    def of_targets(self, targets: Iterable[Target]) -> tuple[Unit, ...]:
        """The units a selection names (a whole GPU in MIG mode: all its MIG devices)."""
        chosen: dict[str, Unit] = {}
        for target in targets:
            for unit in self.of_gpu(target.gpu.index):
                if target.mig is None or unit.mig == target.mig.index:
                    chosen.setdefault(unit.key, unit)
        return tuple(chosen.values())

    def named(self, dev: str) -> tuple[Unit, ...]:
        """The units ``dev`` entries name (``InvalidParameter`` for one that names nothing)."""
        return self.of_targets(select_targets(self.node.devices, dev))

    def given(self, devices: Sequence[str]) -> tuple[Unit, ...]:
        """The units a container was given, from what its engine says, leniently: ``dev``
        entries, CDI names (``nvidia.com/gpu=1``), ``all``, device files (``/dev/nvidia1``,
        ``/dev/nvidia-caps/nvidia-cap12``). What names nothing here is left out (a fact of the
        world, not a request). A GPU in MIG mode named by its device file means its MIG
        devices whose capability files are named too, or all of them when none is."""
        chosen: dict[str, Unit] = {}
        capped = {
            u.gpu
            for entry in devices
            if entry.startswith(CAPS_PREFIX)
            for u in self._by_capability(entry)
        }
        for raw in devices:
            entry = cdi_device(raw) or raw
            if entry == "all":
                units = self.all()
            elif entry.startswith(CAPS_PREFIX):
                units = self._by_capability(entry)
            elif entry.startswith("/dev/"):
                units = tuple(
                    u
                    for d in self.node.devices
                    if d.path == entry and d.index not in capped
                    for u in self.of_gpu(d.index)
                )
            else:
                units = self._lenient(entry)
            for unit in units:
                chosen.setdefault(unit.key, unit)
        return tuple(u for u in self._units.values() if u.key in chosen)

    def _by_capability(self, path: str) -> tuple[Unit, ...]:
        return tuple(
            unit
            for d in self.node.devices
            for m in d.mig_devices
            if d.mig_enabled and path in m.capabilities
            for unit in self.of_gpu(d.index)
            if unit.mig == m.index
        )

    def _lenient(self, entry: str) -> tuple[Unit, ...]:
        if not entry or entry == "*" or any(c in entry for c in " ,"):
            return ()
        try:
            return self.named(entry)
        except ValueError:  # InvalidParameter: a name for nothing on this node
            return ()
