"""Which NVIDIA driver is installed, and which one is loaded: the two facts an upgrade changes.

- **Installed**: the ``libnvidia-ml.so.1`` the dynamic linker cache (``--ldcache``) names,
  resolved to its real file ``libnvidia-ml.so.<version>``: what a new process would load.
  A package upgrade replaces the files and runs ``ldconfig``; the cache is re-parsed only
  when its inode, size or modification time changed, and the library's link is resolved
  again at every look (a cheap ``realpath``), so a poll costs two system calls.
- **Loaded**: the kernel module's version, from ``/proc/driver/nvidia/version`` (or
  ``/sys/module/nvidia/version``); ``None`` while no module is loaded. With ``--simulate
  FILE`` the loaded driver is the node file's ``driver_version``: renaming a file with
  another version into place is loading another module (docs/node-file.md); the file is
  read within the node file's bounds (``agent.gpu.nodefile.read_json``), never blocking.

Every look is blocking file I/O: run it in a thread. None of these raise: a file that cannot
be read means "not known" (``None``).

And the driver's files, which make up its volume: ``prepare_volumes`` finds them at start and
opens the volume directory, ``refresh_volumes`` finds a new driver's after an upgrade (the
plugin serves them from then on); both find them in a child process
(``plugin.driver_scan``: the daemon never loads pyelftools nor parses a library itself).
Without a linker cache (``ldcache`` None: a simulated node with none given) there are no
files, and the volume is empty.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

from agent.files import kind_of
from agent.gpu import nodefile
from plugin.discovery import DriverFiles
from plugin.driver_scan import scan_driver_files
from plugin.ldcache import LdCacheError, WordSize, read_ldcache
from plugin.volumes import VolumeStore

log = logging.getLogger("nvidia-docker-plugin.driver")

NVML_SONAME = "libnvidia-ml.so.1"
_VERSIONED = re.compile(r"libnvidia-ml\.so\.([0-9]+(?:\.[0-9]+)+)$")
_MODULE_LINE = re.compile(r"Kernel Module.*?\s([0-9]+\.[0-9]+(?:\.[0-9]+)?)\s")
PROC_VERSION = Path("/proc/driver/nvidia/version")
SYS_VERSION = Path("/sys/module/nvidia/version")

Signature = tuple[int, int, int]


def _not_regular(path: Path) -> str | None:
    """What ``path`` is when it exists and is not a regular file (``a FIFO``); else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else kind_of(mode)


def _signature(path: Path) -> Signature | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class InstalledDriver:
    """The driver version the linker cache points ``libnvidia-ml.so.1`` at."""

    def __init__(self, ldcache: Path | None) -> None:
        self.ldcache = ldcache  # None: a simulated node without one (no driver installed)
        self._seen: Signature | None = None
        self._library: str | None = None  # the cache's path for libnvidia-ml.so.1

    def version(self, *, force: bool = False) -> str | None:
        if self.ldcache is None:
            return None
        signature = _signature(self.ldcache)
        if force or signature != self._seen:
            self._seen = signature
            self._library = self._find_library()
        if self._library is None:
            return None
        match = _VERSIONED.search(os.path.realpath(self._library))
        return match.group(1) if match else None

    def _find_library(self) -> str | None:
        if self.ldcache is None or _not_regular(self.ldcache) is not None:
            return None  # (a FIFO's read would block the look)
        try:
            entries = read_ldcache(self.ldcache)
        except LdCacheError as err:
            log.debug("%s", err)
            return None
        candidates = [e for e in entries if e.name == NVML_SONAME]
        for entry in candidates:  # the 64-bit one first: what this process would load
            if entry.word_size is WordSize.BITS_64:
                return entry.path
        return candidates[0].path if candidates else None


class LoadedModule:
    """The version of the NVIDIA kernel module that is loaded now; None when none is."""

    def __init__(self, proc_file: Path = PROC_VERSION, sys_file: Path = SYS_VERSION) -> None:
        self.proc_file = proc_file
        self.sys_file = sys_file

    def version(self, *, force: bool = False) -> str | None:
        try:
            text = self.proc_file.read_text(errors="replace")
        except OSError:
            text = ""
        match = _MODULE_LINE.search(text.splitlines()[0] if text else "")
        if match:
            return match.group(1)
        try:
            value = self.sys_file.read_text().strip()
        except OSError:
            return None
        return value or None


class SimulatedModule:
    """``--simulate FILE``: the loaded driver is the file's ``driver_version``.

    The file is read as the GPU worker reads it (``nodefile.read_json``: a regular file only,
    opened without blocking, within its size and depth bounds), once per version: a version
    that cannot be read leaves the version as it was (the worker logs the one line about
    it), and the next version is read again. So no look blocks, whatever is at the path.
    """

    def __init__(self, node_file: Path) -> None:
        self.node_file = node_file
        self._seen: Signature | None = None
        self._version: str | None = None

    def version(self, *, force: bool = False) -> str | None:
        signature = _signature(self.node_file)
        if signature is None:
            return self._version  # between an unlink and a rename: still what it was
        if force or signature != self._seen:
            self._seen = signature  # half written or hostile: look again at the next change
            try:
                data = nodefile.read_json(self.node_file)
            except nodefile.NodeFileError as err:
                log.debug("%s: the driver stays %s", err, self._version)
                return self._version
            version = data.get("driver_version") if isinstance(data, dict) else None
            self._version = version if isinstance(version, str) and version else None
        return self._version


class VolumeSetupError(Exception):
    """The driver's files cannot be found or the volume directory cannot be used; the
    message names the flag (``--ldcache``, ``-d``), the file and what to do."""


def prepare_volumes(
    volume_dir: Path,
    driver_version: str,
    *,
    ldcache: Path | None = Path("/etc/ld.so.cache"),
    search_path: str | None = None,
) -> VolumeStore:
    """Find the driver files and open the volume directory. Blocking: run in a thread.
    Raises ``VolumeSetupError``."""
    kind = _not_regular(ldcache) if ldcache is not None else None
    if kind is not None:  # a FIFO would hold the scan until its 60 s run out
        raise VolumeSetupError(
            f"--ldcache {ldcache} is {kind}, not a regular file: give the dynamic linker "
            "cache that lists the driver's libraries (ldconfig writes /etc/ld.so.cache)"
        )
    try:
        files = _driver_files(driver_version, ldcache, search_path)
    except (OSError, ValueError) as err:
        raise VolumeSetupError(
            f"--ldcache {ldcache}: {err}: give the dynamic linker cache that lists the "
            "driver's libraries (ldconfig writes /etc/ld.so.cache)"
        ) from None
    try:
        store = VolumeStore(volume_dir, files)
        store.clean_stale()
    except OSError as err:
        raise VolumeSetupError(
            f"-d {volume_dir}: the volume directory cannot be used "
            f"({err.strerror or err}): give a directory the agent can create and write"
        ) from None
    return store


def refresh_volumes(
    store: VolumeStore,
    driver_version: str,
    *,
    ldcache: Path | None = Path("/etc/ld.so.cache"),
    search_path: str | None = None,
) -> None:
    """After a driver upgrade: find the new driver's files and serve them from now on (the
    new volume can be created; old names mount it). Blocking: run in a thread."""
    store.use_files(_driver_files(driver_version, ldcache, search_path))


def _driver_files(
    driver_version: str, ldcache: Path | None, search_path: str | None
) -> DriverFiles:
    if ldcache is None:  # a simulated node whose driver files nobody asked for
        log.info(
            "Simulated node: its driver volume holds no files (--ldcache names a linker "
            "cache to build it from)"
        )
        return DriverFiles(driver_version=driver_version)
    files = scan_driver_files(driver_version, ldcache=ldcache, search_path=search_path)
    for skipped in files.skipped:  # NV_DEBUG: what the scan left out, and why
        log.debug("skipping %s: %s", skipped.path, skipped.reason)
    log.info("Driver files found: %s", files.summary())
    if not any(f.component == "libcuda" for f in files.libraries_64):
        log.warning(
            "No libcuda.so.%s in %s: the volume will lack CUDA (run ldconfig?)",
            driver_version,
            ldcache,
        )
    return files
