"""The daemon's file descriptors: how many REST connections its limit leaves room for.

Every connection, file and socket takes a descriptor, up to the process's soft limit
(``RLIMIT_NOFILE``: ``LimitNOFILE=`` in the systemd unit, ``ulimit -n`` in a shell; 1,024
by default). When none is left, ``accept()`` fails on every listening socket, the plugin
socket included, and dockerd cannot start GPU containers. So the REST API may hold at most
the limit minus a reserve (``--reserved-fds``) of connections, even when ``--max-connections``
asks for more. The reserve is for what the daemon needs besides REST clients: the plugin
socket's connections from dockerd, the files of a volume build, its own libraries,
pipes and engine connections, and TLS connections before their handshake's end
(``agent.edge.tls_or_plain``); with ``--engine-socket``, two for each of its connections.
Plain REST connections never exceed the bound, even for a moment (``agent.edge.guarded_accept``).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from agent.errors import StartupError

MIN_REST_CONNECTIONS = 16


@dataclass(frozen=True, slots=True)
class DescriptorBudget:
    limit: int  # the soft RLIMIT_NOFILE
    reserved: int  # --reserved-fds, and the engine socket's share where it is served
    max_connections: int  # the REST bound in force
    asked: int  # what --max-connections asked for

    @property
    def lowered(self) -> bool:
        """Whether the limit lowered the bound below what was asked."""
        return self.max_connections < self.asked


def soft_limit() -> int:
    """The process's soft descriptor limit (a very large number when unlimited)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY and soft >= 0 else 1 << 30


def descriptor_budget(
    asked: int, reserved: int, limit: int | None = None, *, engine_connections: int = 0
) -> DescriptorBudget:
    """The REST connection bound for ``--max-connections asked`` and ``--reserved-fds``,
    less two descriptors for each of ``engine_connections`` (``--engine-connections``
    when ``--engine-socket`` is served: the client's and the engine's); ``StartupError``
    when the limit leaves no room for REST clients."""
    limit = soft_limit() if limit is None else limit
    kept = reserved + 2 * engine_connections
    room = limit - kept
    if room < MIN_REST_CONNECTIONS:
        also = (
            f" and {2 * engine_connections} for the engine socket (--engine-connections)"
            if engine_connections
            else ""
        )
        raise StartupError(
            f"the descriptor limit is {limit} and {reserved} are reserved (--reserved-fds)"
            f"{also}, which leaves fewer than {MIN_REST_CONNECTIONS} for REST connections: "
            "raise the limit (LimitNOFILE= in the unit, ulimit -n) or lower --reserved-fds"
        )
    return DescriptorBudget(limit, kept, min(asked, room), asked)
