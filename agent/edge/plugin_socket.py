"""The plugin socket: Docker's volume plugin served on ``<socket dir>/nvidia-docker.sock``.

The plugin app is served on ``<socket dir>/nvidia-docker.sock`` only, never on TCP: it builds
and deletes files as root and has no authentication. The socket is bound under a temporary
name, given mode 0660, then renamed into place, so it never exists with looser permissions.
Its group is left as the daemon's: the only client is dockerd, which runs as root, and the
``docker`` group needs no access to build volumes (its members reach them through dockerd).

Who serves the socket is decided by an ``flock`` on ``<socket dir>/.nvidia-docker.sock.lock``,
taken before anything else and held, by an open descriptor, for as long as the daemon
serves: of two agents started at once on one directory exactly one gets it, and only the
holder ever checks for a stale socket and renames its own into place. The loser stops with
one line naming the holder's pid (written into the lock file). The lock file is left in
place when the agent stops: removing it would let a third agent lock a new file while a
second one still holds the old.

dockerd finds ``.sock`` files only in ``/run/docker/plugins``; for a socket elsewhere it
reads a spec file (``/etc/docker/plugins/nvidia-docker.spec`` containing
``unix://<socket dir>/nvidia-docker.sock``). ``start_plugin_site(..., spec_file=PATH)``
writes one and removes it on cleanup (``--spec-file`` of the daemon; packaging such as the
Ansible role may write it instead).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
from pathlib import Path

from aiohttp import web

from agent import files
from agent.config import SOCKET_NAME, default
from agent.edge.connections import ConnectionGuard, ConnectionLimits, GuardedSite
from agent.edge.error_log import HttpErrorLog
from agent.edge.stale_socket import InTheWay, clear_stale_socket
from plugin.authz import Gate
from plugin.protocol import create_app
from plugin.volumes import VolumeStore

SOCKET_MODE = 0o660
SHUTDOWN_TIMEOUT_S = 5.0

log = logging.getLogger("nvidia-docker-plugin.plugin")


class PluginSiteError(OSError):
    """The socket cannot be served; the message says why and what to do."""

    def __str__(self) -> str:
        return str(self.strerror)


PLUGIN_LIMITS = ConnectionLimits(default("header_timeout_s"), default("idle_timeout_s"))


async def start_plugin_site(
    store: VolumeStore,
    socket_dir: Path,
    *,
    spec_file: Path | None = None,
    limits: ConnectionLimits = PLUGIN_LIMITS,
    authz_gate: Gate | None = None,
) -> web.AppRunner:
    """Serve the plugin on ``<socket_dir>/nvidia-docker.sock``; cleanup removes the socket
    (and ``spec_file``, when one was asked for). ``limits`` are the header and idle
    timeouts (the socket has no connection bound: its only client is dockerd, and the
    descriptors it needs are kept from the REST API, agent.edge.descriptors). With
    ``authz_gate`` the socket is Docker's authorization plugin too (``plugin.authz``)."""
    path = socket_dir / SOCKET_NAME
    lock_fd = claim_socket(path)
    try:
        sock = _bind(path)
    except BaseException:
        os.close(lock_fd)
        raise
    inode = _inode(path)
    guard = ConnectionGuard("plugin socket", limits)
    app = create_app(store, middlewares=[guard.middleware], authz_gate=authz_gate)
    app.on_cleanup.append(lambda _app: _cleanup(path, inode, spec_file, lock_fd))
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logger=HttpErrorLog("plugin socket", anonymous="a unix socket client"),
        keepalive_timeout=limits.idle_timeout_s,
    )
    try:
        await runner.setup()
        await GuardedSite(runner, guard, sock=sock).start()
    except BaseException:
        sock.close()
        _remove_own_socket(path, inode)
        os.close(lock_fd)
        raise
    if spec_file is not None:
        try:
            write_spec_file(spec_file, path)
        except OSError as err:
            await runner.cleanup()  # the socket removed, the directory's lock let go
            raise PluginSiteError(
                err.errno,
                f"--spec-file {spec_file} cannot be written ({err.strerror or err}): "
                "give a path in a directory the agent can write (dockerd reads "
                "/etc/docker/plugins)",
            ) from None
    return runner


async def _cleanup(path: Path, inode: int | None, spec_file: Path | None, lock_fd: int) -> None:
    _remove_own_socket(path, inode)
    if spec_file is not None:
        remove_spec_file(spec_file, path)
    os.close(lock_fd)  # last: the socket is gone before another agent may take over


def lock_path(socket_path: Path) -> Path:
    """The lock file whose ``flock`` holder owns ``socket_path``."""
    return socket_path.with_name(f".{socket_path.name}.lock")


def claim_socket(socket_path: Path) -> int:
    """Take the socket directory's lock for this process; returns the descriptor, which
    holds the lock until closed. ``PluginSiteError`` when another process holds it."""
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(socket_path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise PluginSiteError(
            err.errno, f"cannot open the lock file {path}: {err.strerror} (check -s)"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise PluginSiteError(
            errno.EADDRINUSE,
            f"another agent{holder} is serving {socket_path} (it holds {path}): "
            "stop it or choose another -s",
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _holder(fd: int) -> str:
    """`` (pid N)`` from the lock file, or nothing when it cannot be read yet."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode("ascii").strip())
        return f" (pid {pid})"
    return ""


def _bind(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(temporary))
        os.chmod(temporary, SOCKET_MODE)
        sock.listen(128)
        os.rename(temporary, path)
    except BaseException:
        sock.close()
        temporary.unlink(missing_ok=True)
        raise
    return sock


def _clear_stale(path: Path) -> None:
    """Remove a socket file nobody listens on; refuse to take over a live one (served by
    a process that does not take the lock, such as an older agent). Called with the lock."""
    in_the_way = clear_stale_socket(path)
    if in_the_way is InTheWay.NOT_A_SOCKET:
        raise PluginSiteError(
            errno.EEXIST, f"{path} exists and is not a socket: remove it or choose another -s"
        )
    if in_the_way is InTheWay.LIVE:
        raise PluginSiteError(
            errno.EADDRINUSE,
            f"another process is serving {path} (another agent?): stop it or choose another -s",
        )


def _inode(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except OSError:
        return None


def _remove_own_socket(path: Path, inode: int | None) -> None:
    """Remove the socket file unless someone else has put theirs there meanwhile."""
    if inode is not None and _inode(path) == inode:
        path.unlink(missing_ok=True)


def _spec_line(socket_path: Path) -> str:
    """What the spec file says: ``unix://`` and the socket's absolute path, ``..`` resolved."""
    return f"unix://{os.path.abspath(socket_path)}"


def write_spec_file(spec_file: Path, socket_path: Path) -> None:
    """Write ``unix://<socket>`` to ``spec_file`` as the agent's state files are written
    (``agent.files.write_atomically``: a new file of mode 0644, synced, renamed over the old;
    a directory that is missing is made)."""
    line = _spec_line(socket_path) + "\n"
    files.write_atomically(spec_file.parent, spec_file.name, line.encode(), mode=0o644)
    log.info("Wrote the plugin spec file %s", spec_file)


def remove_spec_file(spec_file: Path, socket_path: Path) -> None:
    """Remove the spec file if it still points at our socket."""
    with contextlib.suppress(OSError):
        if spec_file.read_text(encoding="utf-8").strip() == _spec_line(socket_path):
            spec_file.unlink()
