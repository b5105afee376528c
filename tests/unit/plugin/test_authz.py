"""Docker's authorization plugin protocol through aiohttp's test client, with a scripted gate:
what is asked about (starts, creates), what is allowed at once, and malformed requests; and
Podman's start hook's ask (``POST /NvidiaDocker.MayStart``) on the same gate."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp import web

from plugin.authz import (
    MAX_AUTHZ_BODY_BYTES,
    MAX_HOOK_DEVICES,
    CreateAsk,
    HookAsk,
    HookDevice,
    StartAsk,
)
from plugin.protocol import CONTENT_TYPE, MAX_BODY_BYTES, create_app
from plugin.volumes import VolumeStore
from tests.support.scripted_gate import ScriptedGate as Gate

V12 = {"Accept": "application/vnd.docker.plugins.v1.2+json"}
CID = "3f2a1b9c0d4e" + "ab" * 26
REFUSAL = "container 3f2a1b9c0d4e may not start: its lease-1 GPUs are in use by another holder"
ALLOW = {"Allow": True, "Msg": "", "Err": ""}

if TYPE_CHECKING:
    from aiohttp.test_utils import TestClient

    Client = TestClient[web.Request, web.Application]
    MakeClient = Callable[[web.Application], Awaitable[Client]]


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
async def client(aiohttp_client: MakeClient, store: VolumeStore, gate: Gate) -> Client:
    return await aiohttp_client(create_app(store, authz_gate=gate))


def request(method: str, uri: str, body: object = None, **extra: Any) -> dict[str, Any]:
    """An AuthZ request as dockerd sends it (its field is ``RequestUri``)."""
    sent: dict[str, Any] = {
        "User": "",
        "RequestMethod": method,
        "RequestUri": uri,
        "RequestHeaders": {"User-Agent": "Docker-Client/28.2.2 (linux)"},
    }
    if body is not None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent["RequestBody"] = base64.b64encode(raw).decode()
    return sent | extra


async def authz(client: Client, body: object, route: str = "AuthZPlugin.AuthZReq") -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await client.post(f"/{route}", data=io.BytesIO(data), headers=V12)
    assert resp.status == 200
    assert resp.headers["Content-Type"] == CONTENT_TYPE
    return json.loads(await resp.text())


async def test_activate_names_authz_only_with_a_gate(
    client: Client, aiohttp_client: MakeClient, store: VolumeStore
) -> None:
    resp = await client.post("/Plugin.Activate", headers=V12)
    assert json.loads(await resp.text()) == {"Implements": ["VolumeDriver", "authz"]}
    plain = await aiohttp_client(create_app(store))
    resp = await plain.post("/Plugin.Activate", headers=V12)
    assert json.loads(await resp.text()) == {"Implements": ["VolumeDriver"]}
    resp = await plain.post("/AuthZPlugin.AuthZReq", data=b"{}", headers=V12)
    assert resp.status == 404


@pytest.mark.parametrize(
    "uri",
    [
        f"/v1.50/containers/{CID}/start",
        "/containers/web-1/start",
        "/v1.24/containers/x/start?a=1",
        f"/v1.50/containers/{CID}/restart?t=0",
        "/containers/web-1/restart",
    ],
)
async def test_a_start_or_restart_is_asked_about(client: Client, gate: Gate, uri: str) -> None:
    assert await authz(client, request("POST", uri)) == ALLOW
    name = uri.split("/containers/")[1].split("/", maxsplit=1)[0]
    assert gate.asked == [StartAsk(name)]


@pytest.mark.parametrize(
    ("uri", "name"),
    [
        ("/v1.44.0/containers/web-1/start", "web-1"),  # dockerd routes /v{version:[0-9.]+}
        ("/v1.0044/containers/web-1/restart", "web-1"),
        ("/v1.47/containers/web-1/st%61rt", "web-1"),  # and the decoded path
        ("/containers/%77eb-1/start", "web-1"),
    ],
)
async def test_a_start_that_dockerd_routes_is_asked_about_however_its_uri_is_spelled(
    client: Client, gate: Gate, uri: str, name: str
) -> None:
    gate.refusal = REFUSAL
    answer = await authz(client, request("POST", uri))
    assert answer == {"Allow": False, "Msg": REFUSAL, "Err": ""}
    assert gate.asked == [StartAsk(name)]
    body = {"Image": "busybox", "HostConfig": {"Devices": [{"PathOnHost": "/dev/nvidia3"}]}}
    await authz(client, request("POST", "/v1.47.0/containers/%63reate", body))
    assert gate.asked[-1] == CreateAsk(None, body)


async def test_a_refused_start_is_denied_with_the_gates_line(client: Client, gate: Gate) -> None:
    gate.refusal = REFUSAL
    answer = await authz(client, request("POST", f"/v1.50/containers/{CID}/start"))
    assert answer == {"Allow": False, "Msg": REFUSAL, "Err": ""}


async def test_a_create_is_asked_about_with_its_body_and_name(client: Client, gate: Gate) -> None:
    body = {
        "Image": "busybox",
        "Labels": {"nvidia-docker.lease": "lease-1"},
        "HostConfig": {"Devices": [{"PathOnHost": "/dev/nvidia3"}]},
    }
    gate.refusal = REFUSAL
    answer = await authz(client, request("POST", "/v1.50/containers/create?name=web-1", body))
    assert answer == {"Allow": False, "Msg": REFUSAL, "Err": ""}
    assert await authz(client, request("POST", "/containers/create", body))
    assert gate.asked == [CreateAsk("web-1", body), CreateAsk(None, body)]


async def test_the_docs_spelling_request_uri_is_read(client: Client, gate: Gate) -> None:
    sent = request("POST", "/")
    del sent["RequestUri"]
    sent["RequestURI"] = "/containers/web-1/start"
    assert await authz(client, sent) == ALLOW
    assert gate.asked == [StartAsk("web-1")]


@pytest.mark.parametrize(
    ("method", "uri", "body"),
    [
        ("GET", f"/v1.50/containers/{CID}/json", None),
        ("HEAD", "/_ping", None),
        ("POST", f"/v1.50/containers/{CID}/stop", None),
        ("POST", f"/v1.50/containers/{CID}/start/extra", None),
        ("GET", f"/v1.50/containers/{CID}/start", None),
        ("POST", "/v1.50/containers/create", None),  # no body: dockerd sent none
        ("POST", "/v1.50/containers/create", b"not json"),  # dockerd refuses it itself
        ("POST", "/v1.50/containers/create", [1, 2]),
        ("POST", "/v1.50/images/create?fromSrc=-", b"tar"),
    ],
)
async def test_everything_else_is_allowed_without_the_gate(
    client: Client, gate: Gate, method: str, uri: str, body: object
) -> None:
    gate.refusal = REFUSAL
    assert await authz(client, request(method, uri, body)) == ALLOW
    assert gate.asked == []


@pytest.mark.parametrize(
    ("body", "err"),
    [
        (b"[]", "bad request: the body must be a JSON object"),
        (b"{", "bad request: "),
        ({"RequestMethod": "POST"}, 'the body needs "RequestMethod" and "RequestUri" strings'),
        (
            request("POST", "/containers/create") | {"RequestBody": "%%%"},
            '"RequestBody" is not base64',
        ),
        (request("POST", "/containers/create") | {"RequestBody": 7}, "must be a base64 string"),
    ],
)
async def test_a_malformed_request_is_denied_with_err_naming_the_problem(
    client: Client, gate: Gate, body: object, err: str
) -> None:
    answer = await authz(client, body)
    assert answer["Allow"] is False
    assert err in answer["Err"]
    assert answer["Err"] in answer["Msg"].replace("bad AuthZ request: ", "bad request: ")
    assert gate.asked == []


async def test_bodies_beyond_the_volume_bound_pass_up_to_the_authz_bound(
    client: Client, gate: Gate
) -> None:
    body = {"Image": "busybox", "Env": ["X=" + "x" * MAX_BODY_BYTES]}
    sent = request("POST", "/containers/create", body)
    assert await authz(client, sent) == ALLOW
    assert gate.asked == [CreateAsk(None, body)]
    huge = json.dumps(request("GET", "/_ping") | {"Pad": "x" * MAX_AUTHZ_BODY_BYTES}).encode()
    answer = await authz(client, huge)
    assert answer["Allow"] is False
    assert answer["Err"] == f"bad request: the body is larger than {MAX_AUTHZ_BODY_BYTES} bytes"


async def test_the_response_is_always_allowed(client: Client, gate: Gate) -> None:
    gate.refusal = REFUSAL
    sent = request("POST", f"/containers/{CID}/start") | {"ResponseStatusCode": 204}
    assert await authz(client, sent, "AuthZPlugin.AuthZRes") == ALLOW
    assert gate.asked == []


async def test_a_start_hooks_ask_reaches_the_gate_with_devices_and_annotations(
    client: Client, gate: Gate
) -> None:
    body = {
        "Id": CID,
        "Devices": [
            {"Path": "/dev/nvidia3", "Major": 195, "Minor": 3},
            {"Path": "/dev/nvidia-caps/nvidia-cap12", "Major": 237, "Minor": 12},
            {"Path": "/dev/gpu"},
        ],
        "Annotations": {"nvidia-docker.lease": "lease-1", "odd": 7, "x" * 5000: "y"},
    }
    assert await authz(client, body, "NvidiaDocker.MayStart") == ALLOW
    assert gate.asked == [
        HookAsk(
            CID,
            (
                HookDevice("/dev/nvidia3", 195, 3),
                HookDevice("/dev/nvidia-caps/nvidia-cap12", 237, 12),
                HookDevice("/dev/gpu"),
            ),
            {"nvidia-docker.lease": "lease-1"},  # strings of at most 4096 characters only
        )
    ]
    gate.refusal = REFUSAL
    refused = await authz(client, {"Id": CID}, "NvidiaDocker.MayStart")
    assert refused == {"Allow": False, "Msg": REFUSAL, "Err": ""}
    assert gate.asked[-1] == HookAsk(CID, (), {})


@pytest.mark.parametrize(
    ("body", "err"),
    [
        ([], "the body must be a JSON object"),
        ({"Id": "web-1"}, "full id (64 hex digits)"),
        ({"Id": CID, "Devices": {"Path": "/dev/nvidia0"}}, '"Devices" must be a list'),
        ({"Id": CID, "Devices": [{"Path": "/dev/nvidia0"}] * (MAX_HOOK_DEVICES + 1)}, "at most"),
        ({"Id": CID, "Devices": ["/dev/nvidia0"]}, "must be an object"),
        ({"Id": CID, "Devices": [{"Path": "dev/nvidia0"}]}, "an absolute path"),
        ({"Id": CID, "Devices": [{"Path": "/dev/x", "Minor": -1}]}, "whole numbers"),
        ({"Id": CID, "Devices": [{"Path": "/dev/x", "Major": True}]}, "whole numbers"),
        ({"Id": CID, "Annotations": ["a"]}, '"Annotations" must be an object'),
    ],
)
async def test_a_malformed_hook_ask_gets_err_and_never_reaches_the_gate(
    client: Client, gate: Gate, body: object, err: str
) -> None:
    answer = await authz(client, body, "NvidiaDocker.MayStart")
    assert answer["Allow"] is False
    assert err in answer["Err"], answer
    assert answer["Msg"] == f"bad start hook request: {answer['Err']}"
    assert gate.asked == []


async def test_the_hook_route_is_served_only_with_a_gate(
    aiohttp_client: MakeClient, store: VolumeStore
) -> None:
    plain = await aiohttp_client(create_app(store))
    resp = await plain.post("/NvidiaDocker.MayStart", data=json.dumps({"Id": CID}), headers=V12)
    assert resp.status == 404


async def test_a_response_of_megabytes_is_allowed(client: Client, gate: Gate) -> None:
    """dockerd sends the served answer's whole body to AuthZRes: a ``docker ps -a`` of a
    busy node is megabytes, and refusing it would fail the user's command."""
    listing = [{"Id": f"{n:064x}", "Names": [f"/job-{n}"], "Pad": "x" * 1500} for n in range(2000)]
    raw = json.dumps(listing).encode()
    assert len(raw) > MAX_AUTHZ_BODY_BYTES
    sent = request("GET", "/v1.47/containers/json?all=1") | {
        "ResponseStatusCode": 200,
        "ResponseHeaders": {"Content-Type": "application/json"},
        "ResponseBody": base64.b64encode(raw).decode(),
    }
    assert await authz(client, sent, "AuthZPlugin.AuthZRes") == ALLOW
    assert gate.asked == []
