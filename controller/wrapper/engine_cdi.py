"""Whether the container engine behind the docker command reads CDI specs.

Asked once per ``run``/``create`` of an image that wants GPUs, never for anything else:

1. ``<docker> version --format '{{json .}}'``: Podman's client answers with ``OsArch`` (Docker's
   never does); Podman 4 and later read CDI. Docker says its engine's version: before 25 it
   has no CDI, and the answer is known after this one call (17-26 ms here, under load).
2. Docker 25 and later only: ``<docker> info --format '{{json .CDISpecDirs}}'``; a non-empty
   list means the engine reads specs from those directories (CDI is a daemon feature that
   may be off).

Where the wrapper asks the engine's socket itself (``engine_api.engine_socket``: docker's
own CLI, a local unix socket), step 1 is ``GET /version`` of that socket, the CLI's
``Server`` part (well under a millisecond instead of 12 ms or more); step 2 stays the CLI's,
whose answer depends on the CLI too (one older than CDI knows no ``CDISpecDirs``, and could
not pass a CDI device on). Anything the socket does not answer clearly is asked of the CLI.

Podman's ``info`` would tell too, but costs 200-700 ms against 30-100 ms for ``version``.
``NV_CDI`` (``Options.cdi``, checked at the edge) overrides the question: ``yes`` (CDI
without asking), ``no`` (the volume form without asking), ``auto`` or unset (ask). Any
failure to ask means "no": the volume form works with every engine.
"""

from __future__ import annotations

import time

from controller import json_codec
from controller.record import record
from controller.wrapper import docker_cli, engine_api

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from controller.options import Options
    from controller.wrapper.docker_args import DockerCommand

DOCKER_CDI_MAJOR = 25  # Docker Engine 25.0 added CDI (opt-in; on by default from 28.2)
PODMAN_CDI_MAJOR = 4
PROBE_TIMEOUT_S = 10.0


@record
class EngineCdi:
    engine: str  # "Podman 4.3.1", "Docker 20.10.24+dfsg1", "NV_CDI=yes"
    reads_cdi: bool
    reason: str  # why, in a few words (for NV_DEBUG)
    seconds: float = 0.0  # what asking cost


def _major(version: str) -> int | None:
    head = version.strip().lstrip("v").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _ask(
    docker: Sequence[str], command: DockerCommand, environment: Mapping[str, str], *args: str
) -> str | None:
    argv = [*docker, *command.global_args, *args]
    try:
        done = docker_cli.ask(argv, environment, timeout_s=PROBE_TIMEOUT_S)
    except OSError:  # not found, or no answer in time (TimeoutError)
        return None
    return done.stdout  # Docker prints its client's part even when the daemon is down


def _json(text: str | None) -> object:
    try:
        return json_codec.loads(text or "null")
    except ValueError:
        return None


def ask_engine(
    docker: Sequence[str],
    command: DockerCommand,
    environment: Mapping[str, str],
    engine: str | None = None,
) -> EngineCdi:
    """Ask the engine (see the module docstring) with the ``docker`` command, run in
    ``environment`` (the edge's: ``Options.environment``), or first on ``engine``, the
    engine's unix socket, when docker's own CLI would ask it."""
    started = time.perf_counter()
    version: object = None
    if engine is not None:
        server = engine_api.server_version(engine)
        if server is not None:  # docker's own CLI asks: its client part is never Podman's
            version = {"Client": {}, "Server": server}
    if version is None:
        version = _json(_ask(docker, command, environment, "version", "--format", "{{json .}}"))
    client = version.get("Client") if isinstance(version, dict) else None
    if not isinstance(client, dict):
        return EngineCdi("unknown engine", False, "no answer to `version`", _since(started))
    if "OsArch" in client:  # Podman's client; Docker's has Os and Arch apart
        number = str(client.get("Version", ""))
        major = _major(number)
        reads = major is not None and major >= PODMAN_CDI_MAJOR
        why = "Podman reads CDI" if reads else f"Podman reads CDI from {PODMAN_CDI_MAJOR}.0 on"
        return EngineCdi(f"Podman {number}", reads, why, _since(started))
    assert isinstance(version, dict)
    server = version.get("Server")
    number = str(server.get("Version", "")) if isinstance(server, dict) else ""
    major = _major(number)
    name = f"Docker {number or '(engine not answering)'}"
    if major is None or major < DOCKER_CDI_MAJOR:
        why = f"Docker reads CDI from {DOCKER_CDI_MAJOR}.0 on"
        return EngineCdi(name, False, why, _since(started))
    dirs = _json(_ask(docker, command, environment, "info", "--format", "{{json .CDISpecDirs}}"))
    if isinstance(dirs, list) and dirs:
        return EngineCdi(name, True, f"CDI spec dirs {', '.join(map(str, dirs))}", _since(started))
    return EngineCdi(name, False, "CDI is off in the engine (no CDI spec dirs)", _since(started))


def _since(started: float) -> float:
    return time.perf_counter() - started


def engine_cdi(options: Options, command: DockerCommand, engine: str | None = None) -> EngineCdi:
    """``NV_CDI`` (``yes``, ``no``, ``auto``: ``Options.cdi``) when not auto, else the
    engine's answer (``engine``: its unix socket, see ``ask_engine``)."""
    choice = options.cdi
    if choice == "auto":
        return ask_engine(options.docker, command, options.environment, engine)
    return EngineCdi(f"NV_CDI={choice}", choice == "yes", "set by NV_CDI")


def is_podman(docker: Sequence[str]) -> bool:
    """The docker command is Podman's (``podman``, ``sudo podman``, ``/usr/bin/podman``):
    it takes its engine from its own settings (``CONTAINER_HOST``, connections), never
    from ``DOCKER_HOST``."""
    return any(word.rsplit("/", 1)[-1] in ("podman", "podman-remote") for word in docker)
