"""The driver volumes on disk, ``<volume dir>/<volume>/<version>/``, and their names.

Names are ``<volume>_<version>`` (``nvidia_driver_580.159.04``); versions are
``digits(.digits)*`` and every path is checked to stay inside the volume directory, so no
name reaches anything else on disk.

A volume is built in a hidden directory next to its final place
(``.<version>.building-<token>``) and renamed into place when complete: a directory named by
a version is always a complete volume. A builder holds an ``flock`` on
``.<version>.building-<token>.lock`` while it works, so a start-up clean-up removes only the
leftovers of builders that died. Creates of one volume in this process are serialised; across
processes the rename decides (the loser discards its copy). Remove renames the volume away
(``.<version>.removing-<token>``) before deleting it, so it disappears at once and whole.
The volume the agent's CDI spec mounts by path (``create(..., keep=True)``) is never removed:
Docker counts only its own containers as its users. The per-name locks live only while used
(``plugin.name_locks``), and Remove takes none for a volume that is not on disk, so made-up
names cost no memory.

After a driver upgrade (``use_files`` with the new driver's files), a Mount of another
driver's volume (``nvidia_driver_<old>``, named by containers created before) serves the
running driver's volume, built if needed: the old libraries cannot talk to the new kernel
module. One log line per name. docs/volume-plugin.md says why, and what a downgrade does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from plugin.discovery import DriverFiles
from plugin.name_locks import NameLocks
from plugin.volume_build import DIR_MODE, BuildReport, build_tree
from plugin.volume_specs import VOLUMES, VolumeSpec

log = logging.getLogger("nvidia-docker-plugin.volumes")

BAD_FORMAT = "bad volume format"
UNSUPPORTED = "unsupported volume"
NO_SUCH_VOLUME = "no such volume"
INVALID_VERSION = "invalid volume version"
IN_USE_BY_PATH = (
    "in use by containers that mount it by path (the agent's CDI spec, or GPU creates "
    "through its Podman engine socket)"
)

VERSION_PATTERN = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9}){0,7}")
BUILDING = ".building-"
REMOVING = ".removing-"
LOCK_SUFFIX = ".lock"
MAX_REDIRECTS_LOGGED = 1024  # old names remembered for "one log line per name"


class VolumeError(Exception):
    """An expected failure, answered as ``{"Err": "<reason>: <name>"}``."""

    def __init__(self, reason: str, name: str) -> None:
        super().__init__(f"{reason}: {name}")
        self.reason = reason
        self.name = name


@dataclass(frozen=True, slots=True)
class VolumeRef:
    spec: VolumeSpec
    version: str

    @property
    def name(self) -> str:
        return self.spec.docker_name(self.version)


class VolumeStore:
    """The plugin's view of the volume directory. Blocking methods: call from threads."""

    def __init__(
        self,
        volume_dir: Path,
        files: DriverFiles,
        *,
        specs: tuple[VolumeSpec, ...] = VOLUMES,
        progress_interval_s: float = 2.0,
    ) -> None:
        volume_dir.mkdir(parents=True, exist_ok=True)
        self.volume_dir = Path(os.path.realpath(volume_dir))
        self.files = files
        self.specs = specs
        self.progress_interval_s = progress_interval_s
        self._locks = NameLocks()  # only names in use: see plugin.name_locks
        # Called as listener(volume name, report) after each build this process completed,
        # in the building thread (the agent counts builds for its metrics).
        self.build_listeners: list[Callable[[str, BuildReport], None]] = []
        self._previous_versions: set[str] = set()  # drivers this store served before
        self._redirected: set[str] = set()  # old names already logged
        self._kept: str | None = None  # the volume the CDI spec mounts: Remove refuses it

    @property
    def driver_version(self) -> str:
        return self.files.driver_version

    def use_files(self, files: DriverFiles) -> None:
        """Serve another driver's files from now on (after a driver upgrade)."""
        old = self.files.driver_version
        if files.driver_version != old:
            self._previous_versions.add(old)
        self.files = files

    # --- names and paths ---

    def parse(self, name: str) -> VolumeRef:
        """Split ``nvidia_driver_580.159.04``; ``VolumeError`` for anything else."""
        base, sep, version = name.rpartition("_")
        if not sep or not base or not VERSION_PATTERN.fullmatch(version):
            raise VolumeError(BAD_FORMAT, name)
        spec = next((s for s in self.specs if s.name == base), None)
        if spec is None:
            raise VolumeError(UNSUPPORTED, name)
        return VolumeRef(spec, version)

    def path(self, ref: VolumeRef) -> Path:
        """Where the volume lives; never outside the volume directory."""
        path = self.volume_dir / ref.spec.name / ref.version
        real = os.path.realpath(path)
        if (
            os.path.commonpath([real, self.volume_dir]) != str(self.volume_dir)
            or Path(real) != self.volume_dir / ref.spec.name / ref.version
        ):
            raise VolumeError(BAD_FORMAT, ref.name)
        return path

    def _existing(self, name: str) -> tuple[VolumeRef, Path]:
        ref = self.parse(name)
        path = self.path(ref)
        if not path.is_dir():
            raise VolumeError(NO_SUCH_VOLUME, name)
        return ref, path

    # --- the protocol's operations ---

    def get(self, name: str) -> Path:
        """The mountpoint of an existing volume (any driver version)."""
        return self._existing(name)[1]

    def mountpoint(self, name: str) -> Path:
        """The mountpoint for a container: always a volume of the running driver.

        A volume of another driver (on disk, or one this store served before an upgrade)
        mounts the running driver's volume instead, built if needed: libraries of another
        version cannot talk to the loaded kernel module."""
        files = self.files
        ref = self.parse(name)
        if ref.version == files.driver_version:
            return self._existing(name)[1]
        path = self.path(ref)
        if not path.is_dir() and ref.version not in self._previous_versions:
            raise VolumeError(NO_SUCH_VOLUME, name)
        running = ref.spec.docker_name(files.driver_version)
        mounted = self.create(running)
        if name not in self._redirected:
            if len(self._redirected) >= MAX_REDIRECTS_LOGGED:
                self._redirected.clear()
            self._redirected.add(name)
            log.info(
                "Mount of %s: driver %s is not the one loaded; serving %s (the running "
                "driver's files) instead",
                name,
                ref.version,
                running,
            )
        return mounted

    def list(self) -> list[tuple[str, Path]]:
        """Every complete volume on disk, of any driver version, sorted by name."""
        found: list[tuple[str, Path]] = []
        for spec in self.specs:
            with contextlib.suppress(OSError):
                for entry in (self.volume_dir / spec.name).iterdir():
                    if VERSION_PATTERN.fullmatch(entry.name) and entry.is_dir():
                        found.append((spec.docker_name(entry.name), entry))
        return sorted(found)

    def create(self, name: str, *, keep: bool = False) -> Path:
        """Build the volume unless it exists; safe to call from many threads at once.
        ``keep``: Remove refuses this volume from now on (it replaces the one kept before):
        the CDI spec, and creates through the Podman engine socket, mount it by path."""
        ref = self.parse(name)
        if ref.version != self.driver_version:
            raise VolumeError(INVALID_VERSION, name)
        final = self.path(ref)
        with self._locks.hold(ref.name):
            if final.is_dir():
                if keep:
                    self._kept = ref.name
                return final
            report = self._build(ref, final)
            if keep:
                self._kept = ref.name
        if report is not None:
            log.info("built volume %s: %s", ref.name, report.summary())
            for listener in self.build_listeners:
                try:
                    listener(ref.name, report)
                except Exception:
                    log.exception("A volume build listener failed")
        return final

    def remove(self, name: str) -> None:
        """Delete a volume of any driver version (stale ones after an upgrade too), but not
        the one kept (mounted by path: ``create``'s ``keep``)."""
        ref = self.parse(name)
        final = self.path(ref)
        if not final.is_dir():  # no lock for names that do not exist
            raise VolumeError(NO_SUCH_VOLUME, name)
        with self._locks.hold(ref.name):
            if not final.is_dir():
                raise VolumeError(NO_SUCH_VOLUME, name)
            if ref.name == self._kept:
                raise VolumeError(IN_USE_BY_PATH, name)
            doomed = final.with_name(f".{ref.version}{REMOVING}{secrets.token_hex(6)}")
            final.rename(doomed)
            _fsync_dir(final.parent)
            shutil.rmtree(doomed)
        log.info("removed volume %s", ref.name)

    # --- housekeeping ---

    def clean_stale(self) -> int:
        """Delete what crashed builders and removers left behind; returns how many."""
        cleaned = 0
        for spec in self.specs:
            parent = self.volume_dir / spec.name
            with contextlib.suppress(FileNotFoundError):
                for entry in sorted(parent.iterdir()):
                    if _is_leftover(entry) and _try_clean(entry):
                        cleaned += 1
                        log.info("removed %s, left by an interrupted build or removal", entry)
        return cleaned

    def _build(self, ref: VolumeRef, final: Path) -> BuildReport | None:
        parent = final.parent
        parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        work = parent / f".{ref.version}{BUILDING}{secrets.token_hex(6)}"
        lock = work.with_name(work.name + LOCK_SUFFIX)
        lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            work.mkdir(mode=DIR_MODE)
            try:
                report = build_tree(
                    self.files,
                    work,
                    what=f"building {ref.name}",
                    progress_interval_s=self.progress_interval_s,
                )
                _fsync_dir(work)
                if _rename_unless_there(work, final):
                    _fsync_dir(parent)
                    return report
                log.info("volume %s was built meanwhile by another process", ref.name)
                shutil.rmtree(work)
                return None
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
        finally:
            with contextlib.suppress(OSError):
                lock.unlink()
            os.close(lock_fd)


def _rename_unless_there(work: Path, final: Path) -> bool:
    try:
        work.rename(final)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST) and final.is_dir():
            return False
        raise
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_leftover(entry: Path) -> bool:
    name = entry.name
    return name.startswith(".") and (BUILDING in name or REMOVING in name)


def _try_clean(entry: Path) -> bool:
    """Remove a leftover unless a live builder holds its lock."""
    if entry.name.endswith(LOCK_SUFFIX):
        work = entry.with_name(entry.name.removesuffix(LOCK_SUFFIX))
        if work.exists() or not entry.exists():
            return False  # handled with its directory
        return _unlink_unlocked(entry)
    lock = entry.with_name(entry.name + LOCK_SUFFIX)
    if lock.exists() and not _unlink_unlocked(lock):
        return False  # a builder is at work
    shutil.rmtree(entry, ignore_errors=True)
    return True


def _unlink_unlocked(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        lock.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)
