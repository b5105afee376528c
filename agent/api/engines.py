"""``GET /engines/json``: the container engines the agent follows, and what the node's Docker
engine says of itself (docs/api.md, "`/engines/json`").

::

    {"BootId": "0f4c2f0e-6a55-4d43-8b4f-55e0ab2b1a57",
     "Engines": [{"Socket": "/var/run/docker.sock", "Following": true,
                  "Version": "26.1.5", "CDISpecDirs": ["/etc/cdi", "/var/run/cdi"],
                  "ReadAt": 1796467200.5, "ID": "5b0f3a4e-..."},
                 {"Socket": "/run/podman/podman.sock", "Following": false,
                  "Version": null, "CDISpecDirs": null, "ReadAt": null, "ID": null}],
     "EngineSocket": "/run/nvidia-docker/docker.sock"}

``BootId``: the kernel's ``/proc/sys/kernel/random/boot_id`` (null where it cannot be
read): a client on the same machine (in a container of it too) reads the same, one through
a tunnel to another node does not. ``Following``: the agent holds the engine's event stream
open now. ``Version``, ``CDISpecDirs`` and ``ID`` are the engine's ``GET /version`` and
``GET /info`` answers, read when the stream opened or at its latest ``daemon reload`` event
(``ReadAt``, seconds since the epoch); null while no stream is open, or for an engine whose
facts the agent does not read (Podman's service). ``EngineSocket``: the GPU-aware Docker
socket the agent serves itself (``--engine-socket``, forwarded to the Docker engine's), null
without one. The nvidia-docker wrapper on the node reads the facts in place of asking
dockerd itself (``controller.wrapper.engine_cdi``), and refuses a lease for a Docker engine
that is none of these (``controller.wrapper.followed_engine``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from aiohttp import web

from agent.api import render_json
from agent.engines.events import EngineEvents


class FollowedEngines(Protocol):
    """The followed engines' events, now (``EngineFeed.engines``)."""

    def __call__(self) -> Sequence[EngineEvents]: ...


ENGINES = web.AppKey("engines", FollowedEngines)
ENGINE_SOCKET = web.AppKey("engine_socket", Path)  # --engine-socket, where the agent serves one


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def boot_id(path: Path = BOOT_ID) -> str | None:
    """This kernel's boot id (read once), None where it cannot be read."""
    try:
        return path.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def engines_answer(
    engines: Sequence[EngineEvents], engine_socket: Path | None = None
) -> dict[str, object]:
    """The JSON document of the route for ``engines`` (and the agent's own ``engine_socket``)."""
    rows: list[dict[str, object]] = []
    for events in engines:
        facts = events.facts
        rows.append(
            {
                "Socket": str(events.engine.socket_path),
                "Following": events.following,
                "Version": facts.version if facts is not None else None,
                "CDISpecDirs": list(facts.cdi_spec_dirs) if facts is not None else None,
                "ReadAt": round(facts.read_s, 3) if facts is not None else None,
                "ID": facts.engine_id if facts is not None else None,
            }
        )
    socket = str(engine_socket) if engine_socket is not None else None
    return {"BootId": boot_id(), "Engines": rows, "EngineSocket": socket}


async def engines_json(request: web.Request) -> web.Response:
    engines = request.app.get(ENGINES)
    answer = engines_answer(
        engines() if engines is not None else (), request.app.get(ENGINE_SOCKET)
    )
    return web.Response(
        body=render_json.encode(answer),
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
