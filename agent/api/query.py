"""The REST API's query parameters bounded at the edge, before any handler reads them.

``dev`` and ``vol`` mean the same on every route (agent.node.selection): space or comma
separated lists, whose entries the handlers match in order (the first entry that names no
GPU or volume is refused). Before that, every value of them is checked here for size:

- a value has at most ``MAX_VALUE_CHARS`` characters and ``MAX_ENTRIES`` entries;
- a ``dev`` entry has at most ``MAX_DEVICE_ENTRY_CHARS`` characters (a GPU or MIG UUID
  has 40), a ``vol`` entry at most ``MAX_VOLUME_ENTRY_CHARS``.

What an entry may be made of is the matcher's: a GPU index is ASCII digits only (Python's
``int()`` would take Unicode digits, and refuses strings of more than 4,300 digits), a
UUID prefix starts ``GPU-``, a MIG device is ``MIG-<uuid prefix>`` or ``<gpu>:<mig>``
(a GPU's index, then its MIG device's). So a client sees one kind of refusal for each parameter,
``invalid device: X`` or ``invalid volume: X``, with X shown bounded and without control
characters (agent.display). ``format`` is the route's own (a fixed list of names, checked
by membership), and other parameters are ignored, as the old tool did, their size bounded
by aiohttp's request line limit (8 KiB). docs/api.md ("Errors") lists the answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from agent.node.selection import InvalidParameter

MAX_VALUE_CHARS = 4096
MAX_ENTRIES = 128  # 8 GPUs with 7 MIG instances each, and room for repeats
MAX_DEVICE_ENTRY_CHARS = 96
MAX_VOLUME_ENTRY_CHARS = 64

_ENTRY_CHARS = {"dev": MAX_DEVICE_ENTRY_CHARS, "vol": MAX_VOLUME_ENTRY_CHARS}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BadRequest = Callable[[InvalidParameter], web.StreamResponse]


def check_list(parameter: str, value: str) -> None:
    """Refuse a ``dev`` or ``vol`` value too large to be a list of what it names."""
    if len(value) > MAX_VALUE_CHARS:
        raise InvalidParameter(parameter, value)
    entries = value.replace(",", " ").split()
    if len(entries) > MAX_ENTRIES:
        raise InvalidParameter(parameter, value, f" (more than {MAX_ENTRIES} entries)")
    longest = _ENTRY_CHARS[parameter]
    for entry in entries:
        if len(entry) > longest:
            raise InvalidParameter(parameter, entry)


def check_query(request: web.Request) -> None:
    """Check every value of the list parameters of ``request``'s query."""
    params = request.query
    for parameter in _ENTRY_CHARS:
        if parameter in params:
            for value in params.getall(parameter):
                check_list(parameter, value)


def query_checked(handler: Handler, bad_request: BadRequest) -> Handler:
    """``handler``, refusing a bad query before it runs; ``bad_request`` renders the 400
    (the REST API's, with its ``X-Invalid-*`` headers). A wrapper of each route rather than
    a middleware: aiohttp builds every middleware's call anew for each request."""

    async def checked(request: web.Request) -> web.StreamResponse:
        if request.query_string:
            try:
                check_query(request)
            except InvalidParameter as err:
                return bad_request(err)
        return await handler(request)

    return checked
