"""Before the agent says it is ready: do its plugin socket and its REST API answer?

``docker.service`` starts once the agent is ready (``agent.process``), and restarts
containers that name the driver volume: the plugin must answer by then. So the agent asks
itself, as its clients will: ``POST /Plugin.Activate`` on the unix socket, and
``GET /gpu/info/json`` on the first address the REST API listens on (over TLS: that it
accepts connections). Each must answer within ``timeout_s``; otherwise ``NotAnswering`` says
which one and how it failed.
"""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path

PLUGIN_REQUEST = (
    b"POST /Plugin.Activate HTTP/1.1\r\nHost: plugin\r\n"
    b"Accept: application/vnd.docker.plugins.v1.2+json\r\n"
    b"Content-Length: 0\r\nConnection: close\r\n\r\n"
)


class NotAnswering(Exception):
    """A server of the agent does not answer itself; the message says which and how."""


async def _status(
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes
) -> int:
    reader, writer = connection
    try:
        writer.write(request)
        line = await reader.readline()
    finally:
        writer.close()
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else 0


async def check_plugin(socket_path: Path, timeout_s: float = 5.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            code = await _status(
                await asyncio.open_unix_connection(str(socket_path)), PLUGIN_REQUEST
            )
    except (OSError, TimeoutError) as err:
        raise NotAnswering(f"the plugin socket {socket_path} does not answer ({err})") from None
    if code != 200:
        raise NotAnswering(f"the plugin socket {socket_path} answered {code} to Plugin.Activate")


async def check_rest(
    address: tuple[str, int],
    *,
    tls: bool = False,
    token: bool = False,
    mark: str = "",
    timeout_s: float = 5.0,
) -> None:
    """The REST API answers on ``address``. Plain HTTP: ``GET /gpu/info/json`` answers 200
        (401 when every request needs a token: the API answered, it only wants the token). Over
        TLS the agent has no client certificate of its own to show a mutual-TLS listener, so the
        check is that the port accepts connections (the same server then speaks TLS). ``mark`` goes
    in the ``X-Readiness-Check`` header, so that the token check does not log its own refusal
    of this request."""
    host, port = address
    if ipaddress.ip_address(host).is_unspecified:  # bound to every interface
        host = "::1" if ":" in host else "127.0.0.1"
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    named = f"[{host.partition('%')[0]}]:{port}" if ":" in host else shown  # no zone in Host
    request = (
        f"GET /gpu/info/json HTTP/1.1\r\nHost: {named}\r\nX-Readiness-Check: {mark}\r\n"
        "Connection: close\r\n\r\n"
    )
    try:
        async with asyncio.timeout(timeout_s):
            connection = await asyncio.open_connection(host, port)
            if tls:
                connection[1].close()
                return
            code = await _status(connection, request.encode())
    except (OSError, TimeoutError) as err:
        raise NotAnswering(f"the REST API on {shown} does not answer ({err})") from None
    if code != 200 and not (token and code == 401):
        raise NotAnswering(f"the REST API on {shown} answered {code} to GET /gpu/info/json")
