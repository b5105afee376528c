"""A scriptable container engine API on a unix socket, served in the test's own event loop.

``FakeEngine`` answers what dockerd (and Podman's compatible API) answer to the requests of
``agent.engines``: ``GET /containers/json?all=1`` (the ids of ``containers``), ``GET
/containers/<id>/json`` (that container's inspect answer, or 404) and ``GET /events?...``,
held open as a chunked stream to which ``send`` writes lines and which ``end_streams`` ends.
A test can replace any answer with raw bytes (``answers``: path prefix -> bytes; held open
after them for the prefixes in ``hold_open``: an answer that never ends), and stop and start
the server (an engine that goes away and comes back on the same socket).
``requests`` lists the paths asked, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def json_answer(value: object, status: str = "200 OK") -> bytes:
    body = json.dumps(value).encode()
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status.encode(),
        len(body),
        body,
    )


NOT_FOUND = json_answer({"message": "No such container"}, "404 Not Found")


async def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` holds; ``AssertionError`` naming ``what`` past the deadline."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.005)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event_line(action: str, container_id: str, **extra: object) -> bytes:
    """One line of dockerd's event stream for a container event."""
    event = {
        "status": action,
        "id": container_id,
        "Type": "container",
        "Action": action,
        "Actor": {"ID": container_id, "Attributes": {}},
        "scope": "local",
        **extra,
    }
    return json.dumps(event).encode() + b"\n"


class FakeEngine:
    """The engine's state, as a test scripts it; ``await start()``, ``await stop()``."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.containers: dict[str, dict[str, object]] = {}  # id -> inspect answer
        self.answers: dict[str, bytes | Callable[[], bytes]] = {}  # path prefix -> raw answer
        self.hold_open: set[str] = set()  # path prefixes whose connections stay open after
        self.requests: list[str] = []
        self.streams: list[asyncio.StreamWriter] = []  # event streams open now
        self.streams_opened = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.on_stream: Callable[[asyncio.StreamWriter], None] | None = None

    def add(
        self,
        container_id: str,
        *,
        running: bool = False,
        labels: Mapping[str, str] | None = None,
        host_config: Mapping[str, object] | None = None,
    ) -> None:
        """A container with an inspect answer of dockerd's shape (the fields read)."""
        self.containers[container_id] = {
            "Id": container_id,
            "State": {"Status": "running" if running else "created", "Running": running},
            "Config": {"Labels": dict(labels or {}), "Env": []},
            "HostConfig": {"Devices": [], "DeviceRequests": None, "Runtime": "runc"}
            | dict(host_config or {}),
        }

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.socket_path)

    async def stop(self) -> None:
        """Stop listening, hang up every connection, remove the socket."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in self.streams:
            writer.close()
        self.streams.clear()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def send(self, data: bytes) -> None:
        """``data`` as one chunk to every open event stream."""
        for writer in list(self.streams):
            with contextlib.suppress(OSError):
                writer.write(chunk(data))
                await writer.drain()

    async def send_raw(self, data: bytes) -> None:
        """``data`` as it is (framing included) to every open event stream."""
        for writer in list(self.streams):
            with contextlib.suppress(OSError):
                writer.write(data)
                await writer.drain()

    async def end_streams(self) -> None:
        """End every open event stream as an engine that stops does: the last chunk."""
        for writer in list(self.streams):
            with contextlib.suppress(OSError):
                writer.write(b"0\r\n\r\n")
                await writer.drain()
            writer.close()
        self.streams.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")[1]
            self.requests.append(path)
            await self._answer(path, reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client hung up, or the test stopped the engine
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _answer(
        self, path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        for prefix, raw in self.answers.items():
            if path.startswith(prefix):
                writer.write(raw() if callable(raw) else raw)
                await writer.drain()
                if any(path.startswith(held) for held in self.hold_open):
                    await reader.read()  # until the client hangs up
                    return
                if not path.startswith("/events"):
                    return
                break
        else:
            if path.startswith("/events"):
                writer.write(CHUNKED_HEAD)
                await writer.drain()
            elif path == "/containers/json?all=1":
                writer.write(json_answer([{"Id": cid} for cid in self.containers]))
                await writer.drain()
                return
            elif path.startswith("/containers/") and path.endswith("/json"):
                found = self.containers.get(path.removeprefix("/containers/")[:-5])
                writer.write(NOT_FOUND if found is None else json_answer(found))
                await writer.drain()
                return
            else:
                writer.write(NOT_FOUND)
                await writer.drain()
                return
        self.streams.append(writer)
        self.streams_opened += 1
        if self.on_stream is not None:
            self.on_stream(writer)
        await reader.read()  # until the client hangs up (or the test stops the engine)
        if writer in self.streams:
            self.streams.remove(writer)
