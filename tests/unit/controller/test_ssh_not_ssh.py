"""An ssh:// address whose port is not sshd's (the agent's HTTP port written as the SSH port)."""

from __future__ import annotations

import asyncio

import pytest

from controller.errors import NodeError
from controller.transport.client import AgentClient
from controller.transport.endpoint import parse_endpoint
from controller.transport.ssh_tunnel import SshOptions


async def test_a_port_that_does_not_speak_ssh_says_so() -> None:
    async def http_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.0 400 Bad Request\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http_server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    options = SshOptions(user="ops", home="/nonexistent", strict_host_key_checking=False)
    try:
        with pytest.raises(NodeError) as info:
            async with AgentClient(parse_endpoint(f"ssh://ops@127.0.0.1:{port}"), ssh=options):
                pass
    finally:
        server.close()
        await server.wait_closed()
    message = str(info.value)
    assert f"127.0.0.1:{port} does not speak SSH" in message
    assert "ssh://user@host:SSH_PORT:HTTP_PORT" in message
