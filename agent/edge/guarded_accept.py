"""Accepting a plain listening socket's connections without overshooting the guard's bound.

``loop.create_server`` accepts up to its backlog (128) connections per wake-up before any of
them reaches the connection guard, and a connection the guard drops keeps its descriptor
until the event loop's next turn. Under a flood of new connections a server accepted that
way would hold well over ``--max-connections`` descriptors for a moment, and the plugin
socket's ``accept()`` could fail with "Too many open files". ``GuardedAcceptor`` accepts the
connections itself and asks ``gate.room()`` before each one. Without room, when the
listening socket has just woken the loop (a client is waiting), the guard drops its oldest
connection (``gate.make_room()``) and the acceptor waits for the next turn of the loop, when
that descriptor is back; so the REST API's descriptors (open, being closed, being set up)
stay within the bound. The kernel keeps the waiting connections in its backlog meanwhile,
and the listening socket stays readable.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Protocol

from agent.edge.rate_limit import RateLimiter

log = logging.getLogger("nvidia-docker-plugin.connections")

ACCEPT_BATCH = 64  # connections accepted per wake-up, so that one socket cannot starve the loop
OUT_OF_FDS_PAUSE_S = 1.0
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class AcceptGate(Protocol):
    """What the acceptor asks and tells (``agent.edge.connections.ConnectionGuard``)."""

    def room(self) -> bool:
        """Whether one more connection may be accepted now."""

    def make_room(self) -> None:
        """No room and a client waits: drop a connection so that there will be."""

    def setting_up(self) -> None:
        """One connection accepted: it holds a descriptor until it is set up or fails."""

    def not_set_up(self) -> None:
        """A connection accepted failed before it was set up (its socket is closed)."""


class GuardedAcceptor:
    """Serves ``factory`` on listening ``sockets`` (TCP or unix), accepting a connection
    only while ``gate`` has room for it."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        sockets: list[socket.socket],
        gate: AcceptGate,
        *,
        name: str,
    ) -> None:
        self.sockets = sockets
        self._factory = factory
        self._gate = gate
        self._name = name
        self._in_flight: set[asyncio.Task[None]] = set()
        self._limiter = RateLimiter(60.0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for listening in self.sockets:
            listening.setblocking(False)
            self._loop.add_reader(listening.fileno(), self._accept, listening)

    def close(self) -> None:
        """Stop accepting and close the listening sockets (the connections set up belong
        to the server's runner, which closes them)."""
        if self._closed:
            return
        self._closed = True
        for listening in self.sockets:
            if self._loop is not None:
                self._loop.remove_reader(listening.fileno())
            listening.close()
        for task in list(self._in_flight):
            task.cancel()

    def _accept(self, listening: socket.socket) -> None:
        tcp = listening.family in (socket.AF_INET, socket.AF_INET6)
        for turn in range(ACCEPT_BATCH):
            if not self._gate.room():
                if turn == 0:  # the socket woke the loop: a client waits
                    self._gate.make_room()
                return  # still readable: accepted at a later turn, once descriptors are back
            try:
                conn, _peer = listening.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as err:
                if err.errno in OUT_OF_RESOURCES:
                    self._pause(listening, err)
                else:  # a network error of one pending connection (EPROTO, ...)
                    log.debug("%s: accept failed: %s", self._name, err)
                return
            conn.setblocking(False)
            if tcp:
                try:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:  # already reset by the client
                    conn.close()
                    continue
            assert self._loop is not None
            self._gate.setting_up()
            task = self._loop.create_task(self._connect(conn))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _connect(self, conn: socket.socket) -> None:
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except BaseException as err:  # the event loop has closed the socket
            self._gate.not_set_up()
            if not isinstance(err, OSError):
                raise
            log.debug("%s: a connection ended before it was served: %s", self._name, err)

    def _pause(self, listening: socket.socket, err: OSError) -> None:
        """Out of descriptors anyway (another part of the daemon took them)."""
        assert self._loop is not None
        pause_accepting(
            self._loop, listening, self._accept, err,
            name=self._name, limiter=self._limiter, closed=lambda: self._closed,
        )  # fmt: skip


def pause_accepting(
    loop: asyncio.AbstractEventLoop,
    listening: socket.socket,
    accept: Callable[[socket.socket], None],
    err: OSError,
    *,
    name: str,
    limiter: RateLimiter,
    closed: Callable[[], bool],
) -> None:
    """Out of descriptors: stop reading ``listening`` and call ``accept`` for it again in a
    second, unless ``closed()`` by then (the kernel keeps the backlog meanwhile); a warning at
    most once a minute."""
    if limiter.allow("out of descriptors") is not None:
        log.warning("%s: cannot accept a connection: %s; retrying in 1 s", name, err.strerror)
    loop.remove_reader(listening.fileno())

    def resume() -> None:
        if not closed():
            loop.add_reader(listening.fileno(), accept, listening)

    loop.call_later(OUT_OF_FDS_PAUSE_S, resume)
