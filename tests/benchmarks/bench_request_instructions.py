"""Instructions per REST request, counted by valgrind (repeatable, whatever else runs).

The REST app is built as the daemon builds it (its connection guard as the routes' wrapper,
the request counters), on the simulated ``h200`` node, served on a loopback socket in this
process, and asked ``path`` N times over one kept-alive connection, client included. Run
under ``valgrind --tool=callgrind`` for 200 and 1,200 requests, the difference divided by
1,000 is the instructions one request costs: start-up and import cancel out.

    python -m tests.benchmarks.bench_request_instructions [--path /gpu/info/json]
        [--agent-dir DIR]      # another checkout's agent, for an A/B
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


async def serve_and_ask(path: str, requests: int) -> None:
    from aiohttp import web  # noqa: PLC0415 - the agent under test is on sys.path first

    from agent.api.docker_cli import control_devices  # noqa: PLC0415
    from agent.api.routes import create_app  # noqa: PLC0415
    from agent.edge.connections import (  # noqa: PLC0415
        ConnectionGuard,
        ConnectionLimits,
        GuardedSite,
    )
    from agent.gpu.simulated import SimulatedBackend  # noqa: PLC0415
    from agent.metrics.agent_metrics import AgentMetrics  # noqa: PLC0415
    from agent.node.facts import NodeFacts  # noqa: PLC0415
    from agent.node.state import NodeState  # noqa: PLC0415
    from agent.node.status import StatusService  # noqa: PLC0415
    from tests.support.readers import ThreadReader  # noqa: PLC0415

    backend = SimulatedBackend.from_file("h200")
    info = backend.node_info()
    status = StatusService(ThreadReader(backend), info)
    state = NodeState(NodeFacts(info, control_devices()))
    counters = AgentMetrics()
    limits = ConnectionLimits(10, 60, 1024)
    if "around" in inspect.signature(create_app).parameters:
        guard = ConnectionGuard("REST API", limits, on_answer=counters.count)
        app = create_app(state, status, around=[guard.wrap])
    else:  # an older agent: the guard and the counters as middlewares
        guard = ConnectionGuard("REST API", limits)
        middlewares = [guard.middleware, counters.middleware]  # type: ignore[attr-defined]
        app = create_app(state, status, middlewares=middlewares)  # type: ignore[call-arg]
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:  # the daemon's fast path for plain GETs of kept answers, where the agent has one
        from agent.api.fast_routes import fast_gets  # noqa: PLC0415
    except ImportError:
        await GuardedSite(runner, guard, sock=sock).start()
    else:
        fast = fast_gets(app, counters.count_resource, lambda _transport: True)
        await GuardedSite(runner, guard, sock=sock, fast=fast).start()
    reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
    request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    for _ in range(requests):
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    writer.close()
    await runner.cleanup()
    await status.close()


def _instructions(path: str, requests: int, agent_dir: Path | None) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(agent_dir) if agent_dir else str(REPO), str(REPO), env.get("PYTHONPATH", "")]
    )
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
                sys.executable, "-m", "tests.benchmarks.bench_request_instructions",
                "--serve", str(requests), "--path", path,
            ],
            env=env, cwd=agent_dir or REPO, capture_output=True, text=True, check=True,
        )  # fmt: skip
    found = re.search(r"Collected : (\d+)", done.stderr)
    assert found is not None, done.stderr[-500:]
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_request_instructions")
    parser.add_argument("--path", default="/gpu/info/json")
    parser.add_argument("--agent-dir", type=Path)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.serve is not None:
        asyncio.run(serve_and_ask(args.path, args.serve))
        return 0
    few = _instructions(args.path, 200, args.agent_dir)
    many = _instructions(args.path, 1200, args.agent_dir)
    where = args.agent_dir or "this checkout"
    print(
        f"{args.path} ({where}): {(many - few) / 1000:,.0f} instructions a request, client included"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
