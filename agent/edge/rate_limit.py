"""At most one log line per key (a client's address, a kind of event) and interval.

Anyone who can reach a port can make the agent log (a malformed request, a connection
dropped at the bound). So such lines go through a ``RateLimiter``: the first event of a
key in an interval is logged, the others are counted, and the next line logged for the key
says how many were held back. The table of keys is bounded (the oldest is forgotten), and
so is the number of lines of all keys together in one interval, so that a client with many
addresses cannot flood the log either.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_KEYS = 1024
MAX_LINES_PER_INTERVAL = 20


@dataclass(slots=True)
class _Window:
    started: float
    held_back: int = 0


class RateLimiter:
    """Decides which events of a key get a log line."""

    def __init__(
        self,
        interval_s: float,
        *,
        max_keys: int = MAX_KEYS,
        max_lines: int = MAX_LINES_PER_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._max_keys = max_keys
        self._max_lines = max_lines
        self._clock = clock
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        self._lines = _Window(started=float("-inf"))  # all keys: held_back counts lines

    def allow(self, key: str) -> int | None:
        """None: hold this event back. Otherwise log it, with the number of events of
        ``key`` held back since its last line (0 for none)."""
        now = self._clock()
        window = self._windows.get(key)
        if window is not None and now - window.started < self.interval_s:
            window.held_back += 1
            return None
        if now - self._lines.started >= self.interval_s:
            self._lines = _Window(started=now)
        if self._lines.held_back >= self._max_lines:
            if window is None:
                window = self._remember(key, now)
            window.held_back += 1
            return None
        self._lines.held_back += 1
        held_back = window.held_back if window is not None else 0
        self._windows.pop(key, None)
        self._remember(key, now)
        return held_back

    def _remember(self, key: str, now: float) -> _Window:
        window = self._windows[key] = _Window(started=now)
        while len(self._windows) > self._max_keys:
            self._windows.popitem(last=False)
        return window
