"""AgentClient over plain HTTP, against an aiohttp server that answers as docs/api.md says."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from controller.errors import Failure, NodeError
from controller.transport.client import AgentClient, AgentHttpError
from controller.transport.endpoint import parse_endpoint
from tests.support.services import free_port, serve_on_loopback

INFO = {"Version": {"Driver": "580.159.04", "CUDA": "13.0"}, "Devices": []}


async def _info(_: web.Request) -> web.Response:
    return web.json_response(INFO)


async def _cli(request: web.Request) -> web.Response:
    if request.query.get("dev") == "9":
        return web.Response(status=400, text="invalid device: 9\n")
    return web.Response(text=f"raw={request.raw_path} dev={request.query.get('dev')}\n")


async def _slow(_: web.Request) -> web.Response:
    await asyncio.sleep(5)
    return web.Response(text="late")


async def _not_json(_: web.Request) -> web.Response:
    return web.Response(text="<html>")


@pytest.fixture
async def agent_port() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/gpu/info/json", _info)
    app.router.add_get("/docker/cli", _cli)
    app.router.add_get("/slow", _slow)
    app.router.add_get("/html", _not_json)
    async with serve_on_loopback(app) as port:
        yield port


async def test_get_json_and_query(agent_port: int) -> None:
    async with AgentClient(parse_endpoint(f"http://127.0.0.1:{agent_port}")) as agent:
        assert await agent.get_json("/gpu/info/json") == INFO
        body = await agent.get("/docker/cli", params={"dev": "0 GPU-1a", "vol": "nvidia_driver"})
    # space separated lists travel as '+' (docs/api.md, query parameters)
    assert body == b"raw=/docker/cli?dev=0+GPU-1a&vol=nvidia_driver dev=0 GPU-1a\n"


async def test_concurrent_requests_share_one_client(agent_port: int) -> None:
    async with AgentClient(parse_endpoint(f"127.0.0.1:{agent_port}")) as agent:
        bodies = await asyncio.gather(*(agent.get_json("/gpu/info/json") for _ in range(50)))
    assert bodies == [INFO] * 50


async def test_non_200_names_node_status_and_message(agent_port: int) -> None:
    async with AgentClient(parse_endpoint(f"http://127.0.0.1:{agent_port}")) as agent:
        with pytest.raises(AgentHttpError) as info:
            await agent.get("/docker/cli", params={"dev": "9"})
    assert info.value.status == 400
    assert info.value.agent_message == "invalid device: 9"
    assert str(info.value) == (
        f"http://127.0.0.1:{agent_port}: the agent answered 400 to GET /docker/cli: "
        "invalid device: 9"
    )


async def test_agent_down_says_what_to_do() -> None:
    port = free_port()
    async with AgentClient(parse_endpoint(f"http://127.0.0.1:{port}")) as agent:
        with pytest.raises(NodeError) as info:
            await agent.get("/gpu/info/json")
    message = str(info.value)
    assert f"cannot connect to the agent at http://127.0.0.1:{port} (connection refused)" in (
        message
    )
    assert "is nvidia-docker-plugin running there" in message


async def test_timeout_is_bounded(agent_port: int) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    endpoint = parse_endpoint(f"http://127.0.0.1:{agent_port}")
    async with AgentClient(endpoint, timeout_s=0.3) as agent:
        with pytest.raises(NodeError, match=r"no answer to GET /slow within 0\.3 s"):
            await agent.get("/slow")
    assert loop.time() - started < 4


async def test_not_json(agent_port: int) -> None:
    async with AgentClient(parse_endpoint(f"http://127.0.0.1:{agent_port}")) as agent:
        with pytest.raises(NodeError, match="not JSON"):
            await agent.get_json("/html")


def test_default_timeout_is_ten_seconds() -> None:
    assert AgentClient(parse_endpoint("10.0.0.1:")).timeout_s == 10.0


async def _raw_agent(answer: bytes) -> tuple[asyncio.AbstractServer, int]:
    """A server that reads a request, writes ``answer`` and closes the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        except ConnectionError:
            pass  # the client stopped reading
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port: int = server.sockets[0].getsockname()[1]
    return server, port


@pytest.mark.parametrize(
    ("answer", "message", "failure"),
    [
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
            "GET /x failed: the answer was cut off after 5 of 10 bytes",
            Failure.DISCONNECTED,
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n",
            "GET /x failed: the answer was cut off after 5 bytes",
            Failure.DISCONNECTED,
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 104857600\r\n\r\n" + b"x" * 65536,
            "GET /x failed: the answer is over 16 MiB: is this an nvidia-docker agent?",
            Failure.NOT_AN_AGENT,
        ),
        (
            b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * (17 * 2**20),
            "GET /x failed: the answer is over 16 MiB: is this an nvidia-docker agent?",
            Failure.NOT_AN_AGENT,
        ),
    ],
    ids=["cut-off", "chunked-cut-off", "content-length-over", "streamed-over"],
)
async def test_a_cut_off_or_oversized_answer_is_one_line(
    answer: bytes, message: str, failure: Failure
) -> None:
    server, port = await _raw_agent(answer)
    try:
        async with AgentClient(parse_endpoint(f"http://127.0.0.1:{port}")) as agent:
            with pytest.raises(NodeError) as info:
                await agent.get("/x")
    finally:
        server.close()
        await server.wait_closed()
    assert info.value.reason.startswith(message)
    assert "https://?" not in str(info.value)  # headers came: not an agent serving TLS
    assert info.value.failure is failure
