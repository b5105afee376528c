"""The errors the controller reports to a person: one line each, saying what to do.

Every message is complete on its own (which node, what failed, what to try), because the
wrapper prints it as ``nvidia-docker | <date> <time> Error: <message>`` and exits 1, without
a traceback unless ``NV_DEBUG`` is set. This module imports nothing, so that the wrapper's
fast path can use it for free.
"""

from __future__ import annotations


class ControllerError(Exception):
    """Something the user can fix; ``str(error)`` is the one line to print."""


class EndpointError(ControllerError):
    """``NV_HOST`` / ``DOCKER_HOST`` (or a node name) does not follow the grammar."""


class NodeError(ControllerError):
    """A node's agent could not be reached or answered badly (HTTP or SSH)."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(f"{node}: {message}")
        self.node = node
        self.reason = message


class DockerError(ControllerError):
    """The docker CLI failed while the wrapper asked it something (inspect, pull)."""


class GpuError(ControllerError):
    """The GPU request cannot be met: unknown GPU in ``NV_GPU``, CUDA too old, no driver."""
