"""Connection limits of the two servers: header and idle timeouts, and a bound with eviction.

A connection holds a file descriptor for as long as it is open, and aiohttp keeps one open
for as long as its client wants: 1,100 clients that each send half a request would use up
the default 1,024 descriptors, after which neither the REST API nor the plugin socket (and
so no GPU container start) can accept anyone. ``ConnectionGuard`` sees every connection of
a server and closes it when:

- its request header is not complete ``header_timeout_s`` after the connection was opened,
  or, on a kept-alive connection, after the first byte of its next request;
- it has been idle (no request since the last answer) for ``idle_timeout_s``;
- the server has more than ``max_connections`` (the REST API only): then the connection
  that has gone longest without completing a request is dropped, so a client that behaves
  gets in even when every attacker comes from its own address.

How it sees them: ``GuardedSite`` (an aiohttp site) serves ``guard.protocol_factory(...)``,
which wraps each of aiohttp's protocol objects to learn of its bytes, its opening and its
end, and ``guard.wrap(handler)`` (each REST route; ``guard.middleware`` for the plugin
socket's application) marks when each request's handler starts and ends (a request being
handled is never timed out) and tells ``on_answer`` each request's status (the agent's
request counters). Everything
is bookkeeping on the event loop: two dictionary operations per request, and a timer per
connection that re-arms itself lazily.
A connection is dropped with ``abort()``, which gives its descriptor back at the event
loop's next turn; until then the guard counts it as *releasing*. ``room()`` (asked by
``agent.edge.guarded_accept`` before each ``accept()`` on a plain socket) counts open,
releasing and not-yet-set-up connections, and ``make_room()`` drops the oldest when a client
waits at the bound, so that the REST API never holds more descriptors than its bound, even
for a moment.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from aiohttp import web
from aiohttp.typedefs import Middleware

from agent.display import shown
from agent.edge.fast_gets import FastGets, FastProtocol
from agent.edge.guarded_accept import GuardedAcceptor
from agent.edge.loopback import is_loopback
from agent.edge.rate_limit import RateLimiter
from agent.edge.tls_or_plain import TlsOrPlainServer, bind

log = logging.getLogger("nvidia-docker-plugin.connections")

LOG_INTERVAL_S = 60.0
DEFAULT_MAX_PENDING = 256  # TLS-port connections before their first byte or handshake's end


def _pending_bound(max_connections: int | None) -> int:
    """Connections of the TLS port that have not reached the server yet (no first byte, or
    in their handshake) hold descriptors the guard does not count yet: at most a quarter of
    the bound (at least 16), taken from the descriptor budget's reserve (docs/agent.md)."""
    if max_connections is None:
        return DEFAULT_MAX_PENDING
    return max(16, max_connections // 4)


def _never(_address: str) -> bool:
    return False


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Answered = Callable[[web.Request, int], None]  # a request and the status it was answered


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    idle_timeout_s: float
    max_connections: int | None = None  # None: no bound (the plugin socket)


class _Connection:
    __slots__ = ("deadline", "first_byte_at", "in_request", "timer", "transport", "waiting_since")

    def __init__(self, transport: asyncio.BaseTransport, now: float) -> None:
        self.transport = transport
        self.waiting_since = now  # since the last answer (or the opening)
        # The first byte of the request being read, None while none is: the opening
        # counts as one, so that a client must send its first request header in time.
        self.first_byte_at: float | None = now
        self.in_request = 0
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = 0.0


class ConnectionGuard:
    """The connections of one server (``name`` is for the log) and their limits."""

    def __init__(
        self, name: str, limits: ConnectionLimits, *, on_answer: Answered | None = None
    ) -> None:
        self.name = name
        self.limits = limits
        self._on_answer = on_answer
        self.dropped = 0  # at the bound, since start
        self._connections: OrderedDict[asyncio.BaseTransport, _Connection] = OrderedDict()
        # Aborted, their descriptor not given back yet (connection_lost not seen).
        self._releasing: set[asyncio.BaseTransport] = set()
        self._setting_up = 0  # accepted by agent.edge.guarded_accept, not opened yet
        self._limiter = RateLimiter(LOG_INTERVAL_S)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Give it to the application served through this guard (its outermost middleware).
        self.middleware = self._progress_middleware()

    @property
    def count(self) -> int:
        """Open connections now."""
        return len(self._connections)

    def room(self) -> bool:
        """Whether one more connection may be accepted, counting those open, those being
        closed and those accepted but not set up yet (always, without a bound)."""
        bound = self.limits.max_connections
        if bound is None:
            return True
        return len(self._connections) + len(self._releasing) + self._setting_up < bound

    def make_room(self) -> None:
        """At the bound with a client waiting: drop the connection that has gone longest
        without completing a request (its descriptor is back at the loop's next turn)."""
        bound = self.limits.max_connections
        held = len(self._connections) + self._setting_up
        if bound is not None and self._connections and held >= bound:
            self._drop_oldest(self._now())

    def setting_up(self) -> None:
        """One connection accepted (``agent.edge.guarded_accept``), not opened yet."""
        self._setting_up += 1

    def not_set_up(self) -> None:
        """An accepted connection failed before it was opened."""
        self._setting_up = max(0, self._setting_up - 1)

    def protocol_factory(
        self, inner: Callable[[], asyncio.Protocol]
    ) -> Callable[[], asyncio.Protocol]:
        """Wrap a protocol factory (an aiohttp ``Server``) so that this guard sees each
        connection."""

        def factory() -> asyncio.Protocol:
            return _GuardedProtocol(self, inner())

        return factory

    def fast_factory(
        self, inner: Callable[[], asyncio.Protocol], fast: FastGets, serving: set[FastProtocol]
    ) -> Callable[[], asyncio.Protocol]:
        """Like ``protocol_factory``, with ``fast``'s GETs answered before aiohttp
        (``agent.edge.fast_gets``); ``serving`` holds the connections the fast path has."""

        def factory() -> asyncio.Protocol:
            protocol = FastProtocol(self, inner, fast, serving.discard)
            serving.add(protocol)
            return protocol

        return factory

    def wrap(self, handler: Handler) -> Handler:
        """``handler``, its handling marked (no timeout interrupts it) and its status told
        to ``on_answer`` (500 for a handler that raised): what ``middleware`` does, as a
        wrapper of one route (cheaper: aiohttp builds every middleware's call anew for each
        request, while a wrapper is one more call)."""
        answered = self._on_answer
        connections = self._connections

        async def guarded(request: web.Request) -> web.StreamResponse:
            transport = request.transport
            conn = connections.get(transport) if transport is not None else None
            if conn is not None:
                conn.in_request += 1
                conn.first_byte_at = None
                connections.move_to_end(conn.transport)
            status = 500
            try:
                response = await handler(request)
                status = response.status
                return response
            except web.HTTPException as exc:
                status = exc.status
                raise
            finally:
                if conn is not None:
                    conn.in_request -= 1
                    if conn.transport in connections:
                        conn.waiting_since = self._now()
                        connections.move_to_end(conn.transport)
                if answered is not None:
                    answered(request, status)

        return guarded

    def _progress_middleware(self) -> Middleware:
        """``self.middleware``: ``wrap`` as a middleware, for an application whose routes
        are not ours to wrap (the plugin socket's)."""

        @web.middleware
        async def connection_progress(request: web.Request, handler: Handler) -> web.StreamResponse:
            return await self.wrap(handler)(request)

        return connection_progress

    # --- what the wrapped protocol reports ---

    def _opened(self, transport: asyncio.BaseTransport) -> _Connection:
        self._setting_up = max(0, self._setting_up - 1)
        now = self._now()
        conn = _Connection(transport, now)
        self._connections[transport] = conn
        self._arm(conn, now + min(self.limits.header_timeout_s, self.limits.idle_timeout_s))
        bound = self.limits.max_connections
        if bound is not None:
            while len(self._connections) > bound:
                self._drop_oldest(now)
        return conn

    def _first_byte(self, conn: _Connection) -> None:
        now = self._now()
        conn.first_byte_at = now
        due = now + self.limits.header_timeout_s
        if due < conn.deadline:
            self._arm(conn, due)

    # --- what a protocol reports (agent.edge.fast_gets's, and _GuardedProtocol) ---

    def opened(self, transport: asyncio.BaseTransport) -> _Connection:
        """A connection was set up: it is seen from now on."""
        return self._opened(transport)

    def data_arrived(self, conn: _Connection) -> None:
        """Bytes came: the first of a request starts its header timeout."""
        if conn.first_byte_at is None and not conn.in_request:
            self._first_byte(conn)

    def request_began(self, conn: _Connection) -> None:
        """A request's head was read and its answer is being made (no timeout meanwhile)."""
        conn.in_request += 1
        conn.first_byte_at = None
        self._connections.move_to_end(conn.transport)

    def answered(self, conn: _Connection) -> None:
        """A request was answered (``request_began`` or not): progress."""
        if conn.in_request:
            conn.in_request -= 1
        conn.first_byte_at = None
        if conn.transport in self._connections:
            conn.waiting_since = self._now()
            self._connections.move_to_end(conn.transport)

    def lost(self, conn: _Connection) -> None:
        """The connection ended."""
        self._closed(conn)
        self._releasing.discard(conn.transport)

    def _closed(self, conn: _Connection) -> None:
        self._connections.pop(conn.transport, None)
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None

    # --- limits ---

    def _now(self) -> float:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.time()

    def _arm(self, conn: _Connection, at: float) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
        assert self._loop is not None
        conn.deadline = at
        conn.timer = self._loop.call_at(at, self._check, conn)

    def _check(self, conn: _Connection) -> None:
        """A connection's timer: close it if a limit has passed, else re-arm."""
        conn.timer = None
        if conn.transport not in self._connections:
            return
        now = self._now()
        if conn.in_request:
            self._arm(conn, now + self.limits.idle_timeout_s)
            return
        due = conn.waiting_since + self.limits.idle_timeout_s
        what = "idle"
        if conn.first_byte_at is not None:
            header_due = conn.first_byte_at + self.limits.header_timeout_s
            if header_due < due:
                due, what = header_due, "request header not complete"
        if now < due:
            self._arm(conn, due)
            return
        log.debug("%s: closing a connection from %s: %s", self.name, _peer(conn), what)
        self._abort(conn)

    def _drop_oldest(self, now: float) -> None:
        oldest = next(iter(self._connections.values()))
        self.dropped += 1
        held_back = self._limiter.allow("bound")
        if held_back is not None:
            more = (
                f"; {held_back} more dropped in the last {LOG_INTERVAL_S:g} s" if held_back else ""
            )
            log.warning(
                "%s: %d connections, the most allowed: dropped the one from %s that went "
                "%.1f s without completing a request%s (if these are real clients, raise "
                "--max-connections and the descriptor limit)",
                self.name,
                len(self._connections) - 1,
                _peer(oldest),
                now - oldest.waiting_since,
                more,
            )
        self._abort(oldest)

    def _abort(self, conn: _Connection) -> None:
        self._closed(conn)
        self._releasing.add(conn.transport)
        cast(asyncio.Transport, conn.transport).abort()


def _peer(conn: _Connection) -> str:
    peer = conn.transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return shown(str(peer[0]))
    return "a unix socket client"


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol object, seen by the guard; everything else is passed through
    (aiohttp talks to the transport itself)."""

    __slots__ = ("_conn", "_guard", "_inner")

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._conn: _Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._conn = self._guard.opened(transport)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._conn is not None:
            self._guard.data_arrived(self._conn)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._guard.lost(self._conn)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """An aiohttp site (a TCP address, or a listening socket) whose connections ``guard``
    sees; otherwise what ``web.TCPSite`` and ``web.SockSite`` are. With ``ssl_context``
    (TCP only) ``agent.edge.tls_or_plain`` accepts the connections."""

    def __init__(
        self,
        runner: web.BaseRunner,
        guard: ConnectionGuard,
        *,
        host: str | None = None,
        port: int | None = None,
        sock: socket.socket | None = None,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 128,
        plain_loopback: bool = False,
        fast: FastGets | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._guarded_runner = runner
        self._guard = guard
        self._where = (host, port, sock)
        self._tls = ssl_context
        self._queue = backlog
        # With TLS: connections to a loopback address may also speak plain HTTP.
        self._plain_loopback = plain_loopback
        self._listener: GuardedAcceptor | TlsOrPlainServer | None = None
        self._fast = fast  # GETs answered before aiohttp (agent.edge.fast_gets)
        self._fast_serving: set[FastProtocol] = set()

    @property
    def name(self) -> str:
        host, port, sock = self._where
        scheme = "https" if self._tls else "http"
        if sock is not None:
            return f"{scheme}://{sock.getsockname()}"
        return f"{scheme}://{host or '*'}:{port}"

    async def start(self) -> None:
        await super().start()
        server = self._guarded_runner.server
        assert server is not None
        if self._fast is None:
            factory = self._guard.protocol_factory(server)
        else:
            factory = self._guard.fast_factory(server, self._fast, self._fast_serving)
        host, port, sock = self._where
        listening = [sock] if sock is not None else bind(host, port or 0, backlog=self._queue)
        if self._tls is not None:  # TLS: accepted by tls_or_plain, bounded before the guard
            listener = TlsOrPlainServer(
                factory,
                listening,
                self._tls,
                first_byte_timeout_s=self._guard.limits.header_timeout_s,
                max_pending=_pending_bound(self._guard.limits.max_connections),
                plain_allowed=is_loopback if self._plain_loopback else _never,
            )
            listener.start()
            self._listener = listener
        else:
            acceptor = GuardedAcceptor(factory, listening, self._guard, name=self._guard.name)
            acceptor.start()
            self._listener = acceptor

    @property
    def bound(self) -> list[tuple[str, int]]:
        """The (host, port) of every socket this site listens on (none before ``start``)."""
        if self._listener is None:
            return []
        return [tuple(sock.getsockname()[:2]) for sock in self._listener.sockets]

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for protocol in list(self._fast_serving):  # aiohttp's runner knows only its own
            protocol.close()
        await super().stop()
