"""Docker's legacy volume plugin protocol, as an aiohttp application.

dockerd sends ``POST /<Method>`` with a JSON body and ``Accept:
application/vnd.docker.plugins.v1.2+json`` (``v1.1`` from older engines); the answers are
JSON with ``Content-Type: application/vnd.docker.plugins.v1+json``. Expected failures are
HTTP 200 with ``{"Err": "<reason>: <volume name>"}``; a request that is not the protocol
(wrong Accept header, body not a JSON object) gets 406 or 400, with ``Err`` saying what to fix.
Bodies are bounded (``MAX_BODY_BYTES``, ``json_body.MAX_DEPTH`` levels, ``Name`` at most
``MAX_NAME_CHARS`` printable characters) and must arrive within ``BODY_TIMEOUT_S``.

Given a gate (``create_app(..., authz_gate=...)``), the app is also Docker's authorization
plugin (``plugin.authz``): ``Plugin.Activate`` names ``authz`` too, and the AuthZ request
bodies may be up to ``authz.MAX_AUTHZ_BODY_BYTES`` (a create body, base64, and its headers;
an ``AuthZRes`` body, which carries the served answer, is dropped unread at any size). The same
gate answers Podman's start hook (``POST /NvidiaDocker.MayStart``, ``plugin.start_hook``).

Serve this app on a unix socket only (``agent.edge.plugin_socket``): it changes files on disk and
has no authentication. Volume builds run in a worker thread; concurrent Creates of one volume
share one build.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from plugin import authz
from plugin.json_body import BodyError, parse_json
from plugin.volumes import VolumeError, VolumeStore

log = logging.getLogger("nvidia-docker-plugin.protocol")

ACCEPTED_MEDIA_TYPES = frozenset(
    {"application/vnd.docker.plugins.v1.1+json", "application/vnd.docker.plugins.v1.2+json"}
)
CONTENT_TYPE = "application/vnd.docker.plugins.v1+json"
MAX_BODY_BYTES = 64 * 1024
MAX_NAME_CHARS = 255
BODY_TIMEOUT_S = 10.0  # dockerd sends its small bodies at once

STORE_KEY = web.AppKey("store", VolumeStore)
BUILDS_KEY = web.AppKey("builds", dict[str, "asyncio.Future[Path]"])
GATE_KEY: web.AppKey[authz.Gate] = web.AppKey("gate")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadRequest(Exception):
    """The request is not the protocol: answered 400 with the message as ``Err``."""


def answer(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(
        status=status,
        body=(json.dumps(body) + "\n").encode(),
        headers={"Content-Type": CONTENT_TYPE},
    )


def _accepts(header: str) -> bool:
    return any(part.split(";")[0].strip() in ACCEPTED_MEDIA_TYPES for part in header.split(","))


@web.middleware
async def protocol_checks(request: web.Request, handler: Handler) -> web.StreamResponse:
    """406 unless the client speaks the plugin protocol; errors never become tracebacks."""
    log.debug("%s (Accept: %s)", _shown(request.path), _shown(request.headers.get("Accept", "")))
    if not _accepts(request.headers.get("Accept", "")):
        wanted = "application/vnd.docker.plugins.v1.2+json"
        return answer({"Err": f"unsupported Accept header: send Accept: {wanted}"}, status=406)
    try:
        return await handler(request)
    except BadRequest as err:
        return answer({"Err": f"bad request: {err}"}, status=400)
    except web.HTTPRequestEntityTooLarge as err:
        return answer(
            {"Err": f"bad request: the body is larger than {MAX_BODY_BYTES} bytes"}, err.status
        )
    except web.HTTPNotFound as err:
        endpoints = ", ".join(route.lstrip("/") for route in ROUTES)
        return answer({"Err": f"unknown endpoint: send one of {endpoints}"}, err.status)
    except web.HTTPMethodNotAllowed as err:
        return answer(
            {"Err": f"method {_shown(request.method)} not allowed: send POST"}, err.status
        )
    except web.HTTPException as err:
        return answer({"Err": err.reason}, status=err.status)
    except VolumeError as err:
        log.info("%s %s", request.path.lstrip("/"), err)
        return answer({"Err": str(err)})
    except OSError as err:
        log.error("%s failed: %s", request.path.lstrip("/"), err)
        return answer({"Err": f"{request.path.lstrip('/')} failed: {err}"})


def _shown(text: str, limit_chars: int = 40) -> str:
    """A client's text as it may appear in an answer: bounded, printable."""
    head = "".join(char if char.isprintable() else "?" for char in text[:limit_chars])
    return head + ("..." if len(text) > limit_chars else "")


async def _body(request: web.Request, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await (
                request.read() if max_bytes <= MAX_BODY_BYTES else _read(request, max_bytes)
            )
    except TimeoutError:
        raise BadRequest(f"the body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    if not raw.strip():
        return {}
    try:
        body = parse_json(raw)
    except BodyError as err:
        raise BadRequest(str(err)) from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


async def _read(request: web.Request, max_bytes: int) -> bytes:
    """The body, read past the app's ``client_max_size`` up to ``max_bytes``."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise BadRequest(f"the body is larger than {max_bytes} bytes")
    raw = bytearray()
    while chunk := await request.content.read(max_bytes + 1 - len(raw)):
        raw += chunk
        if len(raw) > max_bytes:
            raise BadRequest(f"the body is larger than {max_bytes} bytes")
    return bytes(raw)


async def _name(request: web.Request) -> str:
    name = (await _body(request)).get("Name")
    if not isinstance(name, str) or not name:
        raise BadRequest('the body needs a "Name" string')
    if len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise BadRequest(
            f'"Name" must be at most {MAX_NAME_CHARS} printable characters, '
            "e.g. nvidia_driver_<driver version>"
        )
    return name


async def activate(request: web.Request) -> web.Response:
    implements = ["VolumeDriver", authz.IMPLEMENTS] if GATE_KEY in request.app else ["VolumeDriver"]
    return answer({"Implements": implements})


async def authz_request(request: web.Request) -> web.Response:
    """Allow or refuse one API request dockerd is about to serve (``plugin.authz``)."""
    try:
        body = await _body(request, authz.MAX_AUTHZ_BODY_BYTES)
    except BadRequest as err:
        return answer(
            {"Allow": False, "Msg": f"bad AuthZ request: {err}", "Err": f"bad request: {err}"}
        )
    return answer(await authz.decide(body, request.app[GATE_KEY]))


async def hook_request(request: web.Request) -> web.Response:
    """May the container an OCI runtime is about to start start (``nvidia-docker-start-hook``,
    ``plugin.authz.decide_hook``)?"""
    try:
        body = await _body(request, authz.MAX_HOOK_BODY_BYTES)
    except BadRequest as err:
        return answer({"Allow": False, "Msg": f"bad start hook request: {err}", "Err": f"{err}"})
    return answer(await authz.decide_hook(body, request.app[GATE_KEY]))


async def authz_response(request: web.Request) -> web.Response:
    """Every answer dockerd served may go to its client. The body is read and dropped, not
    parsed: dockerd sends the served answer's whole JSON body in it (a ``docker ps -a`` of a
    node with thousands of containers: megabytes), and no size of it refuses anything."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(BODY_TIMEOUT_S):
            while await request.content.readany():
                pass
    return answer({"Allow": True, "Msg": "", "Err": ""})


async def capabilities(request: web.Request) -> web.Response:
    return answer({"Capabilities": {"Scope": "local"}})


async def create(request: web.Request) -> web.Response:
    name = await _name(request)
    await _single_build(request.app, name)
    return answer({"Err": ""})


async def _single_build(app: web.Application, name: str) -> Path:
    """One build per volume at a time; every concurrent Create awaits the same one."""
    store = app[STORE_KEY]
    builds = app[BUILDS_KEY]
    future = builds.get(name)
    if future is None:
        future = asyncio.ensure_future(asyncio.to_thread(store.create, name))
        builds[name] = future
        future.add_done_callback(lambda _: builds.pop(name, None))
    return await asyncio.shield(future)


async def remove(request: web.Request) -> web.Response:
    name = await _name(request)
    await asyncio.to_thread(request.app[STORE_KEY].remove, name)
    return answer({"Err": ""})


async def mount(request: web.Request) -> web.Response:
    name = await _name(request)
    path = await asyncio.to_thread(request.app[STORE_KEY].mountpoint, name)
    return answer({"Mountpoint": str(path), "Err": ""})


async def path(request: web.Request) -> web.Response:
    name = await _name(request)
    where = await asyncio.to_thread(request.app[STORE_KEY].get, name)
    return answer({"Mountpoint": str(where), "Err": ""})


async def unmount(request: web.Request) -> web.Response:
    request.app[STORE_KEY].parse(await _name(request))  # nothing to undo: volumes are read-only
    return answer({"Err": ""})


async def get(request: web.Request) -> web.Response:
    name = await _name(request)
    where = await asyncio.to_thread(request.app[STORE_KEY].get, name)
    return answer({"Volume": {"Name": name, "Mountpoint": str(where), "Status": {}}, "Err": ""})


async def list_volumes(request: web.Request) -> web.Response:
    await _body(request)
    volumes = await asyncio.to_thread(request.app[STORE_KEY].list)
    return answer(
        {
            "Volumes": [{"Name": name, "Mountpoint": str(where)} for name, where in volumes],
            "Err": "",
        }
    )


ROUTES: dict[str, Handler] = {
    "/Plugin.Activate": activate,
    "/VolumeDriver.Create": create,
    "/VolumeDriver.Remove": remove,
    "/VolumeDriver.Mount": mount,
    "/VolumeDriver.Unmount": unmount,
    "/VolumeDriver.Path": path,
    "/VolumeDriver.Get": get,
    "/VolumeDriver.List": list_volumes,
    "/VolumeDriver.Capabilities": capabilities,
}


def create_app(
    store: VolumeStore,
    *,
    middlewares: Sequence[Middleware] = (),
    authz_gate: authz.Gate | None = None,
) -> web.Application:
    """The plugin application. Serve it on a unix socket only.

    ``middlewares`` (the daemon's connection tracking) wrap the protocol checks, which stay
    the innermost. ``authz_gate``: also serve Docker's authorization plugin protocol and
    Podman's start hook (``authz.HOOK_ROUTE``), with it answering container starts and
    creates.
    """
    app = web.Application(
        middlewares=[*middlewares, protocol_checks], client_max_size=MAX_BODY_BYTES
    )
    app[STORE_KEY] = store
    app[BUILDS_KEY] = {}
    for route, handler in ROUTES.items():
        app.router.add_post(route, handler)
    if authz_gate is not None:
        app[GATE_KEY] = authz_gate
        app.router.add_post(authz.REQUEST_ROUTE, authz_request)
        app.router.add_post(authz.RESPONSE_ROUTE, authz_response)
        app.router.add_post(authz.HOOK_ROUTE, hook_request)
    return app
