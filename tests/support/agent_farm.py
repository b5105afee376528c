"""Many simulated agents in ONE process, each node its own listening socket on 127.0.0.1.

::

    python -m tests.support.agent_farm --count 1000 --simulate h200 --ports-file F

serves ``--count`` agents built with the real ``agent.api.routes.create_app`` on the simulated
backend. Each node has its own listening socket (the kernel picks a free port; binding port 0
cannot race another test run). When every socket listens, the farm writes ``F`` (atomically:
one ``PORT KIND`` line per node) and prints ``ready N`` on stdout.

``--leases`` gives the nodes the lease routes (``/leases/json``...: one lease table per kind,
shared by its nodes as the status service is); without it they answer 404 there, as agents
older than leases do. ``--tls-cert F --tls-key K`` serves every node over TLS.

Several ``--simulate`` values are dealt out in turn (node 0 gets the first kind, node 1 the
second, ...), so a test can tell which node answered. Nodes of one kind share one application,
one ``StatusService`` and one PCIe sampler: the real agents would each run on their own
machine, so sharing keeps the farm's cost on this small machine out of the client's figures,
while every node still accepts and answers its own connections.

Control, one command a line on stdin (answered on stdout)::

    stop PORT [PORT...]   stop listening on those nodes: new connections are refused, as
                          by a node whose agent died -> "stopped PORT..."

The farm stops on SIGTERM/SIGINT or when stdin reaches end of file (the test that started
it is gone), so it never outlives its owner.

``AgentFarm`` (``start_farm``/``stop``) starts and drives the process from a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from agent.api.docker_cli import control_devices
from agent.api.routes import create_app
from agent.gpu.simulated import SimulatedBackend
from agent.leases.settings import LeaseSettings
from agent.leasing.service import LeaseService
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.support.readers import ThreadReader
from tests.support.services import stop_process, wait_until

LISTEN_HOST = "127.0.0.1"


def raise_fd_limit(wanted: int) -> None:
    """Raise the soft RLIMIT_NOFILE towards ``wanted`` (as far as the hard limit allows)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _serve(
    count: int,
    kinds: list[str],
    ports_file: Path,
    *,
    leases: bool = False,
    tls: ssl.SSLContext | None = None,
) -> None:
    raise_fd_limit(count * 4 + 256)
    loop = asyncio.get_running_loop()
    runners: dict[str, web.AppRunner] = {}
    services: list[StatusService] = []
    tables: list[LeaseService] = []
    for kind in dict.fromkeys(kinds):
        backend = SimulatedBackend.from_file(kind)
        node = backend.node_info()
        status = StatusService(ThreadReader(backend), node)
        await status.sample_pcie()
        status.start_sampler()
        services.append(status)
        facts = NodeFacts(node, control_devices())
        table = None
        if leases:  # pending grants last an hour: a test's or benchmark's leases stay
            table = LeaseService.open(node, facts.health, LeaseSettings(pending_s=3600.0), None)
            tables.append(table)
        runner = web.AppRunner(
            create_app(NodeState(facts), status, leases=table),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        runners[kind] = runner

    sites: dict[int, web.SockSite] = {}
    lines = []
    for index in range(count):
        kind = kinds[index % len(kinds)]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LISTEN_HOST, 0))
        port: int = sock.getsockname()[1]
        site = web.SockSite(runners[kind], sock, backlog=1024, ssl_context=tls)
        await site.start()
        sites[port] = site
        lines.append(f"{port} {kind}\n")
    tmp = ports_file.with_name(ports_file.name + ".tmp")
    tmp.write_text("".join(lines))
    tmp.replace(ports_file)
    print(f"ready {count}", flush=True)

    stopping = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def control() -> None:
        while True:
            line = await reader.readline()
            if not line:
                stopping.set()
                return
            words = line.decode().split()
            if words and words[0] == "stop":
                ports = [int(w) for w in words[1:]]
                for port in ports:
                    site = sites.pop(port, None)
                    if site is not None:
                        await site.stop()
                print("stopped " + " ".join(map(str, ports)), flush=True)

    task = asyncio.create_task(control())
    await stopping.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for runner in runners.values():
        await runner.cleanup()
    for status in services:
        await status.close()
    for table in tables:
        await table.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--simulate", action="append", required=True)
    parser.add_argument("--ports-file", type=Path, required=True)
    parser.add_argument("--leases", action="store_true")
    parser.add_argument("--tls-cert", type=Path)
    parser.add_argument("--tls-key", type=Path)
    args = parser.parse_args()
    tls = None
    if args.tls_cert is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    asyncio.run(_serve(args.count, args.simulate, args.ports_file, leases=args.leases, tls=tls))


@dataclass
class AgentFarm:
    """A running farm process, seen from the test that started it."""

    proc: subprocess.Popen[bytes]
    ports: list[int]
    kinds: list[str]
    root: Path
    stopped: set[int] = field(default_factory=set)

    def stop_nodes(self, ports: list[int]) -> None:
        """Kill those nodes' agents (their ports then refuse connections)."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(("stop " + " ".join(map(str, ports)) + "\n").encode())
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().decode().split()
        if answer[:1] != ["stopped"]:
            raise RuntimeError(f"agent farm: unexpected answer {answer!r}")
        self.stopped.update(ports)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        stop_process(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        for path in self.root.iterdir():
            path.unlink()
        self.root.rmdir()


def start_farm(
    count: int,
    kinds: tuple[str, ...] = ("h200",),
    timeout_s: float = 60,
    *,
    leases: bool = False,
    tls: tuple[Path, Path] | None = None,
) -> AgentFarm:
    """Start ``count`` agents in one process and wait until every one listens; ``leases``:
    with the lease routes; ``tls``: (certificate, key) to serve TLS with."""
    root = Path(tempfile.mkdtemp(prefix="nvd-farm-"))
    ports_file = root / "ports"
    command = [sys.executable, "-m", "tests.support.agent_farm", "--count", str(count)]
    for kind in kinds:
        command += ["--simulate", kind]
    command += ["--ports-file", str(ports_file)]
    if leases:
        command.append("--leases")
    if tls is not None:
        command += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=repo, env=env
    )
    try:
        wait_until(ports_file.exists, what="agent farm", timeout_s=timeout_s, proc=proc)
        assert proc.stdout is not None
        if proc.stdout.readline().split() != [b"ready", str(count).encode()]:
            raise RuntimeError("agent farm: no ready line")
    except BaseException:
        stop_process(proc)
        for path in root.iterdir():
            path.unlink()
        root.rmdir()
        raise
    pairs = [line.split() for line in ports_file.read_text().splitlines()]
    return AgentFarm(
        proc=proc, ports=[int(p) for p, _ in pairs], kinds=[k for _, k in pairs], root=root
    )


if __name__ == "__main__":
    main()
