"""Fill a directory with the driver's files: ``bin/``, ``lib64/`` (64-bit), ``lib/`` (32-bit).

Each file is placed by ``filecopy.place_file`` (link, reflink or kernel copy). Next to every
library goes its soname symlink (what ldconfig would make), plus ``libcuda.so`` -> the libcuda
file (programs dlopen it by that name) and ``libGLX_indirect.so.0`` -> the libGLX_nvidia file
(GLVND's indirect rendering). Progress is logged while large volumes are copied.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from plugin.discovery import DriverFile, DriverFiles
from plugin.filecopy import Method, place_file, sync_filesystem

log = logging.getLogger("nvidia-docker-plugin.volumes")

DIR_MODE = 0o755
EXTRA_LINKS = (
    ("libcuda", "libcuda.so"),
    ("libGLX_nvidia", "libGLX_indirect.so.0"),
)


@dataclass(frozen=True, slots=True)
class BuildReport:
    files: int
    size_bytes: int
    linked: int
    reflinked: int
    copied: int
    symlinks: int
    seconds: float

    def summary(self) -> str:
        return (
            f"{self.files} files ({self.size_bytes / 2**20:.1f} MiB) in {self.seconds:.2f} s: "
            f"{self.linked} linked, {self.reflinked} reflinked, {self.copied} copied, "
            f"{self.symlinks} symlinks"
        )


class _Progress:
    """Logs bytes and files done, at most once per ``interval_s``."""

    def __init__(self, what: str, files: DriverFiles, interval_s: float) -> None:
        self.what = what
        self.total_files = len(files.all_files)
        self.total_bytes = files.size_bytes
        self.files_done = 0
        self.bytes_done = 0
        self.interval_s = interval_s
        self.last_log = time.monotonic()

    def add_bytes(self, size: int) -> None:
        self.bytes_done += size
        self._maybe_log()

    def file_done(self) -> None:
        self.files_done += 1
        self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last_log < self.interval_s:
            return
        self.last_log = now
        log.info(
            "%s: %d/%d files, %.1f/%.1f MiB done",
            self.what,
            self.files_done,
            self.total_files,
            self.bytes_done / 2**20,
            self.total_bytes / 2**20,
        )


def build_tree(
    files: DriverFiles, root: Path, *, what: str, progress_interval_s: float = 2.0
) -> BuildReport:
    """Fill the empty directory ``root``. Raises ``OSError`` on failure (caller cleans up)."""
    started = time.monotonic()
    progress = _Progress(what, files, progress_interval_s)
    methods = dict.fromkeys(Method, 0)
    symlinks = 0
    for sub, items in (
        ("bin", files.binaries),
        ("lib64", files.libraries_64),
        ("lib", files.libraries_32),
    ):
        directory = root / sub
        directory.mkdir(mode=DIR_MODE)
        directory.chmod(DIR_MODE)  # whatever the umask
        for item in items:
            before = progress.bytes_done
            methods[place_file(item.source, directory / item.name, progress.add_bytes)] += 1
            progress.bytes_done = before + item.size_bytes
            progress.file_done()
        if sub != "bin":
            symlinks += _library_links(directory, items)
    root.chmod(DIR_MODE)
    if methods[Method.COPY]:
        sync_filesystem(root)
    return BuildReport(
        files=len(files.all_files),
        size_bytes=files.size_bytes,
        linked=methods[Method.LINK],
        reflinked=methods[Method.REFLINK],
        copied=methods[Method.COPY],
        symlinks=symlinks,
        seconds=time.monotonic() - started,
    )


def _library_links(directory: Path, items: tuple[DriverFile, ...]) -> int:
    wanted: dict[str, str] = {}
    for item in items:
        if item.soname and item.soname != item.name:
            wanted.setdefault(item.soname, item.name)
    for component, link in EXTRA_LINKS:
        target = next((i.name for i in items if i.component == component), None)
        if target is not None and link != target:
            wanted.setdefault(link, target)
    made = 0
    for link, target in wanted.items():
        path = directory / link
        if path.exists() or path.is_symlink():
            continue  # a real file of that name is already there
        path.symlink_to(target)
        made += 1
    return made
