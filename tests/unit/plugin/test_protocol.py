"""The plugin protocol through aiohttp's test client (no socket): answers and errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web

from plugin import volumes
from plugin.protocol import CONTENT_TYPE, create_app
from plugin.volumes import VolumeStore

NAME = "nvidia_driver_580.159.04"
V12 = {"Accept": "application/vnd.docker.plugins.v1.2+json"}
V11 = {"Accept": "application/vnd.docker.plugins.v1.1+json"}

if TYPE_CHECKING:
    # Types only: aiohttp's TestClient is generic only from 3.11 on, above our floor.
    from aiohttp.test_utils import TestClient

    Client = TestClient[web.Request, web.Application]
    MakeClient = Callable[[web.Application], Awaitable[Client]]


@pytest.fixture
async def client(aiohttp_client: MakeClient, store: VolumeStore) -> Client:
    return await aiohttp_client(create_app(store))


async def call(
    client: Client, method: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    resp = await client.post(f"/{method}", data=data, headers=V12 if headers is None else headers)
    assert resp.headers["Content-Type"] == CONTENT_TYPE
    text = await resp.text()
    assert text.endswith("\n")
    answer: dict[str, Any] = json.loads(text)
    return resp.status, answer


async def test_handshake_and_capabilities(client: Client) -> None:
    assert await call(client, "Plugin.Activate") == (200, {"Implements": ["VolumeDriver"]})
    assert await call(client, "Plugin.Activate", headers=V11) == (
        200,
        {"Implements": ["VolumeDriver"]},
    )
    assert await call(client, "VolumeDriver.Capabilities") == (
        200,
        {"Capabilities": {"Scope": "local"}},
    )


async def test_the_life_of_a_volume(client: Client, store: VolumeStore) -> None:
    where = str(store.volume_dir / "nvidia_driver" / "580.159.04")
    assert await call(client, "VolumeDriver.Get", {"Name": NAME}) == (
        200,
        {"Err": f"no such volume: {NAME}"},
    )
    assert await call(client, "VolumeDriver.Create", {"Name": NAME, "Opts": {}}) == (
        200,
        {"Err": ""},
    )
    assert await call(client, "VolumeDriver.Get", {"Name": NAME}) == (
        200,
        {"Volume": {"Name": NAME, "Mountpoint": where, "Status": {}}, "Err": ""},
    )
    assert await call(client, "VolumeDriver.List", {}) == (
        200,
        {"Volumes": [{"Name": NAME, "Mountpoint": where}], "Err": ""},
    )
    mount = {"Name": NAME, "ID": "c0ffee"}
    assert await call(client, "VolumeDriver.Mount", mount) == (
        200,
        {"Mountpoint": where, "Err": ""},
    )
    assert await call(client, "VolumeDriver.Path", {"Name": NAME}) == (
        200,
        {"Mountpoint": where, "Err": ""},
    )
    assert await call(client, "VolumeDriver.Unmount", mount) == (200, {"Err": ""})
    assert await call(client, "VolumeDriver.Remove", {"Name": NAME}) == (200, {"Err": ""})
    assert not await asyncio.to_thread(Path(where).exists)
    assert await call(client, "VolumeDriver.List") == (200, {"Volumes": [], "Err": ""})


@pytest.mark.parametrize(
    ("method", "body", "headers", "status", "err"),
    [
        ("VolumeDriver.Create", {"Name": NAME}, {}, 406, "unsupported Accept header"),
        ("VolumeDriver.Create", {"Name": NAME}, {"Accept": "application/json"}, 406, "unsupported"),
        ("Plugin.Activate", None, {"Accept": "application/vnd.docker.plugins.v1+json"}, 406, ""),
        ("VolumeDriver.Create", b"{", V12, 400, "bad request: the body is not valid JSON"),
        ("VolumeDriver.Create", b"\xff\xfe", V12, 400, "bad request: the body is not valid"),
        ("VolumeDriver.Create", b'"nvidia_driver"', V12, 400, "bad request: the body must be"),
        ("VolumeDriver.Mount", {"ID": "x"}, V12, 400, 'bad request: the body needs a "Name"'),
        ("VolumeDriver.Mount", {"Name": 5}, V12, 400, 'bad request: the body needs a "Name"'),
        ("VolumeDriver.Create", {"Name": "nvidia_driver_.."}, V12, 200, "bad volume format: "),
        ("VolumeDriver.Remove", {"Name": "nvidia_driver_/"}, V12, 200, "bad volume format: "),
        ("VolumeDriver.Create", {"Name": "cuda_9.0"}, V12, 200, "unsupported volume: cuda_9.0"),
        ("VolumeDriver.Create", {"Name": "nvidia_driver_1.0"}, V12, 200, "invalid volume version"),
        ("VolumeDriver.Mount", {"Name": "nvidia_driver_1.0"}, V12, 200, "no such volume"),
        ("VolumeDriver.Unmount", {"Name": "x"}, V12, 200, "bad volume format: x"),
        ("VolumeDriver.Resize", {"Name": NAME}, V12, 404, "unknown endpoint: send one of"),
        ("VolumeDriver.Mount", b"[" * 2000, V12, 400, "bad request: the body nests deeper"),
        (
            "VolumeDriver.Mount",
            b'{"Name": [[[[' + b"{" * 40,
            V12,
            400,
            "bad request: the body nests",
        ),
        (
            "VolumeDriver.Mount",
            b'{"Name": ' + b"9" * 5000 + b"}",
            V12,
            400,
            "bad request: the body is not valid JSON (a value is too large)",
        ),
        (
            "VolumeDriver.Mount",
            {"Name": "n" * 256},
            V12,
            400,
            'bad request: "Name" must be at most 255 printable',
        ),
        (
            "VolumeDriver.Remove",
            {"Name": "nvidia_driver_1\n2"},
            V12,
            400,
            'bad request: "Name" must be',
        ),
        (
            "VolumeDriver.Get",
            {"Name": "nvidia_driver_\x00"},
            V12,
            400,
            'bad request: "Name" must be',
        ),
    ],
)
async def test_bad_requests_get_their_error_and_change_nothing(
    client: Client,
    store: VolumeStore,
    method: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    err: str,
) -> None:
    before = sorted(store.volume_dir.parent.rglob("*"))
    got_status, answer = await call(client, method, body, headers)
    assert got_status == status
    assert answer["Err"].startswith(err)
    assert sorted(store.volume_dir.parent.rglob("*")) == before


async def test_a_too_large_body_is_refused(client: Client) -> None:
    status, answer = await call(client, "VolumeDriver.Create", b"{" + b" " * 100_000 + b"}")
    assert status == 413
    assert answer["Err"] == "bad request: the body is larger than 65536 bytes"


async def test_json_errors_say_where_not_what_python_said(client: Client) -> None:
    status, answer = await call(client, "VolumeDriver.Mount", b'{"Name": "x",\n  oops}')
    assert (status, answer) == (
        400,
        {"Err": "bad request: the body is not valid JSON (line 2, column 3)"},
    )
    status, answer = await call(client, "VolumeDriver.Mount", b'{"Name": "\xff"}')
    assert (status, answer) == (
        400,
        {"Err": "bad request: the body is not valid JSON (not UTF-8 at byte 10)"},
    )


async def test_a_get_on_an_endpoint_says_to_post(client: Client) -> None:
    resp = await client.get("/VolumeDriver.Mount", headers=V12)
    assert resp.status == 405
    assert json.loads(await resp.text()) == {"Err": "method GET not allowed: send POST"}


async def test_sixteen_concurrent_creates_share_one_build(
    client: Client, store: VolumeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real_create = VolumeStore.create

    def counting(self: VolumeStore, name: str) -> Path:
        calls.append(name)
        return real_create(self, name)

    monkeypatch.setattr(VolumeStore, "create", counting)
    answers = await asyncio.gather(
        *(call(client, "VolumeDriver.Create", {"Name": NAME}) for _ in range(16))
    )
    assert answers == [(200, {"Err": ""})] * 16
    assert len(calls) == 1  # one thread built it; the 15 others awaited the same build
    assert [p.name for p in (store.volume_dir / "nvidia_driver").iterdir()] == ["580.159.04"]


async def test_a_failing_build_is_an_err_answer(
    client: Client, store: VolumeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object, **__: object) -> None:
        raise PermissionError(13, "Permission denied", str(store.volume_dir))

    monkeypatch.setattr(volumes, "build_tree", broken)
    status, answer = await call(client, "VolumeDriver.Create", {"Name": NAME})
    assert status == 200
    assert answer["Err"].startswith("VolumeDriver.Create failed: [Errno 13] Permission denied")
    assert await call(client, "Plugin.Activate") == (200, {"Implements": ["VolumeDriver"]})
