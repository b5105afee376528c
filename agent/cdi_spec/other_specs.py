"""The other CDI specs in the directories engines read, read cheaply and within bounds.

``OtherSpecs`` looks at the spec directories (``/etc/cdi``, ``/var/run/cdi`` and the agent's
own ``--cdi-spec-dir``) for ``*.json`` and ``*.yaml`` files that are not ours (our spec,
and links to it, are left out) and reads each one's kind and device names
(``cdi.others.summarize``). ``changed`` is the cheap question a poll asks: a listing of each
directory and a ``stat`` of each candidate, compared with what the last ``read`` saw.

Anyone who may write a spec directory may put anything there, so: at most ``MAX_ENTRIES``
entries of a directory are looked at and ``MAX_FILES`` spec files read from it; a file is
opened only when it is a regular file (checked before, and again on the open descriptor),
never through a link to a device or a FIFO, without blocking; it is read up to
``MAX_OTHER_BYTES``, and all files of one ``read`` up to ``MAX_READ_BYTES``; what cannot be
read or parsed is not a spec (the engines' library records an error for it and uses none of
its devices either). A file read once is read again only when its ``stat`` changes.
Blocking: run it in a thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from agent import files
from cdi.others import OtherSpec, summarize

log = logging.getLogger("nvidia-docker-plugin.cdi")

SPEC_SUFFIXES = (".json", ".yaml")  # what the CDI library loads
MAX_ENTRIES = 4096  # directory entries looked at, per directory
MAX_FILES = 64  # spec files read, per directory
MAX_OTHER_BYTES = 1024 * 1024  # NVIDIA's spec of an 8-GPU node with MIG is about 100 KB
MAX_READ_BYTES = 8 * 1024 * 1024  # all files of one read together

_Stamp = tuple[int, int, int, int]  # st_dev, st_ino, st_mtime_ns, st_size
# directory, name, its stamp, and whether it is ours (a link to our spec)
_Listing = tuple[tuple[str, str, _Stamp | None, bool], ...]


@dataclass
class _Known:
    stamp: _Stamp
    found: OtherSpec | None


@dataclass
class OtherSpecs:
    """Other specs than ``ours`` in ``directories``; see the module docstring."""

    directories: tuple[Path, ...]
    ours: Path  # our spec file (it, and links to it, are not others)
    _listing: _Listing | None = None
    _known: dict[tuple[str, str], _Known] = field(default_factory=dict)
    _warned: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the poll and a rewrite

    def our_directories(self) -> frozenset[str]:
        """The directories engines read ours from: its own, and those holding a link to it."""
        with self._lock:
            listing = self._listing if self._listing is not None else self._list()
        found = {os.path.dirname(os.path.realpath(self.ours))}
        found |= {os.path.realpath(directory) for directory, _, _, ours in listing if ours}
        return frozenset(found)

    def changed(self) -> bool:
        """Whether the directories differ from what the last ``read`` saw."""
        with self._lock:
            return self._list() != self._listing

    def read(self) -> tuple[OtherSpec, ...]:
        """The other specs now (files unchanged since the last read are not read again)."""
        with self._lock:
            return self._read()

    def _read(self) -> tuple[OtherSpec, ...]:
        listing = self._list()
        budget = MAX_READ_BYTES
        known: dict[tuple[str, str], _Known] = {}
        for directory, name, stamp, ours in listing:
            if stamp is None or ours:
                continue
            key = (directory, name)
            before = self._known.get(key)
            if before is not None and before.stamp == stamp:
                known[key] = before
                continue
            path = os.path.join(directory, name)
            if stamp[3] > min(MAX_OTHER_BYTES, budget):
                self._warn_once(
                    path, f"CDI spec {path}: not read ({files.describe_size(stamp[3])})"
                )
                continue
            budget -= stamp[3]
            known[key] = _Known(stamp, self._parse(directory, path, stamp))
        self._listing = listing
        self._known = known
        return tuple(k.found for k in known.values() if k.found is not None)

    def _list(self) -> _Listing:
        ours = os.path.realpath(self.ours)
        seen: set[str] = set()
        listing: list[tuple[str, str, _Stamp | None, bool]] = []
        for directory in self.directories:
            real = os.path.realpath(directory)
            if real in seen:
                continue
            seen.add(real)
            for name in self._spec_names(directory):
                path = os.path.join(directory, name)
                if os.path.realpath(path) == ours:  # ours (left out), or a link to it
                    if os.path.join(real, name) != ours:
                        listing.append((str(directory), name, None, True))
                else:
                    listing.append((str(directory), name, _stamp(path), False))
        return tuple(listing)

    def _spec_names(self, directory: Path) -> list[str]:
        names: list[str] = []
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for count, entry in enumerate(entries):
                spec_file = entry.name.endswith(SPEC_SUFFIXES)
                if count >= MAX_ENTRIES or (spec_file and len(names) >= MAX_FILES):
                    self._warn_once(
                        str(directory),
                        f"CDI spec directory {directory}: more than {MAX_FILES} spec files or "
                        f"{MAX_ENTRIES} entries; the others are not looked at",
                    )
                    break
                if spec_file:
                    names.append(entry.name)
        return sorted(names)

    def _parse(self, directory: str, path: str, stamp: _Stamp) -> OtherSpec | None:
        try:
            data = _read_regular(Path(path), stamp)
        except files.UnusableFile as err:
            log.debug("%s", err)
            return None
        document: object = None
        if path.endswith(".json"):
            with contextlib.suppress(ValueError):
                document = json.loads(data)
        if document is None:  # YAML (JSON is YAML too: the CDI library reads both so)
            try:
                document = _load_yaml(data)
            except Exception:  # a spec engines cannot read either: it defines nothing
                return None
        summary = summarize(document)
        if summary is None:
            return None
        return OtherSpec(path, os.path.realpath(directory), *summary)

    def _warn_once(self, key: str, line: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", line)


def _load_yaml(data: bytes) -> object:
    """A YAML document, with libyaml's safe loader where PyYAML has it (ten times faster),
    else PyYAML's own. Imported here, on the first YAML spec found: PyYAML is 1 MB of the
    daemon's memory that a node without other producers' YAML specs never needs."""
    import yaml  # noqa: PLC0415

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(data, Loader=loader)  # noqa: S506 (a safe loader)


def _stamp(path: str) -> _Stamp | None:
    """What tells a changed file: device, inode, mtime and size (links followed); None for
    what is not a regular file (or not there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def _read_regular(path: Path, stamp: _Stamp) -> bytes:
    """The file's bytes when the file opened is still the regular file ``stamp`` saw (a
    link swapped meanwhile to a device or a FIFO is never read, nor blocks)."""
    real = Path(os.path.realpath(path))
    data = files.read_regular(real, limit=MAX_OTHER_BYTES, what="CDI spec", follow=False)
    after = _stamp(str(real))
    if after is None or after[:2] != stamp[:2]:
        raise files.UnusableFile(f"CDI spec {path} changed while read")
    return data
