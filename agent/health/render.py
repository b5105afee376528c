"""``/gpu/health`` and ``/gpu/health/json``: each GPU healthy, or unhealthy with why and since.

JSON, one entry per GPU in index order (``dev`` selects, as for the other routes)::

    {"Devices":[{"UUID":"GPU-…","Healthy":true,"Reason":null,"XID":null,"Since":null},
                {"UUID":"GPU-…","Healthy":false,"Reason":"XID 79 (GPU has fallen off the bus)",
                 "XID":79,"Since":"2026-11-30T13:17:38Z"}]}

``Reason`` is one line of words, ``XID`` the XID number when an XID is the reason, ``Since``
the UTC time it became unhealthy. A GPU in MIG mode also has ``MIG``, one entry per MIG
device (``Index``, ``UUID`` and the same four), so that a MIG device withdrawn on its own is
seen while its GPU stays healthy; the text form adds a ``Device #0:1: unhealthy ...`` line
for each such MIG device. The health model is in ``agent.health.rule``; the routes
answer 503 while the driver is being replaced, as the status routes do (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent.api import render_json
from agent.gpu.model import DeviceInfo
from agent.health.rule import DeviceHealth, utc_text


def _state(health: DeviceHealth) -> dict[str, Any]:
    return {
        "Healthy": health.healthy,
        "Reason": health.reason,
        "XID": health.xid,
        "Since": utc_text(health.since_s) if health.since_s is not None else None,
    }


def _entry(device: DeviceInfo, health: DeviceHealth) -> dict[str, Any]:
    entry = {"UUID": device.uuid, **_state(health)}
    if device.mig_devices:
        entry["MIG"] = [
            {"Index": mig.index, "UUID": mig.uuid, **_state(health.of_mig(mig.index))}
            for mig in device.mig_devices
        ]
    return entry


def health_json(devices: Sequence[DeviceInfo], health: Sequence[DeviceHealth]) -> bytes:
    return render_json.encode({"Devices": [_entry(d, health[d.index]) for d in devices]})


def health_text(devices: Sequence[DeviceInfo], health: Sequence[DeviceHealth]) -> bytes:
    lines = []
    for device in devices:
        state = health[device.index]
        if state.healthy:
            lines.append(f"Device #{device.index}: healthy")
        else:
            lines.append(f"Device #{device.index}: unhealthy{_since(state)}: {state.reason}")
            continue
        for mig, mig_state in state.migs:
            lines.append(
                f"Device #{device.index}:{mig}: unhealthy{_since(mig_state)}: {mig_state.reason}"
            )
    return ("\n".join(lines) + "\n").encode()


def _since(state: DeviceHealth) -> str:
    return f" since {utc_text(state.since_s)}" if state.since_s is not None else ""
