"""Streaming fleet output: the same table and JSON as before, printed as nodes answer, bounded."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest

from controller.fleet.query import INFO, STATUS, FleetNode, NodeResult
from controller.fleet.report import (
    MAX_ERROR_LINES,
    JsonDocumentSink,
    OrderedWindow,
    Summary,
    TableSink,
)
from controller.transport.endpoint import parse_endpoint
from tests.support.fleet_output import whole_table

INFO_BODY: dict[str, Any] = {
    "Version": {"Driver": "580.159.04", "CUDA": "13.0"},
    "Devices": [
        {"UUID": "GPU-825bd660-d5ca", "Model": "NVIDIA H200", "Power": 700,
         "Memory": {"Global": 143771}},
    ],
}  # fmt: skip
STATUS_BODY = {
    "Devices": [{"Power": 512, "Utilization": {"GPU": 97}, "Memory": {"GlobalUsed": 121034}}]
}


def _node(name: str) -> FleetNode:
    return FleetNode(name, parse_endpoint(f"http://{name}:3476"))


def _result(name: str, *, ok: bool = True, reason: str = "timeout") -> NodeResult:
    node = _node(name)
    if ok:
        return NodeResult(node, {"info": INFO_BODY, "status": STATUS_BODY}, elapsed_s=0.01)
    return NodeResult(node, {}, f"{name} is down", reason, 0.02)


def _fleet(count: int) -> list[NodeResult]:
    return [_result(f"gpu{i:05d}", ok=i % 7 != 3) for i in range(count)]


@pytest.mark.parametrize("count", [0, 1, 12, 200])
def test_small_table_is_the_whole_table(count: int) -> None:
    results = _fleet(count)
    out = io.StringIO()
    sink = TableSink(STATUS, [r.node for r in results], out, 80)
    for result in results:
        sink.add(result)
    sink.close()
    assert out.getvalue() == "\n".join(whole_table(STATUS, results, 80)) + "\n"


def test_large_table_streams_after_the_first_nodes() -> None:
    results = _fleet(1000)
    out = io.StringIO()
    sink = TableSink(INFO, [r.node for r in results], out, 80, lookahead=256)
    for result in results[:255]:
        sink.add(result)
    assert out.getvalue() == ""  # still fitting the columns
    sink.add(results[255])
    assert out.getvalue().count("\n") == 1 + 256  # header and the first nodes' rows
    for result in results[256:]:
        sink.add(result)
        assert out.getvalue().endswith("\n")  # each node's row as it comes
    sink.close()
    lines = out.getvalue().splitlines()
    assert lines == whole_table(INFO, results, 80)  # same names and values: same table
    assert sink.summary.as_dict() == {
        "nodes": 1000,
        "answered": 857,
        "failed": 143,
        "gpus": 857,
    }


def test_a_longer_value_later_does_not_break_the_numbers() -> None:
    results = [_result("a"), _result("b")]
    later = _result("c")
    body = json.loads(json.dumps(later.answers))
    body["info"]["Devices"][0]["Model"] = "NVIDIA H200 with a very long marketing name"
    body["info"]["Devices"][0]["Power"] = 12345678
    results.append(NodeResult(later.node, body))
    out = io.StringIO()
    sink = TableSink(STATUS, [r.node for r in results], out, 80, lookahead=2)
    for result in results:
        sink.add(result)
    sink.close()
    last = out.getvalue().splitlines()[-1]
    assert "/12345678" in last  # a number is never cut
    assert "marketing" not in last  # a name may be, as in the first rows' width
    assert "…" in last


def test_json_document_streams_one_line_per_node() -> None:
    results = _fleet(20)
    out = io.StringIO()
    sink = JsonDocumentSink(STATUS, out)
    for result in results:
        sink.add(result)
    sink.close()
    text = out.getvalue()
    document = json.loads(text)
    assert list(document) == ["command", "nodes", "summary"]
    assert document["command"] == "status"
    assert list(document["nodes"]) == [r.node.name for r in results]  # in the nodes' order
    assert document["nodes"]["gpu00000"] == {
        "endpoint": "http://gpu00000:3476",
        "info": INFO_BODY,
        "status": STATUS_BODY,
        "error": None,
        "reason": None,
        "elapsed_s": 0.01,
    }
    assert document["nodes"]["gpu00003"] == {
        "endpoint": "http://gpu00003:3476",
        "error": "gpu00003 is down",
        "reason": "timeout",
        "elapsed_s": 0.02,
    }
    assert document["summary"] == {"nodes": 20, "answered": 17, "failed": 3, "gpus": 17}
    assert text.count("\n") == 20 + 6  # one line per node around the document's frame
    empty = io.StringIO()
    JsonDocumentSink(INFO, empty).close()
    assert json.loads(empty.getvalue()) == {
        "command": "info",
        "nodes": {},
        "summary": {"nodes": 0, "answered": 0, "failed": 0, "gpus": 0},
    }


def test_summary_keeps_the_first_messages_and_counts_the_rest() -> None:
    summary = Summary()
    for i in range(MAX_ERROR_LINES + 50):
        summary.add(_result(f"n{i}", ok=False, reason="timeout" if i % 2 else "unknown host"))
    assert len(summary.errors) == MAX_ERROR_LINES
    assert summary.errors_left_out == 50
    assert summary.reasons == {"timeout": 525, "unknown host": 525}


async def test_the_window_orders_results_and_holds_the_query_back() -> None:
    emitted: list[int] = []
    window = OrderedWindow(lambda r: emitted.append(int(r.node.name)), window=4)
    results = {i: _result(str(i)) for i in range(10)}
    # nodes 1..3 finish before node 0: they wait; node 4 may not start yet
    for index in (1, 2, 3):
        await window.admit(index)
        window.put(index, results[index])
    assert emitted == []
    assert window.waiting == 3
    started = asyncio.create_task(window.admit(4))
    await asyncio.sleep(0)
    assert not started.done()  # held back: at most 4 nodes ahead of the first not printed
    window.put(0, results[0])
    await asyncio.wait_for(started, 1)
    assert emitted == [0, 1, 2, 3]
    assert window.waiting == 0
