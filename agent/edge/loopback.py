"""Loopback addresses, and whether a connection is a plain one to a loopback address.

With TLS or tokens on, the REST API still lets connections made on the node itself to a
loopback address (``curl localhost:3476`` in a launch script, the Mesos helper, an SSH
tunnel's end) speak plain HTTP without a token, unless ``--no-plain-loopback``
(docs/remote-access.md). What counts is the connection's *local* address: a connection to
127.0.0.1 or ::1 can only have been made on this node, whereas one to the node's network
address may have come from anywhere.
"""

from __future__ import annotations

import asyncio
import ipaddress


def is_loopback(address: str | None) -> bool:
    """Whether an address is loopback (127.0.0.0/8, ::1, or 127.x mapped into IPv6);
    None (every interface) and names are not."""
    if address is None:
        return False
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def is_plain_loopback(transport: asyncio.BaseTransport | None) -> bool:
    """Whether a connection is plain (no TLS) and to one of this node's loopback addresses."""
    if transport is None or transport.get_extra_info("ssl_object") is not None:
        return False
    local = transport.get_extra_info("sockname")
    return isinstance(local, tuple) and bool(local) and is_loopback(str(local[0]))
