"""How busy a GPU is, as picking weighs it among equally connected GPUs (docs/leases.md,
"Picking").

A status sweep says of each GPU how much of the time a kernel ran (NVML's utilization,
``nvidia-smi --query-gpu=utilization.gpu``) and how much of its memory is used. A GPU is as
busy as the larger of the two, in steps of ``LEVEL_STEP_PCT``: its ``level``, 0 (idle) to
10 (full). The larger, because a GPU whose memory a program fills is a poor pick even while
that program computes nothing, and one that computes all the time is a poor pick with its
memory free. Steps, because idle GPUs differ by noise (0 to 3 % utilization, the few hundred
MiB the driver keeps): equal steps tie, and ties go to the lowest index, so that the same
node picks the same GPUs sweep after sweep. A value that is unknown counts as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

LEVEL_STEP_PCT = 10
MAX_LEVEL = 100 // LEVEL_STEP_PCT


@dataclass(frozen=True, slots=True)
class GpuLoad:
    """One GPU's load in one status sweep, in percent (None: unknown)."""

    utilization_pct: int | None = None  # time a kernel ran, over NVML's sample period
    memory_used_pct: int | None = None  # device memory used, of its total

    @property
    def level(self) -> int:
        """The larger of the two percentages in steps of ``LEVEL_STEP_PCT``: 0 to 10."""
        busiest = max(self.utilization_pct or 0, self.memory_used_pct or 0)
        return min(MAX_LEVEL, max(0, busiest) // LEVEL_STEP_PCT)


def memory_used_pct(used_mib: int | None, total_mib: int | None) -> int | None:
    """``used_mib`` of ``total_mib`` in whole percent, rounded down; None when unknown."""
    if used_mib is None or not total_mib or total_mib <= 0:
        return None
    return max(0, used_mib) * 100 // total_mib
