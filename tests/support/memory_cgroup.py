"""A memory-limited cgroup for a test's processes: "under 256 MB, nothing kills the agent".

``memory_cgroup(limit_bytes)`` makes a new cgroup with that memory limit where the machine
allows it, and yields a ``MemoryCgroup`` whose ``enter`` is a ``preexec_fn`` that moves the
child (and so everything it starts, the GPU worker too) into it before exec. Both layouts
are handled, whichever the machine booted:

- cgroup v2 (``/sys/fs/cgroup`` or a hybrid machine's ``/sys/fs/cgroup/unified``) when its
  ``memory`` controller is enabled there: ``memory.max``, ``memory.swap.max`` 0, and
  ``memory.events``' ``oom_kill`` counts the kills;
- else cgroup v1's ``memory`` hierarchy: ``memory.limit_in_bytes`` (and
  ``memory.memsw.limit_in_bytes`` where swap accounting is on), ``memory.oom_control``'s
  ``oom_kill``.

``layout`` says which one the test ran under. The cgroup is removed afterwards (its
processes must have ended: the test stops them first). Without either, the test cannot
run here (``unavailable``: a skip, a failure in CI).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.prerequisites import require_root, unavailable

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    layout: str  # "cgroup v2" or "cgroup v1"
    limit_bytes: int

    def enter(self) -> None:
        """A ``preexec_fn``: move the calling (child) process into the cgroup."""
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    @property
    def oom_kills(self) -> int:
        """How many processes the kernel killed in this cgroup for memory."""
        name = "memory.events" if self.layout == "cgroup v2" else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    @property
    def peak_bytes(self) -> int | None:
        """The most memory the cgroup used, where the kernel says it."""
        name = "memory.peak" if self.layout == "cgroup v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def processes(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]


def _v2_mount() -> Path | None:
    for candidate in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        controllers = candidate / "cgroup.controllers"
        if controllers.is_file() and "memory" in controllers.read_text().split():
            return candidate
    return None


def _make_v2(root: Path, name: str, limit: int) -> MemoryCgroup:
    subtree = root / "cgroup.subtree_control"
    if "memory" not in subtree.read_text().split():
        subtree.write_text("+memory\n")
    path = root / name
    path.mkdir()
    (path / "memory.max").write_text(f"{limit}\n")
    with contextlib.suppress(OSError):
        (path / "memory.swap.max").write_text("0\n")
    return MemoryCgroup(path, "cgroup v2", limit)


def _make_v1(root: Path, name: str, limit: int) -> MemoryCgroup:
    path = root / name
    path.mkdir()
    (path / "memory.limit_in_bytes").write_text(f"{limit}\n")
    with contextlib.suppress(OSError):  # only where swap accounting is on
        (path / "memory.memsw.limit_in_bytes").write_text(f"{limit}\n")
    return MemoryCgroup(path, "cgroup v1", limit)


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[MemoryCgroup]:
    require_root()
    name = f"nvidia-docker-test-{secrets.token_hex(4)}"
    v2 = _v2_mount()
    v1 = CGROUP_ROOT / "memory"
    try:
        if v2 is not None:
            group = _make_v2(v2, name, limit_bytes)
        elif (v1 / "memory.limit_in_bytes").is_file():
            group = _make_v1(v1, name, limit_bytes)
        else:
            unavailable("needs a memory cgroup (cgroup v2 with the memory controller, or v1's)")
    except OSError as err:
        unavailable(f"cannot make a memory cgroup here: {err}")
    try:
        yield group
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                group.path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # its last processes are still being reaped
