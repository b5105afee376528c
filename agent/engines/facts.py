"""What the node's Docker engine says of itself that the nvidia-docker wrapper needs at every
``run``: its version, and where it reads CDI specs.

The wrapper chooses between the CDI form and the volume form by asking the engine
(``GET /_ping``, then from Docker 25 on ``GET /info``: about 5 ms of dockerd's own time, as
it asks containerd and runc). The agent follows that engine anyway (its event stream, for
the lease table), so it reads the answers once each time the stream opens (the engine
started, an outage ended) and again at each ``daemon reload`` event (dockerd read its
settings again: ``SIGHUP``), and forgets them when the stream ends. While it follows, its
``GET /engines/json`` says them (``agent.api.engines``), and the wrapper on the node uses
them in place of asking (docs/nvidia-docker.md, "Engines that read CDI: Podman, Docker 25+").

``dockerd_version(engine)`` asks ``GET /version``: dockerd's version, or None for another
engine behind the socket (Podman's service names its component ``Podman Engine``; it sends
no daemon events, and may refuse a filter for them). ``read_facts(engine, version)`` asks
``GET /info`` (the CDI spec dirs, and the daemon's ``ID``, which tells the same dockerd
behind two sockets). Both raise ``EngineError`` (a ``BadAnswer`` for an answer that is not what
dockerd sends) when the answer cannot be read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.engines.http import BadAnswer, EngineClient, parse_answer

MAX_FACTS_BYTES = 1024 * 1024  # /info lists plugins, runtimes, registries: kilobytes
MAX_DIRS = 64
MAX_ID_CHARS = 256  # dockerd's ID is a UUID (older ones: a key's 12 groups of 4)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """The engine's version (``GET /version``'s ``Version``) and its CDI spec directories
    (``GET /info``'s ``CDISpecDirs``: empty when CDI is off or the engine is older than
    Docker 25, which has no such field); ``read_s``: when they were read (wall clock);
    ``engine_id``: ``GET /info``'s ``ID``, the daemon's own identity whatever socket it is
    reached on (None where it names none)."""

    version: str
    cdi_spec_dirs: tuple[str, ...]
    read_s: float
    engine_id: str | None = None


def is_reload(value: object) -> bool:
    """Whether one parsed event of the stream is dockerd's ``daemon reload``."""
    return (
        isinstance(value, dict)
        and value.get("Type") == "daemon"
        and value.get("Action", value.get("status")) == "reload"
    )


async def dockerd_version(engine: EngineClient) -> str | None:
    """``GET /version``'s ``Version`` when ``engine`` is dockerd; None for Podman's service."""
    version = await _object(engine, "/version")
    number = version.get("Version")
    if not isinstance(number, str) or not number or len(number) > 64:
        raise BadAnswer(f"{engine.bad_answer('to GET /version')}: it names no Version")
    components = version.get("Components")
    for component in components if isinstance(components, list) else ():
        name = component.get("Name") if isinstance(component, dict) else None
        if isinstance(name, str) and "podman" in name.lower():
            return None
    return number


async def read_facts(
    engine: EngineClient, version: str, *, clock: Callable[[], float] = time.time
) -> EngineFacts:
    """``GET /info`` of dockerd ``version`` at ``engine``, as ``EngineFacts``."""
    info = await _object(engine, "/info")
    dirs = info.get("CDISpecDirs")
    if dirs is None:
        dirs = []
    if (
        not isinstance(dirs, list)
        or len(dirs) > MAX_DIRS
        or not all(isinstance(d, str) and d.startswith("/") and len(d) <= 4096 for d in dirs)
    ):
        raise BadAnswer(
            f"{engine.bad_answer('to GET /info')}: its CDISpecDirs is not a list of paths"
        )
    engine_id = info.get("ID")
    if not isinstance(engine_id, str) or not engine_id or len(engine_id) > MAX_ID_CHARS:
        engine_id = None
    return EngineFacts(version, tuple(dirs), clock(), engine_id)


async def _object(engine: EngineClient, path: str) -> dict[str, object]:
    about = f"to GET {path}"
    body = await engine.get(path, about, max_bytes=MAX_FACTS_BYTES)
    value = parse_answer(body, engine.bad_answer(about)) if body is not None else None
    if not isinstance(value, dict):
        raise BadAnswer(f"{engine.bad_answer(about)}: it is not a JSON object")
    return value
