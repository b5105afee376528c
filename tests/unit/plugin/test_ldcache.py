"""The linker cache parser: the real H200 cache, and every layout ldconfig writes."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from plugin.components import library_of
from plugin.ldcache import LdCacheError, WordSize, parse_ldcache, read_ldcache
from tests.support.fake_driver import FakeDriver
from tests.unit.plugin.conftest import FIXTURES

DRIVER_DIR = "/usr/local/nvidia/lib64/"


def _driver_file_names() -> set[str]:
    """Names under lib64/ in driver-files.txt that ldconfig indexes: sonames and .so links."""
    names: set[str] = set()
    for line in (FIXTURES / "driver-files.txt").read_text().splitlines():
        kind, path, *rest = line.split()
        if not path.startswith("lib64/"):
            continue
        name = path.removeprefix("lib64/")
        if kind == "LINK" or "soname=" + name in rest:
            names.add(name)
    return names


def test_reads_the_real_h200_cache() -> None:
    entries = read_ldcache(FIXTURES / "ld.so.cache")
    assert len(entries) == 520  # what `ldconfig -p` says of this file
    assert all(e.word_size is WordSize.BITS_64 for e in entries)
    driver = {e.name for e in entries if e.path.startswith(DRIVER_DIR)}
    assert driver == _driver_file_names()
    assert len(driver) == 52
    for entry in entries:
        assert entry.path.rsplit("/", 1)[1] == entry.name


def test_every_driver_library_of_the_h200_cache_is_a_component() -> None:
    entries = read_ldcache(FIXTURES / "ld.so.cache")
    ours = {e.name for e in entries if library_of(e.name) is not None}
    assert {e.name for e in entries if e.path.startswith(DRIVER_DIR)} <= ours
    # The CUDA toolkit's libraries are the image's business, never the driver volume's.
    toolkit = {e.name for e in entries if e.path.startswith("/usr/local/cuda/")}
    assert toolkit
    assert not toolkit & ours


def old_layout(records: list[tuple[int, str, str]]) -> bytes:
    """An ``ld.so-1.7.0`` cache: header, 12-byte entries, then the strings they point into.

    Written here because Debian 12's ldconfig aborts (double free) on ``-c old``/``-c compat``.
    """
    strings = b""
    packed = b""
    for flags, name, path in records:
        key = len(strings)
        strings += name.encode() + b"\0"
        value = len(strings)
        strings += path.encode() + b"\0"
        packed += struct.pack("<iII", flags, key, value)
    return b"ld.so-1.7.0\0" + struct.pack("<I", len(records)) + packed + strings


def test_the_old_layout_and_the_new_one_after_it(fake_driver: FakeDriver) -> None:
    new = fake_driver.ldcache.read_bytes()  # written by ldconfig -C (new layout)
    assert new.startswith(b"glibc-ld.so.cache1.1")
    reference = parse_ldcache(new)
    old = old_layout([(e.flags, e.name, e.path) for e in reference])
    assert parse_ldcache(old) == reference
    # glibc's "compat" file: old header and entries, padding to 8 bytes, then the new
    # layout; the old entries point into the string table at the end of the new part.
    cuda = next(e for e in reference if e.name == "libcuda.so.1")
    entries_end = 16 + 12
    pad = -entries_end % 8
    key = pad + new.index(cuda.name.encode() + b"\0")
    value = pad + new.index(cuda.path.encode() + b"\0")
    compat = b"ld.so-1.7.0\0" + struct.pack("<IiII", 1, cuda.flags, key, value)
    assert parse_ldcache(compat + b"\0" * pad + new) == reference
    libcuda = {e.word_size for e in reference if e.name == "libcuda.so.1"}
    expected = {WordSize.BITS_64} | ({WordSize.BITS_32} if fake_driver.lib32 else set())
    assert libcuda == expected


def test_32_and_64_bit_entries_by_their_flags() -> None:
    """A hand-made old-layout cache: i386 (0x0003), x86-64 (0x0303), x32 (0x0803), a.out."""
    records = [
        (0x0303, "libcuda.so.1", "/lib64/libcuda.so.1"),
        (0x0003, "libcuda.so.1", "/lib32/libcuda.so.1"),
        (0x0803, "libcuda.so.1", "/libx32/libcuda.so.1"),
        (0x0000, "libold.so.1", "/lib/libold.so.1"),
    ]
    entries = parse_ldcache(old_layout(records))
    assert [(e.path, e.word_size) for e in entries] == [
        ("/lib64/libcuda.so.1", WordSize.BITS_64),
        ("/lib32/libcuda.so.1", WordSize.BITS_32),
        ("/libx32/libcuda.so.1", None),
        ("/lib/libold.so.1", None),
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "unknown magic"),
        (b"\x7fELF" + b"\0" * 60, "unknown magic"),
        (b"glibc-ld.so.cache1.1" + b"\0" * 8, "cut short"),
        (b"glibc-ld.so.cache2.0" + b"\0" * 40, "unsupported cache version"),
        (b"ld.so-1.7.0\0" + struct.pack("<I", 1000), "cut short"),
    ],
)
def test_garbage_is_a_clear_error(data: bytes, message: str) -> None:
    with pytest.raises(LdCacheError, match=message):
        parse_ldcache(data)


def test_a_cut_file_names_the_file(tmp_path: Path) -> None:
    cut = tmp_path / "ld.so.cache"
    cut.write_bytes((FIXTURES / "ld.so.cache").read_bytes()[:5000])
    with pytest.raises(LdCacheError, match=str(cut)):
        read_ldcache(cut)
    with pytest.raises(LdCacheError, match="cannot read"):
        read_ldcache(tmp_path / "missing")
