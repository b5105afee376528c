"""The daemon's side of the GPU worker: the child process that holds NVML, as the daemon sees it.

``await WorkerClient.spawn(simulate=...)`` starts ``python -m agent.gpu.worker`` on one end
of a socket pair (on a real node with libcuda kept from its NVML:
``agent.gpu.hidden_libcuda``) and waits for its hello (the node's static facts). Then:

- ``read_statuses()`` / ``read_throughputs()`` (coroutines, the daemon's hot path): every
  device in one round trip, read off the pipe by an asyncio protocol in the event loop, so
  no thread hop is added on the daemon's side;
- pushes (NVML events, health checks, driver errors) go to the handler given to
  ``set_push_handler``, in the event loop; pushes that arrive before it is set are kept;
- ``await stop()`` asks the worker to shut NVML down and waits until the process is gone,
  so that every ``/dev/nvidia*`` descriptor it held is closed; ``closed`` is set when the
  pipe ends for any reason (``exit_reason`` says why).
- every call has a deadline (``call_deadline_s``, ``CALL_DEADLINE_S`` by default): a worker
  that does not answer in time (a hung NVML call, a stopped process) is killed at once, and
  every call waiting on it, that one included, raises ``WorkerGone`` with the reason, so
  that no request waits on a hung worker longer than the deadline; ``closed`` is set, and
  the daemon (``agent.node.life``) starts another worker.

``attach(sock)`` is the same client on a socket whose other end is served some other way
(the unit tests serve a ``Worker`` in a thread, over the fake pynvml).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from agent.gpu import worker_protocol as wp
from agent.gpu.backend import BackendGone, GpuBackendError
from agent.gpu.codec import CodecError
from agent.gpu.hidden_libcuda import with_empty_libcuda
from agent.gpu.model import DeviceStatus, NodeInfo, PcieThroughput

log = logging.getLogger("nvidia-docker-plugin.gpu-worker")

START_TIMEOUT_S = 120.0  # nvmlInit plus reading every GPU's facts (8 GPUs: about 1 s)
STOP_TIMEOUT_S = 10.0
# How long any answer of the worker may take. A status read of 8 GPUs takes a few ms and a
# PCIe sample about 45 ms (the GPUs in parallel); past this the worker is taken for hung.
CALL_DEADLINE_S = 3.0

PushHandler = Callable[[dict[str, Any]], None]


class WorkerFailed(GpuBackendError):
    """The worker started but its backend did not (no driver, version mismatch, bad file)."""


class WorkerGone(BackendGone):
    """The worker stopped answering: it exited, or the pipe broke."""


class WorkerClient:
    """One running GPU worker, seen from the event loop that started it (a ``GpuReader``)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        process: subprocess.Popen[bytes] | None,
        call_deadline_s: float = CALL_DEADLINE_S,
    ) -> None:
        self._loop = loop
        self.process = process
        self.call_deadline_s = call_deadline_s
        self._transport: asyncio.Transport | None = None
        self._hello: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        self._push: PushHandler | None = None
        self._early_pushes: list[dict[str, Any]] = []
        self._name = "GPU worker"
        self._node: NodeInfo | None = None
        self.closed = asyncio.Event()
        self.exit_reason: str | None = None
        self._reaped: asyncio.Future[int] | None = None

    # -- starting --------------------------------------------------------------------------

    @classmethod
    async def spawn(
        cls,
        *,
        simulate: str | None = None,
        health_interval_s: float = 1.0,
        start_timeout_s: float = START_TIMEOUT_S,
        call_deadline_s: float = CALL_DEADLINE_S,
    ) -> WorkerClient:
        """Start a worker process and wait for its hello; ``WorkerFailed`` if its backend
        cannot start (the message is the backend's one line)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [
            sys.executable, "-m", "agent.gpu.worker",
            "--fd", str(theirs.fileno()),
            "--health-interval", str(health_interval_s),
        ]  # fmt: skip
        if simulate is not None:
            command += ["--simulate", simulate]
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)  # systemd hears from the daemon only
        if simulate is None:  # NVML without libcuda: 3.9 MB less for the worker's lifetime
            env = with_empty_libcuda(env)
        try:
            process = subprocess.Popen(  # noqa: ASYNC220 - returns at once; reaped in a thread
                command,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        except OSError as err:
            ours.close()
            raise GpuBackendError(f"cannot start the GPU worker ({err})") from None
        finally:
            theirs.close()
        return await cls.attach(
            ours, process=process, start_timeout_s=start_timeout_s, call_deadline_s=call_deadline_s
        )

    @classmethod
    async def attach(
        cls,
        sock: socket.socket,
        *,
        process: subprocess.Popen[bytes] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        call_deadline_s: float = CALL_DEADLINE_S,
    ) -> WorkerClient:
        loop = asyncio.get_running_loop()
        client = cls(loop, process, call_deadline_s)
        sock.setblocking(False)
        transport, _ = await loop.create_unix_connection(lambda: _Pipe(client), sock=sock)
        client._transport = transport
        if process is not None:
            client._reaped = asyncio.ensure_future(loop.run_in_executor(None, process.wait))
        try:
            hello = await asyncio.wait_for(asyncio.shield(client._hello), start_timeout_s)
        except TimeoutError:
            await client.stop(timeout_s=1.0)
            raise GpuBackendError(
                f"the GPU worker did not start within {start_timeout_s:.0f} s "
                "(NVML hangs? check the driver with nvidia-smi)"
            ) from None
        except BaseException:
            await client.stop(timeout_s=STOP_TIMEOUT_S)
            raise
        try:
            client._name = str(hello.get("name") or "GPU worker")
            client._node = wp.decode_node(hello.get("node") or {})
        except (CodecError, AttributeError, TypeError) as err:  # a bug of ours: say so
            await client.stop()
            raise GpuBackendError(f"the GPU worker's node facts cannot be read ({err})") from None
        return client

    # -- the worker's facts ----------------------------------------------------------------

    @property
    def name(self) -> str:
        """The worker's backend: ``NVML 13.580.159.04``, ``simulated (h200.json)``."""
        return self._name

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def node_info(self) -> NodeInfo:
        """The node's static facts, as the worker said them in its hello."""
        assert self._node is not None, "attach() sets it"
        return self._node

    # -- the daemon's side -----------------------------------------------------------------

    async def read_statuses(self) -> tuple[DeviceStatus, ...]:
        """Every device's status, one round trip."""
        return tuple(wp.decode_status(item) for item in await self.call(wp.STATUS_ALL))

    async def read_throughputs(self) -> tuple[PcieThroughput, ...]:
        """Every device's PCIe throughput (the slow sample), one round trip."""
        return tuple(wp.decode_throughput(item) for item in await self.call(wp.PCIE_ALL))

    async def ping(self) -> None:
        """Raises ``WorkerGone`` unless the worker answers within the deadline."""
        await self.call(wp.PING)

    def set_push_handler(self, handler: PushHandler) -> None:
        self._push = handler
        early, self._early_pushes = self._early_pushes, []
        for message in early:
            handler(message)

    async def call(self, op: str, **args: Any) -> Any:
        """Ask the worker; its answer, or ``WorkerGone`` (it answered an error, ended, or
        missed the deadline and was killed)."""
        if self.exit_reason is not None or self._transport is None:
            raise WorkerGone(self.exit_reason or "the GPU worker is not running")
        self._next_id += 1
        ident = self._next_id
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[ident] = future
        self._transport.write(wp.frame({"id": ident, "op": op, **args}))
        timer = self._loop.call_later(self.call_deadline_s, self._missed_deadline, op)
        try:
            return await future
        finally:
            timer.cancel()

    def _missed_deadline(self, op: str) -> None:
        """A call got no answer in time: the worker is hung (NVML, or the process stopped).
        Kill it now (SIGKILL ends a stopped process too) and fail every waiting call."""
        if self.exit_reason is not None:
            return
        pid = f" (pid {self.process.pid})" if self.process is not None else ""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.process.kill()
        self._lost(
            f"the GPU worker{pid} did not answer {_WHAT.get(op, op)} within "
            f"{self.call_deadline_s:g} s (a hung NVML call, or a stopped process) and was killed"
        )
        if self._transport is not None:
            self._transport.close()

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the worker to exit and wait until it has (killing it if it will not)."""
        if self.exit_reason is None and self._transport is not None:
            with contextlib.suppress(WorkerGone, TimeoutError):
                await asyncio.wait_for(self.call(wp.STOP), timeout_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.closed.wait(), timeout_s)
        if self._transport is not None:
            self._transport.close()
        if self.process is not None and self._reaped is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reaped), timeout_s)
            except TimeoutError:
                log.warning("The GPU worker (pid %d) does not exit: killing it", self.process.pid)
                self.process.kill()
                await self._reaped
        self.closed.set()

    # -- the pipe --------------------------------------------------------------------------

    def _dispatch(self, message: dict[str, Any]) -> None:
        ident = message.get("id")
        if ident is not None:
            future = self._pending.pop(ident, None)
            if future is None or future.done():
                return
            if "error" in message:
                future.set_exception(WorkerGone(f"the GPU worker failed: {message['error']}"))
            else:
                future.set_result(message.get("ok"))
        elif "push" in message:
            if self._push is None:
                self._early_pushes.append(message)
            else:
                self._push(message)
        elif "hello" in message and not self._hello.done():
            self._hello.set_result(message["hello"])
        elif "failed" in message and not self._hello.done():
            failed = message["failed"] or {}
            code = failed.get("nvml_code")
            self._hello.set_exception(
                WorkerFailed(
                    str(failed.get("message") or "the GPU backend did not start"),
                    nvml_code=code if isinstance(code, int) else None,
                )
            )

    def _lost(self, why: str) -> None:
        if self.exit_reason is None:
            self.exit_reason = why
        gone = WorkerGone(self.exit_reason)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(gone)
        self._pending.clear()
        if not self._hello.done():
            self._hello.set_exception(
                WorkerGone(f"the GPU worker stopped before it started ({self.exit_reason})")
            )
        self.closed.set()


def _show(message: dict[str, Any]) -> str:
    """A frame in a message: its JSON, cut to 80 characters (one short line)."""
    text = json.dumps(message)
    return text if len(text) <= 80 else text[:77] + "..."


_WHAT = {
    wp.STATUS_ALL: "a status read",
    wp.PCIE_ALL: "a PCIe sample",
    wp.PING: "a ping",
    wp.STOP: "the request to stop",
}


class _Pipe(asyncio.Protocol):
    """Frames in, dispatched to the client as they complete."""

    def __init__(self, client: WorkerClient) -> None:
        self._client = client
        self._reader = wp.FrameReader()
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._reader.feed(data)
        except wp.ProtocolError as err:
            self._client._lost(f"the GPU worker sent garbage ({err})")
            if self._transport is not None:
                self._transport.close()
            return
        for message in messages:
            try:
                self._client._dispatch(message)
            except (TypeError, AttributeError) as err:  # a frame of JSON, but not ours
                self._client._lost(f"the GPU worker sent garbage ({_show(message)}: {err})")
                if self._transport is not None:
                    self._transport.close()
                return

    def connection_lost(self, exc: Exception | None) -> None:
        process = self._client.process
        code = process.poll() if process is not None else None
        why = "the GPU worker's pipe closed"
        if code is not None:
            why = f"the GPU worker exited (code {code})"
        elif exc is not None:
            why = f"the GPU worker's pipe broke ({exc})"
        self._client._lost(why)
