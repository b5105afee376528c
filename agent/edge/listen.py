"""The REST API's TCP address: bound first of all, listened on once the API is ready.

``bind(host, port)`` binds every address a listen name resolves to (the daemon does this
before anything else, so that an address in use is the first thing it says, before it has
built a volume or written a spec). A bound socket does not listen yet: until ``serve``, a
client's connection is refused, as when no agent runs, rather than left waiting in a
backlog. ``serve(runner, sockets, ...)`` then listens and serves the REST API on those
sockets; ``listen`` does both at once. An address of the name this node cannot bind
(``::1`` where IPv6 is disabled) is skipped as long as one of the name's addresses works;
an address in use never is.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl

from aiohttp import web

from agent.edge.connections import ConnectionGuard, GuardedSite
from agent.edge.fast_gets import FastGets
from agent.edge.tls_or_plain import bind as bind_socket
from agent.errors import StartupError

log = logging.getLogger("nvidia-docker-plugin")

_UNBINDABLE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
BACKLOG = 128


def _shown(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (as ``-l`` takes it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _what_to_do(err: OSError) -> str:
    """The advice for a failed bind or listen: another agent only when the address is in use."""
    if err.errno == errno.EADDRINUSE:
        return "is another agent running? choose another address with -l"
    if err.errno == errno.EADDRNOTAVAIL:
        return "it is not an address of this node: choose one of its addresses with -l"
    return "choose another address with -l"


def _numeric(sockaddr: tuple[object, ...], zone: str) -> str:
    """An address of ``getaddrinfo`` or ``getsockname`` as text that names it again: a
    link-local IPv6 address keeps its zone (``fe80::1%eth0``: its interface's name, else its
    index; or the ``zone`` given after ``%`` in ``-l``, since uvloop's ``getaddrinfo`` leaves
    the scope out), without which it cannot be bound or reached."""
    address = str(sockaddr[0])
    scope = sockaddr[3] if len(sockaddr) == 4 else 0
    if isinstance(scope, int) and scope:
        try:
            return f"{address}%{socket.if_indextoname(scope)}"
        except OSError:
            return f"{address}%{scope}"
    return f"{address}%{zone}" if zone and ":" in address else address


async def bind(host: str | None, port: int) -> list[socket.socket]:
    """Sockets bound (not yet listening) on every address of ``host`` (all interfaces for None)
    at ``port``; ``StartupError`` (one line, with what to do) when none can be bound or one is
    in use."""
    where = _shown(host or "*", port)
    if host is None:
        addresses: list[str | None] = [None]
    else:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except OSError as err:
            raise StartupError(f"cannot listen on {where}: {err} (check -l)") from None
        zone = host.partition("%")[2]
        addresses = list(dict.fromkeys(_numeric(info[4], zone) for info in infos))
    sockets: list[socket.socket] = []
    for address in addresses:
        try:
            sockets += bind_socket(address, port, listening=False)
        except OSError as err:
            if err.errno in _UNBINDABLE and len(addresses) > 1:
                log.warning("Not listening on %s port %d: %s", address, port, err.strerror)
                continue
            for sock in sockets:
                sock.close()
            raise StartupError(
                f"cannot listen on {where}: {err.strerror or err} ({_what_to_do(err)})"
            ) from None
    if not sockets:
        raise StartupError(f"cannot listen on {where}: none of its addresses can be bound")
    return sockets


async def serve(
    runner: web.AppRunner,
    sockets: list[socket.socket],
    *,
    guard: ConnectionGuard | None = None,
    ssl_context: ssl.SSLContext | None = None,
    plain_loopback: bool = False,
    fast: FastGets | None = None,
) -> list[tuple[str, int]]:
    """Serve ``runner`` on ``sockets`` (``bind``'s), over TLS when ``ssl_context`` is given
    (and, with ``plain_loopback``, plain HTTP too for connections to a loopback address);
    ``guard`` sees (and limits) the connections of all of them together, and answers
    ``fast``'s GETs itself (``agent.edge.fast_gets``). TLS needs a
    ``guard``: its sites accept through ``agent.edge.tls_or_plain``, which hands each
    connection the newest context (reloads reach new connections, and end the resumption of
    older sessions). Returns the (host, port) of every socket served (a link-local host with
    its zone: ``fe80::1%2``)."""
    if ssl_context is not None and guard is None:
        raise ValueError("listen: TLS is served through a ConnectionGuard's sites (give guard)")
    for sock in sockets:
        try:
            sock.listen(BACKLOG)  # another agent that bound the port too may have listened first
        except OSError as err:
            host, port = sock.getsockname()[:2]
            raise StartupError(
                f"cannot listen on {_shown(host, port)}: {err.strerror or err} ({_what_to_do(err)})"
            ) from None
        sock.setblocking(False)
        site: web.BaseSite
        if guard is None:
            site = web.SockSite(runner, sock)
        else:
            site = GuardedSite(
                runner,
                guard,
                sock=sock,
                ssl_context=ssl_context,
                plain_loopback=plain_loopback,
                fast=fast,
            )
        await site.start()
    return [(_numeric(sock.getsockname(), ""), int(sock.getsockname()[1])) for sock in sockets]


async def listen(
    runner: web.AppRunner,
    host: str | None,
    port: int,
    *,
    guard: ConnectionGuard | None = None,
    ssl_context: ssl.SSLContext | None = None,
    plain_loopback: bool = False,
) -> list[tuple[str, int]]:
    """``bind`` then ``serve``, in one call (the sockets are closed if serving fails)."""
    if ssl_context is not None and guard is None:
        raise ValueError("listen: TLS is served through a ConnectionGuard's sites (give guard)")
    sockets = await bind(host, port)
    try:
        return await serve(
            runner, sockets, guard=guard, ssl_context=ssl_context, plain_loopback=plain_loopback
        )
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
