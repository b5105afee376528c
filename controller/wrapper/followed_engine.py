"""Whether the node's agent follows the Docker engine that ``nvidia-docker run`` creates its
container on.

Why: a lease holds while the agent sees its container, through the event stream of an
engine it follows (docs/leases.md, "How it fails safe"). A docker CLI sent to another
dockerd (rootless Docker's ``unix:///run/user/1000/docker.sock``, a second daemon on the
node, a ``DOCKER_HOST`` or context of the user's own) creates a container the agent never
sees: the wrapper's watcher would give the lease back as soon as docker returned, while the
container runs, and its GPUs would go to the next ask. So no lease is asked for there
(``refusal``).

``engine_followed(answer, engine)``: ``answer`` is the agent's ``GET /engines/json`` and
``engine`` the unix socket file the docker CLI asks (``engine_api.engine_socket``). True
when the agent runs on this machine (the boot id it says is this kernel's) and

- one of its rows is that socket file (its stream open now or not: a stream that dropped
  comes back, and a restarted dockerd is followed again), or
- it is the agent's own GPU-aware engine socket (``EngineSocket``, forwarded to its Docker
  engine), or
- the dockerd behind ``engine`` says (``GET /info``) the ``ID`` of one of its rows: the same
  daemon behind a second socket. Asked only when no socket matched (about 5 ms of dockerd's).
  A row that says no ``ID`` (its stream reconnecting after dockerd restarted, its facts not
  read) is asked its own where its socket is a dockerd (``GET /_ping``'s ``Server``, at
  almost no cost; Podman's service and a socket that does not answer are not asked), only
  when nothing else matched.

False when none holds. None where it cannot say: an agent of another machine, one that
lists no engine, one that follows a dockerd now without saying its ``ID`` (older than the
field), or a socket that does not answer ``GET /info`` (docker then fails on it too).

``followed_by_id(answer, said)``: where no socket file can be compared (docker's engine is
``tcp://`` or ``ssh://``, or the agent runs on another machine, reached through ``NV_HOST``),
the engine's ``ID`` (``said``: ``GET /info`` of a unix socket or of a plain ``tcp://``
address, else ``cli_engine_id``, the docker CLI's ``docker info``, which knows TLS, contexts
and SSH: ``address_id``) against the ``ID`` of each
engine the agent lists, wherever it runs: True for one of them, False for none where every
engine the agent follows now says its ``ID``, else None (an agent older than the field, an
engine that does not answer, or an agent that follows Podman's service, which says no
``ID`` of its own: Podman's compatible ``GET /info`` makes up a new one each time). A
row the agent does not follow now (a socket that is not there) is not waited for.
``refusal_by_id`` is its line.
"""

from __future__ import annotations

import os

from controller.wrapper import docker_cli
from controller.wrapper.engine_api import TIMEOUT_S, docker_version, engine_id, tcp_engine_id
from controller.wrapper.engine_cdi import engine_rows, local_rows

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from controller.wrapper.leases import LeaseAsk


def engine_followed(answer: object, engine: str) -> bool | None:
    """See the module docstring."""
    rows = list(local_rows(answer))
    if not rows:
        return None
    own = answer.get("EngineSocket") if isinstance(answer, dict) else None
    sockets = [row.get("Socket") for row in rows]
    if any(_same_file(socket, engine) for socket in (*sockets, own)):
        return True
    said = engine_id(engine)
    if said is None:
        return None
    if any(row.get("ID") == said for row in rows):
        return True
    if not all(row.get("ID") is not None for row in rows if _follows_dockerd(row)):
        return None
    unsaid = (row.get("Socket") for row in rows if row.get("ID") is None)
    return any(isinstance(socket, str) and _dockerd_id(socket) == said for socket in unsaid)


def refusal(ask: LeaseAsk, engine: str, answer: object) -> str:
    """The line for ``ask`` on the engine at ``engine``, which the agent does not follow
    (naming the sockets of the engines it does that are there: a Docker-only node's agent
    lists Podman's socket too)."""
    listed = [str(row.get("Socket")) for row in local_rows(answer)]
    followed = [socket for socket in listed if os.path.exists(socket)] or listed
    docker = next((s for s in followed if "docker" in os.path.basename(s)), followed[0])
    return (
        f"{ask.source} asks for a GPU lease, but docker runs its containers on the engine at "
        f"unix://{engine}, which the node's agent does not follow (it follows "
        f"{' and '.join(followed)}), so the lease would end as soon as docker returns and its "
        f"GPUs would go to the next ask: use the engine the agent follows "
        f"(DOCKER_HOST=unix://{docker}), have the agent follow this one "
        f"(nvidia-docker-plugin --docker-socket {engine}), or name GPUs without a lease "
        "(NV_GPU=0,1, and no --gpus)"
    )


def followed_by_id(answer: object, said: str | None) -> bool | None:
    """See the module docstring: ``said`` is the ``ID`` of docker's engine (None: unknown)."""
    rows = list(engine_rows(answer))
    if not rows or said is None:
        return None
    if any(row.get("ID") == said for row in rows):
        return True
    if not all(row.get("ID") is not None for row in rows if row.get("Following") is True):
        return None  # a dockerd that does not say its ID, or Podman's service (none to say)
    return False


def address_id(
    address: str, docker: Sequence[str], global_args: Sequence[str], environment: Mapping[str, str]
) -> str | None:
    """The ``ID`` of the engine at ``address`` (not a unix socket): ``GET /info`` over plain
    HTTP for ``tcp://`` without docker's TLS settings (``--tls...``, ``DOCKER_TLS_VERIFY``,
    ``DOCKER_TLS``; about a third of the CLI's cost), else, or where that gets no answer (a
    context's TLS), ``cli_engine_id``."""
    tls = any(arg.startswith("--tls") for arg in global_args)
    if not (tls or environment.get("DOCKER_TLS_VERIFY") or environment.get("DOCKER_TLS")):
        said = tcp_engine_id(address)
        if said is not None:
            return said
    return cli_engine_id(docker, global_args, environment)


def cli_engine_id(
    docker: Sequence[str], global_args: Sequence[str], environment: Mapping[str, str]
) -> str | None:
    """The ``ID`` of the engine that ``docker`` (the docker CLI) with the command's global
    options (``-H``, ``--context``, ``--tls...``) reaches in ``environment``: ``docker info
    --format {{.ID}}`` (None: it failed, said none, or took past ``TIMEOUT_S``)."""
    argv = [*docker, *global_args, "info", "--format", "{{.ID}}"]
    try:
        answer = docker_cli.ask(argv, environment, timeout_s=TIMEOUT_S)
    except (OSError, TimeoutError):
        return None
    said = answer.stdout.strip()
    return said if answer.returncode == 0 and said and "\n" not in said else None


def refusal_by_id(ask: LeaseAsk, address: str, said: str, answer: object, node: str) -> str:
    """The line for ``ask`` on the engine at ``address`` (``ID`` ``said``), which the agent of
    ``node`` does not follow (naming the dockerds it follows, with their ``ID``)."""
    followed = [
        f"{row.get('Socket')} (ID {row.get('ID')})"
        for row in engine_rows(answer)
        if _follows_dockerd(row) and row.get("ID") is not None
    ]
    follows = f"it follows {' and '.join(followed)}" if followed else "it follows no dockerd"
    return (
        f"{ask.source} asks for a GPU lease, but docker runs its containers on the engine at "
        f"{address} (ID {said}), which the agent of {node} does not follow ({follows}), so the "
        "lease would end as soon as docker returns and its GPUs would go to the next ask: "
        "point docker at the engine that agent follows (DOCKER_HOST, -H or --context), ask the "
        "agent of the node that engine runs on (NV_HOST), or name GPUs without a lease "
        "(NV_GPU=0,1, and no --gpus)"
    )


def _same_file(socket: object, engine: str) -> bool:
    try:
        return isinstance(socket, str) and os.path.samefile(socket, engine)
    except (OSError, ValueError):
        return False


def _follows_dockerd(row: dict[str, object]) -> bool:
    """The row is a dockerd the agent follows now (it read its version: Podman's service
    has none said)."""
    return row.get("Following") is True and row.get("Version") is not None


def _dockerd_id(socket: str) -> str | None:
    """The ``ID`` of the dockerd at the socket file ``socket`` (``GET /_ping`` says dockerd
    first: Podman's service is not asked its ``/info``), or None."""
    return engine_id(socket) if docker_version(socket) is not None else None
