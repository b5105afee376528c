"""The engine socket served: bound with the engine socket's rights, one task per client.

The socket is bound under a temporary name, given the owner, group and mode of the engine's
own socket (``--docker-socket``, or ``--podman-socket`` behind ``--podman-engine-socket``:
whoever may use one may use the other, and both are root-equivalent), then renamed into
place, so it never exists with looser rights. When the engine's socket is not there at
start, the socket is the agent's own with mode 0600 (its user only), said in the log. An
agent that may not give a file away (an unprivileged user, as the packaged unit runs it)
keeps itself as the owner and takes the engine socket's group and mode, which needs its user
in that group (``docker``): the same clients may use both. A stale socket file (nobody
listening) is replaced; a live one, or a file that is not a socket, stops the start with one
line. Every client connection is its own task (``agent.engine_socket.proxy``): a slow or
hostile client holds only its own. At most ``max_connections`` are open at once
(``--engine-connections``): a client beyond them gets one ``503`` answer in the engine's
words and the connection is closed, so that the engine socket never takes the descriptors
the REST API and the plugin socket need.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import time
from pathlib import Path

from agent.edge.stale_socket import InTheWay, clear_stale_socket
from agent.engine_socket.gpus import GpuCreates
from agent.engine_socket.heads import MAX_HEAD_BYTES
from agent.engine_socket.proxy import Connection, error_answer, read_head

log = logging.getLogger("nvidia-docker-plugin.engine-socket")

FALLBACK_MODE = 0o600
BUSY_HEAD_S = 5.0  # how long a refused client may take to send its head before the answer
BUSY_LOG_EVERY_S = 60.0  # one warning a minute at most while clients are refused


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
        self._tasks: set[asyncio.Task[None]] = set()  # the clients served
        self._refusing: set[asyncio.Task[None]] = set()  # clients beyond the bound, answered

    @property
    def open_connections(self) -> int:
        return len(self._tasks)

    def track(self, task: asyncio.Task[None], *, served: bool = True) -> None:
        tasks = self._tasks if served else self._refusing
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def close(self) -> None:
        self._server.close()
        tasks = [*self._tasks, *self._refusing]
        for task in tasks:
            task.cancel()
        for task in tasks:
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


def _clear_stale(path: Path, flag: str) -> None:
    in_the_way = clear_stale_socket(path)
    if in_the_way is InTheWay.NOT_A_SOCKET:
        raise EngineSocketError(
            0, f"{path} exists and is not a socket: remove it or choose another {flag}"
        )
    if in_the_way is InTheWay.LIVE:
        raise EngineSocketError(
            0, f"another process is serving {path}: stop it or choose another {flag}"
        )


def _bind(path: Path, engine_socket: Path, flag: str) -> tuple[socket.socket, str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale(path, flag)
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
            said = _give_rights(temporary, engine_socket, mode, uid, gid)
        sock.listen(128)
        os.rename(temporary, path)
    except BaseException:
        sock.close()
        temporary.unlink(missing_ok=True)
        raise
    return sock, said


def _give_rights(temporary: Path, engine_socket: Path, mode: int, uid: int, gid: int) -> str:
    """The engine socket's owner, group and mode on ``temporary``; the group and mode alone
    where this process may not give the file away; what it has, for the log."""
    try:
        os.chown(temporary, uid, gid)
    except PermissionError:
        if uid == os.geteuid():
            raise
        try:
            os.chown(temporary, -1, gid)
        except PermissionError:
            raise EngineSocketError(
                0,
                f"cannot give the engine socket the group of {engine_socket} (gid {gid}): "
                "the agent's user is not in it; add it to that group (the Ansible role: "
                "nvidia_docker_agent_user_groups), or run the agent as root",
            ) from None
        os.chmod(temporary, mode)
        return (
            f"mode {mode:04o}, group {gid} as {engine_socket}, owner {os.geteuid()} "
            f"(this agent's user may not give it to {uid})"
        )
    os.chmod(temporary, mode)
    return f"mode {mode:04o}, owner {uid}:{gid}, as {engine_socket}"


class _Refusals:
    """Clients refused at the connection bound: counted, and warned of once a minute."""

    def __init__(self, path: Path, bound: int) -> None:
        self.path = path
        self.bound = bound
        self.count = 0
        self._warned_at: float | None = None

    def message(self) -> str:
        return (
            f"the engine socket {self.path} has its {self.bound} connections open "
            "(--engine-connections): close some (docker logs -f, attach, events), or "
            "raise it, then try again"
        )

    def note(self) -> None:
        self.count += 1
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= BUSY_LOG_EVERY_S:
            self._warned_at = now
            log.warning(
                "Engine socket: a client refused (%d so far): %s", self.count, self.message()
            )


async def _refuse(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, refusals: _Refusals
) -> None:
    """A client beyond the bound: its head read (so that it sees the answer), one 503."""
    refusals.note()
    try:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(read_head(reader), BUSY_HEAD_S)
        writer.write(error_answer(503, refusals.message(), close=True))
        await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def serve_engine_socket(
    path: Path,
    engine_socket: Path,
    creates: GpuCreates | None,
    *,
    head_timeout_s: float,
    max_connections: int,
    flag: str = "--engine-socket",
) -> EngineSocket:
    """Serve ``path``, forwarding to ``engine_socket``, at most ``max_connections`` clients
    at once; ``EngineSocketError`` or ``OSError`` when it cannot be bound (its line names
    ``flag``, the option that asked for ``path``)."""
    sock, said = _bind(path, engine_socket, flag)
    served: list[EngineSocket] = []
    refusals = _Refusals(path, max_connections)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if served and served[0].open_connections >= max_connections:
            if task is not None:
                served[0].track(task, served=False)
            with contextlib.suppress(asyncio.CancelledError):
                await _refuse(reader, writer, refusals)
            return
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
