"""The daemon process and its surroundings: which event loop it runs, the memory start-up
used, and what it tells systemd.

- ``loop_factory(choice)`` (``--event-loop``): uvloop when asked for or, with ``auto``,
  when installed; asyncio's own loop otherwise.
- ``import_aiohttp_to_serve()``: the daemon's first import of aiohttp, without the system's
  CA certificates that aiohttp's client would load (about 2 MB; the daemon is never its
  client).
- ``release_startup_memory()``: give back to the kernel the heap that start-up used (ELF
  parsing, NVML discovery): glibc keeps freed memory in its arenas, and the agent then runs
  for months with that resident; ``malloc_trim`` returns it.
- ``notify(message)`` / ``notify_status(text)``: the packaged unit is ``Type=notify``:
  systemd starts what is ordered after the agent (``docker.service``, the Mesos agents) only
  once the agent sends ``READY=1``, which it does when its plugin socket and REST API answer
  (``agent.edge.readiness``). The protocol is one datagram to the unix socket named by
  ``$NOTIFY_SOCKET`` (a path, or an abstract name starting with ``@``), as sd_notify(3)
  describes; no library is needed for that. Without ``$NOTIFY_SOCKET`` (not started by
  systemd) every call does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping

from agent.errors import StartupError


def loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """The event loop to serve with: uvloop when asked for or, with ``auto``, when installed."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop  # noqa: PLC0415 - optional, faster event loop
        except ImportError:
            if choice == "uvloop":
                raise StartupError("--event-loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.new_event_loop, "uvloop"
    return None, "asyncio"


def import_aiohttp_to_serve() -> None:
    """Import aiohttp for a process that serves HTTP and is never aiohttp's client.

    When it is first imported, aiohttp (3.10 and later, ``aiohttp.connector``) builds the
    two TLS contexts its client uses by default, so that no event loop waits on the disk for
    them later; the verifying one loads the system's CA file (OpenSSL's default, or
    ``$SSL_CERT_FILE``), about 2 MB of memory for as long as the process lives (measured:
    docs/performance.md, "The house in order: status speed, memory and idle CPU"). The
    daemon serves HTTP; the sockets of Docker and Podman it asks are unix sockets spoken by
    its own clients. So its first import of aiohttp runs with ``SSL_CERT_FILE`` naming an
    empty file, and the variable is put back as it was at once: a TLS context made later in
    the process (and every child process) sees the environment as it was given. Had the
    daemon ever used aiohttp's default verifying context, it would trust no certificate
    authority and refuse the connection: a failure, never a connection left unchecked.
    Nothing happens when aiohttp is already imported (the tests' processes).
    """
    if "aiohttp" in sys.modules:
        return
    given = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = os.devnull
    try:
        import aiohttp  # noqa: F401, PLC0415 - the point: imported here, first
    finally:
        if given is None:
            del os.environ["SSL_CERT_FILE"]
        else:
            os.environ["SSL_CERT_FILE"] = given


def release_startup_memory() -> None:
    """Give back to the kernel the heap that start-up used (ELF parsing, NVML discovery).

    glibc keeps freed memory in its arenas; the agent then runs for months with that
    resident. ``malloc_trim`` returns it. A no-op where libc has no such call.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


log = logging.getLogger("nvidia-docker-plugin")

_failed_logged: set[str] = set()


def notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``message`` (``READY=1``, ``STATUS=...``, lines joined by newlines) to systemd;
    True when sent. A failure is logged once per socket and never raises."""
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        target = "\0" + address[1:]  # an abstract socket name
    elif address.startswith("/"):
        target = address
    else:
        _log_once(address, "only unix socket addresses are supported")
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            sock.sendall(message.encode())
    except OSError as err:
        _log_once(address, err.strerror or str(err))
        return False
    return True


def notify_status(text: str) -> None:
    """The one line ``systemctl status`` shows for the unit."""
    notify(f"STATUS={text}")


def _log_once(address: str, why: str) -> None:
    if address not in _failed_logged:
        _failed_logged.add(address)
        log.warning("Cannot tell systemd (NOTIFY_SOCKET=%s): %s", address, why)
