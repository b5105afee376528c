"""The REST API's fast path (agent.edge.fast_gets): the same bytes as aiohttp's answers.

One application, the daemon's routes over the simulated 8-GPU node, served on two loopback
ports by the same runner: one with the fast path, as the daemon serves it, one without.
Every request is sent to both as raw bytes, and the answers compared byte for byte (the
``Date`` line aside, which may cross a second).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from agent.api.fast_routes import fast_gets
from agent.api.routes import Wrapper, create_app
from agent.edge.connections import ConnectionGuard, ConnectionLimits, GuardedSite
from agent.edge.error_log import HttpErrorLog
from agent.edge.fast_gets import FastGets
from agent.edge.tokens import TokenStore, require_token
from agent.metrics.agent_metrics import AgentMetrics
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.support.services import free_port
from tests.unit.agent.conftest import CONTROL, CountingBackend
from tests.unit.agent.test_connection_guard import GUARD_LOG, timeouts

FAST_PATHS = [
    "/gpu/info",
    "/gpu/info/json",
    "/docker/cli",
    "/docker/cli/json",
    "/mesos/cli",
    "/gpu/status",
    "/gpu/status/json",
]
FAST_TARGETS = [p for path in FAST_PATHS for p in (path, f"/v1.0{path}")]
DATE = re.compile(rb"\r\nDate: [^\r]*\r\n")
# The PCIe sample's age moves between two asks of status; the line itself must be there.
AGE = re.compile(rb"\r\nX-PCIe-Throughput-Age-Ms: \d+\r\n")


@dataclass
class Served:
    fast_port: int
    plain_port: int
    fast: FastGets
    guard: ConnectionGuard
    counters: AgentMetrics
    runner: web.AppRunner
    status: StatusService

    async def close(self) -> None:
        await self.runner.cleanup()
        await self.status.close()


async def _serve(
    token_file: Path | None = None,
    *,
    limits: ConnectionLimits | None = None,
    open_to_all: bool = True,
) -> Served:
    backend = CountingBackend("hgx-h200-8")
    node = backend.node_info()
    status = StatusService(backend, node, pcie_interval_s=60)
    await status.sample_pcie()
    counters = AgentMetrics()
    guard = ConnectionGuard(
        "REST API", limits or ConnectionLimits(10, 60, 64), on_answer=counters.count
    )
    around: list[Wrapper] = [guard.wrap]
    if token_file is not None:
        around.append(require_token(TokenStore(token_file), plain_loopback=False))
    app = create_app(NodeState(NodeFacts(node, CONTROL)), status, around=around)
    runner = web.AppRunner(app, logger=HttpErrorLog("REST API"), handle_signals=False)
    await runner.setup()
    fast = fast_gets(app, counters.count_resource, lambda _transport: open_to_all)
    fast_port, plain_port = free_port(), free_port()
    await GuardedSite(runner, guard, host="127.0.0.1", port=fast_port, fast=fast).start()
    await GuardedSite(runner, guard, host="127.0.0.1", port=plain_port).start()
    return Served(fast_port, plain_port, fast, guard, counters, runner, status)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    both = await _serve()
    yield both
    await both.close()


async def _exchange(port: int, data: bytes, answers: int = 1) -> bytes:
    """``data`` sent at once; the bytes of ``answers`` answers read back (or all, up to the
    end, when the server closes first)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        got = b""
        for _ in range(answers):
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            except asyncio.IncompleteReadError as err:
                return got + err.partial
            length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
            if data.startswith(b"HEAD "):
                length = 0  # the length GET's body would have, and no body
            got += head + await asyncio.wait_for(reader.readexactly(length), 5)
        return got
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _both(served: Served, data: bytes, answers: int = 1) -> tuple[bytes, bytes]:
    fast = await _exchange(served.fast_port, data, answers)
    plain = await _exchange(served.plain_port, data, answers)
    return _same_moment(fast), _same_moment(plain)


def _same_moment(answer: bytes) -> bytes:
    answer = AGE.sub(b"\r\nX-PCIe-Throughput-Age-Ms: -\r\n", answer)
    return DATE.sub(b"\r\nDate: -\r\n", answer)


def get(target: str, *headers: str) -> bytes:
    lines = [f"GET {target} HTTP/1.1", "Host: node", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize("target", FAST_TARGETS)
@pytest.mark.parametrize(
    "headers",
    [
        (),
        ("Connection: close",),
        ("connection: Keep-Alive",),
        ("User-Agent: curl/8", "Accept: */*"),
    ],
)
async def test_a_fast_answer_is_aiohttps_answer_byte_for_byte(
    served: Served, target: str, headers: tuple[str, ...]
) -> None:
    fast, plain = await _both(served, get(target, *headers))
    assert fast == plain
    assert fast.startswith(b"HTTP/1.1 200 OK\r\n")
    assert target.encode() in served.fast.kept  # answered by the fast path, not aiohttp


@pytest.mark.parametrize(
    "request_bytes",
    [
        get("/gpu/info/json?dev=0"),  # a query
        get("/gpu/health/json"),  # not a kept answer
        get("/nowhere"),
        b"HEAD /gpu/info/json HTTP/1.1\r\nHost: node\r\n\r\n",
        b"POST /gpu/info/json HTTP/1.1\r\nHost: node\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /gpu/info/json HTTP/1.0\r\n\r\n",
        get("/gpu/info/json", "Content-Length: 3") + b"abc",
        get("/gpu/info/json", "Transfer-Encoding: chunked") + b"0\r\n\r\n",
        get("/gpu/info/json", "Bad Header: x"),
        get("/gpu/info/json", "X-Bad: a\x01b"),
        get("/gpu/info/json", "Connection: Upgrade", "Upgrade: websocket"),
        get("/gpu/info/json", "X-Long: " + "a" * 9000),
        get("/gpu/info//json"),
        get("/GPU/info/json"),
    ],
)
async def test_what_the_fast_path_does_not_answer_aiohttp_does(
    served: Served, request_bytes: bytes
) -> None:
    fast, plain = await _both(served, request_bytes)
    assert fast == plain
    assert fast  # some answer


async def test_pipelined_requests_are_answered_in_order_across_the_hand_over(
    served: Served,
) -> None:
    targets = ["/gpu/info/json", "/gpu/status", "/mesos/cli", "/gpu/health", "/docker/cli"]
    fast, plain = await _both(served, b"".join(get(t) for t in targets), answers=len(targets))
    assert fast == plain
    assert fast.count(b"HTTP/1.1 200 OK") == len(targets)
    assert set(served.fast.kept) == {b"/gpu/info/json", b"/gpu/status", b"/mesos/cli"}


async def test_requests_behind_a_status_sweep_wait_for_it_in_order(served: Served) -> None:
    """Each status request takes a new sweep (the 2 ms share is over by then): the
    requests sent behind it wait, and every answer comes in the order asked."""
    await asyncio.sleep(0.01)
    targets = ["/gpu/status/json", "/gpu/info", "/gpu/status", "/docker/cli/json"] * 3
    answers = await _exchange(
        served.fast_port, b"".join(get(t) for t in targets), answers=len(targets)
    )
    bodies = [part for part in answers.split(b"HTTP/1.1 200 OK\r\n") if part]
    assert len(bodies) == len(targets)
    for target, answer in zip(targets, bodies, strict=True):
        if target == "/gpu/status":
            assert b"\r\n\r\nGPU" in answer or b"Power" in answer
        assert (b"application/json" in answer) == target.endswith("/json")
    assert served.counters.requests.counts["/gpu/status/json", "200"] == 3


async def test_status_while_the_driver_is_replaced_is_aiohttps_503(served: Served) -> None:
    served.status.suspend("driver upgrade in progress")
    fast, plain = await _both(served, get("/gpu/status/json") + get("/gpu/info"), answers=2)
    assert fast == plain
    assert fast.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"driver upgrade in progress\n" in fast
    assert fast.count(b"HTTP/1.1 200 OK") == 1  # the request behind it: answered by aiohttp


async def test_a_head_sent_byte_by_byte_is_answered_once_whole(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.fast_port)
    for byte in get("/docker/cli"):
        writer.write(bytes([byte]))
        await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    writer.close()


@pytest.mark.parametrize(
    "begun",
    [
        b"\x16\x03\x01\x02\x00\x01",
        b"GARBAGE",
        b"GET /a b HTTP/1.1\r\nHost",
        b"GET /nowhere HTTP/1.1\r\nHost: x",
    ],
)
async def test_the_start_of_a_request_no_fast_answer_can_follow_goes_to_aiohttp_at_once(
    served: Served, begun: bytes
) -> None:
    """A TLS hello to the plain port, or a bad request line, gets aiohttp's 400 (or waits for
    the rest of its head) as it did before, not the fast path's wait for a whole head."""
    fast, plain = await _both(served, begun + b"\r\n\r\n" if b"Host" in begun else begun)
    assert fast == plain
    assert not served.fast.kept


async def test_fast_answers_are_counted_under_their_routes(served: Served) -> None:
    requests = get("/gpu/info/json") * 3 + get("/v1.0/docker/cli")
    await _exchange(served.fast_port, requests, answers=4)
    counts = served.counters.requests.counts
    assert counts["/gpu/info/json", "200"] == 3
    assert counts["/v1.0/docker/cli", "200"] == 1


async def test_many_pipelined_requests_unread_are_all_answered_in_the_end(
    served: Served,
) -> None:
    count = 3000  # about 2 MB of answers, past the transport's write buffer limits
    answers = await _exchange(served.fast_port, get("/gpu/info/json") * count, answers=count)
    assert answers.count(b"HTTP/1.1 200 OK\r\n") == count


async def test_a_connection_that_needs_a_token_gets_aiohttps_refusal(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("s3cret-s3cret-s3cret\n")
    (tmp_path / "tokens").chmod(0o600)
    both = await _serve(tmp_path / "tokens", open_to_all=False)
    try:
        fast, plain = await _both(both, get("/gpu/info/json"))
        assert fast == plain
        assert fast.startswith(b"HTTP/1.1 401 ")
        assert not both.fast.kept
        fast, plain = await _both(
            both, get("/gpu/info/json", "Authorization: Bearer s3cret-s3cret-s3cret")
        )
        assert fast == plain
        assert fast.startswith(b"HTTP/1.1 200 OK\r\n")
    finally:
        await both.close()


async def test_the_guard_times_out_a_fast_connection_that_stalls_mid_head(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, GUARD_LOG)
    both = await _serve(limits=ConnectionLimits(0.3, 60, 64))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", both.fast_port)
        writer.write(get("/gpu/info") + b"GET /gpu/info HTTP/1.1\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK")
        await asyncio.wait_for(reader.read(), 5)  # the rest of the answer, then the end
        assert reader.at_eof()
        assert timeouts(caplog) == ["request header not complete"]
        writer.close()
    finally:
        await both.close()


async def test_stopping_the_server_closes_the_fast_paths_connections(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.fast_port)
    writer.write(get("/gpu/info/json"))
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    await served.runner.cleanup()
    assert await asyncio.wait_for(reader.read(), 5) != b"" or reader.at_eof()
    assert reader.at_eof()
    writer.close()
