"""The lease table's timings and sharing, given once when the table is built."""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.leases.units import Unit

PENDING_S = 60.0  # a grant's container must be created within this time
GRACE_S = 600.0  # a stopped container keeps its lease this long
MAX_WAIT_S = 600.0  # the longest an ask may wait in the queue (longer asks are cut to it)
MAX_WAITING = 256  # asks waiting at once; one more is refused
MAX_SHARING = 64  # the most leases one GPU may be shared by


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """How long grants and stopped containers keep GPUs, and how many leases share one.

    ``sharing`` is the node's sharing count: how many shared leases one GPU (or MIG device)
    takes at once; 1 (the default) means that even a shared ask gets it alone.
    ``gpu_sharing`` sets it per GPU, by UUID or index (``(("GPU-8f…", 4), ("3", 2))``); a MIG
    device has its GPU's count. An exclusive lease always takes a GPU alone.
    """

    pending_s: float = PENDING_S
    grace_s: float = GRACE_S
    max_wait_s: float = MAX_WAIT_S
    max_waiting: int = MAX_WAITING
    sharing: int = 1
    gpu_sharing: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for name in ("pending_s", "grace_s", "max_wait_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"lease settings: {name} must be a finite number >= 0: {value}")
        if self.max_waiting < 0:
            raise ValueError(f"lease settings: max_waiting must be >= 0: {self.max_waiting}")
        for gpu, count in (("sharing", self.sharing), *self.gpu_sharing):
            if not 1 <= count <= MAX_SHARING:
                raise ValueError(
                    f"lease settings: sharing count of {gpu} must be 1 to {MAX_SHARING}: {count}"
                )

    def sharing_of(self, unit: Unit, gpu_uuid: str | None) -> int:
        """How many shared leases ``unit`` takes at once (``gpu_uuid``: its GPU's UUID)."""
        for gpu, count in self.gpu_sharing:
            if gpu == str(unit.gpu) or (gpu_uuid is not None and gpu == gpu_uuid):
                return count
        return self.sharing
