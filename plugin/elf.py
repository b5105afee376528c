"""What the plugin needs to know of an ELF file: word size, soname, needed libraries, ABI tag.

Read with pyelftools from the program headers (what the dynamic linker reads), falling back
to the section headers for files that have no ``PT_DYNAMIC``/``PT_NOTE`` segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection, DynamicSegment
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import NoteSection
from elftools.elf.segments import NoteSegment


class ElfReadError(ValueError):
    """The file cannot be read, or is not an ELF file."""


@dataclass(frozen=True, slots=True)
class ElfInfo:
    word_size: int  # 32 or 64
    machine: str  # "EM_X86_64"
    soname: str | None  # DT_SONAME, e.g. "libcuda.so.1"
    needed: tuple[str, ...]  # DT_NEEDED entries, in order
    abi_tag: tuple[int, int, int] | None  # .note.ABI-tag (GNU, Linux): (2, 3, 99)


def read_elf(path: Path) -> ElfInfo:
    """Read the dynamic section and the notes of the ELF file at ``path``."""
    try:
        with path.open("rb") as stream:
            elf = ELFFile(stream)
            soname, needed = _dynamic(elf)
            return ElfInfo(
                word_size=int(elf.elfclass),
                machine=str(elf["e_machine"]),
                soname=soname,
                needed=tuple(needed),
                abi_tag=_abi_tag(elf),
            )
    except OSError as err:
        raise ElfReadError(f"cannot read {path}: {err.strerror}") from err
    except (ELFError, ValueError, KeyError) as err:  # pyelftools raises these on garbage
        raise ElfReadError(f"{path} is not a valid ELF file: {err}") from err


def _dynamic(elf: ELFFile) -> tuple[str | None, list[str]]:
    soname: str | None = None
    needed: list[str] = []
    tables: list[Any] = [s for s in elf.iter_segments() if isinstance(s, DynamicSegment)]
    if not tables:
        tables = [s for s in elf.iter_sections() if isinstance(s, DynamicSection)]
    for table in tables[:1]:
        for tag in table.iter_tags():
            if tag.entry.d_tag == "DT_SONAME":
                soname = str(tag.soname)
            elif tag.entry.d_tag == "DT_NEEDED":
                needed.append(str(tag.needed))
    return soname, needed


def _abi_tag(elf: ELFFile) -> tuple[int, int, int] | None:
    holders: list[Any] = [s for s in elf.iter_segments() if isinstance(s, NoteSegment)]
    if not holders:
        holders = [s for s in elf.iter_sections() if isinstance(s, NoteSection)]
    for holder in holders:
        for note in holder.iter_notes():
            if note["n_name"] == "GNU" and note["n_type"] == "NT_GNU_ABI_TAG":
                desc = note["n_desc"]
                if desc["abi_os"] == "ELF_NOTE_OS_LINUX":
                    return (int(desc["abi_major"]), int(desc["abi_minor"]), int(desc["abi_tiny"]))
    return None
