"""Ask the local Docker engine over its unix socket what the docker CLI would have asked it.

The wrapper's questions to the engine (an image's labels, whether a volume exists, the
engine's version, where it reads CDI specs) are each one ``GET`` of the engine's API, which
the docker CLI makes for ``docker image inspect``, ``docker volume inspect``, ``docker
version`` and ``docker info``. Starting the CLI for that costs 12 ms or more on the 2-core
development machine (docs/nvidia-docker.md, "Speed"); the ``GET`` itself well under one
(``/version`` and ``/info``: about 5 ms of dockerd's own, which asks containerd and runc for
their versions). So when the docker CLI would talk to a unix socket, the wrapper asks that
socket itself (``engine_socket``), with the HTTP/1.1 client of
``controller.transport.plain_http``.

``engine_socket(options, command)`` says which socket, or None (ask the CLI):

- the docker command is ``docker`` (``NV_DOCKER`` unset or ``docker``), found on ``PATH``,
  or one word naming the file (``NV_DOCKER=/usr/bin/docker``), that is a program (ELF)
  whose real name is ``docker`` (``docker_cli_file``): not ``sudo docker``, ``podman``, a
  script such as podman-docker's, a link to ``podman``;
- the command line has no global options before ``run`` (``-H``, ``--context``,
  ``--config``, TLS flags: the CLI's business);
- docker's address (``controller.transport.docker_context``: ``DOCKER_HOST``,
  ``DOCKER_CONTEXT``, ``docker context use``, in docker's order) is ``unix://PATH``, or
  none: the CLI's default, ``/var/run/docker.sock``.

The answers then are the CLI's: ``image_labels`` returns the image's labels (the CLI's
``{{json .Config.Labels}}``), ``NO_SUCH_IMAGE`` when the engine says it has no such image
(a 404 with docker's or Podman's words), or None for everything else: no answer within
``TIMEOUT_S``, another status, an answer that is not the expected JSON. None makes the
wrapper ask the docker CLI after all, so every error is still said in the CLI's words.
``volume_exists`` is True (200), False (404) or None (ask the CLI). For ``engine_cdi``:
``docker_version`` is dockerd's version from ``GET /_ping`` (its ``Server`` header,
``Docker/26.1.5+dfsg1 (linux)``: the ``Version`` of ``GET /version``, at about a fiftieth of
dockerd's cost) or None (another engine, such as Podman's service, ``Libpod/4.3.1``; no
answer); ``server_version`` is ``GET /version`` (``docker version``'s ``Server`` part) or
None; ``cdi_spec_dirs`` is ``GET /info``'s ``CDISpecDirs`` (``docker info``'s) or None.
``docker_program`` is the docker CLI's file that ``engine_socket`` found on ``PATH``.
"""

from __future__ import annotations

import os

from controller import json_codec
from controller.errors import EndpointError
from controller.transport.plain_http import tcp_get, unix_get

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from controller.options import Options
    from controller.wrapper.docker_args import DockerCommand

DEFAULT_SOCKET = "/var/run/docker.sock"  # the docker CLI's default host, unix:// removed
UNIX = "unix://"
TCP = "tcp://"
DOCKER_TCP_PORT = 2375  # the docker CLI's port for tcp://HOST without TLS
TIMEOUT_S = 30.0  # the CLI waits for ever; past this the CLI is asked, and waits
NO_SUCH_IMAGE = "no such image"
_ELF = b"\x7fELF"
DOCKER_SERVER = "Docker/"  # dockerd's Server header: Docker/<version> (<os>)
# Image and volume names the engine takes as they are in a URL path (anything else: the CLI)
_NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/:@")
_MISSING_WORDS = ("no such image", "image not known")  # docker's, Podman's


def engine_socket(options: Options, command: DockerCommand) -> str | None:
    """The unix socket of the engine the docker CLI would ask, when the wrapper may ask it
    itself (see the module docstring); else None."""
    if command.global_end != 0 or docker_cli_file(options.docker, options.environment) is None:
        return None
    return unix_path(_docker_address(options, command))


def unix_path(address: str | None) -> str | None:
    """The socket file of a ``unix://PATH`` address; None for any other (or none)."""
    if address is None or not address.startswith(UNIX) or len(address) == len(UNIX):
        return None
    return address[len(UNIX) :]


def cli_engine_address(options: Options, command: DockerCommand) -> str | None:
    """The address of the engine that docker's own CLI runs ``command`` on, as docker
    decides it (``unix:///var/run/docker.sock`` where nothing names one;
    ``tcp://127.0.0.1:2375``, ``ssh://user@node``), or None where the docker command is not
    that CLI (``podman``, podman-docker's script: ``docker_cli_file``), or that CLI behind
    prefixes the wrapper does not see through (``_prefixed_settings``), or its settings
    cannot be read (a context, root's ``config.json`` for ``sudo docker``)."""
    if docker_cli_file(options.docker, options.environment) is None:
        settings = _prefixed_settings(options, command)
        if settings is None:
            return None
        options, command = settings
    return _docker_address(options, command)


def _docker_address(options: Options, command: DockerCommand) -> str | None:
    """The address docker's CLI decides for ``command`` in ``options`` (None: its settings
    cannot be read: a context, or root's ``config.json``, the wrapper may not read)."""
    from controller.transport.docker_context import docker_address  # noqa: PLC0415

    try:
        found = docker_address(options, command.docker_host, command.docker_context)
    except EndpointError:
        return None
    return UNIX + DEFAULT_SOCKET if found is None else found[0].strip()


def _prefixed_settings(
    options: Options, command: DockerCommand
) -> tuple[Options, DockerCommand] | None:
    """For a docker command of more than one word that runs docker's CLI (``NV_DOCKER='sudo
    docker -D'``, ``env DOCKER_HOST=... docker``, ``docker -H ...``): the settings the CLI
    gets past the prefixes (``command_prefixes``: the environment and the user whose
    ``HOME`` has its ``.docker``), and the command with the CLI's own global options of
    ``NV_DOCKER`` before the command line's; None for anything else."""
    if len(options.docker) < 2:
        return None
    from controller import env_text  # noqa: PLC0415
    from controller.record import replace  # noqa: PLC0415
    from controller.wrapper.command_prefixes import through_prefixes  # noqa: PLC0415
    from controller.wrapper.docker_args import scan  # noqa: PLC0415

    seen = through_prefixes(options.docker, options.environment)
    if seen is None or not seen[0] or docker_cli_file(seen[0][:1], seen[2]) is None:
        return None
    words, _, env = seen
    home = env.get("HOME") or options.home
    config = (env.get("DOCKER_CONFIG") or "").strip()
    settings = replace(
        options,
        docker_host=(env.get("DOCKER_HOST") or "").strip() or None,
        docker_context=(env.get("DOCKER_CONTEXT") or "").strip() or None,
        docker_config=env_text.expand_home(config, home) if config else None,
        home=home,
        environment=env,
    )
    scanned = scan([*words[1:], *command.args])
    if scanned.docker_config is not None:
        settings = replace(settings, docker_config=scanned.docker_config)
    return settings, scanned


def docker_cli_file(docker: Sequence[str], environment: Mapping[str, str]) -> str | None:
    """The docker CLI's file that the docker command (``NV_DOCKER``'s words) runs: ``docker``
    as found on ``PATH`` (``docker_program``), or one word naming the file
    (``NV_DOCKER=/usr/bin/docker``, as where a ``docker`` earlier on ``PATH`` is the wrapper
    itself), when it is that CLI; None for anything else (``sudo docker``, ``podman``)."""
    if len(docker) != 1:
        return None
    if docker[0] == "docker":
        return docker_program(environment.get("PATH") or os.defpath)
    if "/" not in docker[0] or not os.access(docker[0], os.X_OK):
        return None
    return docker[0] if _is_cli(docker[0]) else None


def docker_program(search_path: str) -> str | None:
    """The file of ``docker`` on ``search_path`` (as ``execvp`` finds it) when it is a
    program whose real name is ``docker``: the docker CLI, not a script or a link to another
    engine's client; else None."""
    for directory in search_path.split(os.pathsep):
        path = os.path.join(directory or ".", "docker")
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            continue
        return path if _is_cli(path) else None
    return None


def _is_cli(path: str) -> bool:
    """``path`` is a program (ELF) whose real name is ``docker``."""
    if os.path.basename(os.path.realpath(path)) != "docker":
        return False
    try:
        with open(path, "rb") as program:
            return program.read(4) == _ELF
    except OSError:
        return False


def _get_json(socket_path: str, target: str) -> tuple[int, object] | None:
    """The status and decoded body of ``GET target`` (None: no answer, or not JSON)."""
    return _decoded(unix_get(socket_path, target, TIMEOUT_S))


def _decoded(answer: tuple[int, dict[str, str], bytes] | None) -> tuple[int, object] | None:
    """An answer's status and decoded JSON body (None: no answer, or not JSON)."""
    if answer is None:
        return None
    status, _, body = answer
    try:
        return status, json_codec.loads(body)
    except ValueError:
        return None


def _usable(name: str) -> bool:
    """A name that is one path segment or a few (an image's), as the CLI would send it."""
    if not name or name.startswith("/") or ".." in name or "//" in name:
        return False
    return set(name) <= _NAME_CHARACTERS


def image_labels(socket_path: str, image: str) -> dict[str, str] | str | None:
    """The labels of ``image`` (``{}``: none), ``NO_SUCH_IMAGE``, or None: ask the CLI."""
    if not _usable(image):
        return None
    answer = _get_json(socket_path, f"/images/{image}/json")
    if answer is None:
        return None
    status, body = answer
    if status == 404:
        message = body.get("message") if isinstance(body, dict) else None
        if isinstance(message, str) and any(w in message.lower() for w in _MISSING_WORDS):
            return NO_SUCH_IMAGE
        return None
    if status != 200 or not isinstance(body, dict):
        return None
    config = body.get("Config")
    labels = config.get("Labels") if isinstance(config, dict) else None
    if config is not None and not isinstance(config, dict):
        return None
    if labels is not None and not isinstance(labels, dict):
        return None
    return {str(k): str(v) for k, v in (labels or {}).items()}


def docker_version(socket_path: str) -> str | None:
    """dockerd's version (``26.1.5+dfsg1``) from the ``Server`` header of its ``GET /_ping``
    answer, ``Docker/<version> (<os>)``; None: another engine or server, or no answer (ask
    ``GET /version``)."""
    answer = unix_get(socket_path, "/_ping", TIMEOUT_S)
    if answer is None or answer[0] != 200:
        return None
    server = answer[1].get("server", "")
    if not server.startswith(DOCKER_SERVER):
        return None
    return server[len(DOCKER_SERVER) :].split(" ", 1)[0] or None


def cdi_spec_dirs(socket_path: str) -> list[str] | None:
    """``CDISpecDirs`` of the engine's ``GET /info`` answer: where it reads CDI specs (``[]``:
    CDI is off; ``[]`` too where the answer has none or ``null``, which ``docker info``'s
    ``{{json .CDISpecDirs}}`` prints as ``null``), or None: ask the CLI (no answer, another
    status, not a list of strings)."""
    answer = _get_json(socket_path, "/info")
    if answer is None or answer[0] != 200 or not isinstance(answer[1], dict):
        return None
    dirs = answer[1].get("CDISpecDirs")
    if dirs is None:
        return []
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        return None
    return dirs


def engine_id(socket_path: str) -> str | None:
    """``GET /info``'s ``ID``: the daemon's own identity, whatever socket it is reached on
    (None: no answer, another status, none said)."""
    return _said_id(_get_json(socket_path, "/info"))


def _said_id(answer: tuple[int, object] | None) -> str | None:
    """The ``ID`` of a ``GET /info`` answer (status, decoded body), or None."""
    if answer is None or answer[0] != 200 or not isinstance(answer[1], dict):
        return None
    found = answer[1].get("ID")
    return found if isinstance(found, str) and found else None


def tcp_engine_id(address: str) -> str | None:
    """``engine_id`` of the dockerd at a ``tcp://HOST[:PORT]`` address over plain HTTP
    (docker's port 2375 where none is written), or None: another form of address (read by
    ``parse_endpoint``), no answer, a server that speaks TLS (Go's answers plain HTTP with a
    400), none said."""
    from controller.transport.endpoint import parse_endpoint  # noqa: PLC0415

    if not address.startswith(TCP) or len(address) == len(TCP):
        return None
    try:
        endpoint = parse_endpoint(address, source="DOCKER_HOST", http_port=DOCKER_TCP_PORT)
    except EndpointError:
        return None
    return _said_id(_decoded(tcp_get(endpoint, "/info", TIMEOUT_S)))


def server_version(socket_path: str) -> dict[str, object] | None:
    """``GET /version``: what ``docker version`` shows as its ``Server`` part (a ``Version``
    at least), or None: ask the CLI."""
    answer = _get_json(socket_path, "/version")
    if answer is None or answer[0] != 200 or not isinstance(answer[1], dict):
        return None
    body: dict[str, object] = answer[1]
    return body if isinstance(body.get("Version"), str) else None


def volume_exists(socket_path: str, name: str) -> bool | None:
    """Whether the engine has the volume ``name`` (None: ask the CLI)."""
    if not _usable(name):
        return None
    answer = unix_get(socket_path, f"/volumes/{name}", TIMEOUT_S)
    if answer is None or answer[0] not in (200, 404):
        return None
    return answer[0] == 200
