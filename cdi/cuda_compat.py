"""An image's CUDA forward compatibility libraries, and whether this host needs them.

CUDA images (``nvidia/cuda``, NGC) may carry a newer ``libcuda`` than the host's driver in
``/usr/local/cuda/compat`` (``libcuda.so.<version>`` with its companions), so that a CUDA
newer than the driver runs on data center GPUs. They must be loaded *instead of* the
driver's ``libcuda`` only when they are newer than it; otherwise the driver's own is right.

The rule is that of NVIDIA's toolkit (its ``enable-cuda-compat`` hook, when it cannot read
the library's compatibility note): use the directory when it holds exactly one
``libcuda.so.X.Y[.Z]`` and ``X`` is greater than the host driver's major version. The hook
then puts that directory first in the container's linker cache (``cdi.hook``). Only names are
read, and paths are resolved inside the container's root (``cdi.rooted``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cdi import rooted

COMPAT_DIR = "/usr/local/cuda/compat"
MAX_ENTRIES = 256  # a compat directory holds a dozen files; more is not one
_LIBCUDA = re.compile(r"libcuda\.so\.(\d+)\.\d+(?:\.\d+)*")
_DRIVER = re.compile(r"(\d+)\.\d+(?:\.\d+)*")


def libcuda_versions(directory: Path) -> list[int]:
    """The major versions of the ``libcuda.so.X.Y...`` files named in ``directory``."""
    majors: list[int] = []
    try:
        with os.scandir(directory) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_ENTRIES:
                    break
                match = _LIBCUDA.fullmatch(entry.name)
                if match:
                    majors.append(int(match.group(1)))
    except OSError:
        return []
    return majors


def compat_dir(root: Path, host_driver_version: str, where: str = COMPAT_DIR) -> str | None:
    """The image's compat directory (as the container sees it, links resolved) when its
    ``libcuda`` is newer than the host driver ``host_driver_version``; None otherwise."""
    host = _DRIVER.fullmatch(host_driver_version)
    resolved = rooted.resolve(root, where)
    if host is None or resolved is None:
        return None
    majors = libcuda_versions(rooted.on_host(root, resolved))
    if len(majors) != 1 or majors[0] <= int(host.group(1)):
        return None
    return resolved
