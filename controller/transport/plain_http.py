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
holding one ``http.client`` connection, kept alive from one request to the next (a new one
when the agent closes it). ``request``, ``get`` and ``get_json`` take and return what
``AgentClient``'s do (headers: names in lower case). As there, ``timeout_s`` bounds each
request as a whole, connecting included (a deadline that every send and receive honours),
``connect_timeout_s`` the connect alone; a body is read up to ``MAX_BODY_BYTES``. Every
failure is a ``NodeError`` with ``AgentClient``'s lines (``controller.transport.agent_errors``).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlencode

from controller.errors import NodeError
from controller.transport.agent_errors import (
    connect_error,
    connect_failure,
    decode_json,
    disconnected_error,
    http_error,
    node_label,
    timeout_error,
)
from controller.transport.endpoint import Endpoint

if TYPE_CHECKING:
    from types import TracebackType

DEFAULT_TIMEOUT_S = 10.0  # AgentClient's
MAX_BODY_BYTES = 16 * 1024 * 1024  # an agent's answer is a few kilobytes
_READ_BYTES = 64 * 1024
_DISCONNECTED = "Server disconnected"  # aiohttp's words, so that both clients say the same


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


class _DeadlineSocket(socket.socket):
    """A connected socket whose sends and receives end by ``deadline`` (``time.monotonic``)."""

    deadline = float("inf")

    def _wait_at_most(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.settimeout(left)

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        self._wait_at_most()
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: Any, flags: int = 0) -> None:
        self._wait_at_most()
        super().sendall(data, flags)


class _Connection(http.client.HTTPConnection):
    """``HTTPConnection`` whose socket keeps the current request's deadline."""

    deadline = float("inf")

    def connect(self) -> None:
        raw = socket.create_connection((self.host, self.port), self.timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = _DeadlineSocket(raw.family, raw.type, raw.proto, raw.detach())
        sock.deadline = self.deadline
        self.sock = sock


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
        self._connection = _Connection(endpoint.host, endpoint.http_port)

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
        if isinstance(connection.sock, _DeadlineSocket):
            connection.sock.deadline = connection.deadline
        target = path + ("?" + urlencode(params) if params else "")
        headers = {"Accept": "*/*"}
        body = None
        if payload is not None:
            body = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        try:
            if connection.sock is None:
                self._connect()
            connection.request(method, target, body=body, headers=headers)
            response = connection.getresponse()
            data = self._read(response, method, path)
        except NodeError:
            connection.close()
            raise
        except TimeoutError:
            connection.close()
            raise timeout_error(self.node, path, limit, method) from None
        except (http.client.RemoteDisconnected, http.client.IncompleteRead, BrokenPipeError) as exc:
            connection.close()
            raise disconnected_error(
                self.node, path, _DISCONNECTED, plain_http=True, method=method
            ) from exc
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise NodeError(
                self.node, f"{method} {path} failed: {exc or type(exc).__name__}"
            ) from exc
        found = {name.lower(): value for name, value in response.getheaders()}
        if response.status not in answers:
            raise http_error(
                self.node, path, response.status, response.reason, found, data, None, method
            )
        return response.status, data, found

    def _connect(self) -> None:
        try:
            self._connection.connect()
        except TimeoutError:
            raise
        except OSError as exc:
            raise connect_error(
                self.node, self.endpoint.agent_url, exc, connect_failure(exc)
            ) from exc

    def _read(self, response: http.client.HTTPResponse, method: str, path: str) -> bytes:
        """The whole body, at most ``MAX_BODY_BYTES``."""
        if response.length is not None and response.length > MAX_BODY_BYTES:
            raise self._too_big(method, path)
        parts: list[bytes] = []
        size = 0
        while chunk := response.read(_READ_BYTES):
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise self._too_big(method, path)
            parts.append(chunk)
        return b"".join(parts)

    def _too_big(self, method: str, path: str) -> NodeError:
        return NodeError(
            self.node,
            f"{method} {path} failed: the answer is over {MAX_BODY_BYTES // 2**20} MiB: "
            "is this an nvidia-docker agent?",
        )

    def get(self, path: str, params: Mapping[str, str] | None = None) -> bytes:
        """The body of ``GET path`` (200 only); raises ``NodeError``."""
        _status, body, _headers = self.request("GET", path, params=params)
        return body

    def get_json(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        return decode_json(self.node, path, self.get(path, params))
