"""A closed-loop HTTP/1.1 load generator whose clients are spread over several processes.

Each client process opens its share of keep-alive connections and keeps one request in
flight on each (closed loop), on raw asyncio streams so that a request costs the client
little. Why several processes: one Python client process saturates one core at a rate
below what a server using every core (the old Go tool) answers, so a single client process
measures itself, not the server. Over the measured window the generator also reads the CPU
time of its client processes and of the server (``/proc/<pid>/stat``), so every row says
which side ran out of CPU first.

Bounded: every measurement stops at its deadline (a server that stops answering turns into
errors ``GRACE_S`` later), the request count has a cap, and client processes stop when the
parent says so or goes away. Loopback targets only.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import ipaddress
import multiprocessing
import socket
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType

from tests.benchmarks.proc_usage import cpu_seconds, machine_busy_seconds

SATURATED_CORES = 0.85
"""A process busy for this share of one core or more is what limits the rate."""
GRACE_S = 10.0
"""A response still missing this long after the deadline (or the end of the warm-up) is an
error; that connection stops."""
START_TIMEOUT_S = 60.0
"""Start (spawn, imports), connect and warm up: a client process that takes longer is stuck."""
MAX_AUTO_PROCESSES = 32
DEFAULT_MAX_REQUESTS = 2_000_000


class LoadError(Exception):
    """The load could not be applied (target refused, errors in the warm-up, a stuck client
    process); the message is one line saying which."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """One closed-loop run: the rate and latencies seen by the clients, and what each side
    spent in CPU over the same window."""

    path: str
    clients: int
    connections_per_process: tuple[int, ...]
    requests: int
    errors: int
    elapsed_s: float
    p50_ms: float
    p99_ms: float
    window_s: float
    client_cpu_s: tuple[float, ...]
    server_cpu_s: float | None  # None: the server's process is not known
    machine_cpu_s: float  # every process on the machine, these included
    cpus: int

    @property
    def processes(self) -> int:
        return len(self.connections_per_process)

    @property
    def rate_per_s(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def client_cores(self) -> float:
        return sum(self.client_cpu_s) / self.window_s

    @property
    def busiest_client_cores(self) -> float:
        return max(self.client_cpu_s) / self.window_s

    @property
    def server_cores(self) -> float | None:
        return None if self.server_cpu_s is None else self.server_cpu_s / self.window_s

    @property
    def machine_cores(self) -> float:
        return self.machine_cpu_s / self.window_s

    @property
    def other_cores(self) -> float:
        """What the rest of the machine used meanwhile (other work competing for the CPUs)."""
        ours = self.client_cores + (self.server_cores or 0.0)
        return max(0.0, self.machine_cores - ours)

    @property
    def saturated(self) -> tuple[str, ...]:
        """Which sides were CPU-bound: ``server``, ``client`` (one client process at least),
        ``machine`` (every CPU busy: client, server and other work competing for them)."""
        sides = []
        server = self.server_cores
        if server is not None and server >= SATURATED_CORES:
            sides.append("server")
        if self.busiest_client_cores >= SATURATED_CORES:
            sides.append("client")
        if self.machine_cores >= SATURATED_CORES * self.cpus:
            sides.append("machine")
        return tuple(sides)

    def verdict(self) -> str:
        sides = self.saturated
        bound = [side for side in sides if side != "machine"]
        if bound == ["server"]:
            text = "server-bound"
        elif bound == ["client"]:
            text = "client-bound (raise --client-procs)"
        elif bound:
            text = "server- and client-bound"
        elif "machine" in sides:
            text = "CPU-bound: every CPU busy"
        else:
            text = "neither side CPU-bound (round trips)"
        if "machine" in sides and bound:
            text += f", all {self.cpus} CPUs busy"
        return text

    def cpu_summary(self) -> str:
        server = self.server_cores
        server_text = "server ?" if server is None else f"server {server:.2f} core"
        others = f", other work {self.other_cores:.2f}" if self.other_cores >= 0.1 else ""
        return (
            f"client {self.client_cores:.2f} cores in {self.processes} procs "
            f"(busiest {self.busiest_client_cores:.2f}), {server_text}{others}, "
            f"of {self.cpus} CPUs"
        )

    def row(self) -> str:
        return (
            f"{self.path:<24} {self.clients:>4} clients {self.processes:>3} procs "
            f"{self.rate_per_s:>9,.0f} req/s  p50 {self.p50_ms:7.3f} ms  p99 {self.p99_ms:7.3f} ms"
            + (f"  ({self.errors} errors)" if self.errors else "")
            + f"\n{'':<29}{self.cpu_summary()}: {self.verdict()}"
        )

    def as_json(self) -> dict[str, object]:
        server = self.server_cores
        return {
            "path": self.path,
            "clients": self.clients,
            "client_processes": self.processes,
            "connections_per_process": list(self.connections_per_process),
            "requests": self.requests,
            "errors": self.errors,
            "rate_per_s": round(self.rate_per_s),
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "window_s": round(self.window_s, 3),
            "client_cpu_s": [round(cpu, 2) for cpu in self.client_cpu_s],
            "client_cores": round(self.client_cores, 2),
            "busiest_client_cores": round(self.busiest_client_cores, 2),
            "server_cpu_s": None if self.server_cpu_s is None else round(self.server_cpu_s, 2),
            "server_cores": None if server is None else round(server, 2),
            "other_cores": round(self.other_cores, 2),
            "machine_cores": round(self.machine_cores, 2),
            "cpus": self.cpus,
            "saturated": list(self.saturated),
        }


def client_procs_option(text: str) -> int | None:
    """``--client-procs``: ``auto`` (None: see ``plan_processes``) or a number, 1 or more."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give 'auto' or a number of client processes (1 or more)"
        )
    return value


def client_counts_option(text: str) -> tuple[int, ...]:
    """``--clients``: comma-separated connection counts, each 1 or more (``1,16,64,256``)."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give connection counts separated by commas, each 1 or more (1,16,64)"
        )
    return counts


def plan_processes(clients: int, setting: int | None, cpus: int) -> int:
    """How many client processes carry ``clients`` connections.

    ``auto`` (None): one per connection, up to the CPUs the server leaves free (``cpus - 1``;
    at least one, at most ``MAX_AUTO_PROCESSES``): the server is one process, so every
    other CPU can drive it. A number is used as given, but never more than the connections.
    """
    if setting is None:
        return max(1, min(clients, cpus - 1, MAX_AUTO_PROCESSES))
    return max(1, min(clients, setting))


def describe_client_procs(setting: int | None, cpus: int) -> str:
    """The ``--client-procs`` setting in words, for a benchmark's first lines."""
    if setting is None:
        return f"auto (one per connection, up to {max(1, cpus - 1)}: CPUs - 1)"
    return f"{setting} (fewer for rows with fewer connections)"


def require_loopback(host: str) -> None:
    """Refuse any target that is not this machine: the generator only loads loopback."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        addresses = set()
    if not addresses or not all(ipaddress.ip_address(a).is_loopback for a in addresses):
        raise LoadError(
            f"{host}: the load generator sends only to loopback (127.0.0.1, ::1, localhost)"
        )


def _split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` shares that differ by at most one."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# --- messages between the parent and a client process (pickled through a pipe) ---


@dataclass(frozen=True)
class _Job:
    host: str
    port: int
    path: str
    connections: int
    warmup_s: float
    max_requests: int
    grace_s: float


@dataclass(frozen=True)
class _Ready:
    """Connected and warmed up; waiting for ``_Go``."""


@dataclass(frozen=True)
class _Go:
    deadline: float  # time.monotonic(): CLOCK_MONOTONIC, the same clock in every process


@dataclass(frozen=True)
class _Done:
    latencies_s: array.array[float]
    errors: int
    ended: float  # time.monotonic()


@dataclass(frozen=True)
class _Failed:
    reason: str


# --- inside a client process ---


class _Tally:
    """What the connections of one client process count together (one event loop, no locks)."""

    __slots__ = ("budget", "errors", "latencies_s")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.errors = 0
        self.latencies_s: array.array[float] = array.array("d")


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    """Read one HTTP/1.1 answer (head, then ``Content-Length`` bytes); returns the head."""
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
            if length:
                await reader.readexactly(length)
            break
    return head


async def _keep_one_in_flight(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    request: bytes,
    deadline: float,
    grace_s: float,
    tally: _Tally,
) -> None:
    """Requests on one connection, one at a time, until ``deadline`` or the budget is spent.

    A broken connection, a bad answer or no answer by ``deadline + grace_s`` is an error and
    ends this connection's part: the loop never waits longer than that.
    """
    try:
        async with asyncio.timeout(deadline - time.monotonic() + grace_s):
            while tally.budget > 0 and time.monotonic() < deadline:
                tally.budget -= 1
                started = time.perf_counter()
                writer.write(request)
                head = await read_answer(reader)
                tally.latencies_s.append(time.perf_counter() - started)
                if not head.startswith(b"HTTP/1.1 200"):
                    tally.errors += 1
    except (OSError, EOFError, asyncio.LimitOverrunError, TimeoutError, ValueError):
        tally.errors += 1
        writer.close()


async def _run_job(conn: Connection, job: _Job) -> bool:
    """Connect, warm up, report ready, wait for go, run, report. False: stop this process."""
    request = f"GET {job.path} HTTP/1.1\r\nHost: {job.host}:{job.port}\r\n\r\n".encode()
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        try:
            async with asyncio.timeout(job.grace_s):
                for _ in range(job.connections):
                    streams.append(await asyncio.open_connection(job.host, job.port))
        except (OSError, TimeoutError) as error:
            reason = str(error) or f"no answer within {job.grace_s:g} s"
            conn.send(_Failed(f"cannot connect to {job.host}:{job.port}: {reason}"))
            return True
        warm = _Tally(job.max_requests)
        warm_deadline = time.monotonic() + job.warmup_s
        await asyncio.gather(
            *(
                _keep_one_in_flight(r, w, request, warm_deadline, job.grace_s, warm)
                for r, w in streams
            )
        )
        if warm.errors:
            conn.send(
                _Failed(
                    f"GET {job.path}: {warm.errors} errors in the warm-up "
                    "(answers other than 200, or broken connections)"
                )
            )
            return True
        conn.send(_Ready())
        # Blocking the event loop here is harmless: its connections are idle until go.
        go = conn.recv()
        if not isinstance(go, _Go):
            return False
        tally = _Tally(job.max_requests)
        await asyncio.gather(
            *(
                _keep_one_in_flight(r, w, request, go.deadline, job.grace_s, tally)
                for r, w in streams
            )
        )
        conn.send(_Done(tally.latencies_s, tally.errors, time.monotonic()))
        return True
    finally:
        for _, writer in streams:
            writer.close()
        with contextlib.suppress(TimeoutError):  # bounded too: never wait on a stuck peer
            async with asyncio.timeout(job.grace_s):
                await asyncio.gather(
                    *(writer.wait_closed() for _, writer in streams), return_exceptions=True
                )


def _client_process(conn: Connection) -> None:
    """A client process: runs the jobs the parent sends until it sends None or goes away."""
    with contextlib.suppress(EOFError, OSError, KeyboardInterrupt):
        while isinstance(job := conn.recv(), _Job):
            if not asyncio.run(_run_job(conn, job)):
                break


# --- in the parent ---


@dataclass(frozen=True)
class _ClientProcess:
    process: BaseProcess
    conn: Connection

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None, "a started process has an id"
        return pid


class LoadGenerator:
    """Client processes for closed-loop load on one loopback server, started when a
    measurement first needs them and reused by the next ones (so starting them is never
    inside a measured window)."""

    def __init__(self, host: str, port: int) -> None:
        require_loopback(host)
        self._host = host
        self._port = port
        self._context = multiprocessing.get_context("spawn")
        self._clients: list[_ClientProcess] = []

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def client_pids(self) -> tuple[int, ...]:
        """Process ids of the client processes started so far (and not yet stopped)."""
        return tuple(client.pid for client in self._clients)

    def close(self) -> None:
        """Tell every client process to stop; kill (by its handle) any that does not."""
        for client in self._clients:
            with contextlib.suppress(OSError):
                client.conn.send(None)
        for client in self._clients:
            client.process.join(timeout=5)
            if client.process.is_alive():
                client.process.kill()
                client.process.join(timeout=5)
            client.conn.close()
        self._clients.clear()

    def _started(self, count: int) -> list[_ClientProcess]:
        while len(self._clients) < count:
            parent_end, child_end = self._context.Pipe()
            process = self._context.Process(
                target=_client_process,
                args=(child_end,),
                name=f"loadgen-{len(self._clients)}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._clients.append(_ClientProcess(process, parent_end))
        return self._clients[:count]

    def _receive(self, client: _ClientProcess, timeout_s: float) -> object:
        pid = client.pid
        if not client.conn.poll(timeout_s):
            raise LoadError(f"client process {pid} did not answer within {timeout_s:.0f} s")
        try:
            message = client.conn.recv()
        except EOFError:
            client.process.join(timeout=5)
            raise LoadError(
                f"client process {pid} exited (code {client.process.exitcode})"
            ) from None
        if isinstance(message, _Failed):
            raise LoadError(message.reason)
        return message

    def measure(
        self,
        path: str,
        clients: int,
        processes: int,
        duration_s: float,
        server_pid: int | None,
        cpus: int,
        warmup_s: float = 0.3,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        grace_s: float = GRACE_S,
    ) -> Measurement:
        """``clients`` connections over ``processes`` client processes for ``duration_s``
        (after a warm-up on the same connections), with the CPU time of both sides.

        Returns within about ``warmup_s + duration_s + 2 * grace_s`` whatever the server
        does (plus the start of new client processes), or raises ``LoadError``."""
        if not 1 <= processes <= clients:
            raise ValueError(f"{processes} client processes for {clients} connections")
        workers = self._started(processes)
        shares = _split(clients, processes)
        try:
            for worker, share, budget in zip(
                workers, shares, _split(max_requests, processes), strict=True
            ):
                worker.conn.send(
                    _Job(self._host, self._port, path, share, warmup_s, max(1, budget), grace_s)
                )
            for worker in workers:
                self._receive(worker, START_TIMEOUT_S + warmup_s + grace_s)
            client_before = [cpu_seconds(worker.pid) for worker in workers]
            server_before = None if server_pid is None else cpu_seconds(server_pid)
            machine_before = machine_busy_seconds()
            started = time.monotonic()
            go = _Go(started + duration_s)
            for worker in workers:
                worker.conn.send(go)
            done = [self._receive(worker, duration_s + 2 * grace_s) for worker in workers]
            window_s = time.monotonic() - started
            client_after = [cpu_seconds(worker.pid) for worker in workers]
            server_after = None if server_pid is None else cpu_seconds(server_pid)
            machine_after = machine_busy_seconds()
        except BaseException:
            self.close()  # the client processes may be mid-job: start afresh next time
            raise
        results = [message for message in done if isinstance(message, _Done)]
        latencies = sorted(lat for result in results for lat in result.latencies_s)
        return Measurement(
            path=path,
            clients=clients,
            connections_per_process=tuple(shares),
            requests=len(latencies),
            errors=sum(result.errors for result in results),
            elapsed_s=max(result.ended for result in results) - started,
            p50_ms=statistics.median(latencies) * 1e3 if latencies else float("nan"),
            p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3
            if latencies
            else float("nan"),
            window_s=window_s,
            client_cpu_s=tuple(
                after - before for before, after in zip(client_before, client_after, strict=True)
            ),
            server_cpu_s=None
            if server_before is None or server_after is None
            else server_after - server_before,
            machine_cpu_s=machine_after - machine_before,
            cpus=cpus,
        )
