"""Plain GETs of the hot routes, served without aiohttp's request machinery.

Most requests a node's REST API sees are ``GET /gpu/info/json``, ``/docker/cli``,
``/mesos/cli`` or ``/gpu/status/json`` without a query: answers kept as bytes (rendered once
per node state, or once per status sweep). Through aiohttp each one costs a request object,
a router lookup, a response object and a task: most of its CPU time. ``FastProtocol`` reads
such requests itself and writes the answer in the very bytes aiohttp would have written
(status line, headers in aiohttp's order, its ``Date`` and ``Server``), and counts it as
aiohttp's route would have been.

A route answers ``now()`` when it can (a kept answer), else ``later()`` (a status sweep to
join); while a request waits for ``later()``, the connection's next bytes wait behind it, so
answers keep their order. Everything else goes to aiohttp, and a connection that reaches
aiohttp stays there: the first request the fast path does not answer (another method or
path, a query, a body, ``Upgrade``, a header that is not plainly valid, a head larger than
``MAX_HEAD_BYTES``, a connection that needs a token, or a route that gives no answer, such
as status while the driver is replaced) is handed over with every byte after it, and
aiohttp's protocol is made for the connection only then. A start of a request that cannot
become a fast one (a TLS hello on the plain port, a bad request line) is handed over at
once, so aiohttp's 400 comes as soon as it would without the fast path. An answer the client
does not read stops reading until the transport's buffer drains.

The connection guard (``agent.edge.connections``) sees these connections as it sees
aiohttp's: their opening, their first byte, each request being answered and each answer
(progress), and their end.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol, cast

from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.tcp_helpers import tcp_nodelay

log = logging.getLogger("nvidia-docker-plugin.rest")

MAX_HEAD_BYTES = 8190  # a longer head goes to aiohttp (its own limit, a line's, is 8190)
_SERVER = SERVER_SOFTWARE.encode()
_OPENING = b"GET /"
_REQUEST_END = b" HTTP/1.1"
# The bytes a header's name may hold (RFC 9110's token), and a value's (no control
# character but tab); a line with any other goes to aiohttp, whose parser decides.
_TOKEN = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_VALUE = b"\t" + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100))
_HANDED_OVER = frozenset((b"content-length", b"transfer-encoding", b"upgrade", b"expect"))

# An answer: header lines placed after Content-Type, as aiohttp places headers a route sets
# (each line ending CRLF; b"" for none), and the body.
Answer = tuple[bytes, bytes]


@dataclass(frozen=True, slots=True)
class FastRoute:
    """A path whose plain GET the fast path answers: ``now()`` gives the answer when it has
    one at hand, ``later()`` (where given) waits for one; None from either: aiohttp answers
    the request. ``content_type`` is its header's value; ``counted()`` tells the request
    counters of each answer."""

    now: Callable[[], Answer | None]
    content_type: str
    counted: Callable[[], None]
    later: Callable[[], Awaitable[Answer | None]] | None = None


class _Kept:
    """A route's last whole answer: kept while its body (the same object), its headers and
    the second are the same."""

    __slots__ = ("body", "date", "headers", "whole")

    def __init__(self) -> None:
        self.body: bytes | None = None
        self.headers = b""
        self.date = ""
        self.whole = b""


@dataclass(frozen=True, slots=True)
class FastGets:
    """What a site serves itself: its routes by request target (``/gpu/info/json``), and
    which connections may use them (``open_to``: False where a token is needed)."""

    routes: Mapping[bytes, FastRoute]
    open_to: Callable[[asyncio.BaseTransport], bool]
    kept: dict[bytes, _Kept] = field(default_factory=dict)  # each route's last answer


class Watch(Protocol):
    """What the connection guard is told (``agent.edge.connections.ConnectionGuard``); the
    connection it returns on ``opened`` is its own."""

    def opened(self, transport: asyncio.BaseTransport) -> Any: ...
    def data_arrived(self, conn: Any) -> None: ...
    def request_began(self, conn: Any) -> None: ...
    def answered(self, conn: Any) -> None: ...
    def lost(self, conn: Any) -> None: ...


class FastProtocol(asyncio.Protocol):
    """One connection: plain GETs of ``fast``'s routes answered here; from the first other
    request on, aiohttp's protocol (made by ``inner_factory``) has the connection."""

    __slots__ = (
        "_close_after",
        "_conn",
        "_eof",
        "_fast",
        "_guard",
        "_inner",
        "_inner_factory",
        "_on_end",
        "_paused",
        "_pending",
        "_reading_paused",
        "_transport",
        "_waiting",
    )

    def __init__(
        self,
        guard: Watch,
        inner_factory: Callable[[], asyncio.Protocol],
        fast: FastGets,
        on_end: Callable[[FastProtocol], None],
    ) -> None:
        self._guard = guard
        self._inner_factory = inner_factory
        self._fast = fast
        self._on_end = on_end
        self._inner: asyncio.Protocol | None = None
        self._conn: Any = None
        self._transport: asyncio.Transport | None = None
        self._pending = b""  # a request head begun; or, while waiting, everything unanswered
        self._waiting: asyncio.Future[Answer | None] | None = None  # a later() answer
        self._close_after = False  # the request waiting asked for Connection: close
        self._eof = False  # the client will send no more (while an answer was waited for)
        self._paused = False  # the transport's buffer is full
        self._reading_paused = False  # by this protocol, until the buffer drains

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conn = self._guard.opened(transport)
        real = self._transport = cast(asyncio.Transport, transport)
        if not self._fast.open_to(transport):
            self._hand_over(b"")
            return
        tcp_nodelay(real, True)  # as aiohttp's protocol does

    def data_received(self, data: bytes) -> None:
        self._guard.data_arrived(self._conn)
        if self._inner is not None:
            self._inner.data_received(data)
        elif self._waiting is not None:
            self._pending += data  # behind the answer being waited for
            if len(self._pending) > MAX_HEAD_BYTES and not self._reading_paused:
                self._pause_reading()
        else:
            self._serve(self._pending + data if self._pending else data)

    def _serve(self, buffer: bytes) -> None:
        """Answer the whole requests at the start of ``buffer``; keep what follows."""
        transport = self._transport
        assert transport is not None
        start = 0
        while (end := buffer.find(b"\r\n\r\n", start)) >= 0:
            target, close = self._request(buffer, start, end)
            route = self._fast.routes.get(target) if target is not None else None
            if route is None or target is None:
                self._hand_over(buffer[start:])
                return
            try:
                answer = route.now()
            except Exception:  # a bug: aiohttp's route answers (or fails) as it would have
                log.exception("The REST API's fast path failed on %s", target.decode("latin-1"))
                answer = None
                route = replace(route, later=None)
            if answer is None:
                if route.later is None:
                    self._hand_over(buffer[start:])
                    return
                self._wait(target, route, route.later, close, buffer[start:], end + 4 - start)
                return
            route.counted()
            transport.write(self._whole(target, route, answer, close))
            if close:
                self._pending = b""
                transport.close()
                return
            self._guard.answered(self._conn)
            start = end + 4
        rest = buffer[start:] if start else buffer
        if len(rest) > MAX_HEAD_BYTES or not self._may_be_fast(rest):
            self._hand_over(rest)  # aiohttp answers it as soon as it can (a 400 at once)
            return
        self._pending = rest
        if rest and start:  # answers written, and the next request has begun
            self._guard.data_arrived(self._conn)

    def _wait(
        self,
        target: bytes,
        route: FastRoute,
        later: Callable[[], Awaitable[Answer | None]],
        close: bool,
        unanswered: bytes,
        head_bytes: int,
    ) -> None:
        """The request at the start of ``unanswered`` (``head_bytes`` long) waits for
        ``later()``; bytes that come meanwhile wait behind it."""
        self._pending = unanswered
        self._close_after = close
        self._guard.request_began(self._conn)
        waiting = self._waiting = asyncio.ensure_future(later())
        waiting.add_done_callback(partial(self._answered_later, target, route, head_bytes))

    def _answered_later(
        self, target: bytes, route: FastRoute, head_bytes: int, done: asyncio.Future[Answer | None]
    ) -> None:
        self._waiting = None
        transport = self._transport
        if transport is None or transport.is_closing() or done.cancelled():
            return
        answer = None if done.exception() is not None else done.result()
        unanswered, self._pending = self._pending, b""
        if answer is None:  # aiohttp answers it, as it answers the route's failures
            self._guard.answered(self._conn)
            self._hand_over(unanswered)
            return
        route.counted()
        transport.write(self._whole(target, route, answer, self._close_after))
        self._guard.answered(self._conn)
        if self._close_after:
            transport.close()
            return
        if self._reading_paused and not self._paused:
            self._resume_reading()
        rest = unanswered[head_bytes:]
        if rest:
            self._serve(rest)
        if self._eof and self._waiting is None and self._inner is None:
            transport.close()  # the client half-closed: nothing more will be asked

    def _may_be_fast(self, begun: bytes) -> bool:
        """Whether the start of a request head could still be one the fast path answers."""
        opening = begun[:5]
        if opening != _OPENING[: len(opening)]:
            return False
        line_end = begun.find(b"\r\n")
        if line_end < 0:
            return True
        line = begun[:line_end]
        return line.endswith(_REQUEST_END) and line[4:-9] in self._fast.routes

    @staticmethod
    def _request(buffer: bytes, start: int, end: int) -> tuple[bytes | None, bool]:
        """The target of the plain ``GET ... HTTP/1.1`` whose head is ``buffer[start:end]``,
        and whether it asks to close the connection after its answer; (None, False) for
        any other request."""
        if end - start > MAX_HEAD_BYTES:
            return None, False
        line_end = buffer.find(b"\r\n", start, end)
        if line_end < 0:
            line_end = end
        if buffer[start : start + 4] != b"GET " or buffer[line_end - 9 : line_end] != _REQUEST_END:
            return None, False
        close = False
        if line_end < end:
            for line in buffer[line_end + 2 : end].split(b"\r\n"):
                name, colon, value = line.partition(b":")
                if (
                    not colon
                    or not name
                    or name.translate(None, _TOKEN)
                    or value.translate(None, _VALUE)
                ):
                    return None, False
                lowered = name.lower()
                if lowered in _HANDED_OVER:
                    return None, False
                if lowered == b"connection":
                    options = {option.strip().lower() for option in value.split(b",")}
                    if b"upgrade" in options:
                        return None, False
                    close = b"close" in options
        return buffer[start + 4 : line_end - 9], close

    def _whole(self, target: bytes, route: FastRoute, answer: Answer, close: bool) -> bytes:
        """The answer's bytes as aiohttp writes them, kept per route while they last."""
        date = rfc822_formatted_time()
        kept = self._fast.kept.get(target)
        if kept is None:
            kept = self._fast.kept[target] = _Kept()
        headers, body = answer
        if kept.body is not body or kept.date != date or kept.headers != headers:
            kept.body, kept.headers, kept.date = body, headers, date
            kept.whole = b"".join(
                (
                    b"HTTP/1.1 200 OK\r\nContent-Type: ",
                    route.content_type.encode(),
                    b"\r\n",
                    headers,
                    b"Content-Length: ",
                    str(len(body)).encode(),
                    b"\r\nDate: ",
                    date.encode(),
                    b"\r\nServer: ",
                    _SERVER,
                    b"\r\n\r\n",
                    body,
                )
            )
        if close:
            head, _, rest = kept.whole.partition(b"\r\n\r\n")
            return head + b"\r\nConnection: close\r\n\r\n" + rest
        return kept.whole

    def _hand_over(self, data: bytes) -> None:
        """aiohttp's protocol has the connection from here on, ``data`` first."""
        transport = self._transport
        assert transport is not None
        self._pending = b""
        inner = self._inner = self._inner_factory()
        self._on_end(self)
        inner.connection_made(transport)
        if self._paused:
            inner.pause_writing()
        if self._reading_paused and not self._paused:
            self._resume_reading()
        if data:
            inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            return self._inner.eof_received()
        self._eof = True
        return self._waiting is not None  # keep the transport open for the answer

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.lost(self._conn)
        if self._waiting is not None:
            self._waiting.cancel()
        if self._inner is not None:
            self._inner.connection_lost(exc)
        else:
            self._on_end(self)

    def pause_writing(self) -> None:
        self._paused = True
        if self._inner is not None:
            self._inner.pause_writing()
        else:
            self._pause_reading()  # no more requests until the answers drain

    def resume_writing(self) -> None:
        self._paused = False
        if self._reading_paused and (self._inner is not None or self._waiting is None):
            self._resume_reading()
        if self._inner is not None:
            self._inner.resume_writing()

    def _pause_reading(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()
            self._reading_paused = True

    def _resume_reading(self) -> None:
        self._reading_paused = False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def close(self) -> None:
        """The server stops: a connection the fast path still has is between requests, or
        waits for a status sweep that stops too; it is closed now."""
        if self._inner is None and self._transport is not None:
            self._transport.close()
