"""The private parts of aiohttp that the SSH transport relies on, checked on the installed aiohttp.

``controller/transport/client.py``'s ``_TunnelConnector`` (every ``NV_HOST=ssh://`` command)
overrides ``aiohttp.BaseConnector._create_connection(req, traces, timeout)`` and builds its protocol
with the connector's ``self._factory`` on ``self._loop``. None of these is public API: an
aiohttp release may change them without notice. These tests run with the newest aiohttp and
with the declared floor (scripts/test-all's min-version run), and fail naming what changed,
so that such a release stops the test command rather than users' SSH nodes.
"""

from __future__ import annotations

import inspect
import socket
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.client_proto import ResponseHandler

from controller.transport.client import _TunnelConnector
from tests.support.services import serve_on_loopback

WHERE = f"aiohttp {aiohttp.__version__}: controller/transport/client.py's _TunnelConnector"


def test_base_connector_still_has_the_create_connection_hook_we_override() -> None:
    hook = getattr(aiohttp.BaseConnector, "_create_connection", None)
    assert hook is not None, f"{WHERE} overrides BaseConnector._create_connection, now gone"
    assert inspect.iscoroutinefunction(hook), f"{WHERE}: _create_connection is no coroutine"
    parameters = list(inspect.signature(hook).parameters)
    assert parameters == ["self", "req", "traces", "timeout"], (
        f"{WHERE} overrides _create_connection(self, req, traces, timeout); "
        f"aiohttp's now takes ({', '.join(parameters)})"
    )
    ours = list(inspect.signature(_TunnelConnector._create_connection).parameters)
    assert ours == parameters


async def test_base_connector_still_builds_protocols_with_factory_on_loop() -> None:
    connector = aiohttp.BaseConnector()
    try:
        factory = getattr(connector, "_factory", None)
        assert callable(factory), f"{WHERE} uses BaseConnector._factory, now gone"
        assert isinstance(factory(), ResponseHandler), (
            f"{WHERE}: BaseConnector._factory() no longer makes a ResponseHandler"
        )
        assert getattr(connector, "_loop", None) is not None, (
            f"{WHERE} uses BaseConnector._loop, now gone"
        )
    finally:
        await connector.close()


class _LoopbackTunnel:
    """Stands in for ``controller.transport.ssh_tunnel.SshTunnel``: its one method the connector
    calls gives a plain loopback socket instead of an SSH channel (tests/e2e/test_ssh_transport.py
    runs the real thing through sshd; this runs at the aiohttp floor too)."""

    async def open_socket(self, port: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.setblocking(False)
        return sock


async def test_a_request_goes_through_the_sockets_the_tunnel_gives() -> None:
    async def info(_: web.Request) -> web.Response:
        return web.json_response({"Version": {"Driver": "580.159.04"}})

    app = web.Application()
    app.router.add_get("/gpu/info/json", info)
    async with serve_on_loopback(app) as port:
        tunnel: Any = _LoopbackTunnel()
        connector = _TunnelConnector(tunnel, port)
        async with aiohttp.ClientSession(connector=connector) as session:
            # the host name is never resolved: the tunnel decides where the bytes go
            for _ in range(2):  # the second request reuses the kept-alive connection
                async with session.get("http://node.invalid/gpu/info/json") as resp:
                    assert resp.status == 200
                    assert await resp.json() == {"Version": {"Driver": "580.159.04"}}
