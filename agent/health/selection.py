"""Which GPUs a container may get: the ``dev`` selection, less the unhealthy ones.

``/docker/cli``, ``/mesos/cli`` and the ``nvidia-docker`` wrapper (which asks
``/docker/cli``) hand out GPUs. Their default selection (no ``dev``, empty, ``*``) leaves the
unhealthy GPUs out; naming one explicitly is refused with ``UnhealthyDevice``, one line
naming the GPU and the reason (the REST API answers 409). ``/gpu/info`` and ``/gpu/status``
still show every GPU: they describe the node, they hand nothing out.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.gpu.model import DeviceInfo
from agent.health.rule import DeviceHealth, utc_text
from agent.node.selection import Target, means_all, select_targets


class UnhealthyDevice(Exception):
    """A GPU named explicitly is unhealthy; ``str()`` is the one-line answer."""

    def __init__(self, entry: str, device: DeviceInfo, health: DeviceHealth) -> None:
        since = f" since {utc_text(health.since_s)}" if health.since_s is not None else ""
        uuid = f" ({device.uuid})" if device.uuid else ""
        super().__init__(
            f"unhealthy device: {entry}: GPU {device.index}{uuid} is unhealthy{since}: "
            f"{health.reason or 'unknown reason'}; choose another GPU"
        )
        self.entry = entry
        self.index = device.index
        self.health = health


def select_usable(
    devices: Sequence[DeviceInfo], dev: str | None, health: Sequence[DeviceHealth]
) -> tuple[Target, ...]:
    """The GPUs and MIG devices ``dev`` names that may be handed out (a MIG device is as
    healthy as its GPU); ``InvalidParameter`` for an entry that names nothing,
    ``UnhealthyDevice`` for one that names an unhealthy GPU or one of its MIG devices."""
    chosen = select_targets(devices, dev)
    if means_all(dev):
        return tuple(t for t in chosen if _healthy(health, t.gpu.index))
    for target in chosen:
        if not _healthy(health, target.gpu.index):
            raise UnhealthyDevice(_entry_for(dev, target), target.gpu, health[target.gpu.index])
    return chosen


def _healthy(health: Sequence[DeviceHealth], index: int) -> bool:
    return index >= len(health) or health[index].healthy


def _entry_for(dev: str | None, target: Target) -> str:
    """The entry of ``dev`` that named ``target`` (as the client wrote it)."""
    device = target.gpu
    for entry in (dev or "").replace(",", " ").split():
        if entry.isascii() and entry.isdigit() and int(entry) == device.index:
            return entry
        uuid = (device.uuid or "").lower()
        if uuid and entry.upper().startswith("GPU-") and uuid.startswith(entry.lower()):
            return entry
        mig = target.mig
        if mig is not None:
            if entry == f"{device.index}:{mig.index}":
                return entry
            mig_uuid = (mig.uuid or "").lower()
            if mig_uuid and entry.upper().startswith("MIG-") and mig_uuid.startswith(entry.lower()):
                return entry
    return str(device.index)
