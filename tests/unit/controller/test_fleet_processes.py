"""``nvidia-docker-ctl status --processes``: who uses each GPU, and agents that cannot say."""

from __future__ import annotations

import socket

from aiohttp import web

from controller.fleet.output import process_owner
from controller.fleet.query import STATUS_WITH_PROCESSES, FleetNode, NodeResult
from controller.transport.endpoint import parse_endpoint
from tests.support.fleet_output import ask_all, json_document, table

INFO = {
    "Version": {"Driver": "580.159.04", "CUDA": "13.0"},
    "Devices": [{"Model": "NVIDIA H200", "Power": 700, "Memory": {"Global": 143771}}] * 3,
}
STATUS = {"Devices": [{"Power": 512, "Utilization": {"GPU": 97}, "Memory": {"GlobalUsed": 1}}] * 3}


def _process(pid: int, owner: str, **fields: object) -> dict[str, object]:
    return {"PID": pid, "Name": "python3", "MemoryUsed": 1, "Owner": owner, "ContainerID": None,
            "ContainerName": None, "Image": None, "MesosContainer": None, **fields}  # fmt: skip


PROCESSES = {
    "Devices": [
        {"Index": 0, "Processes": [
            _process(10, "docker", ContainerID="a" * 64, ContainerName="trainer"),
            _process(11, "docker", ContainerID="a" * 64, ContainerName="trainer"),
        ]},
        {"Index": 1, "Processes": [
            _process(20, "mesos", MesosContainer="6b4a3f7e"),
            _process(21, "host"),
            _process(22, "unknown"),
        ]},
        {"Index": 2, "Processes": []},
    ]
}  # fmt: skip


def _result(name: str, **answers: object) -> NodeResult:
    return NodeResult(FleetNode(name, parse_endpoint(name)), answers)


def test_the_table_names_what_uses_each_gpu() -> None:
    lines = table(
        STATUS_WITH_PROCESSES, [_result("n1:", info=INFO, status=STATUS, processes=PROCESSES)], 160
    )
    assert lines[0].split()[-2:] == ["USED", "BY"]
    assert lines[1].endswith("13.0  trainer")  # two processes, one container: named once
    assert lines[2].endswith("13.0  mesos:6b4a3f7e, host:python3(21), unknown:python3(22)")
    assert lines[3].endswith("13.0  -")


def test_an_agent_without_the_route_shows_a_question_mark() -> None:
    lines = table(
        STATUS_WITH_PROCESSES, [_result("old:", info=INFO, status=STATUS, processes=None)], 120
    )
    assert [line.rsplit(None, 1)[1] for line in lines[1:]] == ["?", "?", "?"]


def test_container_without_a_name_shows_its_short_id() -> None:
    assert process_owner(_process(1, "docker", ContainerID="0123456789ab" + "c" * 52)) == (
        "0123456789ab"
    )
    assert process_owner(_process(1, "podman", ContainerID="f" * 64)) == "podman:" + "f" * 12
    named = _process(1, "podman", ContainerID="f" * 64, ContainerName="trainer")
    assert process_owner(named) == "podman:trainer"
    assert process_owner(_process(1, "cri-o", ContainerID="e" * 64)) == "cri-o:" + "e" * 12


def test_a_mesos_task_in_a_docker_container_shows_as_the_task() -> None:
    process = _process(1, "docker", ContainerID="a" * 64, ContainerName="mesos-6b4a3f7e",
                       MesosContainer="6b4a3f7e")  # fmt: skip
    assert process_owner(process) == "mesos:6b4a3f7e"


async def test_older_agents_answer_404_and_still_count_as_answered() -> None:
    async def old_agent(request: web.Request) -> web.Response:
        if request.path == "/gpu/info/json":
            return web.json_response(INFO)
        if request.path == "/gpu/status/json":
            return web.json_response(STATUS)
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/{tail:.*}", old_agent)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    port = sock.getsockname()[1]
    name = f"http://127.0.0.1:{port}"
    try:
        (result,) = await ask_all(
            [FleetNode(name, parse_endpoint(name))], STATUS_WITH_PROCESSES, timeout_s=5
        )
    finally:
        await runner.cleanup()
    assert result.ok, result.error
    assert result.answers["processes"] is None
    assert json_document(STATUS_WITH_PROCESSES, [result])["nodes"][name]["processes"] is None
