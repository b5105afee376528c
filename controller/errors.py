"""The errors the controller reports to a person: one line each, saying what to do.

Every message is complete on its own (which node, what failed, what to try), because both
commands print it as one line, ``<command> | <date> <time> Error: <message>``
(``nvidia-docker | ...`` as nvidia-docker 1.0 has it, docs/nvidia-docker.md, and
``nvidia-docker-ctl | ...`` the same way), without a traceback unless ``NV_DEBUG`` is set.

Exit codes (docs/fleet.md, "Errors and exit codes", has the table): ``nvidia-docker`` exits
1 for every error of its own (docs/nvidia-docker.md) and otherwise with docker's code (it becomes
docker); ``nvidia-docker-ctl`` uses the ``EXIT_*`` codes below for every command. This
module imports nothing (not even ``enum``: ``Failure``), so that the wrapper's fast path can
use it for free.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import ClassVar

EXIT_OK = 0
EXIT_FAILED = 1  # the command failed (a node failed or refused, a problem found, bad input)
EXIT_USAGE = 2  # the command line or an option is wrong: nothing was asked
EXIT_NO_ANSWER = 3  # no node's agent could be reached
EXIT_INTERNAL = 4  # a bug: NV_DEBUG=1 shows the traceback
EXIT_INTERRUPTED = 130  # Ctrl-C


class ControllerError(Exception):
    """Something the user can fix; ``str(error)`` is the one line to print."""


class UsageError(ControllerError):
    """The command line, a variable or a file named on it is wrong (ctl: exit 2)."""


class EndpointError(UsageError):
    """``NV_HOST`` / ``DOCKER_HOST`` (or a node name) does not follow the grammar."""


class Failure:
    """What kind of thing went wrong with a node, set where the error is raised.

    The value is the few words a fleet table shows in its error column; programs compare
    the member, never the message. The members (``Failure.TIMEOUT``, with ``name`` and
    ``value``) are made once, below, and compared by identity, as an enum's are; this is not
    an ``enum.Enum`` because every ``nvidia-docker ps`` imports this module, and ``enum``
    costs 3 to 6 ms to import there (docs/nvidia-docker.md, "Speed").
    """

    __slots__ = ("name", "value")

    REFUSED: ClassVar[Failure]
    UNKNOWN_HOST: ClassVar[Failure]
    CANNOT_CONNECT: ClassVar[Failure]
    TIMEOUT: ClassVar[Failure]
    DISCONNECTED: ClassVar[Failure]
    HTTP_STATUS: ClassVar[Failure]
    NOT_AN_AGENT: ClassVar[Failure]
    SSH_REFUSED: ClassVar[Failure]
    SSH_HOST_KEY_UNKNOWN: ClassVar[Failure]
    SSH_HOST_KEY_CHANGED: ClassVar[Failure]
    SSH_LOGIN_FAILED: ClassVar[Failure]
    SSH_NO_AGENT: ClassVar[Failure]
    SSH_ERROR: ClassVar[Failure]
    TLS_UNTRUSTED: ClassVar[Failure]
    TLS_NAME_MISMATCH: ClassVar[Failure]
    TLS_CLIENT_CERT_REFUSED: ClassVar[Failure]
    TLS_ERROR: ClassVar[Failure]
    TOKEN_REFUSED: ClassVar[Failure]
    ERROR: ClassVar[Failure]

    def __init__(self, name: str, value: str) -> None:
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"<Failure.{self.name}: {self.value!r}>"

    def __reduce__(self) -> tuple[object, tuple[type[Failure], str]]:
        return getattr, (Failure, self.name)  # a copy or an unpickled one is the member


for _name, _value in (
    ("REFUSED", "connection refused"),
    ("UNKNOWN_HOST", "unknown host"),
    ("CANNOT_CONNECT", "cannot connect"),
    ("TIMEOUT", "timeout"),
    ("DISCONNECTED", "disconnected"),
    ("HTTP_STATUS", "HTTP status"),  # shown as "HTTP <status>" (AgentHttpError)
    ("NOT_AN_AGENT", "not an agent"),  # the answer is not the agent's (JSON shape, HTML page)
    ("SSH_REFUSED", "SSH refused"),
    ("SSH_HOST_KEY_UNKNOWN", "SSH host key unknown"),
    ("SSH_HOST_KEY_CHANGED", "SSH host key CHANGED"),
    ("SSH_LOGIN_FAILED", "SSH login failed"),
    ("SSH_NO_AGENT", "no agent behind SSH"),
    ("SSH_ERROR", "SSH error"),
    ("TLS_UNTRUSTED", "certificate not trusted"),
    ("TLS_NAME_MISMATCH", "certificate name mismatch"),
    ("TLS_CLIENT_CERT_REFUSED", "client certificate refused"),
    ("TLS_ERROR", "TLS error"),
    ("TOKEN_REFUSED", "token refused"),
    ("ERROR", "error"),
):
    setattr(Failure, _name, Failure(_name, _value))


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
