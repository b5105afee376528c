"""Helpers for tests that start real processes: free ports, readiness waits, clean stops."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

from aiohttp import web

T = TypeVar("T")


def python_path(first: Path) -> str:
    """A PYTHONPATH with ``first`` (a checkout) before what the caller's PYTHONPATH names: the
    code under test comes from there, and dependencies installed in a target directory (as on
    the device machine) stay reachable."""
    return os.pathsep.join([str(first), *filter(None, [os.environ.get("PYTHONPATH")])])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody uses right now, for a server that binds it a moment later.

    Chosen at random outside the kernel's ephemeral range (ip_local_port_range). A port the
    kernel picks (bind to port 0) is the worst choice for this: the kernel hands the same
    ports out for every outgoing connection and every other bind to port 0 on the machine,
    so with other test runs busy on it another process often takes the port before the
    server binds it ("address already in use"). A port outside that range is only taken by
    someone who asks for it by number. ``host`` may be an IPv6 address (``::1``).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, high = _ephemeral_ports()
    ranges = [r for r in (range(10000, low), range(high + 1, 65536)) if len(r) > 0]
    for _ in range(200 if ranges else 0):
        port = random.choice(random.choice(ranges))
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:  # no room outside it
        sock.bind((host, 0))
        picked: int = sock.getsockname()[1]
        return picked


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def wait_stable(
    read: Callable[[], T], *, alike: int, what: str, timeout_s: float, interval_s: float
) -> T:
    """Read until the last ``alike`` readings, ``interval_s`` apart, are equal; the last."""
    seen: list[T] = []

    def stable() -> bool:
        seen.append(read())
        return len(seen) >= alike and all(v == seen[-1] for v in seen[-alike:])

    wait_until(stable, what=what, timeout_s=timeout_s, interval_s=interval_s)
    return seen[-1]


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


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself has a TCP socket listening on ``port``.

    Readiness checks use this rather than ``port_open``: a port from ``free_port`` is free
    only when picked, and on a machine where other test runs start servers too, someone else
    may take it before the process under test binds it; connecting would then find the other
    server and call the wrong process ready.
    """
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                listening = fields[3] == "0A"  # TCP_LISTEN
                if (
                    listening
                    and int(fields[1].rsplit(":", 1)[1], 16) == port
                    and fields[9] in inodes
                ):
                    return True
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


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted on ``path`` (made if missing) with ``mount -o options`` for the
    block, unmounted after it; a machine that does not let it mount: ``unavailable``."""
    from tests.support.prerequisites import unavailable  # noqa: PLC0415

    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        unavailable(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
