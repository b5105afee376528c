"""The wrapper's client of one node's agent over plain HTTP, with the standard library only.

Why: ``nvidia-docker run`` asks one node a few small questions (``/gpu/info/json``, a lease,
``/docker/cli``) and then becomes docker. Importing aiohttp and asyncio for that costs about
a quarter of a second on the 2-core development machine, sixty times what the questions
themselves take (docs/nvidia-docker.md, "Speed"). This client serves the case most runs are:
the agent over plain HTTP without a token (``NV_HOST`` unset, the local agent on
localhost:3476; ``http://`` and ``tcp://`` nodes). HTTPS, tokens and SSH keep
``controller.transport.client`` (aiohttp, paramiko), which ``BlockingAgentClient`` drives
with the same methods as this one.

``PlainAgentClient(endpoint, timeout_s=10, connect_timeout_s=None)`` is a context manager
holding one HTTP/1.1 connection, kept alive from one request to the next (a new one when the
agent closes it). It speaks HTTP/1.1 itself, over a ``socket``, as ``http.client`` would (the
request line, ``Host`` (``Endpoint.host_header``: always the port, never an IPv6 zone),
``Accept-Encoding: identity``, ``Content-Length``; an answer with ``Content-Length``, chunked,
or up to the close): ``http.client`` imports the ``email`` package, which alone costs more than
the questions (docs/nvidia-docker.md, "Speed"). ``request``, ``get`` and ``get_json`` take and
return what ``AgentClient``'s do (headers: names in lower case). As there, ``timeout_s`` bounds
each request as a whole, connecting included (a deadline that every send and receive honours),
``connect_timeout_s`` the connect alone; a body is read up to ``MAX_BODY_BYTES``. Every failure
is a ``NodeError`` with ``AgentClient``'s lines (``controller.transport.agent_errors``).

``unix_get(path, target, timeout_s)`` makes one ``GET`` of an HTTP server on a unix socket
with the same code (the wrapper's questions to the local container engine:
``controller.wrapper.engine_api``): the status, headers (names in lower case) and body, or
None when no whole answer came.

The socket is ``_socket``'s, the C module under ``socket``, whose Python layer imports
``enum`` and ``selectors`` (3 to 6 ms) for what this client does not use (address families
as enums, ``sendfile``); ``_create_connection`` is ``socket.create_connection``. JSON is
``controller.json_codec``'s (``json`` imports ``re``).
"""

from __future__ import annotations

import _socket  # socket's C module: socket.py imports enum and selectors (see below)
import time

from controller import json_codec
from controller.errors import NodeError
from controller.transport.agent_errors import (
    connect_error,
    connect_failure,
    cut_off_error,
    decode_json,
    disconnected_error,
    http_error,
    node_label,
    timeout_error,
    too_big_error,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Collection, Mapping
    from types import TracebackType
    from typing import Any, Protocol

    from controller.transport.endpoint import Endpoint
else:
    Protocol = object  # BlockingAgent is a Protocol for type checkers; no typing at run time

DEFAULT_TIMEOUT_S = 10.0  # AgentClient's
MAX_BODY_BYTES = 16 * 1024 * 1024  # an agent's answer is a few kilobytes
_READ_BYTES = 64 * 1024
_MAX_LINE = 65536  # http.client's bounds on a status or header line, and on the headers
_MAX_HEADERS = 100
_DISCONNECTED = "Server disconnected"  # aiohttp's words, so that both clients say the same
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")


class BlockingAgent(Protocol):
    """What the wrapper asks of a node's agent: ``PlainAgentClient``, or
    ``controller.transport.client.BlockingAgentClient`` (HTTPS, tokens, SSH)."""

    @property
    def node(self) -> str: ...

    def __enter__(self) -> BlockingAgent: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        payload: Any = None,
        answers: Collection[int] = (200,),
        timeout_s: float | None = None,
    ) -> tuple[int, bytes, Mapping[str, str]]: ...

    def get(self, path: str, params: Mapping[str, str] | None = None) -> bytes: ...

    def get_json(self, path: str, params: Mapping[str, str] | None = None) -> Any: ...


def urlencode(params: Mapping[str, str]) -> str:
    """``urllib.parse.urlencode(params)``, without importing ``urllib`` (``quote_plus``:
    UTF-8, letters, digits and ``_.-~`` as they are, a space as ``+``, the rest ``%XX``)."""
    return "&".join(f"{_quote_plus(str(k))}={_quote_plus(str(v))}" for k, v in params.items())


def _quote_plus(text: str) -> str:
    return "".join(
        chr(b) if b in _SAFE else "+" if b == 0x20 else f"%{b:02X}" for b in text.encode()
    )


class _Failed(Exception):
    """The answer cannot be read; ``str()`` is what ``http.client`` would have said."""


class _Disconnected(Exception):
    """The connection ended before the status line (``http.client``'s
    ``RemoteDisconnected``)."""


class _CutOff(Exception):
    """The connection ended in the middle of an answer's body (``http.client``'s
    ``IncompleteRead``): ``got`` bytes of it came, of ``expected`` (its Content-Length; None
    when chunked)."""

    def __init__(self, got: int, expected: int | None) -> None:
        super().__init__(got, expected)
        self.got = got
        self.expected = expected


class _Answer:
    """One answer: status, reason phrase, headers (names in lower case), body."""

    __slots__ = ("body", "headers", "reason", "status")

    def __init__(self, status: int, reason: str, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body


class _Connection:
    """One kept-alive HTTP/1.1 connection (``sock``: None until connected, and after the
    agent said it closes); every send and receive ends by ``deadline``
    (``time.monotonic``), the connect by ``timeout`` too."""

    def __init__(self, host: str, port: int, host_header: str) -> None:
        self.host = host  # what getaddrinfo takes: an IPv6 zone after % (fe80::1%eth0)
        self.port = port
        self.timeout = DEFAULT_TIMEOUT_S
        self.deadline = float("inf")
        self.sock: _socket.socket | None = None
        self._buffer = bytearray()
        self._host_header = host_header

    def connect(self) -> None:
        # An ASCII name as bytes: getaddrinfo then does not import the idna codec for it
        name: str | bytes = self.host.encode() if self.host.isascii() else self.host
        sock = _create_connection(name, self.port, self.timeout)
        sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
        self.sock = sock
        self._buffer.clear()

    def close(self) -> None:
        sock, self.sock = self.sock, None
        self._buffer.clear()
        if sock is not None:
            sock.close()

    def _left(self, sock: _socket.socket) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left)

    def exchange(
        self, method: str, target: str, headers: dict[str, str], body: bytes | None
    ) -> _Answer:
        """Send one request and read its whole answer (a body of at most ``MAX_BODY_BYTES``:
        else ``_TooBig``; one the connection ends in the middle of: ``_CutOff``)."""
        sock = self.sock
        assert sock is not None
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._host_header}"]
        lines.append("Accept-Encoding: identity")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        lines += [f"{name}: {value}" for name, value in headers.items()]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + (body or b"")
        self._left(sock)
        sock.sendall(request)
        while True:  # an interim 1xx answer is skipped, as http.client skips 100 Continue
            status, reason, version = self._status_line()
            found = self._headers()
            if status >= 200:
                break
        chunked = found.get("transfer-encoding", "").lower() == "chunked"
        connection = found.get("connection", "").lower()
        closes = "close" in connection if version == 11 else "keep-alive" not in connection
        length = None if chunked else _length(found.get("content-length"))
        if status in (204, 304) or method == "HEAD":
            data = b""
        elif chunked:
            data = self._chunked()
        elif length is not None:
            if length > MAX_BODY_BYTES:
                raise _TooBig
            data = self._up_to(length)
        else:
            data = self._to_close()
            closes = True
        if closes:
            self.close()
        return _Answer(status, reason, found, data)

    def _status_line(self) -> tuple[int, str, int]:
        line = self._line("status line")
        if not line:
            raise _Disconnected
        text = line.decode("iso-8859-1")  # http.client's BadStatusLine says it as it came
        parts = text.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise _Failed(text)
        version, reason = parts[0], (parts[2] if len(parts) > 2 else "").strip()
        try:
            status = int(parts[1])
        except ValueError:
            raise _Failed(text) from None
        if not 100 <= status <= 999:
            raise _Failed(text)
        if version in ("HTTP/1.0", "HTTP/0.9"):
            return status, reason, 10
        if not version.startswith("HTTP/1."):
            raise _Failed(version)  # http.client's UnknownProtocol
        return status, reason, 11

    def _headers(self) -> dict[str, str]:
        found: dict[str, str] = {}
        count = 0
        last = None
        while True:
            line = self._line("header line")
            if line in (b"\r\n", b"\n", b""):
                return found
            count += 1
            if count > _MAX_HEADERS:
                raise _Failed(f"got more than {_MAX_HEADERS} headers")
            text = line.decode("iso-8859-1").rstrip("\r\n")
            if text[:1] in (" ", "\t") and last is not None:  # a folded line goes on
                found[last] += text
                continue
            name, colon, value = text.partition(":")
            if not colon:
                continue
            last = name.lower()
            found[last] = value.lstrip(" \t")

    def _line(self, what: str) -> bytes:
        buffer = self._buffer
        while True:
            end = buffer.find(b"\n")
            if end >= 0:
                if end + 1 > _MAX_LINE:
                    raise _Failed(f"got more than {_MAX_LINE} bytes when reading {what}")
                line = bytes(buffer[: end + 1])
                del buffer[: end + 1]
                return line
            if len(buffer) > _MAX_LINE:
                raise _Failed(f"got more than {_MAX_LINE} bytes when reading {what}")
            if not self._receive():
                line = bytes(buffer)
                buffer.clear()
                return line

    def _receive(self) -> int:
        """Read what has come (at most ``_READ_BYTES``) into the buffer; 0 at the end."""
        sock = self.sock
        assert sock is not None
        self._left(sock)
        chunk = sock.recv(_READ_BYTES)
        self._buffer += chunk
        return len(chunk)

    def _up_to(self, size: int) -> bytes:
        """``size`` bytes; ``_CutOff`` when the connection ends first."""
        while len(self._buffer) < size:
            if not self._receive():
                raise _CutOff(len(self._buffer), size)
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def _exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            if not self._receive():
                raise _Disconnected
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        return data

    def _to_close(self) -> bytes:
        while self._receive():
            if len(self._buffer) > MAX_BODY_BYTES:
                raise _TooBig
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    def _chunked(self) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            line = self._line("chunk size")
            if not line.endswith(b"\n"):  # the connection ended
                raise _CutOff(size, None)
            try:
                chunk = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise _Failed(f"bad chunk size {line[:20]!r}") from None
            if chunk == 0:
                break
            if size + chunk > MAX_BODY_BYTES:
                raise _TooBig
            try:
                parts.append(self._exactly(chunk))
                self._exactly(2)  # the CRLF after the chunk
            except _Disconnected:
                raise _CutOff(size + min(len(self._buffer), chunk), None) from None
            size += chunk
        while self._line("trailer line") not in (b"\r\n", b"\n", b""):
            pass
        return b"".join(parts)


def _create_connection(host: str | bytes, port: int, timeout: float) -> _socket.socket:
    """``socket.create_connection((host, port), timeout)``: each address of the name in
    turn, the last one's error when none connects."""
    error: OSError | None = None
    for family, kind, protocol, _name, address in _socket.getaddrinfo(
        host, port, 0, _socket.SOCK_STREAM
    ):
        sock = _socket.socket(family, kind, protocol)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise error if error is not None else OSError("getaddrinfo returns an empty list")


class _TooBig(Exception):
    """The body is over ``MAX_BODY_BYTES``."""


class _UnixConnection(_Connection):
    """One HTTP/1.1 connection to a server on a unix socket (``Host: docker``, as the
    docker CLI's older clients name the engine)."""

    def __init__(self, path: str) -> None:
        super().__init__("docker", 80, "docker")
        self.path = path

    def connect(self) -> None:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._buffer.clear()


def unix_get(path: str, target: str, timeout_s: float) -> tuple[int, dict[str, str], bytes] | None:
    """``GET target`` of the HTTP server on the unix socket ``path`` (the container engine's
    API): the status, headers (names in lower case) and body of its answer, or None when no
    whole answer came within ``timeout_s`` (no socket, refused, not HTTP, closed early): the
    caller then asks the way it would have without this shortcut."""
    return _get(_UnixConnection(path), target, timeout_s)


def tcp_get(
    endpoint: Endpoint, target: str, timeout_s: float
) -> tuple[int, dict[str, str], bytes] | None:
    """``unix_get`` of a plain HTTP server at ``endpoint``'s host and HTTP port (a dockerd's
    ``-H tcp://...`` without TLS); None as there (a TLS server answers plain HTTP with a
    400)."""
    connection = _Connection(endpoint.host, endpoint.http_port, endpoint.host_header)
    return _get(connection, target, timeout_s)


def _get(
    connection: _Connection, target: str, timeout_s: float
) -> tuple[int, dict[str, str], bytes] | None:
    """``GET target`` on ``connection`` (see ``unix_get``)."""
    connection.timeout = timeout_s
    connection.deadline = time.monotonic() + timeout_s
    try:
        connection.connect()
        answer = connection.exchange("GET", target, {"Accept": "*/*"}, None)
    except (OSError, _Failed, _Disconnected, _CutOff, _TooBig):  # TimeoutError: an OSError
        return None
    finally:
        connection.close()
    return answer.status, answer.headers, answer.body


def _length(text: str | None) -> int | None:
    """``Content-Length`` as http.client reads it (none, negative or not a number: None)."""
    try:
        length = int(text) if text is not None else None
    except ValueError:
        return None
    return None if length is None or length < 0 else length


class PlainAgentClient:
    """Plain HTTP client of one node's agent (see the module docstring)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float | None = None,
    ) -> None:
        if endpoint.transport != "http" or endpoint.scheme != "http":
            raise ValueError(f"{endpoint.uri()}: PlainAgentClient speaks plain HTTP only")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s or timeout_s
        self._connection = _Connection(endpoint.host, endpoint.http_port, endpoint.host_header)

    @property
    def node(self) -> str:
        return node_label(self.endpoint)

    def __enter__(self) -> PlainAgentClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._connection.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        payload: Any = None,
        answers: Collection[int] = (200,),
        timeout_s: float | None = None,
    ) -> tuple[int, bytes, Mapping[str, str]]:
        """``method path`` (``payload``: a JSON body): the status, body and headers of an
        answer whose status is one of ``answers``; any other raises ``AgentHttpError``, and
        every failure to get an answer ``NodeError``. ``timeout_s`` replaces the client's
        ``timeout_s`` for this request."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        connection = self._connection
        connection.deadline = time.monotonic() + limit
        connection.timeout = min(self.connect_timeout_s, limit)
        target = path + ("?" + urlencode(params) if params else "")
        headers = {"Accept": "*/*"}
        body = None
        if payload is not None:
            body = json_codec.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        try:
            if connection.sock is None:
                self._connect()
            answer = connection.exchange(method, target, headers, body)
        except NodeError:
            connection.close()
            raise
        except TimeoutError:
            connection.close()
            raise timeout_error(self.node, path, limit, method) from None
        except _TooBig:
            connection.close()
            raise self._too_big(method, path) from None
        except (_Disconnected, BrokenPipeError) as exc:
            connection.close()
            raise disconnected_error(
                self.node, path, _DISCONNECTED, plain_http=True, method=method
            ) from exc
        except _CutOff as exc:
            connection.close()
            raise cut_off_error(self.node, path, exc.got, exc.expected, method) from None
        except (OSError, _Failed) as exc:
            connection.close()
            raise NodeError(
                self.node, f"{method} {path} failed: {exc or type(exc).__name__}"
            ) from exc
        if answer.status not in answers:
            raise http_error(
                self.node,
                path,
                answer.status,
                answer.reason,
                answer.headers,
                answer.body,
                None,
                method,
            )
        return answer.status, answer.body, answer.headers

    def _connect(self) -> None:
        try:
            self._connection.connect()
        except TimeoutError:
            raise
        except OSError as exc:
            raise connect_error(
                self.node, self.endpoint.agent_url, exc, connect_failure(exc)
            ) from exc

    def _too_big(self, method: str, path: str) -> NodeError:
        return too_big_error(self.node, path, MAX_BODY_BYTES, method)

    def get(self, path: str, params: Mapping[str, str] | None = None) -> bytes:
        """The body of ``GET path`` (200 only); raises ``NodeError``."""
        _status, body, _headers = self.request("GET", path, params=params)
        return body

    def get_json(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        return decode_json(self.node, path, self.get(path, params))
