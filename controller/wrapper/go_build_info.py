"""What a Go program's file says of how it was built: a ``-X`` value given to its linker.

Go (1.18 and later) writes a program's build information into the ELF section
``.go.buildinfo``: the Go version, then the lines ``go version -m PROGRAM`` prints (``path``,
``mod``, ``dep``, ``build`` settings). Where the program was built without ``-trimpath``, one
setting is ``-ldflags``, with every ``-X importpath.name=value`` that set a string variable at
link time. The docker CLI is built so (``-X github.com/docker/cli/cli/version.Version=28.2.2``,
what ``docker --version`` prints): ``linked_value(path, variable)`` reads that value from the
file in a few small reads (the ELF header, the section table, its names, the section; well
under a millisecond) instead of starting the program (12 ms or more on the 2-core development
machine).

None whenever the file does not say it clearly: not ELF, no ``.go.buildinfo`` section (not Go,
or a Go older than 1.18, which wrote pointers there instead), no ``-ldflags`` setting (built
with ``-trimpath``, as Debian builds its Go packages), the variable not set, a value that is
not a plain version word, a file that cannot be read. The caller then asks the program itself.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Literal

SECTION = b".go.buildinfo"
MAGIC = b"\xff Go buildinf:"
_INLINE_STRINGS = 0x2  # flags bit: the version and module strings follow the header (Go 1.18+)
_HEADER_BYTES = 32  # magic, pointer size, flags, padding
_MAX_TABLE_BYTES = 64 * 1024  # the section header table (a Go program has a few dozen)
_MAX_NAMES_BYTES = 64 * 1024  # the section names
_MAX_SECTION_BYTES = 1024 * 1024  # build information: a few KB, more with many modules
# ELF class (1: 32-bit, 2: 64-bit): where e_shoff, e_shentsize, e_shnum, e_shstrndx are in the
# file header, and sh_name, sh_offset, sh_size in a section header (offset, size)
_LAYOUT = {
    1: ((0x20, 4), 0x2E, 0x30, 0x32, 40, (0x10, 4), (0x14, 4)),
    2: ((0x28, 8), 0x3A, 0x3C, 0x3E, 64, (0x18, 8), (0x20, 8)),
}
_LDFLAGS = "build\t-ldflags="
_VERSION_CHARACTERS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.+-_~"
)
_NAME_CHARACTERS = _VERSION_CHARACTERS | frozenset("/")  # what may come before an import path
_QUOTES = frozenset("'\"")
# what may follow an unquoted -X value: the end, a space, a quote (escaped or not) closing
# the whole setting
_ARGUMENT_ENDS = frozenset(("", " ", "\t", "'", '"', "\\'", '\\"'))


def linked_value(path: str, variable: str) -> str | None:
    """The value that ``-X variable=value`` gave the Go program at ``path`` when it was
    linked (``variable``: ``importpath.name``), as its build information records it; None
    where it does not say (see the module docstring). The last ``-X`` of the variable wins,
    as in the linker; a value is a version word (letters, digits, ``.+-_~``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        record = _build_record(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    if record is None:
        return None
    for line in reversed(record.splitlines()):
        if line.startswith(_LDFLAGS):
            return _value_of(line[len(_LDFLAGS) :], variable)
    return None


def _build_record(fd: int) -> str | None:
    """The module and build lines of ``.go.buildinfo`` in the ELF file ``fd``, or None."""
    head = os.pread(fd, 64, 0)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[5] not in (1, 2):
        return None
    layout = _LAYOUT.get(head[4])
    if layout is None:
        return None
    order: Literal["little", "big"] = "little" if head[5] == 1 else "big"
    (shoff_at, shoff_size), entsize_at, count_at, names_at, entry_min, offset_of, size_of = layout

    def number(data: bytes, at: int, size: int) -> int:
        return int.from_bytes(data[at : at + size], order)

    table_at = number(head, shoff_at, shoff_size)
    entry = number(head, entsize_at, 2)
    count = number(head, count_at, 2)
    names_index = number(head, names_at, 2)
    if not table_at or entry < entry_min or not 0 < count * entry <= _MAX_TABLE_BYTES:
        return None
    if names_index >= count:
        return None
    table = os.pread(fd, count * entry, table_at)
    if len(table) < count * entry:
        return None
    sections = []  # (name's offset in the names, offset in the file, size)
    for at in range(0, count * entry, entry):
        offset = number(table, at + offset_of[0], offset_of[1])
        size = number(table, at + size_of[0], size_of[1])
        sections.append((number(table, at, 4), offset, size))
    _, names_offset, names_size = sections[names_index]
    names = os.pread(fd, min(names_size, _MAX_NAMES_BYTES), names_offset)
    wanted = SECTION + b"\0"
    for name, offset, size in sections:
        if names[name : name + len(wanted)] == wanted:
            return _strings(os.pread(fd, min(size, _MAX_SECTION_BYTES), offset))
    return None


def _strings(section: bytes) -> str | None:
    """The second of the two strings after the section's header (the Go version, then the
    module and build lines), each a uvarint length and its bytes; None if not so."""
    if len(section) < _HEADER_BYTES or not section.startswith(MAGIC):
        return None
    if not section[len(MAGIC) + 1] & _INLINE_STRINGS:
        return None
    at = _HEADER_BYTES
    text = b""
    for _ in range(2):
        length, shift = 0, 0
        while True:
            if at >= len(section) or shift > 28:
                return None
            byte = section[at]
            at += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if at + length > len(section):
            return None
        text = section[at : at + length]
        at += length
    return text.decode("utf-8", "replace")


def _value_of(ldflags: str, variable: str) -> str | None:
    """The value of the last ``-X variable=value`` in ``ldflags`` (as recorded: Go-quoted
    when it holds spaces or quotes), or None."""
    key = f"{variable}="
    found = None
    start = ldflags.find(key)
    while start >= 0:
        before = ldflags[start - 1] if start else ""
        if before not in _NAME_CHARACTERS:
            end = start + len(key)
            while end < len(ldflags) and ldflags[end] in _VERSION_CHARACTERS:
                end += 1
            # the word must end where the -X argument does: at its own closing quote when
            # it was quoted, escaped or not ('...=28.2.2 beta' is not a plain word), else at
            # a space, a quote closing the whole setting, or the end
            after = (
                ldflags[end : end + 2] if ldflags[end : end + 1] == "\\" else ldflags[end : end + 1]
            )
            if before in _QUOTES:
                ends = after in (before, "\\" + before)
            else:
                ends = after in _ARGUMENT_ENDS
            found = (ldflags[start + len(key) : end] or None) if ends else None
        start = ldflags.find(key, start + 1)
    return found
