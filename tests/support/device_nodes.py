"""Fake NVIDIA device nodes in /dev for tests on a machine without a GPU.

Docker's ``--device /dev/nvidiaN`` needs the host's node to exist; nothing in these tests
opens one (the containers run busybox). ``nvidia_nodes`` makes the nodes that are missing,
under the machine-wide lock every test that makes nodes in /dev takes, and removes exactly
the ones it made (a real or another run's node is never touched).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator

from tests.support.prerequisites import require_root
from tests.support.services import machine_lock

DEVICE_LOCK = "devices"  # the machine-wide lock of device nodes made in /dev by tests
NVIDIA_MAJOR = 195
CTL_MINOR = 255
UVM_MAJOR = 510  # dynamic on real machines; any free major will do for a node nobody opens


def wanted_nodes(gpus: Iterable[int], *, uvm: bool = True) -> dict[str, tuple[int, int]]:
    """/dev/nvidiaN of each GPU, nvidiactl and (``uvm``) nvidia-uvm: (major, minor)."""
    wanted = {f"/dev/nvidia{i}": (NVIDIA_MAJOR, i) for i in gpus}
    wanted["/dev/nvidiactl"] = (NVIDIA_MAJOR, CTL_MINOR)
    if uvm:
        wanted["/dev/nvidia-uvm"] = (UVM_MAJOR, 0)
    return wanted


@contextlib.contextmanager
def nvidia_nodes(wanted: dict[str, tuple[int, int]]) -> Iterator[None]:
    """The character device nodes ``wanted`` (path: (major, minor)) where missing."""
    require_root()
    created: list[tuple[str, int]] = []
    with machine_lock(DEVICE_LOCK):
        try:
            for path, (major, minor) in wanted.items():
                if os.path.lexists(path):
                    continue  # a real (or another run's) node: never touched
                rdev = os.makedev(major, minor)
                os.mknod(path, 0o666 | stat.S_IFCHR, rdev)
                created.append((path, rdev))
            yield
        finally:
            for path, rdev in created:
                with contextlib.suppress(FileNotFoundError):
                    if os.lstat(path).st_rdev == rdev:
                        os.unlink(path)
