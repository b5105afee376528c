"""The ``/gpu/processes/json`` body: every GPU's compute processes and what they run in.

A new route (``/gpu/status/json`` keeps its processes exactly as the old tool had them).
Compact JSON with a final newline and CamelCase keys, as the other routes; a GPU without
processes has an empty list. ``Owner`` is ``docker``, ``podman``, ``containerd``, ``cri-o``,
``kubernetes``, ``mesos``, ``host`` or ``unknown`` (the process ended, or is not visible,
before it could be placed);
fields that do not apply or are not known are ``null``. See docs/api.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.api.render_json import encode
from agent.attribution.owners import ProcessOwner
from agent.gpu.model import DeviceInfo, DeviceStatus


def processes_body(
    devices: Sequence[DeviceInfo],
    statuses: Sequence[DeviceStatus],
    owners: Mapping[int, ProcessOwner],
) -> bytes:
    return encode({"Devices": [_device(d, statuses[d.index], owners) for d in devices]})


def _device(
    device: DeviceInfo, status: DeviceStatus, owners: Mapping[int, ProcessOwner]
) -> dict[str, Any]:
    return {
        "Index": device.index,
        "UUID": device.uuid,
        "BusID": device.pci.bus_id,
        "Processes": [_process(p.pid, p.name, p.memory_used_mib, owners.get(p.pid))
                      for p in status.processes],
    }  # fmt: skip


def _process(
    pid: int, name: str | None, used_mib: int | None, owner: ProcessOwner | None
) -> dict[str, Any]:
    return {
        "PID": pid,
        "Name": name,
        "MemoryUsed": used_mib,
        "Owner": owner.kind.value if owner else None,
        "ContainerID": owner.container_id if owner else None,
        "ContainerName": owner.container_name if owner else None,
        "Image": owner.image if owner else None,
        "MesosContainer": owner.mesos_container if owner else None,
    }
