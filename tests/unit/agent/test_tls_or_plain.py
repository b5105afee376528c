"""One port for TLS and, to a loopback address, plain HTTP: real sockets, real certificates
(``openssl``), the real aiohttp server behind it."""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.edge.connections import ConnectionGuard, ConnectionLimits, GuardedSite
from agent.edge.loopback import is_loopback
from agent.edge.tls import ServerTls, TlsFiles
from agent.edge.tls_or_plain import TlsOrPlainServer, bind
from agent.edge.tokens import TokenStore, require_token
from tests.support.certs import Pki, make_pki

TOKEN = "k" * 24
REQUEST = b"GET /gpu/info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
Served = tuple[TlsOrPlainServer, int]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _client_tls(pki: Pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki.pem("ca")))


async def _info(_request: web.Request) -> web.Response:
    return web.Response(text="the node's GPUs")


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for something the event loop does in its own time."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture
async def serve(pki: Pki) -> AsyncIterator[Callable[..., Awaitable[Served]]]:
    """A TlsOrPlainServer on 127.0.0.1 in front of a real aiohttp app."""
    runners: list[web.AppRunner] = []
    servers: list[TlsOrPlainServer] = []

    async def start(
        *,
        plain_allowed: Callable[[str], bool] = is_loopback,
        timeout_s: float = 10.0,
        max_pending: int = 1024,
    ) -> Served:
        app = web.Application()
        app.router.add_get("/gpu/info", _info)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        runners.append(runner)
        assert runner.server is not None
        tls = ServerTls(TlsFiles(pki.pem("server"), pki.key("server")))
        server = TlsOrPlainServer(
            runner.server,
            bind("127.0.0.1", 0),
            tls.listening,
            first_byte_timeout_s=timeout_s,
            max_pending=max_pending,
            plain_allowed=plain_allowed,
        )
        server.start()
        servers.append(server)
        return server, server.sockets[0].getsockname()[1]

    yield start
    for server in servers:
        server.close()
    for runner in runners:
        await runner.cleanup()


async def _get(url: str, tls: ssl.SSLContext | None = None, **headers: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, ssl=tls if tls is not None else False, headers=headers) as response,
    ):
        return response.status, await response.text()


async def _raw(port: int, data: bytes) -> bytes:
    """Send bytes, read until the server closes (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()


async def test_one_port_answers_tls_and_plain_http_to_loopback(
    pki: Pki, serve: Callable[..., Awaitable[Served]]
) -> None:
    _server, port = await serve()
    assert await _get(f"http://127.0.0.1:{port}/gpu/info") == (200, "the node's GPUs")
    assert await _get(f"https://127.0.0.1:{port}/gpu/info", _client_tls(pki)) == (
        200,
        "the node's GPUs",
    )
    assert await _get(f"http://localhost:{port}/gpu/info") == (200, "the node's GPUs")


async def test_connections_to_other_addresses_must_speak_tls(
    pki: Pki, serve: Callable[..., Awaitable[Served]]
) -> None:
    """127.0.0.1 taken for a network address: the handshake starts at once, plain HTTP gets
    no answer at all."""
    _server, port = await serve(plain_allowed=lambda _address: False)
    assert await _raw(port, REQUEST) == b""
    assert await _get(f"https://127.0.0.1:{port}/gpu/info", _client_tls(pki)) == (
        200,
        "the node's GPUs",
    )


async def test_a_loopback_connection_that_sends_nothing_is_closed(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    server, port = await serve(timeout_s=0.2)
    assert await _raw(port, b"") == b""  # closed by the server, not by the client
    assert server.waiting == 0
    # and one that closes before its first byte is forgotten at once
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await _until(lambda: server.waiting == 1, "the connection waits for its first byte")
    writer.close()
    await _until(lambda: server.waiting == 0, "the closed connection is forgotten")


async def test_connections_before_their_first_byte_are_bounded(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    server, port = await serve(max_pending=3)
    streams = []
    for count in range(1, 5):
        streams.append(await asyncio.open_connection("127.0.0.1", port))
        await _until(lambda n=count: server.waiting == min(n, 3), f"{count} waiting")  # type: ignore[misc]
    first_reader, first_writer = streams[0]
    assert await asyncio.wait_for(first_reader.read(), 10) == b""  # the oldest was closed
    first_writer.close()
    assert (server.waiting, server.dropped) == (3, 1)
    server.close()  # closes those still waiting
    for reader, writer in streams[1:]:
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    assert server.waiting == 0


@pytest.mark.parametrize("plain_loopback", [True, False])
async def test_connections_stalled_in_their_handshake_are_bounded(
    pki: Pki, serve: Callable[..., Awaitable[Served]], plain_loopback: bool
) -> None:
    """A TLS record header and nothing more, from loopback or from "the network": the oldest
    are closed beyond the bound, and a client that completes its handshake is served."""
    allowed = is_loopback if plain_loopback else (lambda _address: False)
    server, port = await serve(max_pending=4, plain_allowed=allowed)
    stalled = []
    for count in range(1, 7):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x16\x03\x01")  # the start of a ClientHello record
        stalled.append((reader, writer))
        await _until(lambda n=count: server.pending == min(n, 4), f"{count} pending")  # type: ignore[misc]
    for reader, _writer in stalled[:2]:  # the two oldest were closed
        assert await asyncio.wait_for(reader.read(), 10) == b""
    assert (server.pending, server.dropped) == (4, 2)
    assert await _get(f"https://127.0.0.1:{port}/gpu/info", _client_tls(pki)) == (
        200,
        "the node's GPUs",
    )
    for _reader, writer in stalled:
        writer.close()


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_failed_handshakes_give_their_descriptors_back(
    serve: Callable[..., Awaitable[Served]],
) -> None:
    _server, port = await serve()
    _network, network_port = await serve(plain_allowed=lambda _address: False)
    before = _descriptors()
    garbage = b"\x16\x03\x01\x00\x05hello, not a ClientHello"
    for _ in range(20):
        assert await _raw(port, garbage) == b""  # looks like TLS, fails the handshake
        assert await _raw(network_port, REQUEST) == b""  # plain HTTP where TLS is needed
    await _until(lambda: _descriptors() <= before, "every descriptor is given back")


async def test_plain_loopback_needs_no_token_but_tls_does(pki: Pki, tmp_path: Path) -> None:
    """The token check of the daemon, behind GuardedSite as the daemon serves it."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    store = TokenStore(tokens)
    tls = ServerTls(TlsFiles(pki.pem("server"), pki.key("server")))
    for plain_loopback in (True, False):
        guard = ConnectionGuard("REST API", ConnectionLimits(10.0, 60.0, 64))
        app = web.Application()
        checked = require_token(store, plain_loopback=plain_loopback)(_info)
        app.router.add_get("/gpu/info", guard.wrap(checked))
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        site = GuardedSite(
            runner,
            guard,
            host="127.0.0.1",
            port=0,
            ssl_context=tls.listening,
            plain_loopback=plain_loopback,
        )
        try:
            await site.start()
            port = site.bound[0][1]
            plain = f"http://127.0.0.1:{port}/gpu/info"
            secure = f"https://127.0.0.1:{port}/gpu/info"
            if plain_loopback:
                assert await _get(plain) == (200, "the node's GPUs")  # no token needed
            else:  # a TLS-only port: plain HTTP gets no answer
                with pytest.raises(aiohttp.ClientError):
                    await _get(plain)
            status, _ = await _get(secure, _client_tls(pki))
            assert status == 401  # TLS from loopback still needs the token
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert await _get(secure, _client_tls(pki), **auth) == (200, "the node's GPUs")
        finally:
            await runner.cleanup()


def test_uvloop_serves_both_and_gives_descriptors_back(pki: Pki) -> None:
    """The same on uvloop (the agent's loop with '.[fast]'): its connect_accepted_socket and
    add_reader on sockets it does not own, and its handling of failed handshakes."""
    uvloop = pytest.importorskip("uvloop")  # a test dependency: installed wherever tests run

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/gpu/info", _info)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        assert runner.server is not None
        tls = ServerTls(TlsFiles(pki.pem("server"), pki.key("server"))).listening
        servers = [
            TlsOrPlainServer(runner.server, bind("127.0.0.1", 0), tls, first_byte_timeout_s=0.2),
            TlsOrPlainServer(
                runner.server,
                bind("127.0.0.1", 0),
                tls,
                first_byte_timeout_s=0.2,
                plain_allowed=lambda _address: False,
            ),
        ]
        for server in servers:
            server.start()
        loopback, network = (server.sockets[0].getsockname()[1] for server in servers)
        try:
            assert await _get(f"http://127.0.0.1:{loopback}/gpu/info") == (200, "the node's GPUs")
            for port in (loopback, network):
                url = f"https://127.0.0.1:{port}/gpu/info"
                assert await _get(url, _client_tls(pki)) == (200, "the node's GPUs")
            before = _descriptors()
            for _ in range(10):
                assert await _raw(loopback, b"\x16\x03\x01\x00\x05not a hello") == b""
                assert await _raw(network, REQUEST) == b""
                assert await _raw(loopback, b"") == b""  # silent: closed after 0.2 s
            await _until(lambda: _descriptors() <= before, "every descriptor is given back")
        finally:
            for server in servers:
                server.close()
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())
