"""Where a process runs, read off its cgroup path (``/proc/<pid>/cgroup``).

Every container runtime puts a container's processes in a cgroup named after the
container; the names are the runtimes' own, stable for years, and the same under cgroup v1
(one line per hierarchy, ``12:memory:/docker/<id>``) and v2 (one line, ``0::/docker/<id>``):

- Docker, cgroupfs driver: ``/docker/<64 hex>``; systemd driver:
  ``/system.slice/docker-<64 hex>.scope`` (also under ``kubepods`` slices);
- Podman: ``libpod-<64 hex>.scope`` (systemd) or ``/libpod_parent/libpod-<64 hex>``
  (``libpod-conmon-<id>`` is the monitor process, not the container);
- the Mesos containerizer: ``/mesos/<container id>``, a nested container (a task of a
  task group) ``/mesos/<parent>/mesos/<child>``, shown as Mesos writes nested ids,
  ``parent.child``.

A cgroup v1 process has a line per hierarchy and they may disagree (the ``name=systemd``
line can show a session while ``memory`` shows the container), so every line is searched.
A process in none of these is the host's. A process that ended before its cgroup file
could be read, or that this agent cannot see (another PID namespace), is ``UNKNOWN``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path


class OwnerKind(enum.StrEnum):
    DOCKER = "docker"
    PODMAN = "podman"
    MESOS = "mesos"
    HOST = "host"
    UNKNOWN = "unknown"  # the process ended (or is not visible) before it could be placed


@dataclass(frozen=True, slots=True)
class CgroupPlace:
    """The container a cgroup path names; ids only (names come from the engine)."""

    kind: OwnerKind
    container_id: str | None = None  # Docker or Podman: the full 64-hex id
    mesos_container: str | None = None  # the Mesos ContainerID, nested ones as parent.child


HOST = CgroupPlace(OwnerKind.HOST)
UNKNOWN = CgroupPlace(OwnerKind.UNKNOWN)

_HEX64 = "[0-9a-f]{64}"
_DOCKER = (
    re.compile(rf"/docker/({_HEX64})(?=/|$)"),  # cgroupfs driver
    re.compile(rf"(?:^|/)docker-({_HEX64})\.scope(?=/|$)"),  # systemd driver
)
_PODMAN = re.compile(rf"(?:^|/)libpod-({_HEX64})(?:\.scope)?(?=/|$)")
_MESOS = re.compile(r"(?:^|/)mesos/([A-Za-z0-9_.-]+)")


def place_of(cgroup_text: str) -> CgroupPlace:
    """The container named by the content of a ``/proc/<pid>/cgroup`` file."""
    docker: str | None = None
    podman: str | None = None
    mesos: list[str] = []
    lines = [line for line in cgroup_text.splitlines() if line.strip()]
    if not lines:
        return UNKNOWN  # an exiting process: the kernel has already detached it
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path = parts[2]
        if docker is None:
            docker = _first(_DOCKER, path)
        if podman is None:
            found = _PODMAN.search(path)
            podman = found.group(1) if found else None
        if not mesos:
            mesos = _MESOS.findall(path)
    mesos_id = ".".join(mesos) if mesos else None
    if docker is not None:
        return CgroupPlace(OwnerKind.DOCKER, docker, mesos_id)
    if podman is not None:
        return CgroupPlace(OwnerKind.PODMAN, podman, mesos_id)
    if mesos_id is not None:
        return CgroupPlace(OwnerKind.MESOS, None, mesos_id)
    return HOST


def _first(patterns: tuple[re.Pattern[str], ...], path: str) -> str | None:
    for pattern in patterns:
        found = pattern.search(path)
        if found:
            return found.group(1)
    return None


def read_place(pid: int, proc: Path = Path("/proc")) -> CgroupPlace:
    """The container of process ``pid``; ``UNKNOWN`` when it has gone (or cannot be read).

    A few microseconds (procfs, no disk): callers on the event loop may call it inline.
    """
    try:
        text = (proc / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:  # ENOENT: it exited; ESRCH: it is exiting; EACCES: not ours to see
        return UNKNOWN
    return place_of(text)
