"""Many simulated agents in ONE process, each node its own listening socket on 127.0.0.1.

::

    python -m tests.support.agent_farm --count 1000 --simulate h200 --ports-file F

serves ``--count`` agents built with the real ``agent.api.routes.create_app`` on the simulated
backend. Each node has its own listening socket (the kernel picks a free port; binding port 0
cannot race another test run). When every socket listens, the farm writes ``F`` (atomically:
one ``PORT KIND`` line per node) and prints ``ready N`` on stdout.

``--processes P`` spreads the nodes over P processes (node ``i`` is served by process
``i % P``; this one binds every socket, writes the ports file and passes control commands
on): the farm then uses P CPUs, as the real agents would use their own machines, so that a
benchmark measures the client rather than one farm process's ceiling. The nodes of one kind
share one application per process (one lease table per process: a lease asked of node
``k < P`` is on every node of process ``k``). ``--event-loop`` is the agent's own choice
(``auto``: uvloop when installed, as ``nvidia-docker-plugin`` runs; the default here is
``asyncio``).

``--own-uuids`` gives each node GPUs of its own, as in a real fleet: every GPU UUID in its
answers ends in the node's port (``GPU-825bd660-d5ca-57d3-b40a-8a8f9900d35b`` on port
54107), where otherwise the nodes of one kind name the same GPUs (a fleet client that keys
anything on a UUID would then look faster here than on real nodes).

``--leases`` gives the nodes the lease routes (``/leases/json``...: one lease table per kind,
shared by its nodes as the status service is); without it they answer 404 there, as agents
older than leases do. ``--leases-before-free`` gives them the lease routes as agents before
``GET /leases/free`` had them: that GET answers 405 (``Allow: DELETE``), as their router did
for ``/leases/{lease}``. ``--tls-cert F --tls-key K`` serves every node over TLS.

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
import json
import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from agent.api.docker_cli import control_devices
from agent.api.routes import Handler, Wrapper, create_app
from agent.config import EVENT_LOOPS
from agent.gpu.simulated import SimulatedBackend
from agent.leases.settings import LeaseSettings
from agent.leasing.service import LeaseService
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from agent.process import loop_factory
from tests.benchmarks.proc_usage import cpu_seconds
from tests.support.readers import ThreadReader
from tests.support.services import python_path, stop_process, wait_until

LISTEN_HOST = "127.0.0.1"


def raise_fd_limit(wanted: int) -> None:
    """Raise the soft RLIMIT_NOFILE towards ``wanted`` (as far as the hard limit allows)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _bind(count: int) -> list[socket.socket]:
    """``count`` listening sockets on ``LISTEN_HOST``, each on a port the kernel picked."""
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LISTEN_HOST, 0))
        socks.append(sock)
    return socks


def _write_ports(ports_file: Path, ports: list[int], kinds: list[str]) -> None:
    lines = [f"{port} {kinds[index % len(kinds)]}\n" for index, port in enumerate(ports)]
    tmp = ports_file.with_name(ports_file.name + ".tmp")
    tmp.write_text("".join(lines))
    tmp.replace(ports_file)


def _own_uuids(uuids: list[str]) -> Wrapper:
    """A route wrapper: the answer's ``uuids`` end in the port the request came to."""
    given = [uuid.encode() for uuid in uuids]

    def wrap(handler: Handler) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            response = await handler(request)
            if isinstance(response, web.Response) and isinstance(response.body, bytes):
                body = response.body
                port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
                tail = f"{port:06x}".encode()
                for uuid in given:
                    body = body.replace(uuid, uuid[:-6] + tail)
                response.body = body
            return response

        return handle

    return wrap


def _before_free(handler: Handler) -> Handler:
    """A route wrapper: ``GET /leases/free`` answered as agents without the route answer it."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/leases/free":
            return web.Response(
                status=405, text="405: Method Not Allowed", headers={"Allow": "DELETE"}
            )
        return await handler(request)

    return handle


async def _serve(
    socks: list[socket.socket],
    kinds: list[str],
    ports_file: Path | None,
    *,
    leases: bool = False,
    tls: ssl.SSLContext | None = None,
    own_uuids: bool = False,
    before_free: bool = False,
) -> None:
    """Serve ``socks`` (node ``i`` of kind ``kinds[i % len(kinds)]``); control on stdin."""
    raise_fd_limit(len(socks) * 4 + 256)
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
        uuids = [d.uuid for d in node.devices if d.uuid] if own_uuids else []
        around = ((_own_uuids(uuids),) if uuids else ()) + ((_before_free,) if before_free else ())
        runner = web.AppRunner(
            create_app(NodeState(facts), status, around=around, leases=table),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        runners[kind] = runner

    sites: dict[int, web.SockSite] = {}
    for index, sock in enumerate(socks):
        kind = kinds[index % len(kinds)]
        port: int = sock.getsockname()[1]
        site = web.SockSite(runners[kind], sock, backlog=1024, ssl_context=tls)
        await site.start()
        sites[port] = site
    if ports_file is not None:
        _write_ports(ports_file, list(sites), kinds)
    print(f"ready {len(socks)}", flush=True)

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
    parser.add_argument("--own-uuids", action="store_true")
    parser.add_argument("--leases-before-free", action="store_true")
    parser.add_argument("--tls-cert", type=Path)
    parser.add_argument("--tls-key", type=Path)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--event-loop", choices=EVENT_LOOPS, default="asyncio")
    args = parser.parse_args()
    tls = None
    if args.tls_cert is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    raise_fd_limit(args.count * 4 + 256)
    socks = _bind(args.count)
    factory, _ = loop_factory(args.event_loop)

    def serve(mine: list[socket.socket], kinds: list[str], ports_file: Path | None) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(
                _serve(
                    mine,
                    kinds,
                    ports_file,
                    leases=args.leases or args.leases_before_free,
                    tls=tls,
                    own_uuids=args.own_uuids,
                    before_free=args.leases_before_free,
                )
            )

    if args.processes <= 1:
        serve(socks, args.simulate, args.ports_file)
        return
    _serve_in_processes(socks, args.simulate, args.ports_file, args.processes, serve)


def _serve_in_processes(
    socks: list[socket.socket],
    kinds: list[str],
    ports_file: Path,
    processes: int,
    serve: Callable[[list[socket.socket], list[str], Path | None], None],
) -> None:
    """Fork ``processes`` servers (node ``i`` in process ``i % processes``), each controlled
    through a socket on its stdin and stdout; pass this process's control commands on."""
    # node i of the whole farm has kind kinds[i % len(kinds)]; process k serves nodes
    # k, k + P, ...: its own j-th node is node k + j * P
    ports: list[int] = [sock.getsockname()[1] for sock in socks]
    children: list[tuple[int, socket.socket, socket.SocketIO]] = []
    for number in range(processes):
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ours.close()
                for _, other, _ in children:
                    other.close()
                os.dup2(theirs.fileno(), 0)
                os.dup2(theirs.fileno(), 1)
                theirs.close()
                sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the control socket)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                mine = socks[number::processes]
                own_kinds = [kinds[(number + j * processes) % len(kinds)] for j in range(len(mine))]
                for index, sock in enumerate(socks):
                    if index % processes != number:
                        sock.close()
                serve(mine, own_kinds, None)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        children.append((pid, ours, ours.makefile("rwb", buffering=0)))
    for sock in socks:
        sock.close()

    def stop_children(_signum: int = 0, _frame: object = None) -> None:
        for _, sock, stream in children:
            with contextlib.suppress(OSError):
                stream.close()
                sock.close()
        for pid, _, _ in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop_children)
    signal.signal(signal.SIGINT, stop_children)
    for _, _, stream in children:
        if not stream.readline().startswith(b"ready"):
            stop_children()
    _write_ports(ports_file, ports, kinds)
    print(f"ready {len(socks)}", flush=True)
    for line in sys.stdin.buffer:
        words = line.split()
        if words[:1] == [b"stop"]:
            for _, _, stream in children:
                stream.write(line)
            for _, _, stream in children:
                stream.readline()
            print("stopped " + " ".join(w.decode() for w in words[1:]), flush=True)
    stop_children()


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

    def cpu_seconds(self) -> float:
        """User + system CPU time the farm's processes (with ``--processes``, the serving
        ones too) have used so far, in seconds."""
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return cpu_seconds(pid) + sum(cpu_seconds(int(child)) for child in children)

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


def ask_lease(
    url: str, body: Mapping[str, object], context: ssl.SSLContext | None = None
) -> dict[str, object]:
    """``POST body`` to ``url`` + ``/leases`` (a farm node's, or an agent's): the grant; the
    answer must be 201. The nodes of one kind in one farm process share one lease table."""
    ask = urllib.request.Request(f"{url}/leases", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(ask, timeout=30, context=context) as answer:
        assert answer.status == 201
        granted: dict[str, object] = json.loads(answer.read())
        return granted


def start_farm(
    count: int,
    kinds: tuple[str, ...] = ("h200",),
    timeout_s: float = 60,
    *,
    leases: bool = False,
    tls: tuple[Path, Path] | None = None,
    processes: int = 1,
    event_loop: str = "asyncio",
    own_uuids: bool = False,
    before_free: bool = False,
) -> AgentFarm:
    """Start ``count`` agents and wait until every one listens; ``leases``: with the lease
    routes; ``tls``: (certificate, key) to serve TLS with; ``processes``: spread over that
    many processes; ``event_loop``: ``asyncio``, ``uvloop`` or ``auto`` (as the agent's);
    ``own_uuids``: each node's GPUs named by UUIDs of its own; ``before_free``: the lease
    routes as agents before ``GET /leases/free`` had them."""
    root = Path(tempfile.mkdtemp(prefix="nvd-farm-"))
    ports_file = root / "ports"
    command = [sys.executable, "-m", "tests.support.agent_farm", "--count", str(count)]
    for kind in kinds:
        command += ["--simulate", kind]
    command += ["--ports-file", str(ports_file)]
    if leases:
        command.append("--leases")
    if own_uuids:
        command.append("--own-uuids")
    if before_free:
        command.append("--leases-before-free")
    if tls is not None:
        command += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    command += ["--processes", str(processes), "--event-loop", event_loop]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": python_path(repo)}
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


@contextlib.contextmanager
def farms_before_and_after_free(
    *, tls: tuple[Path, Path] | None = None, held: int = 3, context: ssl.SSLContext | None = None
) -> Iterator[tuple[AgentFarm, AgentFarm]]:
    """Two one-node farms of the 8-GPU kind, each with ``held`` GPUs leased: (agents before
    ``GET /leases/free``, current agents); stopped on exit. ``tls`` serves both over TLS,
    ``context`` verifies them for the leases asked here."""
    prior = start_farm(1, ("hgx-h200-8",), tls=tls, before_free=True)
    try:
        current = start_farm(1, ("hgx-h200-8",), tls=tls, leases=True)
    except BaseException:
        prior.stop()
        raise
    try:
        scheme = "http" if tls is None else "https"
        for farm in (prior, current):
            ask_lease(f"{scheme}://127.0.0.1:{farm.ports[0]}", {"count": held}, context)
        yield prior, current
    finally:
        prior.stop()
        current.stop()


if __name__ == "__main__":
    main()
