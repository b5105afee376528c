"""A lean HTTP/1.1 client for asking thousands of agents: one connection per node, no pool.

Why not aiohttp here: a fleet query asks each node a few small GETs over one connection and
never again. Measured on the 2-core development machine, aiohttp's client costs about 0.25 ms
of CPU per request (request and response objects, timers, the connection pool's book-keeping),
which alone is more than the whole budget of a 10,000-node ``status`` in 5 s once the agents'
own share of the two cores is counted; this client costs about a fifth of that. The wrapper
(over HTTPS, with a token or over SSH) and the Mesos helper, which ask one node, keep
``controller.transport.client`` (aiohttp).

``AgentConnection.open(endpoint, node, tls=..., unix_path=None)`` connects (TCP, or the unix
socket of an SSH tunnel; TLS for ``https://`` spoken by ``_TlsReader`` over that connection
rather than by asyncio's TLS transport, whose states and extra sends a fleet query never needs:
7% less CPU per HTTPS node, see its docstring; the ``Host`` header and the name checked in the
certificate never carry an IPv6 zone: ``Endpoint.host_header``, ``server_name``);
``get_all(requests)`` sends a node's requests in one write (pipelined) and reads the answers in
order, the last request asking the agent to close the connection (``last=False``: kept open for
requests that depend on these answers). Answers are read as HTTP/1.1 says: ``Content-Length``,
``chunked``, or until the connection closes; at most ``MAX_HEAD_BYTES`` of status line and
headers and ``MAX_BODY_BYTES`` of body (an agent's answer is a few kilobytes).

Every failure is a ``NodeError`` with the same one-line messages and ``Failure`` kinds as
``AgentClient``'s (``controller.transport.agent_errors``, ``controller.transport.tls``).
Timeouts are the caller's (``asyncio.timeout`` around the node as a whole).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlencode

from agent import __version__
from controller.errors import Failure, NodeError
from controller.transport.agent_errors import (
    connect_error,
    connect_failure,
    cut_off_error,
    disconnected_error,
    http_error,
)
from controller.transport.endpoint import Endpoint
from controller.transport.tls import (
    TlsFileError,
    TlsOptions,
    bearer_token,
    client_context,
    tls_failure,
)

MAX_HEAD_BYTES = 64 * 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
USER_AGENT = f"nvidia-docker-ctl/{__version__}"
# The name checked in the agent's certificate through an SSH tunnel (the tunnel ends on the
# node's loopback; the Ansible role's health gate checks the same name).
TUNNEL_SERVER_NAME = "127.0.0.1"


class _BadAnswer(Exception):
    """The bytes are not an HTTP/1.x answer (or too big): the message says what."""


class _CutOff(Exception):
    """The connection ended in the middle of an answer's body: ``got`` bytes of it came, of
    ``expected`` (its Content-Length; None when chunked)."""

    def __init__(self, got: int, expected: int | None) -> None:
        super().__init__(got, expected)
        self.got = got
        self.expected = expected


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    reason: str
    headers: Mapping[str, str]  # names in lower case
    body: bytes


class _Reader(asyncio.Protocol):
    """Collects what the agent sends; ``wait()`` returns when more came or the end did."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.ended = False
        self.error: BaseException | None = None
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport (uvloop's TLS transport does not subclass asyncio.Transport)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        if exc is not None and self.error is None:
            self.error = exc
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        if self.ended:
            raise EOFError
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    def take(self, count: int) -> bytes:
        data = bytes(self.buffer[:count])
        del self.buffer[:count]
        return data

    def send(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None
        transport.write(data)

    def close(self) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()


class _TlsReader(_Reader):
    """TLS over the TCP connection, through an ``ssl.SSLObject`` and two memory buffers.

    What asyncio's own TLS transport (``loop.create_connection(ssl=...)``) does, less what a
    fleet query never needs: no flow-control states, no peer certificate decoded into a dict
    after the handshake (the check itself is OpenSSL's, during it), no ``close_notify``
    exchange at the end (every answer is framed by HTTP; the agent closes first after the
    last one). The client's Finished message waits for the first request, so both leave in
    one segment. ``handshake`` is done when the handshake is, or fails with its
    ``ssl.SSLError`` (``ConnectionResetError`` when the connection ends during it).
    """

    def __init__(
        self, context: ssl.SSLContext, server_hostname: str, handshake: asyncio.Future[None]
    ) -> None:
        super().__init__()
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._incoming, self._outgoing, server_hostname=server_hostname
        )
        self.handshake = handshake

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._shake()

    def data_received(self, data: bytes) -> None:
        self._incoming.write(data)
        if self.handshake.done():
            self._read()
        else:
            self._shake()

    def eof_received(self) -> bool:
        self._handshake_failed(ConnectionResetError("Connection lost"))
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._handshake_failed(exc or ConnectionResetError("Connection lost"))
        super().connection_lost(exc)

    def send(self, data: bytes) -> None:
        self._tls.write(data)
        self._flush()

    def _handshake_failed(self, error: BaseException) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(error)

    def _shake(self) -> None:
        try:
            self._tls.do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            self._flush()
            return
        except ssl.SSLError as exc:  # as asyncio's transport: no alert sent, the caller closes
            self._handshake_failed(exc)
            return
        self.handshake.set_result(None)
        # the Finished message goes with the first request, written as the caller resumes;
        # sent on its own a turn later if no request comes first
        asyncio.get_running_loop().call_soon(self._flush)
        if self._incoming.pending:
            self._read()

    def _read(self) -> None:
        try:
            while True:
                chunk = self._tls.read(65536)
                if not chunk:  # the agent's close_notify
                    self.ended = True
                    break
                self.buffer += chunk
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        except ssl.SSLError as exc:  # an alert: a refused client certificate, ...
            if self.error is None:
                self.error = exc
            self.ended = True
            self.close()
        self._wake()

    def _flush(self) -> None:
        data = self._outgoing.read()
        transport = self.transport
        if data and transport is not None and not transport.is_closing():
            transport.write(data)


class AgentConnection:
    """One connection to one node's agent (see the module docstring)."""

    def __init__(
        self,
        endpoint: Endpoint,
        node: str,
        reader: _Reader,
        headers: str,
        tls: TlsOptions,
        unix_path: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.node = node
        self._reader = reader
        self._headers = headers  # Host, User-Agent, Authorization: the same on every request
        self._tls = tls
        self._unix_path = unix_path
        self._reusable = True
        self._answered = 0  # answers read on this connection

    @classmethod
    async def open(
        cls,
        endpoint: Endpoint,
        node: str,
        *,
        tls: TlsOptions,
        unix_path: str | None = None,
    ) -> AgentConnection:
        """Connect; raises ``NodeError`` (refused, unknown host, TLS..., and ``TLS error``
        for a CA, certificate, key or token file of the node's own settings that cannot be
        used: the command's own were checked before any node was asked)."""
        loop = asyncio.get_running_loop()
        reader = _Reader()
        # the Host header and the name checked in the certificate: never an IPv6 zone
        if unix_path is None:
            host, server = endpoint.host_header, endpoint.server_name
        else:
            host, server = f"localhost:{endpoint.http_port}", TUNNEL_SERVER_NAME
        try:
            token = bearer_token(tls)
            context = client_context(tls) if endpoint.scheme == "https" else None
        except TlsFileError as exc:
            raise NodeError(node, str(exc), Failure.TLS_ERROR) from None
        headers = f"Host: {host}\r\nUser-Agent: {USER_AGENT}\r\n"
        headers += "Accept: application/json, text/plain\r\n"
        if token is not None:
            headers += f"Authorization: Bearer {token}\r\n"
        if context is not None:
            reader = _TlsReader(context, server, loop.create_future())
        try:
            if unix_path is not None:  # an SSH tunnel; TLS inside it when the agent serves TLS
                await loop.create_unix_connection(lambda: reader, unix_path)
            else:
                await loop.create_connection(lambda: reader, endpoint.host, endpoint.http_port)
            if isinstance(reader, _TlsReader):
                try:
                    await reader.handshake
                except BaseException:
                    reader.close()
                    raise
        except ssl.SSLError as exc:
            failure, message = tls_failure(exc, tls, server)
            raise NodeError(node, message, failure) from exc
        except OSError as exc:
            raise connect_error(node, endpoint.agent_url, exc, connect_failure(exc)) from exc
        return cls(endpoint, node, reader, headers, tls, unix_path)

    def close(self) -> None:
        self._reader.close()

    async def get_all(
        self, requests: Sequence[tuple[str, Mapping[str, str] | None]], *, last: bool = True
    ) -> list[Answer]:
        """Every request at once (HTTP/1.1 pipelining: one write, the answers in order), the
        last one closing the connection (``last=False``: kept open, for requests that depend
        on these answers); the caller reads the answers in the same order.

        One write and one read for the node where there would be two of each: on two cores
        shared with the agents, system calls are a good part of a fleet query's time. If the
        agent ends the connection early (an answer with ``Connection: close``), the requests
        not answered are sent again on a new connection (and so on)."""
        if not self._reusable:
            raise NodeError(self.node, f"GET {requests[0][0]}: the agent closed the connection")
        closing = len(requests) - 1 if last else -1
        self._reader.send(
            b"".join(self._request(p, q, i == closing) for i, (p, q) in enumerate(requests))
        )
        answers: list[Answer] = []
        for path, _ in requests:
            if not self._reusable:
                break
            try:
                answer = await self._read_answer()
            except EOFError:
                # a connection that answered before may have been ended since (as any kept
                # one may): what is left goes again on a new one, as on an early close
                if not answers and not self._answered:
                    raise self._ended(path) from None
                break
            except _BadAnswer as exc:
                raise self._bad(path, exc) from None
            except _CutOff as exc:
                if not answers and not self._answered:
                    if isinstance(self._reader.error, ssl.SSLError):  # a TLS alert ended it
                        raise self._ended(path) from None
                    raise cut_off_error(self.node, path, exc.got, exc.expected) from None
                break  # as an early close: what is left goes again on a new connection
            answers.append(answer)
            self._answered += 1
            if answer.headers.get("connection", "").lower() == "close":
                self._reusable = False
        if last or len(answers) < len(requests):
            self._reusable = False
        if len(answers) < len(requests):
            again = await AgentConnection.open(
                self.endpoint, self.node, tls=self._tls, unix_path=self._unix_path
            )
            try:  # each round gets at least one answer, or raises
                answers += await again.get_all(requests[len(answers) :])
            finally:
                again.close()
        return answers

    @property
    def reusable(self) -> bool:
        """Whether another request may be sent (the agent has not ended the connection)."""
        return self._reusable

    def _request(self, path: str, params: Mapping[str, str] | None, last: bool) -> bytes:
        target = path + ("?" + urlencode(params) if params else "")
        close = "Connection: close\r\n" if last else ""
        return f"GET {target} HTTP/1.1\r\n{self._headers}{close}\r\n".encode("latin-1")

    def _bad(self, path: str, exc: _BadAnswer) -> NodeError:
        return NodeError(
            self.node,
            f"GET {path}: the answer is not HTTP from an agent ({exc}): is this the agent's port?",
            Failure.NOT_AN_AGENT,
        )

    def _ended(self, path: str) -> NodeError:
        error = self._reader.error
        if isinstance(error, ssl.SSLError):
            failure, message = tls_failure(error, self._tls, self.endpoint.server_name)
            return NodeError(self.node, message, failure)
        why = "Server disconnected" if error is None else str(error) or type(error).__name__
        plain = self.endpoint.scheme == "http" and self.endpoint.transport == "http"
        return disconnected_error(self.node, path, why, plain_http=plain)

    async def _read_answer(self) -> Answer:
        reader = self._reader
        while True:  # 1xx answers come before the real one
            head = await self._read_head()
            status, reason, headers = _parse_head(head)
            if not 100 <= status < 200:
                break
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_chunked()
        elif "content-length" in headers:
            text = headers["content-length"].strip()
            if not text.isdigit():
                raise _BadAnswer(f"Content-Length {text!r}")
            if int(text) > MAX_BODY_BYTES:
                raise _BadAnswer(f"more than 16 MiB: Content-Length {text}")
            try:
                body = await self._read_exactly(int(text))
            except EOFError:
                raise _CutOff(len(reader.buffer), int(text)) from None
        else:  # until the connection ends
            while not reader.ended:
                if len(reader.buffer) > MAX_BODY_BYTES:
                    raise _BadAnswer("more than 16 MiB")
                await reader.wait()
            body = reader.take(len(reader.buffer))
            self._reusable = False
        return Answer(status, reason, headers, body)

    async def _read_head(self) -> bytes:
        reader = self._reader
        start = 0
        while True:
            end = reader.buffer.find(b"\r\n\r\n", start)
            if end >= 0:
                return reader.take(end + 4)
            if len(reader.buffer) > MAX_HEAD_BYTES:
                raise _BadAnswer("headers longer than 64 KiB")
            start = max(0, len(reader.buffer) - 3)
            await reader.wait()

    async def _read_exactly(self, count: int) -> bytes:
        reader = self._reader
        while len(reader.buffer) < count:
            await reader.wait()
        return reader.take(count)

    async def _read_line(self) -> bytes:
        reader = self._reader
        while True:
            end = reader.buffer.find(b"\r\n")
            if end >= 0:
                return reader.take(end + 2)[:-2]
            if len(reader.buffer) > MAX_HEAD_BYTES:
                raise _BadAnswer("a chunk header longer than 64 KiB")
            await reader.wait()

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        try:
            return await self._read_chunks(body)
        except EOFError:
            raise _CutOff(len(body), None) from None

    async def _read_chunks(self, body: bytearray) -> bytes:
        while True:
            size_text = (await self._read_line()).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _BadAnswer(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                while await self._read_line():  # trailers, up to the empty line
                    pass
                return bytes(body)
            if len(body) + size > MAX_BODY_BYTES:
                raise _BadAnswer("more than 16 MiB")
            body += await self._read_exactly(size)
            await self._read_exactly(2)  # CRLF after the chunk


def _parse_head(head: bytes) -> tuple[int, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or not (code.isdigit() and len(code) == 3):
        raise _BadAnswer(f"status line {lines[0][:40]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon:
            raise _BadAnswer(f"header line {line[:40]!r}")
        headers[name.strip().lower()] = value.strip()
    if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
        headers["connection"] = "close"
    return int(code), reason, headers


def answer_error(node: str, path: str, answer: Answer, tls: TlsOptions) -> NodeError:
    """The ``NodeError`` of a non-200 answer (401: ``TokenRefusedError``)."""
    return http_error(
        node, path, answer.status, answer.reason, answer.headers, answer.body, tls.token_file
    )
