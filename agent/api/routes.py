"""The REST API (TCP, default ``localhost:3476``): thin handlers over the GPU model.

Every route exists under ``/v1.0`` and without the prefix. Static answers (info, the
default ``/docker/cli``, the Mesos flags) are rendered once and served as cached bytes;
status comes from the single-flight ``StatusService``. While the driver is being replaced
the live routes (status, health) answer 503 with why; ``/docker/cli`` and ``/mesos/cli``
refuse an unhealthy GPU named in ``dev`` with 409 (docs/api.md).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

from agent.api import render_json, render_text
from agent.api.engines import ENGINE_SOCKET, ENGINES, engines_json
from agent.api.leases import IDLE_BY_UNIT, LEASES, make_routes
from agent.api.query import query_checked
from agent.api.usage import OFF as USAGE_OFF
from agent.api.usage import USAGE, idle_by_unit
from agent.api.usage import make_routes as usage_routes
from agent.cdi_spec.writer import CdiSpecWriter
from agent.engines.events import EngineEvents
from agent.gpu.model import DeviceInfo, NodeInfo
from agent.health import render as health_routes
from agent.health.selection import UnhealthyDevice
from agent.leasing.service import LeaseService
from agent.metrics.service import CONTENT_TYPE as METRICS_CONTENT_TYPE
from agent.metrics.service import MetricsService
from agent.node.selection import InvalidParameter
from agent.node.state import NodeState
from agent.node.status import StatusService, StatusUnavailable
from agent.usage.ledger import UsageLedger

log = logging.getLogger("nvidia-docker-plugin.rest")

API_VERSIONS = ("v1.0",)
JSON = "application/json"
TEXT = "text/plain"


NODE = web.AppKey("node", NodeState)
STATUS = web.AppKey("status", StatusService)
METRICS = web.AppKey("metrics", MetricsService)
CDI = web.AppKey("cdi", CdiSpecWriter)  # only when the agent writes a CDI spec
DOCKER_FORMATS = ("legacy", "cdi")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


_HEADERS = {
    JSON: {"Content-Type": "application/json; charset=utf-8"},
    TEXT: {"Content-Type": "text/plain; charset=utf-8"},
}


def _answer(body: bytes, content_type: str) -> web.Response:
    return web.Response(body=body, headers=_HEADERS[content_type])


# A 400 names the parameter and the entry it refused in headers too, so that programs (the
# nvidia-docker wrapper, fleet tools) need not parse the text, which stays the old tool's.
INVALID_PARAMETER_HEADER = "X-Invalid-Parameter"
INVALID_VALUE_HEADER = "X-Invalid-Value"  # percent-encoded (UTF-8), at most 256 characters
_HEADER_ENTRY_CHARS = 256


def _bad_request(err: InvalidParameter) -> web.Response:
    return web.Response(
        status=400,
        text=f"{err}\n",
        content_type=TEXT,
        headers={
            INVALID_PARAMETER_HEADER: err.parameter,
            INVALID_VALUE_HEADER: quote(
                err.entry[:_HEADER_ENTRY_CHARS].encode("utf-8", "backslashreplace"), safe=""
            ),
        },
    )


# 503 while the node's driver is being replaced (status and health cannot be read); the
# body is one line, e.g. "driver upgrade in progress". Clients retry after a second.
RETRY_AFTER_S = "1"


def _unavailable(why: str) -> web.Response:
    return web.Response(
        status=503, text=f"{why}\n", content_type=TEXT, headers={"Retry-After": RETRY_AFTER_S}
    )


def _refused(err: UnhealthyDevice) -> web.Response:
    """409: the GPU exists but may not be handed out now; the headers name the entry."""
    return web.Response(
        status=409,
        text=f"{err}\n",
        content_type=TEXT,
        headers={INVALID_PARAMETER_HEADER: "dev", INVALID_VALUE_HEADER: quote(err.entry, safe="")},
    )


async def _info(request: web.Request, as_json: bool) -> web.Response:
    facts = request.app[NODE].facts
    dev = request.query.get("dev")
    if dev is None:
        return _answer(facts.info_json, JSON) if as_json else _answer(facts.info_text, TEXT)
    try:
        node = _subset(facts.node, facts.devices(dev))
    except InvalidParameter as err:
        return _bad_request(err)
    if as_json:
        return _answer(render_json.info(node), JSON)
    return _answer(render_text.info(node).encode(), TEXT)


async def gpu_info(request: web.Request) -> web.Response:
    return await _info(request, as_json=False)


async def gpu_info_json(request: web.Request) -> web.Response:
    return await _info(request, as_json=True)


def _subset(node: NodeInfo, devices: tuple[DeviceInfo, ...]) -> NodeInfo:
    return NodeInfo(node.driver_version, node.cuda_version, devices)


async def _status(request: web.Request, as_json: bool) -> web.Response:
    facts = request.app[NODE].facts
    try:
        devices = facts.devices(request.query.get("dev"))
    except InvalidParameter as err:
        return _bad_request(err)
    try:
        sweep = await request.app[STATUS].sweep()
    except StatusUnavailable as err:
        return _unavailable(str(err))
    if as_json:
        response = _answer(sweep.json_body(devices), JSON)
    else:
        response = _answer(sweep.text_body(devices).encode(), TEXT)
    if sweep.throughput_age_s is not None:
        response.headers["X-PCIe-Throughput-Age-Ms"] = str(round(sweep.throughput_age_s * 1000))
    return response


async def gpu_status(request: web.Request) -> web.Response:
    return await _status(request, as_json=False)


async def gpu_status_json(request: web.Request) -> web.Response:
    return await _status(request, as_json=True)


async def _docker(request: web.Request, as_json: bool) -> web.Response:
    facts = request.app[NODE].facts
    dev, vol, fmt = (request.query.get(name) for name in ("dev", "vol", "format"))
    try:
        if fmt in (None, "", "legacy"):
            body = facts.docker_cli(dev, vol, as_json)
        elif fmt == "cdi":
            if CDI not in request.app:
                hint = " (this agent writes no CDI spec: start it with --cdi-spec-dir DIR)"
                raise InvalidParameter("format", fmt, hint)
            body = facts.docker_cli_cdi(dev, vol, as_json, request.app[CDI].naming)
        else:
            raise InvalidParameter("format", fmt, f" (expected {' or '.join(DOCKER_FORMATS)})")
    except InvalidParameter as err:
        return _bad_request(err)
    except UnhealthyDevice as err:
        return _refused(err)
    return _answer(body, JSON if as_json else TEXT)


async def docker_cli_text(request: web.Request) -> web.Response:
    return await _docker(request, as_json=False)


async def docker_cli_json(request: web.Request) -> web.Response:
    return await _docker(request, as_json=True)


LEFT_OUT_HEADER = "X-Left-Out"  # what a Mesos line does not offer, and why


async def mesos_cli(request: web.Request) -> web.Response:
    facts = request.app[NODE].facts
    try:
        answer = facts.mesos.render(request.query.get("format"), request.query.get("dev"))
    except InvalidParameter as err:
        return _bad_request(err)
    except UnhealthyDevice as err:
        return _refused(err)
    response = _answer(answer.body, TEXT)
    if answer.left_out:
        response.headers[LEFT_OUT_HEADER] = "; ".join(answer.left_out)
    return response


async def cdi_spec(request: web.Request) -> web.Response:
    """The node's CDI spec, the bytes of the file engines read (docs/cdi.md)."""
    writer = request.app.get(CDI)
    if writer is None:
        return web.Response(
            status=404,
            text="no CDI spec: this agent runs without --cdi-spec-dir\n",
            content_type=TEXT,
        )
    aside = writer.aside  # another producer's spec serves the devices (docs/cdi.md)
    if aside is not None:
        return web.Response(status=409, text=f"{aside}\n", content_type=TEXT)
    body = writer.current
    if body is None:
        return web.Response(
            status=503,
            text=f"the CDI spec {writer.path} could not be written: see the agent's log\n",
            content_type=TEXT,
        )
    return _answer(body, JSON)


async def _health(request: web.Request, as_json: bool) -> web.Response:
    unavailable = request.app[STATUS].unavailable
    if unavailable is not None:
        return _unavailable(unavailable)
    facts = request.app[NODE].facts
    try:
        devices = facts.devices(request.query.get("dev"))
    except InvalidParameter as err:
        return _bad_request(err)
    if as_json:
        return _answer(health_routes.health_json(devices, facts.health), JSON)
    return _answer(health_routes.health_text(devices, facts.health), TEXT)


async def gpu_health(request: web.Request) -> web.Response:
    return await _health(request, as_json=False)


async def gpu_health_json(request: web.Request) -> web.Response:
    return await _health(request, as_json=True)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format, from the same sweeps as status (docs/metrics.md)."""
    body = await request.app[METRICS].scrape()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def gpu_processes_json(request: web.Request) -> web.Response:
    facts = request.app[NODE].facts
    try:
        devices = facts.devices(request.query.get("dev"))
    except InvalidParameter as err:
        return _bad_request(err)
    try:
        return _answer(await request.app[METRICS].processes(devices), JSON)
    except StatusUnavailable as err:
        return _unavailable(str(err))


ROUTES: tuple[tuple[str, Handler], ...] = (
    ("/gpu/info", gpu_info),
    ("/gpu/info/json", gpu_info_json),
    ("/gpu/status", gpu_status),
    ("/gpu/status/json", gpu_status_json),
    ("/docker/cli", docker_cli_text),
    ("/docker/cli/json", docker_cli_json),
    ("/mesos/cli", mesos_cli),
    ("/gpu/processes/json", gpu_processes_json),
    ("/metrics", metrics),
    ("/gpu/health", gpu_health),
    ("/gpu/health/json", gpu_health_json),
    ("/cdi/spec", cdi_spec),
    ("/engines/json", engines_json),
)


Wrapper = Callable[[Handler], Handler]
UNMATCHED = "unmatched"  # the name of the route of every path the API does not serve


async def _not_found(_request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound


def _methods_checked(handlers: dict[str, Handler]) -> Handler:
    """The handler of each method (HEAD: GET's), answered as aiohttp answers a route's other
    methods (405) for any other."""
    if "GET" in handlers:
        handlers = {**handlers, "HEAD": handlers["GET"]}
    allowed = tuple(sorted(handlers))

    async def checked(request: web.Request) -> web.StreamResponse:
        handler = handlers.get(request.method)
        if handler is None:
            raise web.HTTPMethodNotAllowed(request.method, allowed)
        return await handler(request)

    return checked


def create_app(
    node: NodeState,
    status: StatusService,
    *,
    around: Sequence[Wrapper] = (),
    metrics: MetricsService | None = None,
    cdi: CdiSpecWriter | None = None,
    leases: LeaseService | None = None,
    remote_lease_writes: bool = False,
    usage: UsageLedger | None = None,
    usage_off: str | None = None,
    engines: Callable[[], Sequence[EngineEvents]] | None = None,
    engine_socket: Path | None = None,
) -> web.Application:
    """The REST application; the caller owns ``status`` (start its sampler, close it).

    ``around`` wrap every route's handler, outermost first (the daemon's connection guard,
    then its token check where it has tokens): wrappers rather than middlewares, because
    aiohttp builds every middleware's call anew for each request. Every path the API does
    not serve has a route of its own (``unmatched``: 404, counted under that one name) and
    every route takes every method (405 but for its own: GET and HEAD, and the lease
    routes' POST and DELETE), so that what wraps the
    routes sees every request, as a middleware would. ``metrics`` serves ``/metrics`` and
    ``/gpu/processes/json`` (the daemon's has the Docker engine and its counters; without
    one, a plain one over ``node`` and ``status``). The query checks (agent.api.query) are
    the innermost: a handler never sees a bad ``dev``.
    """
    app = web.Application()
    app[NODE] = node
    app[STATUS] = status
    app[METRICS] = metrics if metrics is not None else MetricsService(node, status)
    if cdi is not None:
        app[CDI] = cdi
    if engines is not None:  # the followed engines, for /engines/json
        app[ENGINES] = engines
    if engine_socket is not None:  # the agent's own GPU-aware Docker socket, said there too
        app[ENGINE_SOCKET] = engine_socket
    paths: dict[str, dict[str, Handler]] = {path: {"GET": h} for path, h in ROUTES}
    if leases is not None:  # the lease routes (docs/leases.md, "The REST API")
        app[LEASES] = leases
        for method, path, handler in make_routes(remote_writes=remote_lease_writes):
            paths.setdefault(path, {})[method] = handler
    # The usage routes (docs/usage.md): without a ledger they say why there is none.
    if usage is not None:
        app[USAGE] = usage
        app[IDLE_BY_UNIT] = lambda: idle_by_unit(usage)
    if usage_off is not None:
        app[USAGE_OFF] = usage_off
    for method, path, handler in usage_routes(app[METRICS].hostname):
        paths.setdefault(path, {})[method] = handler

    def wrapped(handler: Handler) -> Handler:
        for wrap in reversed(around):
            handler = wrap(handler)
        return handler

    for path, handlers in paths.items():
        checked = {m: query_checked(h, _bad_request) for m, h in handlers.items()}
        served = wrapped(_methods_checked(checked))
        app.router.add_route("*", path, served)
        for version in API_VERSIONS:
            app.router.add_route("*", f"/{version}{path}", served)
    app.router.add_route("*", "/{path:.*}", wrapped(_not_found), name=UNMATCHED)
    return app
