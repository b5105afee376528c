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
look at the body:

- ``POST [/v1.NN]/containers/<id or name>/start`` and ``.../restart`` (``docker restart``
  starts a container too, stopped or running): ``StartAsk``;
- ``POST [/v1.NN]/containers/create[?name=...]`` with a JSON object body: ``CreateAsk``,
  with that body (``Labels``, ``Env``, ``HostConfig``).

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
from urllib.parse import parse_qs, urlsplit

from plugin.json_body import BodyError, parse_json

IMPLEMENTS = "authz"  # what Plugin.Activate names, as dockerd looks it up
REQUEST_ROUTE = "/AuthZPlugin.AuthZReq"
RESPONSE_ROUTE = "/AuthZPlugin.AuthZRes"
# dockerd sends a body of at most 1 MiB (base64: 4/3 of it) with the request's headers.
MAX_AUTHZ_BODY_BYTES = 2 * 1024 * 1024
MAX_URI_CHARS = 4096

_VERSION = r"(?:/v[0-9]{1,3}(?:\.[0-9]{1,3})?)?"
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


Ask = StartAsk | CreateAsk
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
    start = _START.fullmatch(parts.path)
    if start is not None:
        return StartAsk(start.group(1))
    if _CREATE.fullmatch(parts.path) is None:
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
