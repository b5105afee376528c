"""Giving back the heap that start-up used, so that months of serving do not keep it."""

from __future__ import annotations

import contextlib
import ctypes
import gc


def release_startup_memory() -> None:
    """Give back to the kernel the heap that start-up used (ELF parsing, NVML discovery).

    glibc keeps freed memory in its arenas; the agent then runs for months with that
    resident. ``malloc_trim`` returns it. A no-op where libc has no such call.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
