"""Ask a fleet from worker processes, one per CPU: the nodes' TLS handshakes spread out.

::

    pool = WorkerPool.start(nodes, query, timeout_s=10, tls=tls, workers=2)  # before any loop
    try:
        asyncio.run(pool.ask(on_result, parallel=64, admit=window.admit))
    finally:
        pool.stop()

Why: one HTTPS node costs the client about 0.6 ms of CPU in OpenSSL alone (the TLS 1.3
handshake: key exchange, the certificate's checks, the key schedule), three times what the
rest of asking it costs; one process runs on one CPU, so 10,000 nodes over TLS took one core
for most of 10 s whatever the other cores did. Here each worker process asks the nodes it
is given, as ``query.ask_node`` does in one process (the same connection, timeout, answers
and errors), and sends each node's result back to this process as it is done.

- The workers are forked (``os.fork``) before this process starts an event loop: they have
  the nodes, the query and the TLS contexts already, and start in a few milliseconds
  (no interpreter to start, nothing to import or send). Nothing else runs in them.
- This process keeps everything the output needs: it hands nodes out one by one in their
  order, each to the worker with the fewest in flight, never more than ``parallel`` at a
  time in all and never node ``i`` before ``admit(i)`` says so (the ordered output's
  window), and calls ``on_result(index, result)`` as results come. The table, JSON, progress
  line, summary and exit code are made as without workers, from the same ``NodeResult``.
- SSH nodes are asked by this process itself (their logins share one limit and one
  connection per bastion): only ``http://`` and ``https://`` nodes go to the workers.
- What travels: node numbers one way; the other way each node's number, its answers (the
  agent's JSON, decoded by the worker: loading it again here costs about half of decoding
  it), its error and reason, in ``marshal``'s format with a length before each (a third of
  ``pickle``'s cost to write; only the standard types travel). Results are sent in batches
  of whatever finished in one turn of the worker's loop.
- A worker ends when its socket to this process closes: ``stop`` closes them and reaps the
  workers (SIGKILL for any still running), whatever ended the query (the last answer,
  Ctrl-C, an error writing the output); a worker never outlives this process (this
  process's exit closes the socket too). Workers ignore SIGINT: Ctrl-C on a terminal
  reaches the whole process group, and this process decides. SIGINT is blocked while a
  worker is forked, so that a Ctrl-C at that moment finds the worker ignoring it and in the
  list that ``stop`` ends. Their standard input and
  output are /dev/null: a pipe's reader (``| head``) never waits for a worker.
- A worker that fails (a bug: an exception, or killed) fails the whole query with
  ``WorkerFailed``, naming the worker and its traceback; nodes are never silently lost.

``workers_for(nodes, parallel)`` is how many workers a query gets: the CPUs this process may
run on (no more than ``parallel``), when that is more than one and there are at least
``MIN_NODES`` HTTP(S) nodes and no other thread runs, else 0 (asked in this process).
"""

from __future__ import annotations

import asyncio
import contextlib
import marshal
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from controller.fleet.query import (
    FleetNode,
    NodeResult,
    Query,
    ask_node,
    base_transports,
    raise_fd_limit,
)

if TYPE_CHECKING:
    from controller.transport.ssh_tunnel import SshOptions
    from controller.transport.tls import TlsOptions

MIN_NODES = 32  # fewer HTTP(S) nodes are asked in this process: their handshakes take < 20 ms
_LENGTH = struct.Struct("!I")
_CRASH = -1  # a frame of a worker that failed: (-1, traceback text)
_EXIT_POLLS, _EXIT_POLL_S = 40, 0.025  # how long a worker that ended early is waited for

# What a worker sends for one node: its number, then NodeResult's fields but the node.
Payload = tuple[int, dict[str, Any], str | None, str | None, float, int | None, str | None]


class WorkerFailed(RuntimeError):
    """A worker process failed (a bug): the query cannot be completed."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity: containers and ``taskset`` narrow it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - Linux has it
        return os.cpu_count() or 1


def workers_for(nodes: Sequence[FleetNode], parallel: int) -> int:
    """How many worker processes to ask ``nodes`` with, ``parallel`` at a time: 0 to ask them
    in this process (one CPU, a small fleet, or one node at a time: a worker would only add
    its round trip)."""
    workers = min(usable_cpus(), parallel)
    if workers < 2 or not hasattr(os, "fork") or threading.active_count() > 1:
        return 0  # forking with other threads running could copy a lock they hold
    remote = sum(1 for node in nodes if node.endpoint.transport != "ssh")
    return workers if remote >= MIN_NODES else 0


def _frame(value: Any) -> bytes:
    data = marshal.dumps(value)
    return _LENGTH.pack(len(data)) + data


class _Frames(asyncio.Protocol):
    """Reads length-prefixed ``marshal`` frames from a socket; ``on_frame`` gets each,
    ``on_end`` the end (with the error, if any). Writes go through ``send`` as whole frames."""

    def __init__(
        self, on_frame: Callable[[Any], None], on_end: Callable[[Exception | None], None]
    ) -> None:
        self._on_frame = on_frame
        self._on_end = on_end
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer, start)
            end = start + _LENGTH.size + size
            if len(buffer) < end:
                break
            # the other end is this process's own fork, over a socketpair nobody else has
            value = marshal.loads(memoryview(buffer)[start + _LENGTH.size : end])  # noqa: S302
            start = end
            self._on_frame(value)
        if start:
            del buffer[:start]

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost tells the end

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_end(exc)

    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


@dataclass
class _Worker:
    """This process's view of one worker: its process, socket, and nodes in flight."""

    number: int
    pid: int
    sock: socket.socket
    in_flight: int = 0
    ended: bool = False
    frames: _Frames | None = None
    pending: list[int] | None = None  # node numbers handed out this turn, not yet written
    reaped: bool = False  # waited for already (it ended early)


class WorkerPool:
    """Worker processes forked for one query (see the module docstring)."""

    def __init__(
        self,
        nodes: Sequence[FleetNode],
        query: Query,
        timeout_s: float,
        tls: TlsOptions,
        ssh: SshOptions | None,
        workers: list[_Worker],
    ) -> None:
        self.nodes = nodes
        self.query = query
        self.timeout_s = timeout_s
        self.tls = tls
        self.ssh = ssh
        self.workers = workers

    @classmethod
    def start(
        cls,
        nodes: Sequence[FleetNode],
        query: Query,
        *,
        timeout_s: float,
        workers: int,
        tls: TlsOptions | None = None,
        ssh: SshOptions | None = None,
    ) -> WorkerPool:
        """Fork ``workers`` processes to ask ``nodes``; call before any event loop runs in
        this process (and with no other thread), and ``stop`` the pool whatever happens."""
        raise_fd_limit()
        base_ssh, base_tls = base_transports(nodes, timeout_s, ssh, tls)
        for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            with contextlib.suppress(Exception):
                stream.flush()
        pool = cls(nodes, query, timeout_s, base_tls, base_ssh, [])
        try:
            for number in range(max(1, workers)):
                # Ctrl-C held back while a worker is forked, until it is in the list that
                # ``stop`` ends (and until the worker ignores it): it then ends the pool.
                held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
                try:
                    pool.workers.append(pool._fork(number, held))
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, held)
        except BaseException:
            pool.stop()
            raise
        return pool

    def _fork(self, number: int, mask: set[int | signal.Signals]) -> _Worker:
        """Fork worker ``number`` (SIGINT blocked here: ``mask`` is the signal mask to give
        it once it ignores SIGINT)."""
        ours, theirs = socket.socketpair()
        try:
            pid = os.fork()
        except BaseException:
            ours.close()
            theirs.close()
            raise
        if pid == 0:  # the worker
            code = 1
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent decides
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                ours.close()
                for other in self.workers:  # their sockets must end when this process does
                    other.sock.close()
                code = _worker_main(theirs, self)
            finally:
                os._exit(code)
        theirs.close()
        return _Worker(number, pid, ours)

    async def ask(
        self,
        on_result: Callable[[int, NodeResult], None],
        *,
        parallel: int,
        admit: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """Hand the nodes out, ``parallel`` at most in flight, and ``on_result`` each one's
        result as it comes; raises ``WorkerFailed`` when a worker fails."""
        loop = asyncio.get_running_loop()
        nodes = self.nodes
        slots = asyncio.Semaphore(max(1, parallel))
        finished: asyncio.Future[None] = loop.create_future()
        remaining = len(nodes)
        local: set[asyncio.Task[None]] = set()

        def fail(error: BaseException) -> None:
            if not finished.done():
                finished.set_exception(error)

        def deliver(index: int, result: NodeResult) -> None:
            nonlocal remaining
            slots.release()
            remaining -= 1
            try:
                on_result(index, result)
            except BaseException as exc:  # writing the output failed: the query ends
                fail(exc)
                return
            if remaining == 0 and not finished.done():
                finished.set_result(None)

        def frame_of(worker: _Worker) -> Callable[[Any], None]:
            def on_frame(batch: Any) -> None:
                if batch and batch[0] == _CRASH:
                    fail(WorkerFailed(f"fleet worker {worker.number} failed:\n{batch[1]}"))
                    return
                for payload in batch:
                    worker.in_flight -= 1
                    index = payload[0]
                    deliver(index, NodeResult(nodes[index], *payload[1:]))

            return on_frame

        def end_of(worker: _Worker) -> Callable[[Exception | None], None]:
            def on_end(exc: Exception | None) -> None:
                worker.ended = True
                if not finished.done():
                    fail(WorkerFailed(f"fleet worker {worker.number} {_ending(worker, exc)}"))

            return on_end

        for worker in self.workers:
            worker.frames = await _connect(worker.sock, frame_of(worker), end_of(worker))
        flush_due = False

        def flush() -> None:  # the nodes handed out in one turn: one write per worker
            nonlocal flush_due
            flush_due = False
            for worker in self.workers:
                if worker.pending:
                    assert worker.frames is not None
                    worker.frames.send(_frame(worker.pending))
                    worker.pending = None

        async def ask_here(index: int) -> None:  # an SSH node: asked by this process
            result = await ask_node(nodes[index], self.query, self.timeout_s, self.ssh, self.tls)
            deliver(index, result)

        async def hand_out() -> None:
            nonlocal flush_due
            for index, node in enumerate(nodes):
                if admit is not None:
                    await admit(index)
                await slots.acquire()
                if node.endpoint.transport == "ssh":
                    task = asyncio.create_task(ask_here(index))
                    local.add(task)
                    task.add_done_callback(local.discard)
                    continue
                worker = min(self.workers, key=lambda w: w.in_flight)
                if worker.ended:
                    return  # on_end has failed the query
                worker.in_flight += 1
                if worker.pending is None:
                    worker.pending = []
                worker.pending.append(index)
                if not flush_due:
                    flush_due = True
                    loop.call_soon(flush)

        if not nodes:
            return
        dispatch = asyncio.create_task(hand_out())
        try:
            await finished
        finally:
            dispatch.cancel()
            for task in list(local):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dispatch
            for task in list(local):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            for worker in self.workers:
                if worker.frames is not None and worker.frames.transport is not None:
                    worker.frames.transport.abort()

    def stop(self) -> None:
        """End every worker and wait for it (no zombie is left); safe to call twice."""
        for worker in self.workers:
            with contextlib.suppress(OSError):
                worker.sock.close()
        for worker in self.workers:
            if worker.reaped:
                continue
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(worker.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(worker.pid, 0)
        self.workers = []


def _ending(worker: _Worker, error: Exception | None) -> str:
    """How a worker ended before the query did: its exit status when it is known."""
    why = f" ({error})" if error else ""
    pid = status = 0
    for _ in range(_EXIT_POLLS):  # its socket closes a moment before its exit status is known
        try:
            pid, status = os.waitpid(worker.pid, os.WNOHANG)
        except ChildProcessError:
            break
        if pid:
            break
        time.sleep(_EXIT_POLL_S)  # the query has failed: nothing else waits for this loop
    if pid == 0:
        return f"(pid {worker.pid}) closed its socket before answering{why}"
    worker.reaped = True
    if os.WIFSIGNALED(status):
        return f"(pid {worker.pid}) was killed by signal {os.WTERMSIG(status)} before answering"
    return f"(pid {worker.pid}) exited with code {os.waitstatus_to_exitcode(status)} early"


async def _connect(
    sock: socket.socket,
    on_frame: Callable[[Any], None],
    on_end: Callable[[Exception | None], None],
) -> _Frames:
    frames = _Frames(on_frame, on_end)
    await asyncio.get_running_loop().create_connection(lambda: frames, sock=sock)
    return frames


def _worker_main(sock: socket.socket, pool: WorkerPool) -> int:
    """A worker's life: ask the nodes it is sent until its socket ends; 0 when it ended so."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    try:
        _run(_serve(sock, pool))
    except BaseException:  # a bug: tell the parent, which fails the query with it
        with contextlib.suppress(OSError):
            sock.setblocking(True)
            sock.sendall(_frame([_CRASH, traceback.format_exc()]))
        return 1
    return 0


def _run(main: Coroutine[Any, Any, None]) -> None:
    """``main`` on uvloop's event loop where it is installed (the ``fast`` extra), else on
    asyncio's: about a tenth less CPU a node over TLS (docs/fleet.md, "Figures")."""
    try:
        import uvloop  # noqa: PLC0415 (optional)
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


async def _serve(sock: socket.socket, pool: WorkerPool) -> None:
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    out: list[Payload] = []
    tasks: set[asyncio.Task[None]] = set()

    def flush() -> None:
        if out:
            frames.send(_frame(out))
            out.clear()

    async def ask(index: int) -> None:
        result = await ask_node(pool.nodes[index], pool.query, pool.timeout_s, None, pool.tls)
        if not out:
            loop.call_soon(flush)
        out.append(
            (index, cast(dict[str, Any], result.answers), result.error, result.reason,
             result.elapsed_s, result.http_status, result.agent_message)
        )  # fmt: skip

    def fail(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not ended.done():
            ended.set_exception(cast(BaseException, task.exception()))

    def on_frame(indices: Any) -> None:
        for index in indices:
            task = loop.create_task(ask(index))
            tasks.add(task)
            task.add_done_callback(fail)

    def on_end(_: Exception | None) -> None:  # the parent is done, or gone: nothing to do
        os._exit(0)

    frames = await _connect(sock, on_frame, on_end)
    try:
        await ended
    finally:
        for task in tasks:
            task.cancel()
