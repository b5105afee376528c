"""One lock per volume name, kept only while someone holds or waits for it.

The volume store serialises the Creates and Removes of one volume. A lock object kept for
every name ever asked about would let a client grow the daemon's memory without bound (one
Remove per made-up version), so each lock is counted: created on first use, dropped when
its last user leaves. The table never holds more names than there are calls in progress.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0


class NameLocks:
    """Per-name mutual exclusion across threads, with a table bounded by its users."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._guard = threading.Lock()

    def __len__(self) -> int:
        """How many names have a lock now (held or awaited)."""
        return len(self._entries)

    @contextlib.contextmanager
    def hold(self, name: str) -> Iterator[None]:
        """Hold ``name``'s lock for the ``with`` block."""
        with self._guard:
            entry = self._entries.get(name)
            if entry is None:
                entry = self._entries[name] = _Entry()
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                if not entry.users:
                    del self._entries[name]
