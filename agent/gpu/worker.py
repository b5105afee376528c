"""The GPU worker: the child process that holds NVML, so that the daemon never does.

A driver upgrade needs every process to let go of ``/dev/nvidia*`` before the old kernel
module can be unloaded, and a new ``libnvidia-ml`` cannot be loaded reliably into a
process that had the old one. So the daemon (``agent.server``) keeps NVML here: to release
the GPUs it stops this process, to pick up a new driver it starts a new one. Started as

    python -m agent.gpu.worker --fd N [--simulate FILE] [--health-interval S]

with one end of a socket pair as file descriptor ``N``; the conversation is
``agent.gpu.worker_protocol``'s. With ``--simulate`` the simulated backend runs here
instead of NVML, so that tests exercise the same processes as a real node.

Threads: the main one reads requests and answers status reads (inline for one GPU, in a
pool of a thread per GPU for more); PCIe samples run on their own threads (one that takes
the request, a pool of a thread per GPU that samples), so a sample (about 40 ms a GPU)
never delays a status read; one thread waits for NVML events
(an unexpected failure there is one log line, and it waits again after a pause that grows
from ``EVENT_RETRY_FIRST_S`` to ``EVENT_RETRY_MAX_S``: it never ends for good); one sweeps
health checks every ``--health-interval`` seconds and pushes what changed. Both count the
GPUs' resets (``agent.gpu.resets``): an event's GPU is checked as soon as the event arrives,
and the event carries the count, so that a reset just after it is not mistaken for one
before it.
The worker exits when the daemon says ``stop`` or when its end of the pipe closes (the
daemon died). SIGINT and SIGTERM are the daemon's to handle: a terminal's Ctrl-C and
systemd's stop reach the whole process group or unit, and the daemon, which decides when
NVML goes, stops its worker as part of its own shutdown.

The worker lives as long as the agent and every module it imports stays resident, so its
NVML path (this module, ``nvml_backend`` and what they import) reads the kernel's files with
``os.path`` rather than ``pathlib`` (which brings ``urllib.parse`` and ``ipaddress``: 0.5 MB),
and a simulated node's worker does not import pynvml: NVML's driver-wide errors come from the
backend (``NvmlBackend.take_driver_error``), not from ``nvml_query`` directly.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from agent.gpu import worker_protocol as wp
from agent.gpu.backend import GpuBackend, GpuBackendError
from agent.gpu.backends import open_backend
from agent.gpu.health import DeviceCheck, EventWatch, HealthEvent, HealthSource
from agent.gpu.model import LOST_DEVICE_STATUS, UNKNOWN_THROUGHPUT, DeviceStatus, PcieThroughput
from agent.gpu.resets import ResetCounter

log = logging.getLogger("nvidia-docker-plugin.gpu-worker")

DEFAULT_HEALTH_INTERVAL_S = 1.0
EVENT_WAIT_S = 0.5  # how long one nvmlEventSetWait blocks (bounds how long stop takes)
# After an unexpected failure of the event watch, the pause before it watches again: doubled
# at each failure in a row, up to the maximum (at most two log lines a minute).
EVENT_RETRY_FIRST_S = 0.5
EVENT_RETRY_MAX_S = 30.0
EXIT_BACKEND_FAILED = 2
# The daemon's log format (agent.logs), so the worker's lines read as the daemon's own.
LOG_FORMAT = "nvidia-docker-plugin | %(asctime)s GPU worker: %(message)s"


class Worker:
    """Serves one backend over one socket until told to stop or the daemon goes away."""

    def __init__(
        self,
        sock: socket.socket,
        backend: GpuBackend,
        *,
        health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S,
    ) -> None:
        self._sock = sock
        self._backend = backend
        self._count = len(backend.node_info().devices)
        self._health_interval_s = health_interval_s
        self._write_lock = threading.Lock()
        self._stopping = threading.Event()
        self._status_pool = ThreadPoolExecutor(max(1, self._count), thread_name_prefix="status")
        self._pcie_pool = ThreadPoolExecutor(max(1, self._count), thread_name_prefix="pcie")
        self._sampler = ThreadPoolExecutor(1, thread_name_prefix="sample")
        self._threads: list[threading.Thread] = []
        self._resets = ResetCounter(self._count)
        # NVML's driver-wide errors (NvmlBackend.take_driver_error); a simulation has none.
        self._take_driver_error: Callable[[], int | None] = getattr(
            backend, "take_driver_error", _no_driver_error
        )

    # -- the conversation ------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        data = wp.frame(message)
        with self._write_lock, contextlib.suppress(OSError):  # the daemon went away: we stop
            self._sock.sendall(data)

    def serve(self) -> None:
        """Say hello, then answer until stop or end of stream; always shuts the backend."""
        try:
            self.send(
                {
                    "hello": {
                        "name": self._backend.name,
                        "node": wp.encode_node(self._backend.node_info()),
                    }
                }
            )
            self._start_health_threads()
            while not self._stopping.is_set():
                try:
                    request = wp.read_frame(self._sock)
                except (OSError, wp.ProtocolError) as err:
                    log.error("The pipe to the daemon broke (%s): stopping", err)
                    break
                if request is None:
                    break
                self._handle(request)
        finally:
            self._stop()

    def _handle(self, request: dict[str, Any]) -> None:
        ident, op = request.get("id"), request.get("op")
        if op == wp.STATUS_ALL:
            self._answer(ident, self._status_all)
        elif op == wp.PCIE_ALL:
            self._sampler.submit(self._answer, ident, self._pcie_all)
        elif op == wp.PING:
            self.send({"id": ident, "ok": True})
        elif op == wp.STOP:
            self.send({"id": ident, "ok": True})
            self._stopping.set()
        else:
            self.send({"id": ident, "error": f"unknown request {op!r}"})

    def _answer(self, ident: Any, work: Callable[[], Any]) -> None:
        try:
            value = work()
        except Exception as err:  # one bad request must not end the worker
            self.send({"id": ident, "error": f"{type(err).__name__}: {err}"})
        else:
            self.send({"id": ident, "ok": value})
        self._report_driver_error()

    def _report_driver_error(self) -> None:
        code = self._take_driver_error()
        if code is not None:
            self.send({"push": wp.PUSH_DRIVER_ERROR, "code": code})

    # -- reads -----------------------------------------------------------------------------

    def _status(self, index: int) -> DeviceStatus:
        try:
            return self._backend.device_status(index)
        except Exception as err:  # a backend must not raise; one GPU never fails the node
            log.warning("GPU %d: reading its status failed (%s); showing null values", index, err)
            return LOST_DEVICE_STATUS

    def _pcie(self, index: int) -> PcieThroughput:
        try:
            return self._backend.pcie_throughput(index)
        except Exception as err:
            log.warning("GPU %d: reading its PCIe throughput failed (%s)", index, err)
            return UNKNOWN_THROUGHPUT

    def _status_all(self) -> list[Any]:
        if self._count == 1:
            return [wp.encode_status(self._status(0))]
        statuses = self._status_pool.map(self._status, range(self._count))
        return [wp.encode_status(status) for status in statuses]

    def _pcie_all(self) -> list[Any]:
        throughputs = self._pcie_pool.map(self._pcie, range(self._count))
        return [wp.encode_throughput(throughput) for throughput in throughputs]

    # -- health ----------------------------------------------------------------------------

    def _start_health_threads(self) -> None:
        health = _health_source(self._backend)
        if health is None:
            return
        for name, target in (("events", self._watch_events), ("checks", self._sweep_checks)):
            thread = threading.Thread(target=target, args=(health,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _watch_events(self, health: HealthSource) -> None:
        try:
            watch: EventWatch | None = health.event_watch()
        except Exception as err:  # the checks still run
            log.warning("GPU events cannot be watched (%s): health comes from the checks", err)
            return
        if watch is None:
            return
        retry_s = EVENT_RETRY_FIRST_S
        try:
            while not self._stopping.is_set():
                try:
                    for event in watch.wait(EVENT_WAIT_S):
                        counted = self._counted(health, event)
                        self.send({"push": wp.PUSH_EVENT, "event": wp.encode_event(counted)})
                except Exception as err:  # the watch never ends for good: one line, a pause
                    log.error(
                        "Watching GPU events failed (%s): watching again in %g s",
                        _one_line(err),
                        retry_s,
                    )
                    self._stopping.wait(retry_s)
                    retry_s = min(retry_s * 2, EVENT_RETRY_MAX_S)
                else:
                    retry_s = EVENT_RETRY_FIRST_S
        finally:
            watch.close()

    def _counted(self, health: HealthSource, event: HealthEvent) -> HealthEvent:
        """``event`` with its GPU's reset count, after a check of that GPU now."""
        if not 0 <= event.index < self._count:
            return event
        check = self._resets.observe(event.index, self._check(health, event.index))
        return replace(event, resets=check.resets)

    def _sweep_checks(self, health: HealthSource) -> None:
        last: list[DeviceCheck] | None = None
        while not self._stopping.is_set():
            checks = [
                self._resets.observe(index, self._check(health, index))
                for index in range(self._count)
            ]
            if checks != last:
                self.send({"push": wp.PUSH_CHECKS, "checks": [wp.encode_check(c) for c in checks]})
                last = checks
            self._report_driver_error()
            self._stopping.wait(self._health_interval_s)

    @staticmethod
    def _check(health: HealthSource, index: int) -> DeviceCheck:
        try:
            return health.health_check(index)
        except Exception as err:
            log.warning("GPU %d: its health check failed (%s)", index, err)
            return DeviceCheck(answering=False)

    # -- the end ---------------------------------------------------------------------------

    def _stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for pool in (self._sampler, self._pcie_pool, self._status_pool):
            pool.shutdown(wait=True, cancel_futures=True)
        self._backend.close()
        with contextlib.suppress(OSError):
            self._sock.close()


def _one_line(err: BaseException) -> str:
    """``Type: message`` of an exception on one line, cut to 200 characters."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= 200 else text[:197] + "..."


def _no_driver_error() -> int | None:
    return None


def _health_source(backend: GpuBackend) -> HealthSource | None:
    if callable(getattr(backend, "health_check", None)) and callable(
        getattr(backend, "event_watch", None)
    ):
        return backend  # type: ignore[return-value]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.gpu.worker")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the daemon")
    parser.add_argument("--simulate", metavar="FILE")
    parser.add_argument("--health-interval", type=float, default=DEFAULT_HEALTH_INTERVAL_S)
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y/%m/%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if os.environ.get("NV_DEBUG") else logging.INFO)
    for signum in (signal.SIGINT, signal.SIGTERM):  # the daemon decides when we stop
        signal.signal(signum, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    return run(sock, lambda: open_backend(args.simulate), health_interval_s=args.health_interval)


def run(
    sock: socket.socket,
    start_backend: Callable[[], GpuBackend],
    *,
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S,
) -> int:
    """Start the backend and serve it on ``sock``, or say why it failed; the exit code."""
    try:
        backend = start_backend()
    except GpuBackendError as err:
        with contextlib.suppress(OSError):
            sock.sendall(wp.frame({"failed": {"message": str(err), "nvml_code": err.nvml_code}}))
            sock.close()
        return EXIT_BACKEND_FAILED
    Worker(sock, backend, health_interval_s=health_interval_s).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
