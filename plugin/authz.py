"""Docker's authorization plugin protocol: dockerd asks before it serves each API request.

With ``dockerd --authorization-plugin=nvidia-docker`` the engine sends every request it gets
to ``POST /AuthZPlugin.AuthZReq`` (``{"User", "RequestMethod", "RequestUri",
"RequestBody", "RequestHeaders", ...}``: dockerd spells it ``RequestUri``, its docs
``RequestURI``, and both are read; the body base64, and only when it is JSON or text of at
most 1 MiB) and serves it only when the answer is ``{"Allow": true}``; ``{"Allow":
false, "Msg": "<line>"}`` makes the client see ``authorization denied by plugin
nvidia-docker: <line>`` (HTTP 403). After serving it sends the answer to
``/AuthZPlugin.AuthZRes``, which allows everything here.

Two requests are asked about (``ask_of``), every other one is allowed at once, without a
look at the body. The URI's path is matched as dockerd routes it: percent-decoded, and
``[/v1.NN]`` standing for any ``/v`` of digits and dots (``/v1.44.0``):

- ``POST [/v1.NN]/containers/<id or name>/start`` and ``.../restart`` (``docker restart``
  starts a container too, stopped or running): ``StartAsk``;
- ``POST [/v1.NN]/containers/create[?name=...]`` with a JSON object body: ``CreateAsk``,
  with that body (``Labels``, ``Env``, ``HostConfig``).

A third ask comes from an OCI runtime hook rather than from dockerd: Podman has no
authorization plugins, so ``nvidia-docker-start-hook`` (``plugin.start_hook``), run by the
runtime before each Podman container starts, posts the container's id, the GPU device nodes of
its runtime config and its annotations to ``POST /NvidiaDocker.MayStart`` (``HookAsk``,
``hook_ask_of``) and gets the same ``{"Allow", "Msg"}`` answer (``decide_hook``).

The ``Gate`` the app is given answers them: None to allow, or the line of a refusal. It
never raises: its own trouble (an engine that does not answer, a bug) is an allow. A
request that is not the protocol (not a JSON object, a ``RequestBody`` that is not base64)
is denied, with ``Err`` naming the problem: dockerd sends none, and what does is no dockerd.
A create body that is not JSON is allowed: dockerd refuses it itself, with its own message.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from plugin.json_body import BodyError, parse_json

IMPLEMENTS = "authz"  # what Plugin.Activate names, as dockerd looks it up
REQUEST_ROUTE = "/AuthZPlugin.AuthZReq"
HOOK_ROUTE = "/NvidiaDocker.MayStart"  # nvidia-docker-start-hook's ask (plugin.start_hook)
RESPONSE_ROUTE = "/AuthZPlugin.AuthZRes"
# dockerd sends a body of at most 1 MiB (base64: 4/3 of it) with the request's headers.
MAX_AUTHZ_BODY_BYTES = 2 * 1024 * 1024
MAX_URI_CHARS = 4096
MAX_HOOK_BODY_BYTES = 256 * 1024
MAX_HOOK_DEVICES = 1024
MAX_HOOK_ANNOTATIONS = 256
MAX_HOOK_STRING_CHARS = 4096
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")

_VERSION = r"(?:/v[0-9.]{1,16})?"  # dockerd routes /v{version:[0-9.]+}: /v1.44.0 too
_START = re.compile(_VERSION + r"/containers/([^/?#]{1,256})/(?:start|restart)")
_CREATE = re.compile(_VERSION + r"/containers/create")


@dataclass(frozen=True, slots=True)
class StartAsk:
    """``docker start`` or ``docker restart``: the container as the URI names it (an id, a
    prefix or a name)."""

    container: str


@dataclass(frozen=True, slots=True)
class CreateAsk:
    """``docker create`` (and ``run``): the name asked for (None: dockerd picks one) and the
    create body, a JSON object."""

    name: str | None
    body: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class HookDevice:
    """A device node of a runtime config (``linux.devices``): its path in the container
    and its numbers (None where the config has none)."""

    path: str
    major: int | None = None
    minor: int | None = None


@dataclass(frozen=True, slots=True)
class HookAsk:
    """A container an OCI runtime is about to start (Podman's, through
    ``nvidia-docker-start-hook``): its full id, the NVIDIA device nodes its runtime config
    gives it (``HookDevice``) and its OCI annotations."""

    container: str
    devices: tuple[HookDevice, ...]
    annotations: Mapping[str, str]


Ask = StartAsk | CreateAsk | HookAsk
Gate = Callable[[Ask], Awaitable[str | None]]  # None: allow; else the refusal's one line


class AuthzError(ValueError):
    """The AuthZ request is not the protocol; the message says what is wrong."""


def ask_of(request: Mapping[str, object]) -> Ask | None:
    """What an AuthZ request asks the gate about; None for a request allowed as it is."""
    method, uri = request.get("RequestMethod"), request.get("RequestUri", request.get("RequestURI"))
    if not isinstance(method, str) or not isinstance(uri, str):
        raise AuthzError('the body needs "RequestMethod" and "RequestUri" strings')
    if method.upper() != "POST" or len(uri) > MAX_URI_CHARS:
        return None
    parts = urlsplit(uri)
    path = unquote(parts.path)  # dockerd routes the decoded path: /containers/web/st%61rt
    start = _START.fullmatch(path)
    if start is not None:
        return StartAsk(start.group(1))
    if _CREATE.fullmatch(path) is None:
        return None
    body = _create_body(request.get("RequestBody"))
    if body is None:
        return None
    names = parse_qs(parts.query).get("name")
    return CreateAsk(names[-1] if names else None, body)


def _create_body(raw: object) -> Mapping[str, Any] | None:
    """The create body; None when dockerd sent none (too large, not JSON) or it is no JSON
    object (dockerd refuses that create itself)."""
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        raise AuthzError('"RequestBody" must be a base64 string')
    try:
        decoded = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise AuthzError('"RequestBody" is not base64') from None
    try:
        body = parse_json(decoded)
    except BodyError:
        return None
    return body if isinstance(body, dict) else None


def hook_ask_of(body: object) -> HookAsk:
    """The ask of a ``POST /NvidiaDocker.MayStart`` body: ``{"Id": "<64 hex>", "Devices":
    [{"Path", "Major", "Minor"}, ...], "Annotations": {...}}``; ``AuthzError`` for anything
    else."""
    if not isinstance(body, dict):
        raise AuthzError("the body must be a JSON object")
    container = body.get("Id")
    if not isinstance(container, str) or not _CONTAINER_ID.fullmatch(container):
        raise AuthzError('"Id" must be a container\'s full id (64 hex digits)')
    raw_devices = body.get("Devices", [])
    if not isinstance(raw_devices, list) or len(raw_devices) > MAX_HOOK_DEVICES:
        raise AuthzError(f'"Devices" must be a list of at most {MAX_HOOK_DEVICES} objects')
    devices = tuple(_hook_device(entry) for entry in raw_devices)
    raw_annotations = body.get("Annotations", {})
    if not isinstance(raw_annotations, dict) or len(raw_annotations) > MAX_HOOK_ANNOTATIONS:
        raise AuthzError(
            f'"Annotations" must be an object of at most {MAX_HOOK_ANNOTATIONS} strings'
        )
    annotations = {
        key: value
        for key, value in raw_annotations.items()
        if isinstance(value, str) and _short(key) and _short(value)
    }
    return HookAsk(container, devices, annotations)


def _short(text: str) -> bool:
    return len(text) <= MAX_HOOK_STRING_CHARS


def _hook_device(entry: object) -> HookDevice:
    if not isinstance(entry, dict):
        raise AuthzError('each of "Devices" must be an object: {"Path", "Major", "Minor"}')
    path, major, minor = entry.get("Path"), entry.get("Major"), entry.get("Minor")
    if not isinstance(path, str) or not path.startswith("/") or not _short(path):
        raise AuthzError('each of "Devices" needs a "Path": an absolute path')
    for number in (major, minor):
        if number is not None and (type(number) is not int or not 0 <= number < 2**32):
            raise AuthzError('a device\'s "Major" and "Minor" must be whole numbers or null')
    return HookDevice(path, major, minor)


async def decide_hook(body: object, gate: Gate) -> dict[str, object]:
    """The answer to a start hook's ask: allowed unless the gate refuses it. A body that is
    not the ask gets ``Err`` saying why (the hook lets the container start then: an agent
    and a hook of different versions must not stop the node's Podman)."""
    try:
        ask = hook_ask_of(body)
    except AuthzError as err:
        return {"Allow": False, "Msg": f"bad start hook request: {err}", "Err": f"{err}"}
    refusal = await gate(ask)
    return {"Allow": refusal is None, "Msg": refusal or "", "Err": ""}


async def decide(request: Mapping[str, object], gate: Gate) -> dict[str, object]:
    """The answer to an AuthZ request: allowed unless the gate refuses what it asks."""
    try:
        ask = ask_of(request)
    except AuthzError as err:
        return {"Allow": False, "Msg": f"bad AuthZ request: {err}", "Err": f"bad request: {err}"}
    refusal = None if ask is None else await gate(ask)
    if refusal is None:
        return {"Allow": True, "Msg": "", "Err": ""}
    return {"Allow": False, "Msg": refusal, "Err": ""}
