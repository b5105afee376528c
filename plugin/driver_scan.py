"""Find the driver's files in a child process: the daemon never parses a library itself.

``scan_driver_files(version, ldcache=..., search_path=...)`` runs ``python -m
plugin.discovery`` (``plugin.discovery.find_driver_files``: the linker cache, the binaries
on the search path, every candidate library read with pyelftools) and reads its JSON answer
back. Why a child: the daemon stays without pyelftools (3.3 MB resident that it would keep
for months, for a few hundred milliseconds of use at start and after a driver upgrade), and
the ELF files of the linker cache, which any package can add to, are parsed where a file
that makes the parser loop or blow up costs a child, not the API: the child has
``timeout_s`` (60 s by default) and is killed past it.

Every failure is a ``DriverScanError`` (a ``ValueError``, as the linker cache's own errors
are) with one line: the child's own for a linker cache that cannot be read, else what went
wrong with the child.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from plugin.discovery import DriverFiles, from_json

DEFAULT_TIMEOUT_S = 60.0


class DriverScanError(ValueError):
    """The driver's files could not be found (one line: why)."""


def scan_driver_files(
    driver_version: str,
    *,
    ldcache: Path,
    search_path: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DriverFiles:
    """``find_driver_files``'s answer, found by a child process. Blocking."""
    command = [
        sys.executable, "-m", "plugin.discovery",
        "--driver-version", driver_version, "--ldcache", str(ldcache),
    ]  # fmt: skip
    if search_path is not None:
        command += ["--search-path", search_path]
    try:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise DriverScanError(
            f"finding the driver files took more than {timeout_s:g} s (the child was killed)"
        ) from None
    except OSError as err:
        raise DriverScanError(f"cannot start the driver file scan ({err.strerror})") from None
    said = done.stderr.decode("utf-8", "replace").strip().splitlines()
    if done.returncode != 0:
        why = said[-1] if said else f"exit code {done.returncode}"
        if done.returncode == 2 and said:  # its own one line: the linker cache
            raise DriverScanError(why)
        raise DriverScanError(f"the driver file scan failed ({why})")
    try:
        return from_json(json.loads(done.stdout))
    except ValueError as err:
        raise DriverScanError(f"the driver file scan answered badly ({err})") from None
