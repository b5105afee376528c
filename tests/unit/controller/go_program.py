"""Files laid out as Go writes a program's build information, for the wrapper's tests.

``go_program(path, build_lines)`` writes an ELF file (64- or 32-bit, either byte order)
whose section table names ``.shstrtab`` and ``.go.buildinfo``, the latter as Go 1.18 and
later write it: the 16-byte magic, pointer size and flags, padding to 32 bytes, then the
Go version and the module and build lines, each as a uvarint length and its bytes, the
lines between Go's 16-byte sentinels (what ``go version -m`` prints). Only what
``controller.wrapper.go_build_info`` reads is there: no program headers, no code (the
file cannot be run). The real docker CLI's file is read in the tests beside it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

MAGIC = b"\xff Go buildinf:"
MODINFO_START = bytes.fromhex("3077af0c9274080241e1c107e6d618e6")
MODINFO_END = bytes.fromhex("f932433186182072008242104116d8f2")


def uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def buildinfo_section(go_version: str, lines: str, *, inline: bool = True) -> bytes:
    """The ``.go.buildinfo`` section: ``inline`` (Go 1.18+) or the older pointer form."""
    header = MAGIC + bytes([8, 0x2 if inline else 0x0])
    header += b"\0" * (32 - len(header))
    if not inline:
        return header + b"\0" * 16  # two pointers into the data segment
    modinfo = MODINFO_START + lines.encode() + MODINFO_END
    return header + uvarint(len(go_version)) + go_version.encode() + uvarint(len(modinfo)) + modinfo


def ldflags_lines(ldflags: str | None, path: str = "github.com/docker/cli/cmd/docker") -> str:
    """The module and build lines of a program, with a ``-ldflags`` setting (as recorded:
    Go-quoted) unless None (a ``-trimpath`` build)."""
    lines = [f"path\t{path}", "build\t-compiler=gc"]
    if ldflags is not None:
        lines.append(f"build\t-ldflags={ldflags}")
    lines += ["build\tCGO_ENABLED=1", "build\tGOARCH=amd64", "build\tGOOS=linux"]
    return "".join(f"{line}\n" for line in lines)


def go_program(
    path: Path,
    build_lines: str,
    *,
    elf_class: Literal[32, 64] = 64,
    order: Literal["little", "big"] = "little",
    section: bytes | None = None,
    section_name: bytes = b".go.buildinfo",
) -> Path:
    """Write the ELF file ``path`` holding ``section`` (default: the build information of
    Go 1.24 with ``build_lines``) under ``section_name``; returns ``path``."""
    if section is None:
        section = buildinfo_section("go1.24.3", build_lines)
    wide = elf_class == 64
    header_size, entry_size = (64, 64) if wide else (52, 40)
    names = b"\0.shstrtab\0" + section_name + b"\0"
    names_at = header_size
    section_at = names_at + len(names)
    table_at = section_at + len(section)

    def word(value: int, size: int) -> bytes:
        return value.to_bytes(size, order)

    address = 8 if wide else 4

    def entry(name: int, kind: int, offset: int, size: int) -> bytes:
        if wide:
            fields = word(name, 4) + word(kind, 4) + word(0, 8) + word(0, 8)
            fields += word(offset, 8) + word(size, 8) + word(0, 4) + word(0, 4)
            fields += word(1, 8) + word(0, 8)
        else:
            fields = word(name, 4) + word(kind, 4) + word(0, 4) + word(0, 4)
            fields += word(offset, 4) + word(size, 4) + word(0, 4) + word(0, 4)
            fields += word(1, 4) + word(0, 4)
        assert len(fields) == entry_size
        return fields

    table = entry(0, 0, 0, 0)
    table += entry(1, 3, names_at, len(names))  # SHT_STRTAB
    table += entry(11, 1, section_at, len(section))  # SHT_PROGBITS
    ident = b"\x7fELF" + bytes([2 if wide else 1, 1 if order == "little" else 2, 1])
    ident += b"\0" * (16 - len(ident))
    head = ident + word(2, 2) + word(62, 2) + word(1, 4)  # ET_EXEC, x86-64, EV_CURRENT
    head += word(0, address) + word(0, address) + word(table_at, address)  # entry, ph, sh
    head += word(0, 4) + word(header_size, 2) + word(0, 2) + word(0, 2)  # flags, sizes
    head += word(entry_size, 2) + word(3, 2) + word(1, 2)  # shentsize, shnum, shstrndx
    assert len(head) == header_size
    path.write_bytes(head + names + section + table)
    return path
