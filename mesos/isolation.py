"""The ``--isolation`` values that Mesos's ``gpu/nvidia`` isolator needs, per Mesos version.

What each version's isolator checks when it starts (``isolators/gpu/isolator.cpp``):

- 1.0 - 1.1: ``cgroups/devices`` present and listed before ``gpu/nvidia``;
- 1.2 - 1.6: ``cgroups/devices`` and ``filesystem/linux`` present, both before ``gpu/nvidia``;
- 1.7 and later: ``cgroups/devices`` (or ``cgroups/all``, new in 1.7) and ``filesystem/linux``
  present, in any order.

``with_gpu_isolation`` gives a value that satisfies all of them: the operator's isolators in
their order, the two that are missing added, ``gpu/nvidia`` last.
"""

from __future__ import annotations

GPU_ISOLATOR = "gpu/nvidia"
DEVICES_ISOLATOR = "cgroups/devices"
CGROUPS_ALL = "cgroups/all"
FILESYSTEM_ISOLATOR = "filesystem/linux"
DEFAULT_ISOLATION = "posix/cpu,posix/mem"
"""Mesos's default ``--isolation`` on Linux (every 1.x release)."""


def isolators(value: str) -> list[str]:
    """The isolator names of an ``--isolation`` value, as Mesos tokenizes it."""
    return [token for token in value.split(",") if token]


def with_gpu_isolation(value: str | None) -> str:
    """``value`` (Mesos's default when None) with what ``gpu/nvidia`` needs, valid for 1.0+."""
    tokens = isolators(DEFAULT_ISOLATION if value is None else value)
    tokens = [t for t in tokens if t != GPU_ISOLATOR]
    if DEVICES_ISOLATOR not in tokens and CGROUPS_ALL not in tokens:
        tokens.append(DEVICES_ISOLATOR)
    if FILESYSTEM_ISOLATOR not in tokens:
        tokens.append(FILESYSTEM_ISOLATOR)
    tokens.append(GPU_ISOLATOR)
    return ",".join(dict.fromkeys(tokens))
