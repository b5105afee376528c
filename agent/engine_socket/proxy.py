"""One client connection of the engine socket, forwarded to the engine's socket.

Each client connection gets its own task and its own connection to the engine, opened at
its first request. Requests are read one at a time: the head (within ``MAX_HEAD_BYTES``, in
``head_timeout_s``), then the body, copied as it comes (``Content-Length`` or chunked,
framing checked, bytes unchanged) while the answer is relayed as it comes. Only a
container create (``agent.engine_socket.create``) is read whole (within
``MAX_CREATE_BYTES``), and only one that asks for GPUs is rewritten and leased; a create
that cannot get its GPUs, or whose body is refused, is answered here, as the engine
answers a bad create (``{"message": ...}``), and nothing is forwarded; a create that asks
``Expect: 100-continue`` gets ``100 Continue`` from the socket before its body is read (the
``Expect`` is not forwarded). An error answered here before a request was read whole (a
``413``, a head refused) says ``Connection: close``, ends the socket's output, and reads and
drops what the client still sends for up to ``LINGER_S`` before closing, so that a client
that sends its whole body before it reads gets the answer. A create that waits
for its GPUs (``nvidia-docker.lease.wait``) holds its connection meanwhile; its client's
closing the connection (checked every ``CLIENT_CHECK_S``) takes it out of the queue. While
any other answer is relayed, a client that closes its connection ends the engine's (checked
as often), as the engine ends a request whose client left (``docker events`` killed).

An answer of ``101`` (HTTP Upgrade: attach, exec, ``docker run -it``) or one without a
length (Docker's hijacked streams answer ``200`` and then raw bytes) turns the connection
into a byte pump both ways: the client's end of input is passed on as a half close, and the
engine's end ends the connection. A request after an Upgrade-asking one is never parsed.
Request bodies are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import select
from collections.abc import Callable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

from agent.engine_socket.create import (
    MAX_CREATE_BYTES,
    Addition,
    CreateError,
    GpuRequest,
    container_name,
    gpu_request,
    is_create,
    read_body,
    rewrite,
)
from agent.engine_socket.gpus import GpuCreates
from agent.engine_socket.heads import (
    MAX_CHUNK_LINE,
    MAX_HEAD_BYTES,
    Body,
    Framing,
    Head,
    HeadError,
    chunk_size,
    parse_request_head,
    parse_response_head,
)
from agent.leases.answers import Granted

log = logging.getLogger("nvidia-docker-plugin.engine-socket")

PIECE = 256 * 1024  # bytes copied at once
END = b"\r\n\r\n"
CLIENT_CHECK_S = 0.25  # how often a create that waits for GPUs checks that its client is there
LINGER_S = 2.0  # how long what a client still sends after a closing error is read and dropped
MAX_CREATED_ANSWER = 64 * 1024  # a create's answer read whole for its container's id
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Hijacked(Exception):
    """The answer turned the connection into a raw stream."""


class _Broken(Exception):
    """A request whose body broke off or lost its framing after its head went on, an
    answer whose body did, or a create whose client left while it waited for GPUs: the
    connection is closed (the engine may have answered part already)."""


def _whole(answer: Head) -> bool:
    """A success whose body is short and of a known length."""
    return (
        200 <= answer.status < 300
        and answer.framing.body is Body.LENGTH
        and answer.framing.length <= MAX_CREATED_ANSWER
    )


def error_answer(status: int, text: str, *, close: bool = False) -> bytes:
    """An engine-style error: ``{"message": text}``, as the docker CLI prints it."""
    body = (json.dumps({"message": text}) + "\n").encode()
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    )
    return head.encode() + body


async def read_head(reader: asyncio.StreamReader) -> bytes | None:
    """One head, its empty line included; None at the end of the stream before a byte.
    ``HeadError`` for a head that is too large or ends early."""
    try:
        return await reader.readuntil(END)
    except asyncio.IncompleteReadError as err:
        if not err.partial:
            return None
        raise HeadError(400, "the connection ended inside a request head") from None
    except asyncio.LimitOverrunError:
        raise HeadError(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes") from None


async def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


async def _copy_exactly(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int
) -> None:
    while length > 0:
        piece = await reader.read(min(length, PIECE))
        if not piece:
            raise HeadError(400, "the connection ended inside a body")
        length -= len(piece)
        await _write(writer, piece)


async def _line(reader: asyncio.StreamReader) -> bytes:
    try:
        line = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError:
        raise HeadError(400, "the connection ended inside a chunked body") from None
    except asyncio.LimitOverrunError:
        raise HeadError(400, "a chunk-size line is too long") from None
    if len(line) > MAX_CHUNK_LINE:
        raise HeadError(400, "a chunk-size or trailer line is too long")
    return line


async def copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one chunked body unchanged, its trailer included; ``HeadError`` when its
    framing is broken."""
    while True:
        line = await _line(reader)
        size = chunk_size(line)
        await _write(writer, line)
        if size == 0:
            break
        await _copy_exactly(reader, writer, size)
        end = await reader.readexactly(2) if size else b""
        if end != b"\r\n":
            raise HeadError(400, "a chunk does not end with CRLF")
        await _write(writer, end)
    trailers = 0
    while (line := await _line(reader)) != b"\r\n":  # the trailer, then the empty line
        trailers += 1
        if trailers > 64:
            raise HeadError(400, "too many trailer lines")
        await _write(writer, line)
    await _write(writer, line)


async def read_chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    """A chunked body, decoded, of at most ``limit`` bytes (``HeadError`` 413 beyond)."""
    parts: list[bytes] = []
    total = 0
    while True:
        size = chunk_size(await _line(reader))
        if size == 0:
            break
        total += size
        if total > limit:
            raise HeadError(413, f"the create body is larger than {limit} bytes")
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise HeadError(400, "a chunk does not end with CRLF")
    while await _line(reader) != b"\r\n":
        pass
    return b"".join(parts)


async def copy_body(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, framing: Framing
) -> None:
    if framing.body is Body.LENGTH:
        await _copy_exactly(reader, writer, framing.length)
    elif framing.body is Body.CHUNKED:
        await copy_chunked(reader, writer)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until the end of ``reader``, then half-close ``writer`` (where it can be)."""
    while piece := await reader.read(PIECE):
        await _write(writer, piece)
    if writer.can_write_eof():
        with contextlib.suppress(OSError):
            writer.write_eof()


class Connection:
    """One client connection; ``serve`` runs it to its end."""

    def __init__(
        self,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        engine_socket: Path,
        creates: GpuCreates | None,
        head_timeout_s: float,
    ) -> None:
        self._reader, self._writer = client
        self._engine_socket = engine_socket
        self._creates = creates
        self._head_timeout_s = head_timeout_s
        self._engine: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._status = 0  # the status of the engine's latest answer, once its head is read
        self._watcher: asyncio.TimerHandle | None = None  # ``_watch``

    async def serve(self) -> None:
        try:
            await self._requests()
        except _Hijacked:
            await self._both_ways()
        except HeadError as err:
            log.debug("Engine socket: %s", err)
            with contextlib.suppress(OSError):
                await _write(self._writer, error_answer(err.status, str(err), close=True))
                await self._linger()
        except (OSError, asyncio.IncompleteReadError, _Broken) as err:
            log.debug("Engine socket: a connection ended: %s", err)
        finally:
            self._close()

    async def _linger(self) -> None:
        """The end of the socket's output, then what the client still sends (the rest of a
        body refused before it was read) read and dropped until its end or ``LINGER_S``."""
        if self._writer.can_write_eof():
            self._writer.write_eof()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_S):
                while await self._reader.read(PIECE):
                    pass

    def _close(self) -> None:
        for writer in (self._writer, self._engine[1] if self._engine else None):
            if writer is not None:
                with contextlib.suppress(Exception):
                    writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._engine is None:
            try:
                self._engine = await asyncio.open_unix_connection(
                    str(self._engine_socket), limit=MAX_HEAD_BYTES
                )
            except OSError as err:
                raise HeadError(
                    502,
                    f"Cannot connect to the Docker daemon at unix://{self._engine_socket} "
                    f"({err.strerror or err}). Is the docker daemon running?",
                ) from None
        return self._engine

    async def _requests(self) -> None:
        while True:
            raw = await asyncio.wait_for(read_head(self._reader), self._head_timeout_s)
            if raw is None:
                return
            head = parse_request_head(raw)
            if self._creates is not None and is_create(head.method, head.target):
                keep = await self._create(head)
            else:
                keep = await self._forward(head, raw)
            if not keep:
                return

    async def _forward(self, head: Head, raw: bytes) -> bool:
        _, engine_writer = await self._connect()
        await _write(engine_writer, raw)
        if head.get(b"upgrade") is not None or head.has_token(b"connection", b"upgrade"):
            await copy_body(self._reader, engine_writer, head.framing)
            raise _Hijacked  # whatever comes next is the stream's, or the engine's to read
        if head.framing.body is Body.NONE:  # most calls: no body to copy beside the answer
            with self._watching():
                return _keeps_alive(head, await self._answer(head.method))
        body = asyncio.ensure_future(copy_body(self._reader, engine_writer, head.framing))
        answering = asyncio.ensure_future(self._answer(head.method))
        try:
            self._watch()
            await asyncio.wait({body, answering}, return_when=asyncio.FIRST_EXCEPTION)
            if body.done() and body.exception() is not None:
                raise _Broken(f"the request body: {body.exception()}")
            try:
                answer = await answering
            except _Hijacked:
                await body  # a hijack's request body is sent whole before the stream
                raise
            await body
        finally:
            self._unwatch()
            for task in (body, answering):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        return _keeps_alive(head, answer)

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        self._watch()
        try:
            yield
        finally:
            self._unwatch()

    def _watch(self) -> None:
        """Every ``CLIENT_CHECK_S`` until ``_unwatch``: a client that closed its connection
        whole (``docker events``, ``logs -f`` or ``wait`` killed while nothing comes) ends
        the engine's connection, so that the answer's relay ends, as the engine ends a
        request whose client left. A half close still gets its answer."""
        self._watcher = asyncio.get_running_loop().call_later(CLIENT_CHECK_S, self._check)

    def _check(self) -> None:
        if not self._client_gone():
            self._watch()
        elif self._engine is not None:
            self._engine[1].close()

    def _unwatch(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def _answer(self, method: bytes, created: Callable[[bytes], None] | None = None) -> Head:
        """Relay the engine's answer (interim ones too); the final head. ``_Hijacked``.
        Its status is kept (``_status``) before it is relayed. A body that breaks off is
        ``_Broken``: the client gets what came, then the connection's end. ``created``: a
        success with a body of a known length (at most ``MAX_CREATED_ANSWER``) is read
        whole and given to it before anything of it is relayed."""
        engine_reader, _ = await self._connect()
        while True:
            raw = await engine_reader.readuntil(END)
            answer = parse_response_head(raw, method=method)
            self._status = answer.status
            if created is not None and _whole(answer):
                body = await engine_reader.readexactly(answer.framing.length)
                created(body)
                await _write(self._writer, raw + body)
                return answer
            await _write(self._writer, raw)
            if answer.status == 101 or answer.framing.body is Body.UNTIL_CLOSE:
                raise _Hijacked
            if not 100 <= answer.status < 200:
                break
        try:
            await copy_body(engine_reader, self._writer, answer.framing)
        except HeadError as err:  # its head went on: no answer of ours inside its body
            raise _Broken(f"the engine's answer: {err}") from None
        return answer

    async def _create(self, head: Head) -> bool:
        if head.framing.body is Body.LENGTH and head.framing.length > MAX_CREATE_BYTES:
            raise HeadError(413, f"the create body is larger than {MAX_CREATE_BYTES} bytes")
        continuing = head.has_token(b"expect", b"100-continue")
        if continuing and head.start[2] == b"HTTP/1.1" and head.framing.body is not Body.NONE:
            await _write(self._writer, CONTINUE)
        if head.framing.body is Body.CHUNKED:
            raw = await read_chunked(self._reader, MAX_CREATE_BYTES)
        else:
            raw = await self._reader.readexactly(head.framing.length)
        assert self._creates is not None
        lease = None
        sent: dict[str, Any] = {}
        try:
            body = read_body(raw)
            request = gpu_request(body)
            if request is not None:
                grant, addition = await self._leased(request, container_name(head.target))
                lease = grant.lease.id
                sent = rewrite(body, addition)
                raw = json.dumps(sent, separators=(",", ":")).encode()
        except CreateError as err:
            keep = _keeps_alive(head, None)
            await _write(self._writer, error_answer(err.status, str(err), close=not keep))
            return keep
        except BaseException:
            if lease is not None:  # granted, never sent on: given back now, not at its expiry
                self._creates.release(lease)
            raise
        self._status = 0
        try:
            _, engine_writer = await self._connect()
            dropped = (b"expect",) if continuing else ()
            await _write(engine_writer, head.with_body_length(len(raw), dropped) + raw)
            if lease is None:
                answer = await self._answer(head.method)
            else:  # bound before its client can start it: its events may come too late
                made = functools.partial(self._creates.bind, sent)
                answer = await self._answer(head.method, created=made)
        finally:
            # the engine's answer decides, even when its client left before it was relayed
            if lease is not None and not 200 <= self._status < 300:
                self._creates.release(lease)
        return _keeps_alive(head, answer)

    async def _leased(self, request: GpuRequest, name: str | None) -> tuple[Granted, Addition]:
        """The create's lease; one that waits in the queue (``nvidia-docker.lease.wait``)
        leaves it when its client goes away (``_Broken``), so that no container is created
        for nobody."""
        assert self._creates is not None
        if request.wait_s <= 0:
            return await self._creates.lease(request, name)
        asking = asyncio.ensure_future(self._creates.lease(request, name))
        try:
            while True:
                done, _ = await asyncio.wait({asking}, timeout=CLIENT_CHECK_S)
                if done:
                    return asking.result()
                if self._client_gone():
                    raise _Broken("the client left while its create waited for GPUs")
        finally:
            if not asking.done():
                asking.cancel()
                with contextlib.suppress(BaseException):
                    await asking

    def _client_gone(self) -> bool:
        """Whether the client closed its connection whole: the unix socket's ``POLLHUP``.
        A half close (the end of its input only) still waits for its answer."""
        if self._writer.is_closing() or self._reader.exception() is not None:
            return True
        sock = self._writer.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLHUP)
        return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))

    async def _both_ways(self) -> None:
        """After a hijack: client to engine (its end passed on), engine to client until the
        engine's end."""
        assert self._engine is not None
        engine_reader, engine_writer = self._engine
        upward = asyncio.ensure_future(pump(self._reader, engine_writer))
        try:
            with contextlib.suppress(OSError):
                await pump(engine_reader, self._writer)
        finally:
            upward.cancel()
            with contextlib.suppress(BaseException):
                await upward


def _keeps_alive(request: Head, answer: Head | None) -> bool:
    """Whether the connection serves another request after ``answer`` (None: one of the
    socket's own, HTTP/1.1 with a length)."""
    if request.has_token(b"connection", b"close"):
        return False
    if request.start[2] == b"HTTP/1.0" and not request.has_token(b"connection", b"keep-alive"):
        return False
    if answer is None:
        return True
    return not answer.has_token(b"connection", b"close") and answer.start[0] != b"HTTP/1.0"
