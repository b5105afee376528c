"""What the connection limits and query checks cost per request, with and without them.

    python -m tests.benchmarks.bench_limits [--bursts 20] [--burst 0.25]

Two REST servers in this process, on the simulated ``hgx-h200-8`` node, the same
``agent.api.routes`` routes: one as the daemon serves them (``ConnectionGuard`` with its
middleware and ``GuardedSite``, the query checks, ``HttpErrorLog``), one without any of it
(the routes on a plain ``web.TCPSite``). A closed-loop client in the same process loads
them in alternating short bursts, so that whatever else the machine runs weighs on both
alike; per burst it counts the requests answered and the process's CPU time (client and
server: the client's share is the same for both). Rows: keep-alive connections
(tests.benchmarks.loadgen), and a new connection for every request (``Connection:
close``), where the guard's per-connection bookkeeping shows. Medians over the bursts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

from aiohttp import web

from agent.api import routes as rest
from agent.api.docker_cli import control_devices
from agent.edge.connections import ConnectionGuard, ConnectionLimits, GuardedSite
from agent.edge.error_log import HttpErrorLog
from agent.gpu.simulated import SimulatedBackend
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.benchmarks.loadgen import read_answer
from tests.support.readers import ThreadReader
from tests.support.services import free_port

HOST = "127.0.0.1"
KEEP_ALIVE_ROWS = (("/gpu/info/json", 16), ("/docker/cli?dev=0+1", 16), ("/gpu/status/json", 16))
CHURN_CLIENTS = 8

Load = Callable[[int], Awaitable[int]]


async def keep_alive_requests(
    port: int, path: str, clients: int, duration_s: float, tls: ssl.SSLContext | None = None
) -> int:
    """Requests answered by ``clients`` keep-alive connections, one request in flight each
    (over TLS with ``tls``).

    In this process on purpose: the CPU figure is this process's, client and servers alike.
    """
    request = f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    deadline = time.perf_counter() + duration_s
    done = [0]

    async def loop() -> None:
        reader, writer = await asyncio.open_connection(HOST, port, ssl=tls)
        try:
            while time.perf_counter() < deadline:
                writer.write(request)
                head = await read_answer(reader)
                done[0] += head.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
            await writer.wait_closed()

    await asyncio.gather(*(loop() for _ in range(clients)))
    return done[0]


async def new_connection_requests(
    port: int, path: str, clients: int, duration_s: float, tls: ssl.SSLContext | None = None
) -> int:
    """Requests answered by ``clients`` loops of one new connection per request."""
    request = f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode()
    deadline = time.perf_counter() + duration_s
    done = [0]

    async def loop() -> None:
        while time.perf_counter() < deadline:
            reader, writer = await asyncio.open_connection(HOST, port, ssl=tls)
            writer.write(request)
            reply = await reader.read()
            writer.close()
            await writer.wait_closed()
            done[0] += reply.startswith(b"HTTP/1.1 200")

    await asyncio.gather(*(loop() for _ in range(clients)))
    return done[0]


@dataclass(frozen=True, slots=True)
class BurstFigures:
    """Medians over the bursts of one load on one server."""

    rate: float  # requests answered per second
    cpu_us: float  # this process's CPU time per request answered (client and server)

    def cell(self) -> str:
        return f"{self.rate:>8,.0f} req/s {self.cpu_us:>7.1f} us/req"


async def alternate_bursts(
    loads: Mapping[str, Callable[[], Awaitable[int]]], bursts: int
) -> dict[str, BurstFigures]:
    """Run every load once per round, ``bursts`` rounds, so that whatever else the machine
    does weighs on all alike; each load returns the requests it had answered."""
    rates: dict[str, list[float]] = {name: [] for name in loads}
    cpu_us: dict[str, list[float]] = {name: [] for name in loads}
    for _ in range(bursts):
        for name, load in loads.items():
            cpu, wall = time.process_time(), time.perf_counter()
            answered = await load()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            rates[name].append(answered / wall)
            cpu_us[name].append(cpu / max(answered, 1) * 1e6)
    return {
        name: BurstFigures(statistics.median(rates[name]), statistics.median(cpu_us[name]))
        for name in loads
    }


@contextlib.asynccontextmanager
async def simulated_rest_node() -> AsyncIterator[tuple[NodeState, StatusService]]:
    """The 8-GPU simulated node and its status service, as the REST routes need them."""
    backend = SimulatedBackend.from_file("hgx-h200-8")
    info = backend.node_info()
    status = StatusService(ThreadReader(backend), info)
    try:
        await status.sample_pcie()
        yield NodeState(NodeFacts(info, control_devices())), status
    finally:
        await status.close()
        backend.close()


async def cleanup(runners: Iterable[web.AppRunner]) -> None:
    for runner in runners:
        await runner.cleanup()


async def _serve(
    guarded: bool, node: NodeState, status: StatusService
) -> tuple[web.AppRunner, int]:
    port = free_port()
    if guarded:
        guard = ConnectionGuard("REST API", ConnectionLimits(10.0, 60.0, 1024))
        app = rest.create_app(node, status, around=[guard.wrap])
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, logger=HttpErrorLog("REST API")
        )
        await runner.setup()
        await GuardedSite(runner, guard, host=HOST, port=port).start()
    else:
        app = web.Application()
        app[rest.NODE] = node
        app[rest.STATUS] = status
        for path, handler in rest.ROUTES:
            app.router.add_get(path, handler)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, HOST, port, reuse_address=True).start()
    return runner, port


async def _bench(bursts: int, burst_s: float) -> None:
    async with simulated_rest_node() as (node, status):
        served = {n: await _serve(n == "with", node, status) for n in ("without", "with")}
        try:
            await _rows(served, bursts, burst_s)
        finally:
            await cleanup(runner for runner, _port in served.values())
    print(f"(medians of {bursts} alternating bursts of {burst_s:g} s; CPU: client and server)")


async def _rows(served: dict[str, tuple[web.AppRunner, int]], bursts: int, burst_s: float) -> None:
    rows: list[tuple[str, Load]] = []
    for path, clients in KEEP_ALIVE_ROWS:

        async def keep_alive(port: int, path: str = path, clients: int = clients) -> int:
            return await keep_alive_requests(port, path, clients, burst_s)

        rows.append((f"{path}, {clients} keep-alive clients", keep_alive))

    def churn(port: int) -> Awaitable[int]:
        return new_connection_requests(port, "/gpu/info/json", CHURN_CLIENTS, burst_s)

    rows.append((f"/gpu/info/json, {CHURN_CLIENTS} clients, new connection each", churn))
    print(f"{'row':<52} {'without limits':>24} {'with limits':>24}  CPU")
    for what, load in rows:
        figures = await alternate_bursts(
            {name: partial(load, port) for name, (_runner, port) in served.items()}, bursts
        )
        without, with_ = figures["without"], figures["with"]
        change = with_.cpu_us / without.cpu_us - 1
        print(f"{what:<52} {without.cell():>24} {with_.cell():>24}  {change * 100:+.1f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--burst", type=float, default=0.25, help="seconds per burst")
    args = parser.parse_args()
    asyncio.run(_bench(args.bursts, args.burst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
