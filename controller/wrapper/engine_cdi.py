"""Whether the container engine behind the docker command reads CDI specs.

Asked once per ``run``/``create`` of an image that wants GPUs, never for anything else:

1. ``<docker> version --format '{{json .}}'``: Podman's client answers with ``OsArch`` (Docker's
   never does); Podman 4 and later read CDI. Docker says its engine's version: before 25 it
   has no CDI, and the answer is known after this one call (17-26 ms here, under load).
2. Docker 25 and later only: ``<docker> info --format '{{json .CDISpecDirs}}'``; a non-empty
   list means the engine reads specs from those directories (CDI is a daemon feature that
   may be off).

Where the wrapper asks the engine's socket itself (``engine_api.engine_socket``: docker's
own CLI, a local unix socket), the same answer is read without starting the CLI:

1. ``GET /_ping``: dockerd says its version in the ``Server`` header (``Docker/20.10.24+dfsg1
   (linux)``: ``docker version``'s ``Server.Version``) at almost no cost to it (0.1-0.2 ms
   here, against about 5 ms for ``GET /version``, which asks containerd and runc). An engine
   before 25 is answered there: one ``GET``, nothing else.
2. Docker 25 and later: ``GET /info``'s ``CDISpecDirs`` (what ``docker info`` prints; about
   5 ms of dockerd's own, as ``docker info`` costs it too). An empty list: no CDI.
3. A non-empty list: ``docker info``'s answer depends on the CLI too. One older than 25
   knows no ``CDISpecDirs`` (its template fails: no CDI), and could not pass a CDI device on
   anyway (``--device`` must be a path). The CLI's version is read from its own file, the
   ``-X ...version.Version=`` its build recorded (``go_build_info``, about 0.1 ms): 25 or
   later, CDI; older, no CDI. A CLI whose file does not record it (Debian and Ubuntu build
   with ``-trimpath``) is asked ``docker --version`` once, and its answer is remembered for
   that file (``cli_versions``: about 0.1 ms a run after the first).

Anything not answered clearly is asked the slower way, so the answer stays the CLI's: no
``Docker/`` server (Podman's service says ``Libpod/4.3.1``) or no answer to ``/_ping``:
``GET /version`` of the socket, else ``docker version``; no clear ``/info``, or a CLI that
says no version: ``docker info``.

Podman (the docker command is one word, ``podman``: its client decides, as ``podman
version``'s ``Client`` part does) is asked ``podman --version`` once per program file, and
the answer remembered the same way, in place of ``podman version`` (20 to 100 ms) at every
run; ``sudo podman`` and other commands of several words are asked ``version`` (step 1) every run.

Where the node's agent answers on this machine and follows that same socket's dockerd, steps
1 and 2 are its word instead (``agent_engine_cdi``: ``GET /engines/json`` on the connection
the wrapper has open to it anyway, about 0.3 ms, against dockerd's 5 ms for ``/info``): the
agent reads the version and the CDI spec dirs when its event stream opens and at each
``daemon reload`` event, and says nothing while it does not follow the engine.

Podman's ``info`` would tell too, but costs 200-700 ms against 30-100 ms for ``version``.
``NV_CDI`` (``Options.cdi``, checked at the edge) overrides the question: ``yes`` (CDI
without asking), ``no`` (the volume form without asking), ``auto`` or unset (ask). Any
failure to ask means "no": the volume form works with every engine.
"""

from __future__ import annotations

import os
import time

from controller import json_codec
from controller.record import record
from controller.wrapper import docker_cli, engine_api

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from controller.options import Options
    from controller.wrapper.docker_args import DockerCommand

DOCKER_CDI_MAJOR = 25  # Docker Engine 25.0 added CDI (opt-in; on by default from 28.2)
PODMAN_CDI_MAJOR = 4
NO_SPEC_DIRS = "CDI is off in the engine (no CDI spec dirs)"
PROBE_TIMEOUT_S = 10.0
CLI_VERSION = "github.com/docker/cli/cli/version.Version"  # set by the CLI's build (-X)
AGENT_ENGINES = "the agent's GET /engines/json"
BOOT_ID = "/proc/sys/kernel/random/boot_id"  # the same for the agent: on this machine


@record
class EngineCdi:
    engine: str  # "Podman 4.3.1", "Docker 20.10.24+dfsg1", "NV_CDI=yes"
    reads_cdi: bool
    reason: str  # why, in a few words (for NV_DEBUG)
    seconds: float = 0.0  # what asking cost
    asked: tuple[str, ...] = ()  # whom, in order ("GET /_ping", "docker info", ...)


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
    asked: list[str] = []

    def found(name: str, reads: bool, why: str) -> EngineCdi:
        return EngineCdi(name, reads, why, time.perf_counter() - started, tuple(asked))

    version: object = None
    if engine is not None:
        asked.append("GET /_ping")
        number = engine_api.docker_version(engine)
        if number is not None:
            return _docker(number, docker, command, environment, engine, asked, found)
        asked.append("GET /version")
        server = engine_api.server_version(engine)
        if server is not None:  # docker's own CLI asks: its client part is never Podman's
            version = {"Client": {}, "Server": server}
    if version is None and is_podman(docker):
        said = _remembered(docker, environment, asked)
        if said is not None and said[0].startswith("podman"):
            return found(*_podman(said[1]))
    if version is None:
        asked.append("docker version")
        version = _json(_ask(docker, command, environment, "version", "--format", "{{json .}}"))
    client = version.get("Client") if isinstance(version, dict) else None
    if not isinstance(client, dict):
        return found("unknown engine", False, "no answer to `version`")
    if "OsArch" in client:  # Podman's client; Docker's has Os and Arch apart
        return found(*_podman(str(client.get("Version", ""))))
    assert isinstance(version, dict)
    server = version.get("Server")
    number = str(server.get("Version", "")) if isinstance(server, dict) else ""
    name = f"Docker {number or '(engine not answering)'}"
    if not _docker_reads_cdi(number):
        return found(name, False, f"Docker reads CDI from {DOCKER_CDI_MAJOR}.0 on")
    return found(name, *_cli_info(docker, command, environment, asked))


def _podman(number: str) -> tuple[str, bool, str]:
    """Podman ``number``'s name, whether it reads CDI, and why."""
    major = _major(number)
    reads = major is not None and major >= PODMAN_CDI_MAJOR
    why = "Podman reads CDI" if reads else f"Podman reads CDI from {PODMAN_CDI_MAJOR}.0 on"
    return f"Podman {number}", reads, why


def agent_engine_cdi(
    answer: object,
    engine: str,
    docker: Sequence[str],
    command: DockerCommand,
    environment: Mapping[str, str],
    *,
    engine_id: str | None = None,
) -> EngineCdi | None:
    """Whether the engine at ``engine`` (its unix socket) reads CDI, from what the node's
    agent says of it (``answer``: its ``GET /engines/json``): the row of that same socket
    file while the agent follows its events (dockerd's version and CDI spec dirs, read when
    the stream opened or at its latest ``daemon reload``); then step 3 as on the socket.
    With ``engine_id`` (docker's engine at a ``tcp://`` or ``ssh://`` address, whose ``ID``
    a lease's check asked: ``followed_engine``), the row of the dockerd with that ``ID``,
    wherever the agent runs. None when the agent says nothing of it (another socket, not
    following now, an agent before the route): the caller asks the engine."""
    started = time.perf_counter()
    row = _followed_row(answer, engine) if engine_id is None else _row_of_id(answer, engine_id)
    if row is None:
        return None
    asked = [AGENT_ENGINES]

    def found(name: str, reads: bool, why: str) -> EngineCdi:
        return EngineCdi(name, reads, why, time.perf_counter() - started, tuple(asked))

    number, dirs = row
    return _docker(number, docker, command, environment, engine, asked, found, dirs=dirs)


def local_rows(answer: object) -> Iterator[dict[str, object]]:
    """The rows of ``answer`` (the agent's ``GET /engines/json``), when the agent runs on
    this machine (its kernel's boot id); none otherwise."""
    own = _boot_id()
    if own is None or not isinstance(answer, dict) or answer.get("BootId") != own:
        return
    yield from engine_rows(answer)


def engine_rows(answer: object) -> Iterator[dict[str, object]]:
    """The rows of ``answer`` (the agent's ``GET /engines/json``), wherever the agent runs."""
    rows = answer.get("Engines") if isinstance(answer, dict) else None
    for row in rows if isinstance(rows, list) else ():
        if isinstance(row, dict):
            yield row


def _followed_rows(answer: object) -> Iterator[dict[str, object]]:
    """The rows of ``answer`` (the agent's ``GET /engines/json``) whose engine the agent
    follows now, when it runs on this machine (its kernel's boot id); none otherwise."""
    return (row for row in local_rows(answer) if row.get("Following") is True)


def _followed_row(answer: object, engine: str) -> tuple[str, list[str]] | None:
    """The version and CDI spec dirs of ``answer``'s row for the socket file ``engine``,
    when the agent runs on this machine (its kernel's boot id), follows it and knows both."""
    for row in _followed_rows(answer):
        facts, socket = _facts(row), row.get("Socket")
        if facts is None or not isinstance(socket, str):
            continue
        try:
            same = os.path.samefile(socket, engine)
        except (OSError, ValueError):
            continue
        if same:
            return facts
    return None


def _row_of_id(answer: object, engine_id: str) -> tuple[str, list[str]] | None:
    """The version and CDI spec dirs of ``answer``'s row of the dockerd whose ``ID`` is
    ``engine_id``, wherever the agent runs, when it follows it now and knows both."""
    for row in engine_rows(answer):
        if row.get("Following") is True and row.get("ID") == engine_id:
            return _facts(row)
    return None


def _facts(row: dict[str, object]) -> tuple[str, list[str]] | None:
    """A row's dockerd version and CDI spec dirs, where it says both."""
    number, dirs = row.get("Version"), row.get("CDISpecDirs")
    if not (isinstance(number, str) and number):
        return None
    if not (isinstance(dirs, list) and all(isinstance(d, str) for d in dirs)):
        return None
    return number, dirs


def follows_own_engine(answer: object, uid: int) -> bool:
    """``answer`` (the agent's ``GET /engines/json``) says the agent runs on this machine
    and follows an engine whose socket is user ``uid``'s (rootless Podman's service, as
    ``--podman-socket /run/user/<uid>/podman/podman.sock`` has it follow). A row that says
    a dockerd's version is not one: that user's rootless Docker does not see the containers
    of the user's Podman. A socket the wrapper's user may not look at (``sudo -u alice
    podman`` run by bob: alice's ``/run/user/<uid>`` is hers alone) is the user's whose
    ``<uid>`` its path names."""
    for row in _followed_rows(answer):
        socket = row.get("Socket")
        if row.get("Version") is not None:  # a dockerd (Podman's service says none)
            continue
        try:
            if isinstance(socket, str) and os.stat(socket).st_uid == uid:
                return True
        except PermissionError:  # another user's runtime directory: its path says whose
            if isinstance(socket, str) and runtime_dir_owner(socket) == uid:
                return True
        except (OSError, ValueError):
            continue
    return False


def runtime_dir_owner(path: str) -> int | None:
    """The ``<uid>`` of a ``path`` in ``/run/user/<uid>/`` (``/var/run`` too), else None."""
    for runtime in ("/run/user/", "/var/run/user/"):
        number, slash, _ = path.removeprefix(runtime).partition("/")
        if path.startswith(runtime) and slash and number.isascii() and number.isdigit():
            return int(number)
    return None


def _boot_id() -> str | None:
    """This kernel's boot id, as ``agent.api.engines.boot_id`` reads it (not imported from
    there: ``agent.api`` brings aiohttp, and even ``pathlib`` costs the run path 8 ms)."""
    try:
        with open(BOOT_ID, encoding="ascii") as file:
            return file.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _docker(
    number: str,
    docker: Sequence[str],
    command: DockerCommand,
    environment: Mapping[str, str],
    engine: str,
    asked: list[str],
    found: Callable[[str, bool, str], EngineCdi],
    *,
    dirs: list[str] | None = None,
) -> EngineCdi:
    """Steps 2 and 3 on the engine's socket, for dockerd ``number`` (from ``/_ping``, or
    with ``dirs`` from the agent)."""
    name = f"Docker {number}"
    if not _docker_reads_cdi(number):
        return found(name, False, f"Docker reads CDI from {DOCKER_CDI_MAJOR}.0 on")
    if dirs is None:
        asked.append("GET /info")
        dirs = engine_api.cdi_spec_dirs(engine)
    if dirs is None:
        return found(name, *_cli_info(docker, command, environment, asked))
    if not dirs:
        return found(name, False, NO_SPEC_DIRS)
    asked.append("the docker CLI's build information")
    from controller.wrapper import go_build_info  # noqa: PLC0415 (here only: 0.1 ms to import)

    program = _program(docker, environment)
    cli = go_build_info.linked_value(program, CLI_VERSION) if program is not None else None
    if cli is None and program is not None:  # not recorded (-trimpath): its --version
        from controller.wrapper import cli_versions  # noqa: PLC0415 (here only)

        said = cli_versions.cli_version(program, environment, asked)
        cli = said[1] if said is not None and said[0] == "Docker" else None
    cli_major = _major(cli) if cli is not None else None
    if cli_major is None:
        return found(name, *_cli_info(docker, command, environment, asked))
    if cli_major < DOCKER_CDI_MAJOR:
        why = f"the docker CLI {cli} cannot pass CDI devices ({DOCKER_CDI_MAJOR}.0 on can)"
        return found(name, False, why)
    return found(name, True, _spec_dirs(dirs))


def _program(docker: Sequence[str], environment: Mapping[str, str]) -> str | None:
    """The file that ``docker`` runs, when it is one word (``docker``: the CLI on ``PATH``)."""
    if len(docker) != 1:
        return None
    if "/" in docker[0]:
        return docker[0]
    return engine_api.docker_program(environment.get("PATH") or os.defpath)


def _remembered(
    docker: Sequence[str], environment: Mapping[str, str], asked: list[str]
) -> tuple[str, str] | None:
    """What the one-word ``docker`` command's program (``podman``) prints for
    ``--version``, as ``cli_versions`` remembers it (None: not one word, not found, not
    said)."""
    if len(docker) != 1:
        return None
    from controller.wrapper import cli_versions, docker_cli  # noqa: PLC0415 (only here)

    try:
        program = docker_cli.found(docker[0], environment)
    except FileNotFoundError:
        return None
    return cli_versions.cli_version(program, environment, asked)


def _docker_reads_cdi(number: str) -> bool:
    major = _major(number)
    return major is not None and major >= DOCKER_CDI_MAJOR


def _cli_info(
    docker: Sequence[str], command: DockerCommand, environment: Mapping[str, str], asked: list[str]
) -> tuple[bool, str]:
    """Whether CDI is on, and why, as ``docker info``'s ``CDISpecDirs`` says."""
    asked.append("docker info")
    dirs = _json(_ask(docker, command, environment, "info", "--format", "{{json .CDISpecDirs}}"))
    if isinstance(dirs, list) and dirs:
        return True, _spec_dirs(dirs)
    return False, NO_SPEC_DIRS


def _spec_dirs(dirs: list[object] | list[str]) -> str:
    return f"CDI spec dirs {', '.join(map(str, dirs))}"


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
