"""Where a process runs, read off its cgroup path (``/proc/<pid>/cgroup``).

Every container runtime puts a container's processes in a cgroup named after the
container; the names are the runtimes' own, stable for years, and the same under cgroup v1
(one line per hierarchy, ``12:memory:/docker/<id>``) and v2 (one line, ``0::/docker/<id>``):

- Docker, cgroupfs driver: ``/docker/<64 hex>``; systemd driver:
  ``/system.slice/docker-<64 hex>.scope`` (also under ``kubepods`` slices);
- Podman: ``libpod-<64 hex>.scope`` (systemd) or ``/libpod_parent/libpod-<64 hex>``
  (``libpod-conmon-<id>`` is the monitor process, not the container);
- containerd: ``cri-containerd-<64 hex>.scope`` (Kubernetes through CRI, systemd driver) or
  ``nerdctl-<64 hex>.scope`` (nerdctl); CRI-O: ``crio-<64 hex>.scope`` (``crio-conmon-``
  is its monitor); a Kubernetes pod under the cgroupfs driver,
  ``/kubepods[/<class>]/pod<uid>/<64 hex>``, names no runtime: ``kubernetes``. These
  runtimes are not asked for names (no client here): their processes carry the id;
- the Mesos containerizer: ``/mesos/<container id>``, a nested container (a task of a
  task group) ``/mesos/<parent>/mesos/<child>``, shown as Mesos writes nested ids,
  ``parent.child``.

A container nested in another (Docker in Docker, Docker in a Podman container, a Kubernetes
node in Docker) is the outer one, whichever runtimes and drivers the two have: the node's
engine knows only that one (``/system.slice/docker-<outer>.scope/docker/<inner>`` is
``<outer>``).

A cgroup v1 process has a line per hierarchy and they may disagree (the ``name=systemd``
line can show a session while ``memory`` shows the container), so every line is searched.
A cgroup v2 path that ends in `` (deleted)`` (a process that has exited, whose container's
cgroup was removed) is read without it.
A process in none of these is the host's. A process that ended before its cgroup file
could be read, or that this agent cannot see (another PID namespace), is ``UNKNOWN``; so is
one that is exiting under cgroup v1, whose every v1 line the kernel shows as ``/``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path


class OwnerKind(enum.StrEnum):
    DOCKER = "docker"
    PODMAN = "podman"
    CONTAINERD = "containerd"
    CRIO = "cri-o"
    KUBERNETES = "kubernetes"  # a pod's container whose runtime the path does not name
    MESOS = "mesos"
    HOST = "host"
    UNKNOWN = "unknown"  # the process ended (or is not visible) before it could be placed


@dataclass(frozen=True, slots=True)
class CgroupPlace:
    """The container a cgroup path names; ids only (names come from the engine)."""

    kind: OwnerKind
    container_id: str | None = None  # a container runtime's full 64-hex id
    mesos_container: str | None = None  # the Mesos ContainerID, nested ones as parent.child


HOST = CgroupPlace(OwnerKind.HOST)
UNKNOWN = CgroupPlace(OwnerKind.UNKNOWN)

_HEX64 = "[0-9a-f]{64}"
_DOCKER = (
    re.compile(rf"/docker/({_HEX64})(?=/|$)"),  # cgroupfs driver
    re.compile(rf"(?:^|/)docker-({_HEX64})\.scope(?=/|$)"),  # systemd driver
)
_PODMAN = re.compile(rf"(?:^|/)libpod-({_HEX64})(?:\.scope)?(?=/|$)")
# In one path the outermost container wins; between the lines of cgroup v1, the first
# runtime in this order (a Docker container in a Kubernetes pod is Docker's).
_RUNTIMES: tuple[tuple[OwnerKind, tuple[re.Pattern[str], ...]], ...] = (
    (OwnerKind.DOCKER, _DOCKER),
    (OwnerKind.PODMAN, (_PODMAN,)),
    (
        OwnerKind.CONTAINERD,
        (
            re.compile(rf"(?:^|/)cri-containerd-({_HEX64})\.scope(?=/|$)"),
            re.compile(rf"(?:^|/)nerdctl-({_HEX64})\.scope(?=/|$)"),
        ),
    ),
    (OwnerKind.CRIO, (re.compile(rf"(?:^|/)crio-({_HEX64})\.scope(?=/|$)"),)),
    (
        OwnerKind.KUBERNETES,
        (re.compile(rf"/kubepods(?:/[a-z]+)?/pod[0-9a-f_-]+/({_HEX64})(?=/|$)"),),
    ),
)
_MESOS = re.compile(r"(?:^|/)mesos/([A-Za-z0-9_.-]+)")
# cgroup v2 adds this to the path of a cgroup that was removed: the process has exited (a
# zombie) and its container's cgroup is gone, yet the path still names the container.
_DELETED = " (deleted)"
_PF_EXITING = 0x4  # the kernel's flag of a task in do_exit (the 9th field of /proc/<pid>/stat)


def place_of(cgroup_text: str) -> CgroupPlace:
    """The container named by the content of a ``/proc/<pid>/cgroup`` file."""
    lines = [line for line in cgroup_text.splitlines() if line.strip()]
    if not lines:
        return UNKNOWN  # an exiting process: the kernel has already detached it
    paths = [
        parts[2].removesuffix(_DELETED)
        for parts in (line.split(":", 2) for line in lines)
        if len(parts) == 3
    ]
    mesos = next((found for found in map(_MESOS.findall, paths) if found), [])
    mesos_id = ".".join(mesos) if mesos else None
    outermost = [found for found in map(_outermost, paths) if found is not None]
    for kind, _patterns in _RUNTIMES:
        for found_kind, container_id in outermost:
            if found_kind is kind:
                return CgroupPlace(kind, container_id, mesos_id)
    if mesos_id is not None:
        return CgroupPlace(OwnerKind.MESOS, None, mesos_id)
    return HOST


def _outermost(path: str) -> tuple[OwnerKind, str] | None:
    """The container of ``path`` nearest its root, of whichever runtime (the one this
    node's engines know: a container nested in it belongs to the engine inside it)."""
    best: tuple[int, OwnerKind, str] | None = None
    for kind, patterns in _RUNTIMES:
        for pattern in patterns:
            found = pattern.search(path)
            if found and (best is None or found.start(1) < best[0]):
                best = (found.start(1), kind, found.group(1))
    return None if best is None else (best[1], best[2])


def read_place(pid: int, proc: Path = Path("/proc")) -> CgroupPlace:
    """The container of process ``pid``; ``UNKNOWN`` when it has gone (or cannot be read).

    A few microseconds (procfs, no disk): callers on the event loop may call it inline.
    """
    try:
        text = (proc / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:  # ENOENT: it exited; ESRCH: it is exiting; EACCES: not ours to see
        return UNKNOWN
    place = place_of(text)
    if place is HOST and _v1_root_only(text) and _exiting(pid, proc):
        return UNKNOWN
    return place


def _v1_root_only(cgroup_text: str) -> bool:
    """Whether every cgroup v1 line says ``/``: what the kernel shows of a process that is
    exiting (it still holds its GPU while its files close), whatever its cgroup was."""
    v1 = [line for line in cgroup_text.splitlines() if line.strip() and not line.startswith("0::")]
    return bool(v1) and all(line.rpartition(":")[2] == "/" for line in v1)


def _exiting(pid: int, proc: Path) -> bool:
    """Whether ``pid`` is exiting (``PF_EXITING`` in the flags of ``/proc/<pid>/stat``);
    False when that file cannot be read (it is gone)."""
    try:
        stat = (proc / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
        flags = int(stat.rpartition(")")[2].split()[6])
    except (OSError, ValueError, IndexError):
        return False  # unreadable: it stays the host's, as its cgroup says
    return bool(flags & _PF_EXITING)
