"""The engine socket served: bound with the engine socket's rights, one task per client.

The socket is bound under a temporary name, given the owner, group and mode of the engine's
own socket (``--docker-socket``: whoever may use one may use the other, and both are
root-equivalent), then renamed into place, so it never exists with looser rights. When the
engine's socket is not there at start, the socket is the agent's own with mode 0600 (root
only), said in the log. A stale socket file (nobody listening) is replaced; a live one, or
a file that is not a socket, stops the start with one line. Every client connection is its
own task (``agent.engine_socket.proxy``): a slow or hostile client holds only its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from pathlib import Path

from agent.edge.stale_socket import InTheWay, clear_stale_socket
from agent.engine_socket.gpus import GpuCreates
from agent.engine_socket.heads import MAX_HEAD_BYTES
from agent.engine_socket.proxy import Connection

log = logging.getLogger("nvidia-docker-plugin.engine-socket")

FALLBACK_MODE = 0o600


class EngineSocketError(OSError):
    """The socket cannot be served; ``str()`` says why and what to do."""

    def __str__(self) -> str:
        return str(self.strerror)


class EngineSocket:
    """The served socket; ``close`` ends every connection and removes the file."""

    def __init__(self, path: Path, server: asyncio.Server, inode: int, rights: str) -> None:
        self.path = path
        self.rights = rights  # "mode 0660, owner 0:998", for the log
        self._server = server
        self._inode = inode
        self._tasks: set[asyncio.Task[None]] = set()

    def track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(OSError):
            if self.path.lstat().st_ino == self._inode:
                self.path.unlink()


def _rights(engine_socket: Path) -> tuple[int, int, int] | None:
    try:
        found = engine_socket.stat()
    except OSError:
        return None
    return stat.S_IMODE(found.st_mode), found.st_uid, found.st_gid


def _clear_stale(path: Path) -> None:
    in_the_way = clear_stale_socket(path)
    if in_the_way is InTheWay.NOT_A_SOCKET:
        raise EngineSocketError(
            0, f"{path} exists and is not a socket: remove it or choose another --engine-socket"
        )
    if in_the_way is InTheWay.LIVE:
        raise EngineSocketError(
            0, f"another process is serving {path}: stop it or choose another --engine-socket"
        )


def _bind(path: Path, engine_socket: Path) -> tuple[socket.socket, str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(path)
    rights = _rights(engine_socket)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(temporary))
        if rights is None:
            os.chmod(temporary, FALLBACK_MODE)
            said = f"mode {FALLBACK_MODE:04o}, the agent's own ({engine_socket} is not there)"
        else:
            mode, uid, gid = rights
            os.chmod(temporary, FALLBACK_MODE)
            os.chown(temporary, uid, gid)
            os.chmod(temporary, mode)
            said = f"mode {mode:04o}, owner {uid}:{gid}, as {engine_socket}"
        sock.listen(128)
        os.rename(temporary, path)
    except BaseException:
        sock.close()
        temporary.unlink(missing_ok=True)
        raise
    return sock, said


async def serve_engine_socket(
    path: Path,
    engine_socket: Path,
    creates: GpuCreates | None,
    *,
    head_timeout_s: float,
) -> EngineSocket:
    """Serve ``path``, forwarding to ``engine_socket``; ``EngineSocketError`` or
    ``OSError`` when it cannot be bound."""
    sock, said = _bind(path, engine_socket)
    served: list[EngineSocket] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None and served:
            served[0].track(task)
        connection = Connection((reader, writer), engine_socket, creates, head_timeout_s)
        try:
            await connection.serve()
        except asyncio.CancelledError:
            # closed by ``EngineSocket.close``: the connection's end is this task's end
            # (asyncio's server logs a cancelled client task as an error)
            return

    try:
        server = await asyncio.start_unix_server(handle, sock=sock, limit=MAX_HEAD_BYTES)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    site = EngineSocket(path, server, os.lstat(path).st_ino, said)
    served.append(site)
    return site
