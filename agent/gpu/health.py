"""What the GPU worker reports about GPU health: NVML's events and each sweep's checks.

Two signals, both produced in the GPU worker (``agent.gpu.worker``) and sent to the daemon:

- **events**, as NVML delivers them (``nvmlEventSetWait``): critical XID errors and
  double-bit ECC errors (``HealthEvent``);
- **checks**, one per GPU at every health sweep (``DeviceCheck``): does the GPU answer at
  all (not "GPU is lost"), has row remapping failed or is a remap pending, are retired
  pages pending, does the driver ask for a recovery action (a GPU reset, a reboot).

On a GPU in MIG mode the driver says which GPU instance (and compute instance) an XID
belongs to when it knows (``HealthEvent.gpu_instance_id``), so that the daemon can withdraw
that MIG device alone. The worker also counts the resets it sees of each GPU
(``agent.gpu.resets``): both signals carry that count, so a reset that happens between two
sweeps, or just before an event, is told apart from one after it.

What they mean, healthy or unhealthy and why, is the daemon's rule: ``agent.health.rule``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

XID = "xid"
DOUBLE_BIT_ECC = "double_bit_ecc"


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """One NVML event: ``kind`` is ``xid`` (with ``xid``) or ``double_bit_ecc``.

    ``gpu_instance_id`` and ``compute_instance_id`` are the MIG instances the driver
    attributes it to (NVML's ids, as ``MigDevice`` has them); ``None`` when it names none
    (a GPU not in MIG mode, or an error of the whole GPU). ``resets``: the worker's count of
    this GPU's resets when the event arrived (``DeviceCheck.resets``); None: not counted.
    """

    index: int  # the GPU, in NVML index order
    kind: str
    xid: int | None = None
    at_s: float = 0.0  # Unix time it was received
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    resets: int | None = None


@dataclass(frozen=True, slots=True)
class DeviceCheck:
    """What one health sweep found on one GPU (a value NVML cannot give is ``None``)."""

    answering: bool = True  # False: "GPU is lost", or NVML could not open it
    row_remap_failure: bool = False
    row_remap_pending: bool = False
    retired_pages_pending: bool = False
    volatile_dbe: int | None = None  # uncorrected volatile ECC errors; a reset clears them
    # What the driver says the GPU needs (nvmlDeviceGpuRecoveryAction_t: 0 none, 1 a GPU
    # reset, 2 a node reboot, 3 drain peer-to-peer traffic, 4 drain and reset, ...); None:
    # the driver does not say (older drivers have no such field). A reset sets it back to 0.
    recovery_action: int | None = None
    resets: int = 0  # resets of this GPU the worker has seen (``agent.gpu.resets``)


class EventWatch(Protocol):
    """A backend's event subscription (NVML's event set); used by one thread only."""

    def wait(self, timeout_s: float) -> list[HealthEvent]:
        """The events that arrived, waiting at most ``timeout_s`` for one; [] on timeout."""
        ...

    def close(self) -> None: ...


class HealthSource(Protocol):
    """What a backend offers the worker's health threads."""

    def health_check(self, index: int) -> DeviceCheck:
        """One GPU's per-sweep check (``resets`` left 0: the worker counts). Never raises."""
        ...

    def event_watch(self) -> EventWatch | None:
        """Subscribe to the GPUs' critical events; None when none can be watched."""
        ...
