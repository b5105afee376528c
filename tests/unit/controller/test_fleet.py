"""The fleet query on small real servers, and the table an operator reads."""

from __future__ import annotations

import asyncio
import io
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from controller.fleet.output import Progress, number_ranges
from controller.fleet.query import INFO, STATUS, FleetNode, NodeResult
from controller.fleet.table import Column, Row, Span, cut, render
from controller.transport.endpoint import parse_endpoint
from tests.support.fleet_output import ask_all, json_document, table

INFO_BODY = {
    "Version": {"Driver": "580.159.04", "CUDA": "13.0"},
    "Devices": [
        {
            "UUID": "GPU-825bd660-d5ca",
            "Model": "NVIDIA H200",
            "Power": 700,
            "Memory": {"Global": 143771},
        },
        {"UUID": None, "Model": None, "Power": None, "Memory": {"Global": None}},
    ],
}
STATUS_BODY = {
    "Devices": [
        {"Power": 512, "Utilization": {"GPU": 97}, "Memory": {"GlobalUsed": 121034}},
        {"Power": None, "Utilization": {"GPU": None}, "Memory": {"GlobalUsed": None}},
    ]
}


class Counter:
    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.answer_delay_s = 0.05


async def serve(handler: Callable[[web.Request], object]) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)  # type: ignore[arg-type]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    return runner, sock.getsockname()[1]


@pytest.fixture
async def slow_agents() -> AsyncIterator[tuple[list[int], Counter]]:
    """Ten agents that take 50 ms per answer (``answer_delay_s``) and count requests in flight
    across all."""
    counter = Counter()

    async def handler(request: web.Request) -> web.Response:
        counter.now += 1
        counter.peak = max(counter.peak, counter.now)
        try:
            await asyncio.sleep(counter.answer_delay_s)
        finally:
            counter.now -= 1
        body = INFO_BODY if request.path == "/gpu/info/json" else STATUS_BODY
        return web.json_response(body)

    servers = [await serve(handler) for _ in range(10)]
    try:
        yield [port for _, port in servers], counter
    finally:
        for runner, _ in servers:
            await runner.cleanup()


def node(port: int, name: str | None = None) -> FleetNode:
    text = f"http://127.0.0.1:{port}"
    return FleetNode(name or text, parse_endpoint(text))


async def test_parallel_bounds_nodes_in_flight(slow_agents: tuple[list[int], Counter]) -> None:
    ports, counter = slow_agents
    seen: list[str] = []
    results = await ask_all(
        [node(p) for p in ports],
        STATUS,
        parallel=3,
        timeout_s=5,
        on_result=lambda r: seen.append(r.node.name),
    )
    # never more than --parallel nodes at once (one request each), and more than one
    assert 2 <= counter.peak <= 3
    assert [r.node.name for r in results] == [node(p).name for p in ports]  # input order
    assert sorted(seen) == sorted(node(p).name for p in ports)  # each reported once
    assert all(r.ok and r.answers["status"] == STATUS_BODY for r in results)


async def test_timeout_is_per_node(slow_agents: tuple[list[int], Counter]) -> None:
    ports, counter = slow_agents
    # two sequential 500 ms answers do not fit in 800 ms: every node times out, on its own,
    # while waiting for an answer (connecting on loopback takes far less, even under load)
    counter.answer_delay_s = 0.5
    results = await ask_all([node(p) for p in ports], STATUS, parallel=10, timeout_s=0.8)
    assert {r.reason for r in results} == {"timeout"}
    assert all("waiting for GET /gpu/" in (r.error or "") for r in results), results
    assert all(r.elapsed_s < 2 for r in results)


async def test_connection_refused_and_http_error() -> None:
    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=503, text="busy\n")

    runner, port = await serve(fail)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = closed.getsockname()[1]
    closed.close()
    try:
        results = await ask_all([node(port), node(dead)], INFO, timeout_s=5)
    finally:
        await runner.cleanup()
    assert [r.reason for r in results] == ["HTTP 503", "connection refused"]
    assert results[0].error == "the agent answered 503 to GET /gpu/info/json: busy"


def result(name: str, **answers: object) -> NodeResult:
    return NodeResult(FleetNode(name, parse_endpoint(name)), answers)


def failed(name: str, reason: str) -> NodeResult:
    return NodeResult(FleetNode(name, parse_endpoint(name)), {}, f"{reason}: long story", reason)


def test_status_table_fits_80_columns_with_long_names() -> None:
    long_name = "gpu-node-0017.rack-07.datacenter-frankfurt.example.com:"
    results = [
        result(long_name, info=INFO_BODY, status=STATUS_BODY),
        failed("node2:", "SSH host key unknown"),
    ]
    lines = table(STATUS, results, 80)
    assert max(map(len, lines)) <= 80
    assert lines[1].split()[1:] == ["0", "H200", "118/140", "97%", "512/700", "580.159.04", "13.0"]
    assert lines[1].startswith("gpu-node-0017.rack-07")
    assert lines[1].split()[0].endswith("…")
    # a lost GPU shows dashes, never "None"
    assert lines[2].split()[1:] == ["1", "-", "-/-", "-", "-/-", "580.159.04", "13.0"]
    assert lines[3].split(None, 2)[1:] == ["-", "error: SSH host key unknown"]
    assert all(line == line.rstrip() for line in lines)


def test_info_table_and_narrow_terminal() -> None:
    lines = table(INFO, [result("node1:", info=INFO_BODY)], 80, ellipsis="~")
    assert lines[0].split() == [
        "NODE",
        "GPU",
        "MODEL",
        "MEM",
        "GiB",
        "POWER",
        "W",
        "UUID",
        "DRIVER",
        "CUDA",
    ]
    assert lines[1].split() == [
        "node1:",
        "0",
        "H200",
        "140",
        "700",
        "825bd660",
        "580.159.04",
        "13.0",
    ]


def test_json_document_keeps_answers_and_errors() -> None:
    document = json_document(
        STATUS, [result("a:", info=INFO_BODY, status=STATUS_BODY), failed("b:", "timeout")]
    )
    assert document["nodes"]["a:"]["info"] == INFO_BODY
    assert document["nodes"]["a:"]["error"] is None
    assert document["nodes"]["b:"]["reason"] == "timeout"
    assert document["summary"] == {"nodes": 2, "answered": 1, "failed": 1, "gpus": 2}


def test_render_shrinks_only_shrinkable_columns() -> None:
    columns = (Column("NAME", min_width=6), Column("N", right=True), Column("FIXED"))
    rows: list[Row] = [("a" * 30, "7", "x" * 10), Span(("b",), "z" * 50)]
    lines = render(columns, rows, 24)
    assert lines[1] == "a" * 8 + "…" + "  7  " + "x" * 10
    assert len(lines[2]) == 24
    assert cut("abcdef", 4) == "abc…"


def test_progress_draws_and_clears() -> None:
    stream = io.StringIO()
    progress = Progress("status", 2, stream)
    progress.update(failed("a:", "timeout"))
    progress.update(result("b:"))
    progress.close()
    text = stream.getvalue()
    assert "2/2 nodes  1 failed" in text
    assert text.endswith("\r\033[K")


def test_number_ranges() -> None:
    assert number_ranges([3, 0, 1, 2, 5, 7, 6]) == "0-3,5-7"
    assert number_ranges([4]) == "4"
