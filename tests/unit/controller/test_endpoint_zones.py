"""An IPv6 address with its zone (``[fe80::1%eth0]``, ``[fe80::1%25eth0]``) through each of
the three HTTP clients, against servers on ::1: the zone reaches the socket, never the
``Host`` header nor the name checked in the agent's certificate.

``::1%1`` stands in for a link-local address and its zone: glibc takes a numeric zone for
any address, an interface name only for a link-local one. ``tests/e2e/test_link_local.py``
asks a real agent on this machine's link-local address, by interface name, over SSH too.
"""

from __future__ import annotations

import asyncio
import gc
import json
import ssl
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from aiohttp import web

from controller.transport.client import BlockingAgentClient
from controller.transport.endpoint import Endpoint, parse_endpoint
from controller.transport.fleet_http import AgentConnection
from controller.transport.plain_http import PlainAgentClient
from controller.transport.tls import TlsOptions
from tests.support.certs import Pki, make_pki
from tests.support.services import free_port

# the zone 1 (the loopback's interface index) as users write it, and as RFC 6874 writes it
ZONES = ["%1", "%251"]
Serve = Callable[[ssl.SSLContext | None], Awaitable[int]]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("zones"), server_names="IP:::1")


@pytest.fixture(autouse=True)
def _collect_closing_transports() -> Iterator[None]:
    """After each test (its loop and the clients' closed): collect the transports that the
    clients' loops closed before they finished closing (aiohttp before 3.12 does not wait for
    them), here, rather than in whichever test the garbage collector next runs in."""
    yield
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


async def _host(request: web.Request) -> web.Response:
    return web.json_response({"Host": request.headers.get("Host")})


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start a server on [::1] answering ``/host`` with the Host header it got."""
    runners: list[web.AppRunner] = []

    async def start(context: ssl.SSLContext | None) -> int:
        app = web.Application()
        app.router.add_get("/host", _host)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        port = free_port("::1")
        await web.TCPSite(runner, "::1", port, ssl_context=context).start()
        return port

    yield start
    for runner in runners:
        await runner.cleanup()


def _server_context(pki: Pki) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.pem("server"), pki.key("server"))
    return context


def _plain(endpoint: Endpoint) -> object:
    with PlainAgentClient(endpoint, timeout_s=5) as agent:
        return agent.get_json("/host")


def _aiohttp(endpoint: Endpoint, tls: TlsOptions | None = None) -> object:
    with BlockingAgentClient(endpoint, timeout_s=5, tls=tls) as agent:
        return agent.get_json("/host")


async def _fleet(endpoint: Endpoint, tls: TlsOptions | None = None) -> object:
    connection = await AgentConnection.open(endpoint, "node", tls=tls or TlsOptions())
    try:
        (answer,) = await connection.get_all([("/host", None)])
    finally:
        connection.close()
        await asyncio.sleep(0)  # the transport's close completes before the test's loop ends
    assert answer.status == 200
    return json.loads(answer.body)


@pytest.mark.parametrize("zone", ZONES)
async def test_plain_http_with_a_zone(serve: Serve, zone: str) -> None:
    port = await serve(None)
    endpoint = parse_endpoint(f"http://[::1{zone}]:{port}/")
    assert endpoint.host == "::1%1"
    expected = {"Host": f"[::1]:{port}"}
    assert await asyncio.to_thread(_plain, endpoint) == expected
    assert await asyncio.to_thread(_aiohttp, endpoint) == expected
    assert await _fleet(endpoint) == expected


@pytest.mark.parametrize("zone", ZONES)
async def test_https_with_a_zone_checks_the_address(serve: Serve, pki: Pki, zone: str) -> None:
    """The certificate names ::1; the zone is this machine's business, not the agent's."""
    port = await serve(_server_context(pki))
    endpoint = parse_endpoint(f"https://[::1{zone}]:{port}")
    tls = TlsOptions(ca=str(pki.pem("ca")))
    expected = {"Host": f"[::1]:{port}"}
    assert await asyncio.to_thread(_aiohttp, endpoint, tls) == expected
    assert await _fleet(endpoint, tls) == expected


async def test_https_on_ipv6_loopback_without_a_zone(serve: Serve, pki: Pki) -> None:
    port = await serve(_server_context(pki))
    endpoint = parse_endpoint(f"https://[::1]:{port}")
    tls = TlsOptions(ca=str(pki.pem("ca")))
    assert await asyncio.to_thread(_aiohttp, endpoint, tls) == {"Host": f"[::1]:{port}"}
    assert await _fleet(endpoint, tls) == {"Host": f"[::1]:{port}"}
