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
"""

from __future__ import annotations

import os

from controller.wrapper.engine_api import docker_version, engine_id
from controller.wrapper.engine_cdi import local_rows

TYPE_CHECKING = False
if TYPE_CHECKING:
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
