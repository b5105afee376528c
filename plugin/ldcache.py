"""Read the dynamic linker cache, ``/etc/ld.so.cache``.

Two layouts exist, and a file may hold both (the old one first, the new one after it):

- old, magic ``ld.so-1.7.0``: a 16-byte header (magic padded to 12 bytes, ``nlibs``), then
  ``nlibs`` entries of 12 bytes (``flags``, ``key``, ``value``); string offsets count from the
  end of the entries;
- new, magic ``glibc-ld.so.cache`` + version ``1.1``: a 48-byte header (magic, version,
  ``nlibs``, ``len_strings``, endianness flags, extension offset), then ``nlibs`` entries of
  24 bytes (``flags``, ``key``, ``value``, ``osversion``, ``hwcap``); string offsets count
  from the start of the new header.

When the new layout is present, it is the one the dynamic linker reads, and so do we.

An entry's ``flags`` say what kind of library it is: the low byte the type (ELF with libc6
is 3), the high byte the ABI. The ABI tells the 64-bit libraries (``lib64/`` of the volume)
from the 32-bit ones (``lib/``).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from pathlib import Path

OLD_MAGIC = b"ld.so-1.7.0"
NEW_MAGIC = b"glibc-ld.so.cache"
NEW_VERSION = b"1.1"

_OLD_HEADER = struct.Struct("<12sI")  # magic (11 bytes + 1 pad), nlibs
_OLD_ENTRY_SIZE = 12
_NEW_HEADER_SIZE = 48
_NEW_ENTRY_SIZE = 24
_NEW_ALIGN = 8  # alignment of the new header when it follows the old entries

FLAG_TYPE_MASK = 0x00FF
FLAG_ELF_TYPES = frozenset({1, 2, 3})  # ELF, ELF libc5, ELF libc6 (0 is a.out libc4)
FLAG_ABI_MASK = 0xFF00

# ABI byte of the flags (glibc's FLAG_*_LIB64 etc.), by word size of the library.
_ABI_64 = frozenset(
    {
        0x0100,  # SPARC 64
        0x0200,  # IA-64
        0x0300,  # x86-64
        0x0400,  # s390x
        0x0500,  # POWER 64
        0x0700,  # MIPS n64
        0x0A00,  # AArch64
        0x0E00,  # MIPS n64 NaN2008
        0x0F00,  # RISC-V 64 soft float
        0x1000,  # RISC-V 64 double float
        0x1100,  # LoongArch 64 soft float
        0x1200,  # LoongArch 64 double float
    }
)
_ABI_32 = frozenset(
    {
        0x0000,  # the default ABI: i386 (and 32-bit PowerPC, s390, SPARC)
        0x0900,  # ARM hard float
        0x0B00,  # ARM soft float
        0x0C00,  # MIPS o32 NaN2008
    }
)
# Not listed, so never put in a volume: x32 (0x0800) and MIPS n32 (0x0600, 0x0D00), ABIs
# with 32-bit pointers on 64-bit CPUs for which no GPU driver ships libraries.


class WordSize(enum.IntEnum):
    BITS_32 = 32
    BITS_64 = 64


class LdCacheError(ValueError):
    """The file is not a dynamic linker cache, or is cut short."""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    name: str  # the name programs ask for: "libcuda.so.1" or "libcuda.so"
    path: str  # where it is: "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    flags: int

    @property
    def word_size(self) -> WordSize | None:
        """64 or 32 for ELF libraries of a known ABI; ``None`` for anything else."""
        if self.flags & FLAG_TYPE_MASK not in FLAG_ELF_TYPES:
            return None
        abi = self.flags & FLAG_ABI_MASK
        if abi in _ABI_64:
            return WordSize.BITS_64
        if abi in _ABI_32:
            return WordSize.BITS_32
        return None


def read_ldcache(path: Path) -> list[CacheEntry]:
    """The entries of the cache file at ``path``, in file order (highest priority first)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise LdCacheError(f"cannot read the dynamic linker cache {path}: {err.strerror}") from err
    try:
        return parse_ldcache(data)
    except LdCacheError as err:
        raise LdCacheError(f"{path}: {err}") from None


def parse_ldcache(data: bytes) -> list[CacheEntry]:
    """Parse a cache in either layout, or the old layout followed by the new one."""
    if data.startswith(NEW_MAGIC):
        return _parse_new(data, 0)
    if not data.startswith(OLD_MAGIC):
        raise LdCacheError("not a dynamic linker cache (unknown magic)")
    if len(data) < _OLD_HEADER.size:
        raise LdCacheError("cut short in the header")
    _, nlibs = _OLD_HEADER.unpack_from(data, 0)
    entries_end = _OLD_HEADER.size + nlibs * _OLD_ENTRY_SIZE
    if entries_end > len(data):
        raise LdCacheError(f"cut short: {nlibs} entries announced")
    new_at = -(-entries_end // _NEW_ALIGN) * _NEW_ALIGN
    if data.startswith(NEW_MAGIC, new_at):
        return _parse_new(data, new_at)
    entries: list[CacheEntry] = []
    for i in range(nlibs):
        flags, key, value = struct.unpack_from("<iII", data, _OLD_HEADER.size + i * 12)
        entries.append(
            CacheEntry(
                name=_string(data, entries_end + key),
                path=_string(data, entries_end + value),
                flags=flags & 0xFFFFFFFF,
            )
        )
    return entries


def _parse_new(data: bytes, start: int) -> list[CacheEntry]:
    if len(data) < start + _NEW_HEADER_SIZE:
        raise LdCacheError("cut short in the header")
    version = data[start + len(NEW_MAGIC) : start + len(NEW_MAGIC) + len(NEW_VERSION)]
    if version != NEW_VERSION:
        raise LdCacheError(f"unsupported cache version {version!r} (known: 1.1)")
    # Byte 28 of the header: 0 unknown (old glibc, native order), 2 little, 3 big endian.
    order = ">" if data[start + 28] == 3 else "<"
    (nlibs,) = struct.unpack_from(order + "I", data, start + 20)
    if start + _NEW_HEADER_SIZE + nlibs * _NEW_ENTRY_SIZE > len(data):
        raise LdCacheError(f"cut short: {nlibs} entries announced")
    entry = struct.Struct(order + "iIIIQ")
    entries: list[CacheEntry] = []
    for i in range(nlibs):
        flags, key, value, _osversion, _hwcap = entry.unpack_from(
            data, start + _NEW_HEADER_SIZE + i * _NEW_ENTRY_SIZE
        )
        entries.append(
            CacheEntry(
                name=_string(data, start + key),
                path=_string(data, start + value),
                flags=flags & 0xFFFFFFFF,
            )
        )
    return entries


def _string(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset)
    if offset >= len(data) or end < 0:
        raise LdCacheError(f"string offset {offset} is outside the file")
    return data[offset:end].decode("utf-8", "surrogateescape")
