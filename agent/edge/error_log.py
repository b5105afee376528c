"""What aiohttp's servers and the event loop report, as the agent's one-line log.

aiohttp logs every request it cannot parse (``GET /a b HTTP/1.1``, a header line of 9 KiB,
a TLS hello on the plain port) as an ERROR with a full traceback, on both servers: whoever
can reach a port could fill the log. Both servers are given an ``HttpErrorLog`` instead (the
``logger`` argument of aiohttp's request handler, passed through ``web.AppRunner``):

- a malformed request (aiohttp's ``HttpProcessingError``) becomes one WARNING line naming
  the source address, the server and the parser's reason, at most one per source and
  interval (``agent.edge.rate_limit``); the client still gets aiohttp's 400;
- any other error aiohttp reports (a handler that raised: a bug) is one ERROR line with
  the exception's type and message.

Tracebacks are added only when ``NV_DEBUG`` is set. ``loop_exception_handler`` does the same
for what the event loop reports (a failed ``accept()``, an exception nobody retrieved).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from aiohttp.http import HttpProcessingError

from agent.display import shown
from agent.edge.rate_limit import RateLimiter
from agent.logs import debug_enabled

LOG_INTERVAL_S = 60.0
_REASON_CHARS = 60
_QUOTED = re.compile(r":|\s(?:b|bytearray\()?['\"]")

log = logging.getLogger("nvidia-docker-plugin.http")


def describe(exc: BaseException) -> str:
    """``Type: message``, on one bounded line."""
    text = shown(str(exc).replace("\n", " "), _REASON_CHARS * 2)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _reason(exc: HttpProcessingError) -> str:
    """The parser's reason, without the request bytes aiohttp quotes after it (``Bad
    status line 'GET /a b'``, ``Got more than 8190 bytes when reading: b'...'``)."""
    first = str(exc.message).split("\n", 1)[0]
    reason = _QUOTED.split(first, maxsplit=1)[0].strip()
    return shown(reason, _REASON_CHARS) or type(exc).__name__


def _exception(exc_info: object) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if (
        isinstance(exc_info, tuple)
        and len(exc_info) == 3
        and isinstance(exc_info[1], BaseException)
    ):
        return exc_info[1]
    return None


class HttpErrorLog(logging.LoggerAdapter[logging.Logger]):
    """The logger of one aiohttp server (``server`` names it in each line)."""

    def __init__(
        self,
        server: str,
        *,
        anonymous: str = "an unknown address",
        interval_s: float = LOG_INTERVAL_S,
        tracebacks: bool | None = None,
        logger: logging.Logger = log,
    ) -> None:
        super().__init__(logger, {})
        self.server = server
        # What a source without an address is called: a unix socket's peers have none,
        # and older aiohttp versions name no source at all.
        self.anonymous = anonymous
        self.tracebacks = debug_enabled() if tracebacks is None else tracebacks
        self.limiter = RateLimiter(interval_s)

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        exc = _exception(kwargs.get("exc_info"))
        if isinstance(exc, HttpProcessingError):
            self._malformed(exc, args[0] if args else "")
            return
        if exc is not None and level >= logging.ERROR and not self.tracebacks:
            kwargs["exc_info"] = None
            msg, args = f"{msg} on the %s: %s", (*args, self.server, describe(exc))
        self.logger.log(level, msg, *args, **kwargs)

    def _malformed(self, exc: HttpProcessingError, source: object) -> None:
        where = shown(str(source)) or self.anonymous
        held_back = self.limiter.allow(where)
        reason = _reason(exc)
        if held_back is None:
            self.logger.debug(
                "Malformed HTTP request from %s on the %s: %s", where, self.server, reason
            )
            return
        more = (
            f" ({held_back} more from this source in the last {self.limiter.interval_s:g} s "
            "were not logged)"
            if held_back
            else ""
        )
        self.logger.warning(
            "Malformed HTTP request from %s on the %s: %s; answered 400%s",
            where,
            self.server,
            reason,
            more,
            exc_info=exc if self.tracebacks else None,
        )


_loop_limiter = RateLimiter(LOG_INTERVAL_S)


def loop_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's reports as one ERROR line each (rate-limited per message)."""
    if debug_enabled():
        loop.default_exception_handler(context)
        return
    message = str(context.get("message") or "unexpected error")
    held_back = _loop_limiter.allow(message)
    if held_back is None:
        return
    exc = context.get("exception")
    detail = f": {describe(exc)}" if isinstance(exc, BaseException) else ""
    more = f" ({held_back} more not logged)" if held_back else ""
    log.error("Event loop: %s%s%s (NV_DEBUG=1 shows the traceback)", message, detail, more)
