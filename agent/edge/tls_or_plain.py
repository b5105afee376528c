"""The REST API's TLS port: TLS, and from the node itself plain HTTP as well; bounded.

With ``--tls-cert`` and ``--plain-loopback`` (the default), a launch script's
``curl localhost:3476`` keeps working while other machines must speak TLS on the same port.
``TlsOrPlainServer`` accepts the connections itself (with ``--no-plain-loopback`` too, then
with ``plain_allowed`` false for every address):

- a connection to an address that is not loopback starts its TLS handshake at once (plain
  HTTP from the network fails the handshake, as on a TLS-only port);
- a connection to a loopback address is held until its first byte arrives (at most
  ``first_byte_timeout_s``), which is read with ``MSG_PEEK`` so that it stays in the
  socket: ``0x16`` opens a TLS handshake record, anything else is plain HTTP (a request
  starts with a method's letter). The socket then goes to the event loop as TLS or plain.

A connection is *pending* until it reaches the server's protocol: while it waits for its
first byte, and while its TLS handshake runs (at most ``first_byte_timeout_s`` too). The
connection guard (``agent.edge.connections``) sees connections only from then on, so pending
ones are bounded here: beyond ``max_pending`` the oldest is closed (one still waiting for its
first byte before one in its handshake), so that clients that open connections and stall
before or inside the handshake cannot take the descriptors the plugin socket needs. Once
handed over, a connection is the event loop's and the protocol's, as with
``loop.create_server``.

Which TLS context a connection gets is decided when its handshake starts: the context given,
or, for a ``ReloadableContext`` (``agent.edge.tls``: the files read again on SIGHUP), the newest
one built from them. A new context brings its own session cache and ticket keys, so
sessions (TLS 1.3 tickets, TLS 1.2 session IDs) made under an older certificate or client CA
are not resumed: their clients make a full handshake, and the new client CA checks them.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import OrderedDict
from collections.abc import Callable

from agent.edge.guarded_accept import ACCEPT_BATCH, OUT_OF_RESOURCES, pause_accepting
from agent.edge.loopback import is_loopback
from agent.edge.rate_limit import RateLimiter

log = logging.getLogger("nvidia-docker-plugin.connections")

TLS_HANDSHAKE = 0x16  # the content type of a TLS handshake record: a ClientHello's first byte


class ReloadableContext(ssl.SSLContext):
    """A server context whose files may be read again: ``TlsOrPlainServer`` hands each new
    connection ``newest``, this context until ``supersede`` names a newer one. What a
    superseded context served keeps it (connections open, requests in flight); nothing new
    reaches it, its sessions included."""

    _newer: ssl.SSLContext | None = None

    @property
    def newest(self) -> ssl.SSLContext:
        """The context new connections get."""
        return self if self._newer is None else self._newer

    def supersede(self, newer: ssl.SSLContext) -> None:
        """From now on, new connections get ``newer``."""
        self._newer = None if newer is self else newer


def bind(
    host: str | None, port: int, *, backlog: int = 128, listening: bool = True
) -> list[socket.socket]:
    """Non-blocking sockets bound on every address of ``host`` (all interfaces for None) at
    ``port``, as ``loop.create_server`` binds them, listening unless ``listening`` is false
    (``agent.edge.listen`` binds first, listens later); raises ``OSError`` (none left open)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _name, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            if listening:
                sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class TlsOrPlainServer:
    """Serves ``factory`` on ``sockets``: TLS for every connection (with
    ``ssl_context``, or its ``newest`` for a ``ReloadableContext``), and plain HTTP too for
    connections to an address that ``plain_allowed`` accepts (loopback ones)."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        sockets: list[socket.socket],
        ssl_context: ssl.SSLContext,
        *,
        first_byte_timeout_s: float,
        max_pending: int = 256,
        plain_allowed: Callable[[str], bool] = is_loopback,
    ) -> None:
        self.sockets = sockets
        self._factory = factory
        self._tls = ssl_context
        self._timeout_s = first_byte_timeout_s
        self._max_pending = max(1, max_pending)
        self._plain_allowed = plain_allowed
        self._waiting: OrderedDict[socket.socket, asyncio.TimerHandle] = OrderedDict()
        self._handing: OrderedDict[asyncio.Task[None], None] = OrderedDict()
        self.dropped = 0  # pending connections closed at the bound, since start
        self._limiter = RateLimiter(60.0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for listening in self.sockets:
            listening.setblocking(False)
            self._loop.add_reader(listening.fileno(), self._accept, listening)

    def close(self) -> None:
        """Stop accepting; close the listening sockets and the connections not yet handed
        over (those handed over belong to the server's runner, which closes them)."""
        if self._closed:
            return
        self._closed = True
        for listening in self.sockets:
            if self._loop is not None:
                self._loop.remove_reader(listening.fileno())
            listening.close()
        for conn in list(self._waiting):
            self._drop(conn)
        for task in list(self._handing):
            task.cancel()
        self._handing.clear()

    @property
    def waiting(self) -> int:
        """Connections to a loopback address whose first byte has not come yet."""
        return len(self._waiting)

    @property
    def pending(self) -> int:
        """Connections not yet served: waiting for their first byte, or in their handshake."""
        return len(self._waiting) + len(self._handing)

    def _make_room(self) -> None:
        """At the bound: close the oldest pending connection (waiting ones first)."""
        while self.pending >= self._max_pending:
            self.dropped += 1
            if self._waiting:
                self._drop(next(iter(self._waiting)))
            else:
                task = next(iter(self._handing))
                del self._handing[task]
                task.cancel()  # the event loop closes the socket of a cancelled handshake
            held_back = self._limiter.allow("pending")
            if held_back is not None:
                more = f"; {held_back} more in the last 60 s" if held_back else ""
                log.warning(
                    "REST API: %d connections before their first byte or in their TLS "
                    "handshake, the most allowed: closed the oldest%s",
                    self._max_pending,
                    more,
                )

    # --- accepting ---

    def _accept(self, listening: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _peer = listening.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as err:
                if err.errno in OUT_OF_RESOURCES:
                    self._pause(listening, err)
                else:  # a network error of a pending connection (EPROTO, ...): that one only
                    log.debug("REST API: accept failed: %s", err)
                return
            conn.setblocking(False)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                local = str(conn.getsockname()[0])
            except OSError:  # already reset by the client
                conn.close()
                continue
            if self._plain_allowed(local):
                self._wait_for_first_byte(conn)
            else:
                self._hand_over(conn, tls=True)

    def _pause(self, listening: socket.socket, err: OSError) -> None:
        """Out of descriptors: accept again in a second (the kernel keeps the backlog)."""
        assert self._loop is not None
        pause_accepting(
            self._loop, listening, self._accept, err,
            name="REST API", limiter=self._limiter, closed=lambda: self._closed,
        )  # fmt: skip

    # --- a loopback connection's first byte ---

    def _wait_for_first_byte(self, conn: socket.socket) -> None:
        assert self._loop is not None
        self._make_room()
        self._waiting[conn] = self._loop.call_later(self._timeout_s, self._drop, conn)
        self._loop.add_reader(conn.fileno(), self._first_byte, conn)

    def _first_byte(self, conn: socket.socket) -> None:
        try:
            first = conn.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not first:  # closed before a byte was sent
            self._drop(conn)
            return
        self._forget(conn)  # still pending: now as a handover, in the same bound
        self._hand_over(conn, tls=first[0] == TLS_HANDSHAKE)

    def _forget(self, conn: socket.socket) -> None:
        timer = self._waiting.pop(conn, None)
        if timer is not None:
            timer.cancel()
        if self._loop is not None and conn.fileno() != -1:
            self._loop.remove_reader(conn.fileno())

    def _drop(self, conn: socket.socket) -> None:
        self._forget(conn)
        conn.close()

    # --- to the event loop ---

    def _hand_over(self, conn: socket.socket, *, tls: bool) -> None:
        assert self._loop is not None
        self._make_room()
        task = self._loop.create_task(self._connect(conn, tls))
        self._handing[task] = None
        task.add_done_callback(lambda done: self._handing.pop(done, None))

    async def _connect(self, conn: socket.socket, tls: bool) -> None:
        assert self._loop is not None
        context = self._tls
        if isinstance(context, ReloadableContext):
            context = context.newest
        try:
            await self._loop.connect_accepted_socket(
                self._factory,
                conn,
                ssl=context if tls else None,
                ssl_handshake_timeout=self._timeout_s if tls else None,
            )
        except OSError as err:  # ssl.SSLError and TimeoutError among them
            # A failed handshake (plain HTTP from the network, an untrusted client
            # certificate, a client that went away): the event loop has closed the socket.
            log.debug("REST API: a connection ended before it was served: %s", err)
