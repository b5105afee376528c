"""What the integrator tells the table of containers and GPU processes (engine events, a
container list, a status sweep's attribution)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.leases.holders import CONTAINER_ID
from agent.leases.labels import LeaseLabel

MAX_ENGINE_CHARS = 256  # a unix socket's path is at most 108 bytes


@dataclass(frozen=True, slots=True)
class Container:
    """A container as its engine says it: id, whether it runs, its lease label (``read_label``
    of its labels) and the GPU devices it was given, in any form ``NodeUnits.given`` reads
    (``1``, ``GPU-…``, ``all``, ``nvidia.com/gpu=0:1``, ``/dev/nvidia1``), with ``how`` it was
    given them, in words (``--device /dev/nvidia1``, ``--gpus device=1``, ``/docker/cli``).

    ``engine`` names the engine that tells of it (the agent's feed: the engine's socket
    path; empty: the one engine of a table that is told of one, as in tests). The table
    keeps it with the container's lease and hold, so that only that engine's container list
    (``LeaseTable.resync``) can end them."""

    id: str
    running: bool = False
    lease: LeaseLabel | None = None
    devices: tuple[str, ...] = ()
    how: str = "its devices"
    engine: str = ""

    def __post_init__(self) -> None:
        if not CONTAINER_ID.fullmatch(self.id):
            raise ValueError(f"not a container id: {self.id[:80]!r}")
        check_engine(self.engine)


def check_engine(engine: str) -> str:
    """``engine`` when it is an engine's name (printable, at most ``MAX_ENGINE_CHARS``),
    else ``ValueError``."""
    if len(engine) > MAX_ENGINE_CHARS or not engine.isprintable():
        raise ValueError(f"not an engine name: {engine[:80]!r}")
    return engine


@dataclass(frozen=True, slots=True)
class GpuUser:
    """A GPU process the attribution sees: its GPU (index), its container (None: a process
    outside any container) and its pid."""

    gpu: int
    container_id: str | None
    pid: int

    def __post_init__(self) -> None:
        if self.container_id is not None and not CONTAINER_ID.fullmatch(self.container_id):
            raise ValueError(f"not a container id: {self.container_id[:80]!r}")

    @property
    def holder(self) -> str:
        return self.container_id if self.container_id is not None else f"pid {self.pid}"
