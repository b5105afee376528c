"""Files that others may have touched: read within a bound, written without following links.

The agent runs as root and reads files that an operator names (node files, token files,
certificates) or that sit in directories others can write (the CDI spec directory). Any of
them may turn out to be a FIFO, a device, a directory, a symbolic link planted by someone
else, or a file of many gigabytes. So:

- ``read_regular(path, limit=..., what=...)`` opens without blocking (``O_NONBLOCK``: a
  FIFO with no writer opens at once, and is then refused), checks on the open descriptor that
  it is a regular file of at most ``limit`` bytes, and reads at most that many. With
  ``follow=False`` a symbolic link at ``path`` is refused too (``O_NOFOLLOW``). With
  ``kernel=True`` (a sysfs or procfs attribute) the size the file declares is not checked,
  only what is read: the kernel declares 4096 bytes for every sysfs attribute, 0 for procfs
  files, and for a binary attribute its buffer, which is not its content (a NUMA node's
  ``cpulist`` declares 28 KiB on a kernel built for 8,192 CPUs, as Debian's and Ubuntu's
  are, and holds ``0-31``). Any failure is an ``UnusableFile`` whose message is one line:
  the path and what is wrong with it.
- ``write_atomically(directory, name, data, mode=...)`` creates a temporary file with a
  random name inside ``directory`` (opened once, as a descriptor, so the directory cannot be
  swapped underneath), with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (nothing that is already
  there, link or not, is ever opened), writes, sets the mode, fsyncs, renames it over
  ``name`` (a rename replaces a link or a FIFO at ``name`` itself, never what a link points
  to) and fsyncs the directory. Readers see the old file or the new one, never a part.
- ``writable_directory(directory, what=...)`` makes ``directory`` (and its parents) if it is
  missing and creates and removes one such temporary file in it: the check, at start, that
  ``write_atomically`` will be able to write there. A failure is an ``UnusableFile`` of one
  line: the directory and why (``Not a directory``, naming the file in the way;
  ``Permission denied``; ``Read-only file system``).

Only the standard library is imported here: ``agent.gpu`` (the node file) uses it too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)
_TEMPORARY_TRIES = 16


class UnusableFile(Exception):
    """A file that cannot be read or written as asked; the message is one line."""


def describe_size(size: int) -> str:
    """``512 bytes``, ``4 KiB``, ``20.0 GB``: a size as a person reads it."""
    if size < 1024:
        return f"{size} bytes"
    if size < 1024 * 1024:
        return f"{size // 1024} KiB"
    if size < 1024**3:
        return f"{size / 1024 / 1024:.1f} MiB"
    return f"{size / 1000**3:.1f} GB"


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for a message: ``a FIFO``, ``a regular file``."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def read_regular(
    path: Path, *, limit: int, what: str, follow: bool = True, kernel: bool = False
) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); ``UnusableFile`` for
    anything else: missing, unreadable, not a regular file, larger than ``limit`` (by its
    declared size, unless ``kernel``, or by what was read)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP and not follow:
            raise UnusableFile(f"{what} {path} is a symbolic link, not a regular file") from None
        raise UnusableFile(f"{what} {path}: {err.strerror or err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnusableFile(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file")
        if not kernel and st.st_size > limit:
            raise UnusableFile(
                f"{what} {path} is {describe_size(st.st_size)}, more than the "
                f"{describe_size(limit)} it may be"
            )
        chunks: list[bytes] = []
        left = limit + 1  # one byte more: a file that grew since fstat is refused too
        while left > 0:
            try:
                chunk = os.read(fd, min(left, 1 << 20))
            except OSError as err:
                raise UnusableFile(f"{what} {path}: {err.strerror or err}") from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnusableFile(
                f"{what} {path} grew beyond the {describe_size(limit)} it may be while read"
            )
        return data
    finally:
        os.close(fd)


def write_atomically(directory: Path, name: str, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``directory/name`` with ``data`` (see the module docstring); raises
    ``OSError`` (the previous file stays, no temporary file is left behind; a file where
    ``directory`` should be is ``ENOTDIR``, ``Not a directory``)."""
    with contextlib.suppress(FileExistsError):  # something else at the name: ENOTDIR below
        directory.mkdir(parents=True, exist_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        temporary, fd = _create_temporary(dir_fd, name, mode)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)  # whatever the umask
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dir_fd)
            raise
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def writable_directory(directory: Path, *, what: str, mode: int = 0o700) -> None:
    """Make ``directory`` (of ``mode``, whatever the umask; its missing parents as the umask
    says) if it is missing, then create a temporary file in it as ``write_atomically`` does,
    and remove it; ``UnusableFile`` (one line: ``what``, the directory and why) if either
    cannot be done. A directory that exists keeps its mode."""
    try:
        with contextlib.suppress(FileExistsError):  # something else at the name: ENOTDIR below
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir(mode=mode)
            directory.chmod(mode)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            temporary, fd = _create_temporary(dir_fd, "probe", 0o600)
            os.close(fd)
            os.unlink(temporary, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as err:
        why = err.strerror or str(err)
        if err.errno == errno.ENOTDIR:
            why += _in_the_way(directory)
        raise UnusableFile(f"{what} {directory}: {why}") from None


def _in_the_way(directory: Path) -> str:
    """`` (/x is a regular file)``: the nearest of ``directory`` and its parents that exists
    and is not a directory; empty if none is found."""
    for path in (directory, *directory.parents):
        try:
            mode = path.stat().st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode):
            return ""
        return f" ({path} is {kind_of(mode)})"
    return ""


def _random_suffix() -> str:
    """16 random hex digits: os.urandom, as secrets.token_hex is, without importing secrets
    (hmac, hashlib, OpenSSL: 3.8 MB more in the GPU worker, which reads node files here)."""
    return os.urandom(8).hex()


def _create_temporary(dir_fd: int, name: str, mode: int) -> tuple[str, int]:
    """A new file ``.<name>.<random>.tmp`` (CDI readers load ``*.json`` and ``*.yaml`` only),
    created by this call and by nobody else."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_TEMPORARY_TRIES):
        temporary = f".{name}.{_random_suffix()}.tmp"
        try:
            return temporary, os.open(temporary, flags, mode & 0o600, dir_fd=dir_fd)
        except FileExistsError:
            continue
    raise OSError(
        errno.EEXIST, f"no free temporary name beside {name} after {_TEMPORARY_TRIES} tries"
    )
