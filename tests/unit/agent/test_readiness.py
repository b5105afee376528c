"""The agent asks its own servers before it says it is ready."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from agent.edge.readiness import NotAnswering, check_plugin, check_rest
from tests.support.services import free_port, serve_on_loopback


async def _info(_: web.Request) -> web.Response:
    return web.json_response({})


async def test_a_rest_api_that_answers_is_ready() -> None:
    app = web.Application()
    app.router.add_get("/gpu/info/json", _info)
    async with serve_on_loopback(app) as port:
        await check_rest(("127.0.0.1", port))
        await check_rest(("0.0.0.0", port))  # every interface: asked on loopback


async def test_what_does_not_answer_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(NotAnswering, match=r"^the plugin socket .*nvidia-docker.sock does not"):
        await check_plugin(tmp_path / "nvidia-docker.sock", timeout_s=1)
    port = free_port()
    with pytest.raises(NotAnswering, match=rf"^the REST API on 127.0.0.1:{port} does not answer"):
        await check_rest(("127.0.0.1", port), timeout_s=1)
    app = web.Application()
    async with serve_on_loopback(app) as other:
        with pytest.raises(NotAnswering, match="answered 404 to GET /gpu/info/json"):
            await check_rest(("127.0.0.1", other))
