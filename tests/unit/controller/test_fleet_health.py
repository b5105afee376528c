"""The fleet's health: ``status`` notes unhealthy GPUs and differing drivers; ``health`` lists
only the problems and exits 1 when there is one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from controller.ctl.main import main
from controller.fleet.health_view import problems
from controller.fleet.query import STATUS, FleetNode, NodeResult
from controller.transport.endpoint import parse_endpoint
from tests.support.cli import cli_runner
from tests.support.fleet_output import ask_all, problem_lines, status_notes
from tests.unit.controller.test_fleet import INFO_BODY, STATUS_BODY, serve

UPGRADING = "driver upgrade in progress"
SICK = {
    "UUID": None,
    "Healthy": False,
    "Reason": "XID 79 (GPU has fallen off the bus)",
    "XID": 79,
    "Since": "2026-11-30T13:17:38Z",
}
WELL = {"UUID": "GPU-825bd660-d5ca", "Healthy": True, "Reason": None, "XID": None, "Since": None}


def result(name: str, driver: str = "580.159.04", **answers: object) -> NodeResult:
    info = {**INFO_BODY, "Version": {"Driver": driver, "CUDA": "13.0"}}
    return NodeResult(FleetNode(name, parse_endpoint(name)), {"info": info, **answers})


def failed(name: str, reason: str, error: str) -> NodeResult:
    return NodeResult(FleetNode(name, parse_endpoint(name)), {}, error, reason)


def test_problems_are_unhealthy_gpus_and_failed_nodes() -> None:
    results = [
        result("a:", health={"Devices": [WELL, SICK]}),
        result("b:", health={"Devices": [WELL, WELL]}),
        failed("c:", "HTTP 503", "the agent answered 503 to GET /gpu/health/json: " + UPGRADING),
        failed("d:", "connection refused", "cannot connect to the agent (connection refused)"),
        failed("e:", "HTTP 404", "the agent answered 404 to GET /gpu/health/json: 404: Not Found"),
    ]  # fmt: skip
    found = [(p.node, p.gpu, p.what, p.since, p.xid) for p in problems(results)]
    assert found == [
        ("a:", 1, "unhealthy: XID 79 (GPU has fallen off the bus)", "2026-11-30T13:17:38Z", 79),
        ("c:", None, "driver upgrade in progress", None, None),
        ("d:", None, "does not answer: cannot connect to the agent (connection refused)",
         None, None),
        ("e:", None, "its agent has no /gpu/health (an older release: upgrade it to see GPU "
         "health)", None, None),
    ]  # fmt: skip
    lines = problem_lines(results)
    assert lines[0] == (
        "a:  GPU 1  unhealthy: XID 79 (GPU has fallen off the bus)  since 2026-11-30T13:17:38Z"
    )  # whole, whatever the terminal's width
    assert lines[1] == "c:  driver upgrade in progress"
    assert len(lines) == 4
    assert problem_lines([results[1]]) == []  # nothing to say


def test_the_driver_summary_only_when_the_fleet_is_not_uniform() -> None:
    uniform = [result(f"n{i}:") for i in range(3)]
    assert status_notes(uniform) == []
    mixed = [result(f"n{i}:") for i in range(998)]
    mixed += [result("old1:", "575.64.05"), result("old2:", "575.64.05")]
    mixed.append(failed("x:", "timeout", "no answer"))
    assert status_notes(mixed) == ["drivers: 580.159.04 on 998 nodes, 575.64.05 on 2"]
    notes = status_notes([result("a:", health={"Devices": [WELL, SICK]}), *mixed[-3:]])
    assert notes == [
        "a: GPU 1 unhealthy: XID 79 (GPU has fallen off the bus) since 2026-11-30T13:17:38Z",
        "drivers: 575.64.05 on 2 nodes, 580.159.04 on 1",
    ]


Handler = Callable[[web.Request], Any]


@pytest.fixture
async def agents() -> AsyncIterator[tuple[int, int]]:
    """Two stand-in agents: a current one whose GPU 1 is unhealthy, and an older one that
    has no /gpu/health route (404, as aiohttp answers an unknown route)."""

    def agent(with_health: bool) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            if request.path == "/gpu/info/json":
                return web.json_response(INFO_BODY)
            if request.path == "/gpu/status/json":
                return web.json_response(STATUS_BODY)
            if request.path == "/gpu/health/json" and with_health:
                return web.json_response({"Devices": [WELL, SICK]})
            return web.Response(status=404, text="404: Not Found")

        return handler

    current, port = await serve(agent(True))
    older, old_port = await serve(agent(False))
    try:
        yield port, old_port
    finally:
        await current.cleanup()
        await older.cleanup()


async def test_status_reads_health_where_the_agent_has_it(agents: tuple[int, int]) -> None:
    port, old_port = agents
    nodes = [
        FleetNode(name, parse_endpoint(f"http://127.0.0.1:{p}"))
        for name, p in (("new", port), ("old", old_port))
    ]
    new, old = await ask_all(nodes, STATUS, timeout_s=5)
    assert new.ok
    assert old.ok  # an older agent is not a failure of status
    assert new.answers["health"] == {"Devices": [WELL, SICK]}
    assert old.answers["health"] is None  # an agent without the route: null, as --json shows
    assert status_notes([new, old]) == [
        "new GPU 1 unhealthy: XID 79 (GPU has fallen off the bus) since 2026-11-30T13:17:38Z"
    ]


def _ctl(*args: str) -> Any:
    return cli_runner().invoke(main, list(args), catch_exceptions=False)


async def test_health_command_exit_codes_and_output(agents: tuple[int, int]) -> None:
    port, old_port = agents
    sick = await asyncio.to_thread(_ctl, "health", f"http://127.0.0.1:{port}")
    assert sick.exit_code == 1
    assert sick.stdout.splitlines() == [
        f"http://127.0.0.1:{port}  GPU 1  unhealthy: XID 79 (GPU has fallen off the bus)  "
        "since 2026-11-30T13:17:38Z"
    ]  # GPU 0 is healthy: not listed

    as_json = await asyncio.to_thread(
        _ctl, "health", "--json", f"http://127.0.0.1:{port}", f"http://127.0.0.1:{old_port}"
    )
    assert as_json.exit_code == 1
    document = json.loads(as_json.stdout)
    assert [(p["node"], p["gpu"], p["xid"]) for p in document["problems"]] == [
        (f"http://127.0.0.1:{port}", 1, 79),
        (f"http://127.0.0.1:{old_port}", None, None),
    ]


async def test_health_says_nothing_and_exits_0_when_all_is_well() -> None:
    async def well(request: web.Request) -> web.Response:
        if request.path == "/gpu/health/json":
            return web.json_response({"Devices": [WELL]})
        return web.json_response(INFO_BODY)

    runner, port = await serve(well)
    try:
        done = await asyncio.to_thread(_ctl, "health", f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()
    assert done.exit_code == 0
    assert done.stdout == ""
    assert "1 node, 1 answered" in done.stderr


HEALTHY = {"Devices": [WELL, WELL]}


async def test_status_shows_a_node_whose_info_has_no_version_object_among_the_others() -> None:
    # An agent-like answer whose "Version" is not an object (null, a string) is that node's
    # row with '-' for the driver; it used to end the whole query as an internal error.
    async def odd(request: web.Request) -> web.Response:
        if request.path == "/gpu/info/json":
            return web.json_response({**INFO_BODY, "Version": None})
        return web.json_response(STATUS_BODY if request.path == "/gpu/status/json" else HEALTHY)

    async def well(request: web.Request) -> web.Response:
        if request.path == "/gpu/info/json":
            return web.json_response(INFO_BODY)
        return web.json_response(STATUS_BODY if request.path == "/gpu/status/json" else HEALTHY)

    odd_runner, odd_port = await serve(odd)
    well_runner, well_port = await serve(well)
    try:
        done = await asyncio.to_thread(
            _ctl, "status", f"http://127.0.0.1:{odd_port}", f"http://127.0.0.1:{well_port}"
        )
    finally:
        await odd_runner.cleanup()
        await well_runner.cleanup()
    assert "internal error" not in done.stderr
    assert done.exit_code == 0
    drivers = {line.split()[0]: line.split()[-2] for line in done.stdout.splitlines()[1:]}
    assert drivers == {
        f"http://127.0.0.1:{odd_port}": "-",
        f"http://127.0.0.1:{well_port}": "580.159.04",
    }
    assert "2 nodes, 2 answered (4 GPUs), 0 failed" in done.stderr
