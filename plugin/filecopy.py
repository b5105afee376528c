"""Put one file into a volume: hard link, else reflink, else a copy done by the kernel.

A hard link costs nothing but needs the same filesystem (and a writable one: a read-only
squashfs refuses even that). A reflink (``FICLONE``) shares the blocks on btrfs, XFS and
other copy-on-write filesystems. Otherwise the data is copied by the kernel
(``copy_file_range``, or ``sendfile`` where the kernel refuses copy_file_range across
filesystems) without passing through Python, and the mode and times are kept. After a build
that copied, ``sync_filesystem`` makes the copies durable before the volume is renamed into
place, so a power cut cannot leave a complete-looking volume of empty files.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import fcntl
import os
from collections.abc import Callable
from pathlib import Path

FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
CHUNK_BYTES = 64 * 2**20  # report progress at least every 64 MiB

# copy_file_range fails like this where the kernel or filesystem cannot do it: try sendfile.
_NO_COPY_FILE_RANGE = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}
)

Progress = Callable[[int], None]  # called with the bytes just copied


class Method(enum.Enum):
    LINK = "link"
    REFLINK = "reflink"
    COPY = "copy"


def place_file(source: Path, target: Path, progress: Progress | None = None) -> Method:
    """Make ``target`` (which must not exist) have the content and mode of ``source``."""
    try:
        os.link(source, target)
    except OSError:
        pass
    else:
        return Method.LINK
    with source.open("rb") as src:
        stat = os.fstat(src.fileno())
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            method = Method.REFLINK if _reflink(src.fileno(), fd) else Method.COPY
            if method is Method.COPY:
                _kernel_copy(src.fileno(), fd, progress)
            elif progress is not None:
                progress(stat.st_size)
            os.fchmod(fd, stat.st_mode & 0o7777)
            os.utime(fd, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                target.unlink()
            raise
        os.close(fd)
    return method


def sync_filesystem(path: Path) -> None:
    """Write the dirty data of the filesystem holding ``path`` to disk (``syncfs``): one
    call after many copies, instead of an fsync per file that waits for each in turn."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc is not None and _libc.syncfs(fd) == 0:
            return
        os.sync()  # no syncfs: the whole machine's dirty data, correct but wider
    finally:
        os.close(fd)


def _load_libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syncfs.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return libc


_libc = _load_libc()


def _reflink(src_fd: int, dst_fd: int) -> bool:
    try:
        fcntl.ioctl(dst_fd, FICLONE, src_fd)
    except OSError:
        return False
    return True


def _kernel_copy(src_fd: int, dst_fd: int, progress: Progress | None) -> None:
    copied = 0
    use_sendfile = False
    while True:
        if use_sendfile:
            done = os.sendfile(dst_fd, src_fd, None, CHUNK_BYTES)
        else:
            try:
                done = os.copy_file_range(src_fd, dst_fd, CHUNK_BYTES)
            except OSError as err:
                if copied or err.errno not in _NO_COPY_FILE_RANGE:
                    raise
                use_sendfile = True
                continue
        if done == 0:
            return
        copied += done
        if progress is not None:
            progress(done)
