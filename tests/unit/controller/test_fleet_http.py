"""The fleet's lean HTTP/1.1 client against real sockets: aiohttp servers and raw byte servers."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl
import struct
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import uvloop
from aiohttp import web

from controller.errors import Failure, NodeError
from controller.fleet.query import FleetNode, Query, Request, ask_node, base_transports
from controller.transport.agent_errors import AgentHttpError, TokenRefusedError, os_reason
from controller.transport.endpoint import parse_endpoint
from controller.transport.fleet_http import AgentConnection, Answer, answer_error
from controller.transport.tls import NO_TLS_OPTIONS, TlsOptions
from tests.support.services import free_port, serve_on_loopback


async def get(
    connection: AgentConnection,
    path: str,
    params: dict[str, str] | None = None,
    *,
    last: bool = False,
) -> Answer:
    """One ``GET`` on ``connection`` through ``get_all``, the call fleet queries make."""
    (answer,) = await connection.get_all([(path, params)], last=last)
    return answer


INFO = b'{"Version": {"Driver": "580.159.04"}, "Devices": []}'
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _connect(port: int, tls: TlsOptions = NO_TLS_OPTIONS) -> AgentConnection:
    endpoint = parse_endpoint(f"http://127.0.0.1:{port}")
    return await AgentConnection.open(endpoint, f"http://127.0.0.1:{port}", tls=tls)


SEEN: list[str] = []  # the Authorization headers the stand-in agent saw


@pytest.fixture
async def agent_port() -> AsyncIterator[int]:
    seen = SEEN
    seen.clear()

    async def info(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", "-"))
        return web.Response(body=INFO, content_type="application/json")

    async def cli(request: web.Request) -> web.Response:
        if request.query.get("dev") == "9":
            return web.Response(
                status=400,
                text="invalid device: 9\n",
                headers={"X-Invalid-Parameter": "dev", "X-Invalid-Value": "9"},
            )
        return web.Response(text=f"raw={request.raw_path}\n")

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for part in (b'{"Devices": ', b"[1, 2", b"]}"):
            await response.write(part)
        await response.write_eof()
        return response

    async def secret(request: web.Request) -> web.Response:
        return web.Response(status=401, text="token refused: it is not one of this agent's\n")

    app = web.Application()
    app.router.add_get("/gpu/info/json", info)
    app.router.add_get("/docker/cli", cli)
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/secret", secret)
    async with serve_on_loopback(app) as port:
        yield port


async def test_requests_follow_one_another_on_one_connection(agent_port: int) -> None:
    connection = await _connect(agent_port)
    try:
        first = await get(connection, "/gpu/info/json")
        second = await get(connection, "/docker/cli", {"dev": "0 GPU-1a", "vol": "nvidia_driver"})
        third = await get(connection, "/chunked", last=True)
    finally:
        connection.close()
    assert (first.status, first.body) == (200, INFO)
    assert first.headers["content-type"].startswith("application/json")
    # space separated lists travel as '+', as aiohttp's client sends them
    assert second.body == b"raw=/docker/cli?dev=0+GPU-1a&vol=nvidia_driver\n"
    assert (third.status, third.body) == (200, b'{"Devices": [1, 2]}')
    with pytest.raises(NodeError, match="the agent closed the connection"):
        await get(connection, "/gpu/info/json")


async def test_non_200_answers_become_the_agents_errors(agent_port: int) -> None:
    connection = await _connect(agent_port)
    try:
        refused = await get(connection, "/docker/cli", {"dev": "9"})
        secret = await get(connection, "/secret")
    finally:
        connection.close()
    error = answer_error("n", "/docker/cli", refused, NO_TLS_OPTIONS)
    assert isinstance(error, AgentHttpError)
    assert (error.status, error.invalid_parameter, error.invalid_value) == (400, "dev", "9")
    assert error.label == "HTTP 400"
    token = answer_error("n", "/secret", secret, TlsOptions(token_file="/etc/t"))
    assert isinstance(token, TokenRefusedError)
    assert token.failure is Failure.TOKEN_REFUSED
    assert token.label == "token refused"
    assert "the agent refused the token of /etc/t (401" in str(token)


async def test_the_token_is_sent(agent_port: int, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("# mine\nsecret-token-0123456789\n")
    connection = await _connect(agent_port, TlsOptions(token_file=str(token)))
    try:
        assert (await get(connection, "/gpu/info/json", last=True)).status == 200
    finally:
        connection.close()
    assert SEEN == ["Bearer secret-token-0123456789"]


async def test_refused_and_unknown_host() -> None:
    port = free_port()
    with pytest.raises(NodeError) as info:
        await _connect(port)
    assert info.value.failure is Failure.REFUSED
    assert str(info.value) == (
        f"http://127.0.0.1:{port}: cannot connect to the agent at http://127.0.0.1:{port} "
        "(connection refused): is nvidia-docker-plugin running there, listening on that "
        "address (-l HOST:PORT)?"
    )
    endpoint = parse_endpoint("http://gpu.invalid:3476")
    with pytest.raises(NodeError) as info:
        await AgentConnection.open(endpoint, "gpu.invalid", tls=NO_TLS_OPTIONS)
    assert info.value.failure is Failure.UNKNOWN_HOST


async def _raw_server(answer: bytes) -> tuple[asyncio.AbstractServer, int]:
    """A server that reads a request and writes ``answer`` bytes, then closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port: int = server.sockets[0].getsockname()[1]
    return server, port


@pytest.mark.parametrize(
    ("answer", "status", "body"),
    [
        (b"HTTP/1.0 200 OK\r\n\r\nuntil the end", 200, b"until the end"),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            200,
            b"ok",
        ),
        (b"HTTP/1.1 500 Oops\r\ncontent-length: 4\r\n\r\nboom", 500, b"boom"),
    ],
)
async def test_answers_as_http_frames_them(answer: bytes, status: int, body: bytes) -> None:
    server, port = await _raw_server(answer)
    try:
        connection = await _connect(port)
        got = await get(connection, "/x")
        connection.close()
    finally:
        server.close()
        await server.wait_closed()
        await server.wait_closed()
    assert (got.status, got.body) == (status, body)


@pytest.mark.parametrize(
    ("answer", "failure", "message"),
    [
        (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", Failure.NOT_AN_AGENT, "not HTTP from an agent"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", Failure.NOT_AN_AGENT, "Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            Failure.DISCONNECTED,
            "GET /gpu/info/json failed: the answer was cut off after 5 of 10 bytes",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n9\r\nde",
            Failure.DISCONNECTED,
            "GET /gpu/info/json failed: the answer was cut off after 3 bytes",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 104857600\r\n\r\n",
            Failure.NOT_AN_AGENT,
            "more than 16 MiB: Content-Length 104857600",
        ),
        (b"", Failure.DISCONNECTED, "Server disconnected"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20000, Failure.NOT_AN_AGENT, "64 KiB"),
    ],
)
async def test_what_is_not_an_answer(answer: bytes, failure: Failure, message: str) -> None:
    server, port = await _raw_server(answer)
    try:
        connection = await _connect(port)
        with pytest.raises(NodeError) as info:
            await get(connection, "/gpu/info/json")
        connection.close()
    finally:
        server.close()
        await server.wait_closed()
        await server.wait_closed()
    assert info.value.failure is failure
    assert message in str(info.value)
    if b"HTTP/1.1 200" in answer:  # headers came over plain HTTP: no TLS hint
        assert "https://?" not in str(info.value)


async def test_a_silent_server_is_the_callers_timeout() -> None:
    handled = asyncio.Event()

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()  # until the client gives up
        finally:
            writer.close()
            handled.set()

    server = await asyncio.start_server(never, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    wait: Callable[[], Awaitable[object]]
    try:
        connection = await _connect(port)
        wait = lambda: get(connection, "/gpu/info/json")  # noqa: E731
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await wait()
        connection.close()
        async with asyncio.timeout(10):  # the server's side ends too: nothing left pending
            await handled.wait()
    finally:
        server.close()
        await server.wait_closed()


async def test_pipelined_requests_answered_in_order(agent_port: int) -> None:
    connection = await _connect(agent_port)
    try:
        answers = await connection.get_all(
            [("/gpu/info/json", None), ("/docker/cli", {"dev": "1"}), ("/chunked", None)]
        )
    finally:
        connection.close()
    assert [a.body for a in answers] == [INFO, b"raw=/docker/cli?dev=1\n", b'{"Devices": [1, 2]}']


async def test_an_agent_that_closes_after_one_answer_gets_the_rest_again() -> None:
    """A server that answers one request per connection (Connection: close), ignoring what
    was pipelined after it: the other requests go again on new connections."""
    connections = 0

    async def one_per_connection(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal connections
        connections += 1
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            body = request.split(b" ", 2)[1]
            writer.write(
                b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(one_per_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        connection = await _connect(port)
        answers = await connection.get_all([("/a", None), ("/b", None), ("/c", None)])
        connection.close()
    finally:
        server.close()
        await server.wait_closed()
    assert [a.body for a in answers] == [b"/a", b"/b", b"/c"]
    assert connections == 3  # one per answer: each new connection carries what is left


def test_a_failed_connect_says_why_in_the_systems_words() -> None:
    """asyncio's connect raises ``Connect call failed (ADDRESS)``, uvloop's the error's name:
    the message says the reason (the address is already in it), whichever loop asked."""
    asyncio_style = OSError(errno.EHOSTUNREACH, "Connect call failed ('10.0.0.9', 3476)")
    assert os_reason(asyncio_style) == "No route to host"
    assert os_reason(OSError(errno.EHOSTUNREACH, "No route to host")) == "No route to host"
    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert os_reason(unknown) == "Name or service not known"  # not errno's table
    assert os_reason(OSError("no errno at all")) == "no errno at all"
    tls = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)")
    assert os_reason(tls) == tls.strerror  # OpenSSL's code 1, not EPERM


def _reset_on_accept() -> tuple[socket.socket, int]:
    """A listening socket whose connections are reset (RST) as soon as they are accepted."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = listener.accept()
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                connection.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener, int(listener.getsockname()[1])


def test_each_failure_reads_the_same_on_asyncio_and_uvloop() -> None:
    """A fleet's worker processes run uvloop where it is installed, the ctl's own process
    asyncio: a node's message must not depend on which one asked it."""
    listener, reset_port = _reset_on_accept()
    closed = free_port()

    async def failures() -> list[str]:
        said = []
        for url in (
            f"http://127.0.0.1:{closed}",
            f"https://127.0.0.1:{closed}",
            f"https://127.0.0.1:{reset_port}",  # reset at the connect or in the handshake
        ):
            try:
                connection = await AgentConnection.open(parse_endpoint(url), url, tls=TlsOptions())
                await get(connection, "/gpu/info/json", last=True)
            except NodeError as exc:
                said.append(f"{exc.failure.value}: {exc}")
        return said

    said = {}
    try:  # each loop made by a factory: asyncio.run would replace the thread's current loop
        for factory in (asyncio.SelectorEventLoop, uvloop.new_event_loop):
            with asyncio.Runner(loop_factory=factory) as runner:
                said[factory] = runner.run(failures())
    finally:
        listener.close()
    on_asyncio, on_uvloop = said.values()
    assert len(on_asyncio) == 3
    assert on_uvloop == on_asyncio
    assert "(Connection reset by peer)" in on_asyncio[2]


@pytest.mark.parametrize("has_route", [True, False], ids=["new agent", "older agent"])
async def test_a_route_an_older_agent_lacks_is_replaced_on_the_same_connection(
    has_route: bool,
) -> None:
    """``Request.instead``: an agent with the route answers it alone; one without it (404)
    is asked the replacement requests next, on the connection already open, the last of
    them closing it."""
    seen: list[tuple[str, int, str]] = []  # (path, the client's port, Connection header)

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        assert request.transport is not None  # every request, the 404 included
        client_port = request.transport.get_extra_info("peername")[1]  # one per connection
        seen.append((request.path, client_port, request.headers.get("Connection", "").lower()))
        return await handler(request)

    def answering(body: bytes) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            return web.Response(body=body, content_type="application/json")

        return handle

    app = web.Application(middlewares=[record])
    if has_route:
        app.router.add_get("/new", answering(b'{"Set": []}'))
    app.router.add_get("/a", answering(b'{"A": 1}'))
    app.router.add_get("/b", answering(b'{"B": 2}'))
    older = (Request("a", "/a"), Request("b", "/b"))
    query = Query("q", (Request("new", "/new", must_have="Set", instead=older),))
    async with serve_on_loopback(app) as port:
        node = FleetNode("n", parse_endpoint(f"http://127.0.0.1:{port}"))
        _, tls = base_transports([node], 5.0, None, None)
        result = await ask_node(node, query, 5.0, None, tls)
    assert result.ok, result.error
    if has_route:
        assert result.answers == {"new": {"Set": []}}
        assert [(path, header) for path, _, header in seen] == [("/new", "")]
    else:
        assert result.answers == {"a": {"A": 1}, "b": {"B": 2}}
        assert [(path, header) for path, _, header in seen] == [
            ("/new", ""), ("/a", ""), ("/b", "close")
        ]  # fmt: skip
    assert len({client_port for _, client_port, _ in seen}) == 1  # one connection


async def test_a_kept_connection_the_agent_ended_is_replaced_for_the_next_round() -> None:
    """The agent answers the route's 404 and then ends the connection without saying so
    (no ``Connection: close``): the replacement requests go on a new connection."""
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            if connections == 1:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            else:
                for _ in range(2):
                    request = await reader.readuntil(b"\r\n\r\n")
                    body = b'{"path": "%s"}' % request.split(b" ", 2)[1]
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                    )
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    older = (Request("a", "/a"), Request("b", "/b"))
    query = Query("q", (Request("new", "/new", instead=older),))
    try:
        node = FleetNode("n", parse_endpoint(f"http://127.0.0.1:{port}"))
        _, tls = base_transports([node], 5.0, None, None)
        result = await ask_node(node, query, 5.0, None, tls)
    finally:
        server.close()
        await server.wait_closed()
    assert result.ok, result.error
    assert result.answers == {"a": {"path": "/a"}, "b": {"path": "/b"}}
    assert connections == 2
