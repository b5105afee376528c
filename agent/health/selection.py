"""Which GPUs a container may get: the ``dev`` selection, less the unhealthy ones.

``/docker/cli``, ``/mesos/cli`` and the ``nvidia-docker`` wrapper (which asks
``/docker/cli``) hand out GPUs. Their default selection (no ``dev``, empty, ``*``) leaves the
unhealthy GPUs out, and the unhealthy MIG devices of a healthy GPU (the GPU then gives its
healthy MIG devices only); naming one explicitly, or a GPU whose MIG devices include one, is
refused with ``UnhealthyDevice``, one line naming the device and the reason (the REST API
answers 409). ``/gpu/info`` and ``/gpu/status`` still show every GPU: they describe the
node, they hand nothing out.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.gpu.model import DeviceInfo, MigDevice
from agent.health.rule import HEALTHY, DeviceHealth, utc_text
from agent.node.selection import Target, means_all, select_targets


class UnhealthyDevice(Exception):
    """A GPU (or MIG device) named explicitly is unhealthy; ``str()`` is the one-line answer."""

    def __init__(
        self, entry: str, device: DeviceInfo, health: DeviceHealth, mig: MigDevice | None = None
    ) -> None:
        since = f" since {utc_text(health.since_s)}" if health.since_s is not None else ""
        if mig is None:
            uuid = f" ({device.uuid})" if device.uuid else ""
            what = f"GPU {device.index}{uuid}"
        else:
            uuid = f" ({mig.uuid})" if mig.uuid else ""
            what = f"MIG device {device.index}:{mig.index}{uuid}"
        super().__init__(
            f"unhealthy device: {entry}: {what} is unhealthy{since}: "
            f"{health.reason or 'unknown reason'}; choose another GPU"
        )
        self.entry = entry
        self.index = device.index
        self.mig = None if mig is None else mig.index
        self.health = health


def select_usable(
    devices: Sequence[DeviceInfo], dev: str | None, health: Sequence[DeviceHealth]
) -> tuple[Target, ...]:
    """The GPUs and MIG devices ``dev`` names that may be handed out (a MIG device is
    unhealthy with its GPU, or on its own); ``InvalidParameter`` for an entry that names
    nothing, ``UnhealthyDevice`` for one that names an unhealthy GPU or MIG device."""
    chosen = select_targets(devices, dev)
    if means_all(dev):
        usable: list[Target] = []
        for target in chosen:
            state = _health(health, target.gpu.index)
            if not state.healthy:
                continue
            if target.mig is None and state.migs and target.gpu.mig_devices:
                usable += [
                    Target(target.gpu, m)
                    for m in target.gpu.mig_devices
                    if state.of_mig(m.index).healthy
                ]
            elif target.mig is None or state.of_mig(target.mig.index).healthy:
                usable.append(target)
        return tuple(usable)
    for target in chosen:
        state = _health(health, target.gpu.index)
        if not state.healthy:
            raise UnhealthyDevice(_entry_for(dev, target), target.gpu, state)
        migs = target.gpu.mig_devices if target.mig is None else (target.mig,)
        for mig in migs:
            if not state.of_mig(mig.index).healthy:
                raise UnhealthyDevice(
                    _entry_for(dev, target), target.gpu, state.of_mig(mig.index), mig
                )
    return chosen


def _health(health: Sequence[DeviceHealth], index: int) -> DeviceHealth:
    return health[index] if index < len(health) else HEALTHY


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
