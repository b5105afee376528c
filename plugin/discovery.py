"""Find the files of the running driver: binaries on PATH, libraries in the linker cache.

Every symlink is resolved to the real file. A library goes in only if its real file belongs
to the running driver (``<name>.so.<driver version>``, for the components that carry the
driver's version), its ELF word size matches the cache entry, and it passes the component's
vendor check (see ``components``). The first entry of the cache wins, as for the dynamic
linker; the same real file reached through several cache names is taken once.

The daemon does not call ``find_driver_files`` itself: ``plugin.driver_scan`` runs it in a
child process, ``python -m plugin.discovery --driver-version V --ldcache FILE [--search-path
P]``, which prints the ``DriverFiles`` as JSON (``to_json``; ``from_json`` reads it back) or,
when the linker cache cannot be read, one line on stderr and exit code 2. pyelftools (which
``plugin.elf`` reads the libraries with) is imported only when libraries are read.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from plugin.components import (
    BINARIES,
    GL_VENDOR_MARKERS,
    TLS_ABI,
    Check,
    Library,
    library_of,
)
from plugin.ldcache import CacheEntry, WordSize, read_ldcache

TYPE_CHECKING = False
if TYPE_CHECKING:
    from plugin.elf import ElfInfo

DEFAULT_LDCACHE = Path("/etc/ld.so.cache")


@dataclass(frozen=True, slots=True)
class DriverFile:
    source: Path  # the real file (symlinks resolved)
    name: str  # its name in the volume: the real file's name, or the command name
    component: str  # "libcuda", "nvidia-smi"
    soname: str | None = None  # DT_SONAME of a library
    size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Skipped:
    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class DriverFiles:
    """What makes up the ``nvidia_driver`` volume of one driver version."""

    driver_version: str
    binaries: tuple[DriverFile, ...] = ()
    libraries_64: tuple[DriverFile, ...] = ()  # -> lib64/
    libraries_32: tuple[DriverFile, ...] = ()  # -> lib/
    skipped: tuple[Skipped, ...] = field(default=(), compare=False)

    @property
    def all_files(self) -> tuple[DriverFile, ...]:
        return self.binaries + self.libraries_64 + self.libraries_32

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.all_files)

    def summary(self) -> str:
        return (
            f"driver {self.driver_version}: {len(self.binaries)} binaries, "
            f"{len(self.libraries_64)} 64-bit and {len(self.libraries_32)} 32-bit libraries "
            f"({self.size_bytes / 2**20:.1f} MiB), {len(self.skipped)} cache entries skipped"
        )


def find_driver_files(
    driver_version: str,
    *,
    ldcache: Path = DEFAULT_LDCACHE,
    search_path: str | None = None,
) -> DriverFiles:
    """Collect the driver's files. ``search_path`` defaults to ``$PATH``. Blocking."""
    skipped: list[Skipped] = []
    libraries = _libraries(read_ldcache(ldcache), driver_version, skipped)
    return DriverFiles(
        driver_version=driver_version,
        binaries=tuple(_binaries(search_path, skipped)),
        libraries_64=tuple(libraries[WordSize.BITS_64]),
        libraries_32=tuple(libraries[WordSize.BITS_32]),
        skipped=tuple(skipped),
    )


def _binaries(search_path: str | None, skipped: list[Skipped]) -> list[DriverFile]:
    found: list[DriverFile] = []
    for binary in BINARIES:
        where = shutil.which(binary.name, path=search_path)
        if where is None:
            continue
        real = Path(os.path.realpath(where))
        try:
            size = real.stat().st_size
        except OSError as err:
            skipped.append(Skipped(where, f"cannot stat: {err.strerror}"))
            continue
        found.append(DriverFile(real, binary.name, binary.name, size_bytes=size))
    return found


def _libraries(
    entries: list[CacheEntry], driver_version: str, skipped: list[Skipped]
) -> dict[WordSize, list[DriverFile]]:
    from plugin.elf import ElfReadError, read_elf  # noqa: PLC0415 (pyelftools: here only)

    found: dict[WordSize, list[DriverFile]] = {WordSize.BITS_64: [], WordSize.BITS_32: []}
    seen: dict[WordSize, set[str]] = {WordSize.BITS_64: set(), WordSize.BITS_32: set()}
    for entry in entries:
        library = library_of(entry.name)
        word_size = entry.word_size
        if library is None or word_size is None:
            continue
        real = Path(os.path.realpath(entry.path))
        # Keys: the real file, its name in the directory, and its soname: first one wins.
        if str(real) in seen[word_size] or real.name in seen[word_size]:
            continue
        reason = _reject(real, library, driver_version)
        info: ElfInfo | None = None
        if reason is None:
            try:
                info = read_elf(real)
            except ElfReadError as err:
                reason = str(err)
        if info is not None:
            reason = _reject_elf(info, library, word_size)
        if reason is not None:
            skipped.append(Skipped(entry.path, reason))  # the daemon logs them (NV_DEBUG)
            continue
        assert info is not None
        if info.soname is not None and info.soname in seen[word_size]:
            continue
        seen[word_size].update({str(real), real.name})
        if info.soname is not None:
            seen[word_size].add(info.soname)
        found[word_size].append(
            DriverFile(
                source=real,
                name=real.name,
                component=library.name,
                soname=info.soname,
                size_bytes=real.stat().st_size,
            )
        )
    return found


def _reject(real: Path, library: Library, driver_version: str) -> str | None:
    if not real.is_file():
        return "missing (stale linker cache: run ldconfig)"
    if library.driver_versioned and not real.name.endswith(f".so.{driver_version}"):
        return f"not of the running driver {driver_version}"
    return None


def _reject_elf(info: ElfInfo, library: Library, word_size: WordSize) -> str | None:
    if info.word_size != int(word_size):
        return f"{info.word_size}-bit ELF listed as {int(word_size)}-bit in the cache"
    if library.check is Check.NVIDIA_GL_VENDOR and not any(
        needed.startswith(GL_VENDOR_MARKERS) for needed in info.needed
    ):
        return "another vendor's GL library (needs none of libnvidia-glcore/-eglcore/GLdispatch)"
    if library.check is Check.TLS_ABI_2_3_99 and info.abi_tag != TLS_ABI:
        tag = ".".join(map(str, info.abi_tag)) if info.abi_tag else "none"
        return f"TLS library for ABI {tag}, not 2.3.99"
    return None


def to_json(files: DriverFiles) -> dict[str, object]:
    """``files`` as JSON values (``from_json`` reads them back)."""

    def one(f: DriverFile) -> dict[str, object]:
        return {
            "source": str(f.source),
            "name": f.name,
            "component": f.component,
            "soname": f.soname,
            "size_bytes": f.size_bytes,
        }

    return {
        "driver_version": files.driver_version,
        "binaries": [one(f) for f in files.binaries],
        "libraries_64": [one(f) for f in files.libraries_64],
        "libraries_32": [one(f) for f in files.libraries_32],
        "skipped": [{"path": s.path, "reason": s.reason} for s in files.skipped],
    }


def from_json(data: object) -> DriverFiles:
    """The ``DriverFiles`` of ``to_json``'s document; ``ValueError`` for anything else."""
    try:
        if not isinstance(data, dict):
            raise TypeError("not an object")

        def files(key: str) -> tuple[DriverFile, ...]:
            return tuple(
                DriverFile(
                    source=Path(_text(f["source"])),
                    name=_text(f["name"]),
                    component=_text(f["component"]),
                    soname=None if f["soname"] is None else _text(f["soname"]),
                    size_bytes=_count(f["size_bytes"]),
                )
                for f in data[key]
            )

        return DriverFiles(
            driver_version=_text(data["driver_version"]),
            binaries=files("binaries"),
            libraries_64=files("libraries_64"),
            libraries_32=files("libraries_32"),
            skipped=tuple(Skipped(_text(s["path"]), _text(s["reason"])) for s in data["skipped"]),
        )
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a list of driver files ({type(err).__name__}: {err})") from None


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{value!r} is not a size")
    return value


def main(argv: list[str] | None = None) -> int:
    """``python -m plugin.discovery``: print the driver's files as JSON (see the module
    docstring)."""
    import argparse  # noqa: PLC0415
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m plugin.discovery")
    parser.add_argument("--driver-version", required=True)
    parser.add_argument("--ldcache", type=Path, default=DEFAULT_LDCACHE)
    parser.add_argument("--search-path", default=None)
    args = parser.parse_args(argv)
    try:
        files = find_driver_files(
            args.driver_version, ldcache=args.ldcache, search_path=args.search_path
        )
    except (OSError, ValueError) as err:
        print(err, file=sys.stderr)
        return 2
    json.dump(to_json(files), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
