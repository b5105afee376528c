"""The errors the controller reports to a person: one line each, saying what to do.

Every message is complete on its own (which node, what failed, what to try), because the
wrapper prints it as ``nvidia-docker | <date> <time> Error: <message>`` and exits 1, without
a traceback unless ``NV_DEBUG`` is set. This module imports nothing, so that the wrapper's
fast path can use it for free.
"""

from __future__ import annotations

import enum


class ControllerError(Exception):
    """Something the user can fix; ``str(error)`` is the one line to print."""


class EndpointError(ControllerError):
    """``NV_HOST`` / ``DOCKER_HOST`` (or a node name) does not follow the grammar."""


class Failure(enum.Enum):
    """What kind of thing went wrong with a node, set where the error is raised.

    The value is the few words a fleet table shows in its error column; programs compare
    the member, never the message.
    """

    REFUSED = "connection refused"
    UNKNOWN_HOST = "unknown host"
    CANNOT_CONNECT = "cannot connect"
    TIMEOUT = "timeout"
    DISCONNECTED = "disconnected"
    HTTP_STATUS = "HTTP status"  # shown as "HTTP <status>" (AgentHttpError)
    NOT_AN_AGENT = "not an agent"  # the answer is not the agent's (JSON shape, HTML page)
    SSH_REFUSED = "SSH refused"
    SSH_HOST_KEY_UNKNOWN = "SSH host key unknown"
    SSH_HOST_KEY_CHANGED = "SSH host key CHANGED"
    SSH_LOGIN_FAILED = "SSH login failed"
    SSH_NO_AGENT = "no agent behind SSH"
    SSH_ERROR = "SSH error"
    TLS_UNTRUSTED = "certificate not trusted"
    TLS_NAME_MISMATCH = "certificate name mismatch"
    TLS_CLIENT_CERT_REFUSED = "client certificate refused"
    TLS_ERROR = "TLS error"
    TOKEN_REFUSED = "token refused"  # noqa: S105 (a label: the agent answered 401)
    ERROR = "error"


class NodeError(ControllerError):
    """A node's agent could not be reached or answered badly (HTTP or SSH).

    ``node`` names the node, ``reason`` is the message without it, ``failure`` the kind.
    """

    def __init__(self, node: str, message: str, failure: Failure = Failure.ERROR) -> None:
        super().__init__(f"{node}: {message}")
        self.node = node
        self.reason = message
        self.failure = failure

    @property
    def label(self) -> str:
        """The few words for a table's error column."""
        return self.failure.value


class DockerError(ControllerError):
    """The docker CLI failed while the wrapper asked it something (inspect, pull)."""


class GpuError(ControllerError):
    """The GPU request cannot be met: unknown GPU in ``NV_GPU``, CUDA too old, no driver."""
