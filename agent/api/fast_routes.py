"""The REST routes whose plain GET the HTTP edge answers itself (``agent.edge.fast_gets``).

``/gpu/info[/json]``, ``/docker/cli[/json]`` and ``/mesos/cli`` (rendered once per node
state) and ``/gpu/status[/json]`` (once per status sweep), under ``/v1.0`` and without, asked
without a query. Each gives the bytes its aiohttp route gives for the same request
(``agent.api.routes``), read from the node's state at each request (a driver or health
change swaps it). Status shares a sweep taken within the last 2 ms at once, else joins or
takes one. What is not a plain answer stays aiohttp's: a ``/mesos/cli`` that leaves a GPU
out (its ``X-Left-Out`` header), a refusal, status while the driver is replaced (503). Each
answer is counted under its route, as aiohttp's would be.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractResource

from agent.api.routes import API_VERSIONS, NODE, STATUS
from agent.edge.fast_gets import Answer, FastGets, FastRoute
from agent.health.selection import UnhealthyDevice
from agent.node.selection import InvalidParameter
from agent.node.state import NodeState
from agent.node.status import StatusService, StatusUnavailable, Sweep

JSON = "application/json; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
Count = Callable[[AbstractResource | None, int], None]
Now = Callable[[], Answer | None]
Later = Callable[[], Awaitable[Answer | None]]


def _static(state: NodeState) -> dict[str, tuple[Now, str]]:
    def info(as_json: bool) -> Answer:
        facts = state.facts
        return b"", facts.info_json if as_json else facts.info_text

    def docker_cli(as_json: bool) -> Answer | None:
        try:
            return b"", state.facts.docker_cli(None, None, as_json)
        except (InvalidParameter, UnhealthyDevice):
            return None  # aiohttp's route renders the refusal

    def mesos_cli() -> Answer | None:
        answer = state.facts.mesos.render(None, None)
        return None if answer.left_out else (b"", answer.body)

    return {
        "/gpu/info": (partial(info, False), TEXT),
        "/gpu/info/json": (partial(info, True), JSON),
        "/docker/cli": (partial(docker_cli, False), TEXT),
        "/docker/cli/json": (partial(docker_cli, True), JSON),
        "/mesos/cli": (mesos_cli, TEXT),
    }


class _StatusAnswers:
    """``/gpu/status[/json]``'s answers: the sweep's body, and the PCIe sample's age."""

    def __init__(self, state: NodeState, status: StatusService, as_json: bool) -> None:
        self._state = state
        self._status = status
        self._as_json = as_json
        self._text: tuple[Sweep | None, bytes] = (None, b"")  # the text body, encoded once

    def now(self) -> Answer | None:
        sweep = self._status.shared()
        return None if sweep is None else self._answer(sweep)

    async def later(self) -> Answer | None:
        try:
            sweep = await self._status.sweep()
        except StatusUnavailable:
            return None  # aiohttp's route answers 503 with why
        return self._answer(sweep)

    def _answer(self, sweep: Sweep) -> Answer:
        devices = self._state.facts.devices(None)
        if self._as_json:
            body = sweep.json_body(devices)
        else:
            kept, body = self._text
            if kept is not sweep:
                body = sweep.text_body(devices).encode()
                self._text = (sweep, body)
        age = sweep.throughput_age_s
        if age is None:
            return b"", body
        return f"X-PCIe-Throughput-Age-Ms: {round(age * 1000)}\r\n".encode(), body


def fast_gets(
    app: web.Application, count: Count, open_to: Callable[[asyncio.BaseTransport], bool]
) -> FastGets:
    """The fast path of ``app`` (``create_app``'s): its routes, counted with ``count``, on
    the connections ``open_to`` allows (those that need no token)."""
    state, status = app[NODE], app[STATUS]
    answers: dict[str, tuple[Now, str, Later | None]] = {
        path: (now, content_type, None) for path, (now, content_type) in _static(state).items()
    }
    for path, as_json, content_type in (
        ("/gpu/status", False, TEXT),
        ("/gpu/status/json", True, JSON),
    ):
        route = _StatusAnswers(state, status, as_json)
        answers[path] = (route.now, content_type, route.later)
    resources = {resource.canonical: resource for resource in app.router.resources()}
    routes: dict[bytes, FastRoute] = {}
    for path, (now, content_type, later) in answers.items():
        for target in (path, *(f"/{version}{path}" for version in API_VERSIONS)):
            counted = partial(count, resources[target], 200)
            routes[target.encode()] = FastRoute(now, content_type, counted, later)
    return FastGets(routes, open_to)
