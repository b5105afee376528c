"""Listening on every address of a name, skipping the ones this node cannot bind."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from agent.edge.listen import listen
from agent.errors import StartupError
from tests.support.services import free_port, port_open

UNASSIGNED = "192.0.2.1"  # TEST-NET-1: never an address of this machine, so never bindable


@pytest.fixture
async def runner() -> AsyncIterator[web.AppRunner]:
    app_runner = web.AppRunner(web.Application(), handle_signals=False)
    await app_runner.setup()
    yield app_runner
    await app_runner.cleanup()


def _resolve_to(monkeypatch: pytest.MonkeyPatch, *addresses: str) -> None:
    async def getaddrinfo(*_args: Any, **_kwargs: Any) -> list[Any]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0)) for address in addresses]

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)


async def test_an_unbindable_address_of_the_name_is_skipped(
    runner: web.AppRunner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _resolve_to(monkeypatch, "127.0.0.1", UNASSIGNED)
    port = free_port()
    await listen(runner, "localhost", port)
    assert port_open(port)
    assert f"Not listening on {UNASSIGNED}" in caplog.text


async def test_no_bindable_address_is_a_startup_error(
    runner: web.AppRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    _resolve_to(monkeypatch, UNASSIGNED)
    with pytest.raises(StartupError, match="cannot listen on localhost"):
        await listen(runner, "localhost", free_port())


async def test_address_in_use_is_never_skipped(
    runner: web.AppRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _resolve_to(monkeypatch, UNASSIGNED, "127.0.0.1")
        with pytest.raises(StartupError, match="is another agent running"):
            await listen(runner, "localhost", port)


async def test_an_address_not_of_this_node_is_not_blamed_on_another_agent(
    runner: web.AppRunner,
) -> None:
    with pytest.raises(StartupError) as refused:
        await listen(runner, UNASSIGNED, free_port())
    assert "is another agent running" not in str(refused.value)
    assert "it is not an address of this node: choose one of its addresses with -l" in str(
        refused.value
    )


async def test_an_ipv6_address_in_an_error_is_shown_as_l_takes_it(runner: web.AppRunner) -> None:
    with pytest.raises(StartupError, match=r"cannot listen on \[2001:db8::1\]:"):
        await listen(runner, "2001:db8::1", free_port())
