"""Helpers for tests that start real processes: free ports, readiness waits, clean stops."""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator

from aiohttp import web


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(
    ready: Callable[[], bool],
    *,
    what: str,
    timeout_s: float = 60.0,
    proc: subprocess.Popen[bytes] | None = None,
    interval_s: float = 0.05,
) -> None:
    """Poll ``ready`` until it is true; fail early, with the reason, if ``proc`` dies first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with code {proc.returncode}")
        with contextlib.suppress(OSError):
            if ready():
                return
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM, wait, then SIGKILL: never leave a process behind."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def machine_lock(name: str, timeout_s: float = 600) -> Iterator[None]:
    """Hold the machine-wide lock ``name`` (across concurrent test runs) for the duration.

    The lock is a unix socket bound in the abstract namespace (``@nvd-test-<name>``): only one
    socket can hold a name, the kernel frees it when the socket closes or its process dies,
    and nothing is written to disk (a lock file in /run/lock would outlive the run).
    """
    address = f"\0nvd-test-{name}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock.bind(address)
                break
            except OSError as err:
                if err.errno != errno.EADDRINUSE:
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lock {name!r} is held by another test run") from None
                time.sleep(0.2)
        yield
    finally:
        sock.close()


@contextlib.asynccontextmanager
async def serve_on_loopback(app: web.Application) -> AsyncIterator[int]:
    """Serve an aiohttp app on a free 127.0.0.1 port for the duration; yields the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()
