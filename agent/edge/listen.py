"""Binding the REST API's TCP address: every address a listen name resolves to."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl

from aiohttp import web

from agent.edge.connections import ConnectionGuard, GuardedSite
from agent.errors import StartupError

log = logging.getLogger("nvidia-docker-plugin")

# A name such as localhost can resolve to an address this node cannot bind (::1 where IPv6
# is disabled): such addresses are skipped as long as one of the name's addresses works.
_UNBINDABLE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


async def listen(
    runner: web.AppRunner,
    host: str | None,
    port: int,
    *,
    guard: ConnectionGuard | None = None,
    ssl_context: ssl.SSLContext | None = None,
    plain_loopback: bool = False,
) -> list[tuple[str, int]]:
    """Serve ``runner`` on every address of ``host`` (all interfaces for None), over TLS when
    ``ssl_context`` is given (and, with ``plain_loopback``, plain HTTP too for connections to
    a loopback address); ``guard`` sees (and limits) the connections of all of them
    together. TLS needs a ``guard``: its sites accept through ``agent.edge.tls_or_plain``, which
    hands each connection the newest context (reloads reach new connections, and end the
    resumption of older sessions). Returns the (host, port) of every socket bound."""
    if ssl_context is not None and guard is None:
        raise ValueError("listen: TLS is served through a ConnectionGuard's sites (give guard)")
    where = f"{host or '*'}:{port}"
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
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    started = 0
    bound: list[tuple[str, int]] = []
    for address in addresses:
        site: web.BaseSite
        if guard is None:
            site = web.TCPSite(runner, address, port, reuse_address=True)
        else:
            site = GuardedSite(
                runner,
                guard,
                host=address,
                port=port,
                reuse_address=True,
                ssl_context=ssl_context,
                plain_loopback=plain_loopback,
            )
        try:
            await site.start()
        except OSError as err:
            if err.errno in _UNBINDABLE and len(addresses) > 1:
                log.warning("Not listening on %s port %d: %s", address, port, err.strerror)
                continue
            raise StartupError(
                f"cannot listen on {where}: {err.strerror or err} (is another agent running? "
                "choose another address with -l)"
            ) from None
        if isinstance(site, GuardedSite):
            bound += site.bound
        started += 1
    if not started:
        raise StartupError(f"cannot listen on {where}: none of its addresses can be bound")
    return bound or [tuple(address[:2]) for address in runner.addresses]
