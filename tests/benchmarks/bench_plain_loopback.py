"""What serving TLS and plain HTTP on one port (``--plain-loopback``) costs.

    python -m tests.benchmarks.bench_plain_loopback [--bursts 10] [--burst 0.3]

Three REST servers in this process, as the daemon serves them (``ConnectionGuard``,
``GuardedSite``, the ``agent.api.routes`` routes of the simulated ``hgx-h200-8`` node), with
certificates made by ``openssl``: plain HTTP only, TLS only by the event loop's own server
(``loop.create_server`` with TLS, as aiohttp serves it: what the agent did before), and TLS
or plain (``agent.edge.tls_or_plain``, what the agent does with TLS now: its own accept loop, the
bound on pending connections, and a peek at the first byte of each connection to a loopback
address). Plain rows compare the plain-only port with the shared one, TLS rows the
event loop's TLS port with the shared one, in alternating short bursts from a client in the
same process; per burst the requests answered and the process's CPU time per request
(client and server). Keep-alive rows show what a connection costs once
handed over (nothing: the same transport); new-connection rows show the accept path.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import ssl
import sys
import tempfile
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

from aiohttp import web

from agent.api import routes as rest
from agent.edge.connections import ConnectionGuard, ConnectionLimits, GuardedSite
from agent.edge.error_log import HttpErrorLog
from agent.edge.tls import ServerTls, TlsFiles
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.benchmarks.bench_limits import (
    HOST,
    alternate_bursts,
    cleanup,
    keep_alive_requests,
    new_connection_requests,
    simulated_rest_node,
)
from tests.support.certs import make_pki
from tests.support.services import free_port

PATH = "/gpu/info/json"
Load = Callable[[int, ssl.SSLContext | None], Awaitable[int]]


async def _serve(
    node: NodeState,
    status: StatusService,
    tls: ssl.SSLContext | None,
    plain_loopback: bool,
    *,
    event_loop_tls: bool = False,
) -> tuple[web.AppRunner, int]:
    """The REST routes as the daemon serves them; ``event_loop_tls``: TLS by the event
    loop's own server (``loop.create_server``, aiohttp's ``TCPSite``) instead."""
    guard = ConnectionGuard("REST API", ConnectionLimits(10.0, 60.0, 1024))
    app = rest.create_app(node, status, around=[guard.wrap])
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, logger=HttpErrorLog("REST API")
    )
    await runner.setup()
    if event_loop_tls:
        port = free_port()
        await web.TCPSite(runner, HOST, port, ssl_context=tls, reuse_address=True).start()
        return runner, port
    site = GuardedSite(
        runner, guard, host=HOST, port=0, ssl_context=tls, plain_loopback=plain_loopback
    )
    await site.start()
    return runner, site.bound[0][1]


async def _bench(bursts: int, burst_s: float, pki_dir: Path) -> None:
    pki = make_pki(pki_dir)
    server_tls = ServerTls(TlsFiles(pki.pem("server"), pki.key("server"))).listening
    client_tls = ssl.create_default_context(cafile=str(pki.pem("ca")))
    async with simulated_rest_node() as (node, status):
        ports = {
            "plain only": await _serve(node, status, None, False),
            "TLS only": await _serve(node, status, server_tls, False, event_loop_tls=True),
            "TLS or plain": await _serve(node, status, server_tls, True),
        }
        try:
            await _rows(ports, client_tls, bursts, burst_s)
        finally:
            await cleanup(runner for runner, _port in ports.values())
    print(f"(medians of {bursts} alternating bursts of {burst_s:g} s; CPU: client and server)")


async def _rows(
    ports: dict[str, tuple[web.AppRunner, int]],
    client_tls: ssl.SSLContext,
    bursts: int,
    burst_s: float,
) -> None:
    def keep_alive(port: int, tls: ssl.SSLContext | None) -> Awaitable[int]:
        return keep_alive_requests(port, PATH, 16, burst_s, tls)

    def new_connections(port: int, tls: ssl.SSLContext | None) -> Awaitable[int]:
        return new_connection_requests(port, PATH, 8, burst_s, tls)

    rows: list[tuple[str, str, ssl.SSLContext | None, Load]] = [
        ("plain, 16 keep-alive clients", "plain only", None, keep_alive),
        ("plain, 8 clients, new connection each", "plain only", None, new_connections),
        ("TLS, 16 keep-alive clients", "TLS only", client_tls, keep_alive),
        ("TLS, 8 clients, new connection each", "TLS only", client_tls, new_connections),
    ]
    print(f"{'row':<40} {'one protocol per port':>26} {'TLS or plain (shared)':>26}  CPU")
    for what, alone, tls, load in rows:
        figures = await alternate_bursts(
            {name: partial(load, ports[name][1], tls) for name in (alone, "TLS or plain")},
            bursts,
        )
        shared = figures["TLS or plain"]
        ratio = shared.cpu_us / figures[alone].cpu_us
        print(f"{what:<40} {figures[alone].cell():>26} {shared.cell():>26}  x{ratio:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--burst", type=float, default=0.3, help="seconds per burst")
    args = parser.parse_args()
    pki_dir = Path(tempfile.mkdtemp(prefix="nvd-bench-pki-"))
    try:
        asyncio.run(_bench(args.bursts, args.burst, pki_dir))
    finally:
        shutil.rmtree(pki_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
