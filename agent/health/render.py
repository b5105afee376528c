"""``/gpu/health`` and ``/gpu/health/json``: each GPU healthy, or unhealthy with why and since.

JSON, one entry per GPU in index order (``dev`` selects, as for the other routes)::

    {"Devices":[{"UUID":"GPU-…","Healthy":true,"Reason":null,"XID":null,"Since":null},
                {"UUID":"GPU-…","Healthy":false,"Reason":"XID 79 (GPU has fallen off the bus)",
                 "XID":79,"Since":"2026-11-30T13:17:38Z"}]}

``Reason`` is one line of words, ``XID`` the XID number when an XID is the reason, ``Since``
the UTC time it became unhealthy. The health model is in ``agent.gpu.health``; the routes
answer 503 while the driver is being replaced, as the status routes do (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent.api import render_json
from agent.gpu.model import DeviceInfo
from agent.health.rule import DeviceHealth, utc_text


def _entry(device: DeviceInfo, health: DeviceHealth) -> dict[str, Any]:
    return {
        "UUID": device.uuid,
        "Healthy": health.healthy,
        "Reason": health.reason,
        "XID": health.xid,
        "Since": utc_text(health.since_s) if health.since_s is not None else None,
    }


def health_json(devices: Sequence[DeviceInfo], health: Sequence[DeviceHealth]) -> bytes:
    return render_json.encode({"Devices": [_entry(d, health[d.index]) for d in devices]})


def health_text(devices: Sequence[DeviceInfo], health: Sequence[DeviceHealth]) -> bytes:
    lines = []
    for device in devices:
        state = health[device.index]
        if state.healthy:
            lines.append(f"Device #{device.index}: healthy")
        else:
            since = f" since {utc_text(state.since_s)}" if state.since_s is not None else ""
            lines.append(f"Device #{device.index}: unhealthy{since}: {state.reason}")
    return ("\n".join(lines) + "\n").encode()
