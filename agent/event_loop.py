"""Which asyncio event loop the daemon serves with (``--event-loop``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agent.errors import StartupError

CHOICES = ("auto", "asyncio", "uvloop")


def loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """The event loop to serve with: uvloop when asked for or, with ``auto``, when installed."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop  # noqa: PLC0415 - optional, faster event loop
        except ImportError:
            if choice == "uvloop":
                raise StartupError("--event-loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.new_event_loop, "uvloop"
    return None, "asyncio"
