"""The connection guard on a real loopback server: timeouts, the bound and who is dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from agent.edge.connections import ConnectionGuard, ConnectionLimits, GuardedSite
from agent.edge.error_log import HttpErrorLog
from tests.support.services import free_port

Serve = Callable[[ConnectionLimits], Awaitable[tuple[ConnectionGuard, int]]]
REQUEST = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"
SLOW_REQUEST = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
HALF = b"GET /ok HTTP/1.1\r\nHost: x\r\n"
GUARD_LOG = "nvidia-docker-plugin.connections"


async def _ok(_request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _slow(_request: web.Request) -> web.Response:
    await asyncio.sleep(0.6)
    return web.Response(text="slow\n")


def timeouts(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Why the guard closed connections for their time, as its debug lines say (``idle``,
    ``request header not complete``); the test sets ``GUARD_LOG`` to DEBUG."""
    return [
        r.getMessage().rsplit(": ", 1)[1]
        for r in caplog.records
        if r.name == GUARD_LOG and ": closing a connection from " in r.getMessage()
    ]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(limits: ConnectionLimits) -> tuple[ConnectionGuard, int]:
        guard = ConnectionGuard("test server", limits)
        app = web.Application(middlewares=[guard.middleware])
        app.router.add_get("/ok", _ok)
        app.router.add_get("/slow", _slow)
        runner = web.AppRunner(app, logger=HttpErrorLog("test server"), handle_signals=False)
        await runner.setup()
        runners.append(runner)
        port = free_port()
        await GuardedSite(runner, guard, host="127.0.0.1", port=port).start()
        return guard, port

    yield start
    for runner in runners:
        await runner.cleanup()


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def ask(self, request: bytes = REQUEST) -> bytes:
        self.writer.write(request)
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        return head + await self.reader.readexactly(length)

    async def closed(self, timeout_s: float = 5.0) -> bool:
        """Whether the server has closed the connection (end of file within the timeout)."""
        try:
            return await asyncio.wait_for(self.reader.read(), timeout_s) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.writer.close()


_OPEN: list[Client] = []


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _OPEN:
        client = _OPEN.pop()
        client.close()
        with contextlib.suppress(OSError):
            await client.writer.wait_closed()


async def connect(port: int, first: bytes = b"") -> Client:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if first:
        writer.write(first)
        await writer.drain()
    client = Client(reader, writer)
    _OPEN.append(client)
    return client


async def settle(guard: ConnectionGuard, count: int) -> None:
    """Until the server has seen ``count`` connections (accepts are asynchronous)."""
    for _ in range(500):
        if guard.count == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{guard.count} connections, expected {count}")


async def test_at_the_bound_the_connection_longest_without_a_request_is_dropped(
    serve: Serve,
) -> None:
    guard, port = await serve(ConnectionLimits(60, 60, max_connections=3))
    a = await connect(port, HALF)
    b = await connect(port, HALF)
    c = await connect(port)
    assert (await c.ask()).endswith(b"ok\n")
    await settle(guard, 3)
    a.writer.write(b"\r\n")  # a completes its request: now b has gone longest without one
    assert (await a.ask(b"")).endswith(b"ok\n")
    d = await connect(port)
    assert (await d.ask()).endswith(b"ok\n")
    assert await b.closed()
    assert not await a.closed(0.2)
    assert not await c.closed(0.2)
    assert guard.count == 3
    assert guard.dropped == 1


async def test_a_flood_of_stalled_connections_never_keeps_a_client_out(serve: Serve) -> None:
    guard, port = await serve(ConnectionLimits(60, 60, max_connections=20))
    for _ in range(100):
        await connect(port, HALF)
    good = await connect(port)
    assert (await good.ask()).endswith(b"ok\n")
    assert guard.count <= 20
    assert guard.dropped >= 80


async def test_a_half_sent_or_silent_connection_is_closed_after_the_header_timeout(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, GUARD_LOG)
    guard, port = await serve(ConnectionLimits(header_timeout_s=0.3, idle_timeout_s=60))
    started = asyncio.get_running_loop().time()
    half, silent = await connect(port, HALF), await connect(port)
    assert await half.closed()
    assert await silent.closed()
    assert asyncio.get_running_loop().time() - started < 2.0
    assert timeouts(caplog) == ["request header not complete"] * 2
    await settle(guard, 0)


async def test_the_header_timeout_counts_from_the_first_byte_of_the_next_request(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """A pause between requests is the idle timeout's business, not the header's."""
    caplog.set_level(logging.DEBUG, GUARD_LOG)
    _guard, port = await serve(ConnectionLimits(header_timeout_s=0.3, idle_timeout_s=60))
    client = await connect(port)
    for _ in range(2):
        assert (await client.ask()).endswith(b"ok\n")
        await asyncio.sleep(0.5)  # longer than the header timeout: what is tested
    client.writer.write(HALF)
    assert await client.closed(2.0)
    assert timeouts(caplog) == ["request header not complete"]


async def test_a_request_being_handled_is_never_timed_out(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, GUARD_LOG)
    _guard, port = await serve(ConnectionLimits(header_timeout_s=0.2, idle_timeout_s=0.2))
    client = await connect(port)
    assert (await client.ask(SLOW_REQUEST)).endswith(b"slow\n")
    assert timeouts(caplog) == []
    assert await client.closed(2.0)  # then idle
    assert timeouts(caplog) == ["idle"]


async def test_an_idle_kept_alive_connection_is_closed_after_the_idle_timeout(
    serve: Serve,
) -> None:
    _guard, port = await serve(ConnectionLimits(header_timeout_s=5, idle_timeout_s=0.4))
    client = await connect(port)
    assert (await client.ask()).endswith(b"ok\n")
    loop = asyncio.get_running_loop()
    answered = loop.time()
    assert await client.closed()
    assert 0.3 < loop.time() - answered < 2.0


async def test_without_a_bound_nothing_is_dropped(serve: Serve) -> None:
    guard, port = await serve(ConnectionLimits(60, 60))
    clients = [await connect(port, HALF) for _ in range(50)]
    await settle(guard, 50)
    assert guard.dropped == 0
    for client in clients:
        client.close()
    await settle(guard, 0)
