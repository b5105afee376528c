"""Talk to a node's agent REST API, over plain HTTP or through SSH, with one HTTP client.

Public API::

    from controller.transport.endpoint import parse_endpoint
    from controller.transport.client import AgentClient

    async with AgentClient(parse_endpoint("ssh://admin@node2:")) as agent:
        info = await agent.get_json("/gpu/info/json")
        cli = await agent.get("/docker/cli", params={"dev": "0 1", "vol": "nvidia_driver"})

- ``AgentClient(endpoint, timeout_s=10, ssh=SshOptions(...))`` is an async context manager.
  Transport ``http`` (and ``local``, the agent on localhost) uses aiohttp's TCP connector;
  ``ssh`` logs in once (``ssh_tunnel.SshTunnel``) and every HTTP connection is a
  ``direct-tcpip`` channel to ``localhost:http_port`` on the node, given to aiohttp through a
  small connector. Everything above the connector (requests, keep-alive, timeouts, errors) is
  the same code for both.
- ``get(path, params=None) -> bytes`` returns the body of a 200 answer. Every failure raises
  ``controller.errors.NodeError`` with one line: which node, what failed, what to do;
  ``AgentHttpError`` (a ``NodeError``) for an answer other than 200, with ``status`` and the
  agent's message in ``reason``.
- ``get_json(path, params=None)`` decodes the body as JSON.
- Timeouts: ``timeout_s`` (default 10 s) bounds each request, including connecting and the
  SSH login; ``connect_timeout_s`` can be shorter (the wrapper probes the local agent with a
  short one).
- ``session``: an aiohttp ``ClientSession`` shared by many clients (HTTP nodes only), so that
  a fleet query keeps one connection pool for a thousand nodes instead of one per node; the
  client never closes a session it was given. SSH nodes always get their own (the tunnel).

Many requests may run concurrently on one client: over SSH they share the one SSH connection.
A fleet query makes one client per node and runs them concurrently (``asyncio.gather``).

Only this module and ``ssh_tunnel`` import aiohttp / paramiko.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import aiohttp
from aiohttp.client_proto import ResponseHandler

from controller.errors import Failure, NodeError
from controller.transport.endpoint import Endpoint

if TYPE_CHECKING:
    from aiohttp.client_reqrep import ClientRequest
    from aiohttp.tracing import Trace

    from controller.transport.ssh_tunnel import SshOptions, SshTunnel

DEFAULT_TIMEOUT_S = 10.0


# Headers of the agent's 400 answers (agent.rest): which query parameter, which entry.
INVALID_PARAMETER_HEADER = "X-Invalid-Parameter"
INVALID_VALUE_HEADER = "X-Invalid-Value"


class AgentHttpError(NodeError):
    """The agent answered, but not 200 (e.g. 400 ``invalid device: 9``).

    ``status`` and ``agent_message`` (the first line of the body) as answered; for a 400 of
    an agent that names what it refused, ``invalid_parameter`` (``dev``, ``vol``, ...) and
    ``invalid_value`` (the entry), else None (an old agent: only the text says it).
    """

    def __init__(
        self,
        node: str,
        path: str,
        status: int,
        text: str,
        *,
        invalid_parameter: str | None = None,
        invalid_value: str | None = None,
    ) -> None:
        self.status = status
        self.agent_message = text
        self.invalid_parameter = invalid_parameter
        self.invalid_value = invalid_value
        super().__init__(
            node, f"the agent answered {status} to GET {path}: {text}", Failure.HTTP_STATUS
        )

    @property
    def label(self) -> str:
        return f"HTTP {self.status}"


def _http_error(
    node: str, path: str, response: aiohttp.ClientResponse, body: bytes
) -> AgentHttpError:
    text = body.decode("utf-8", "replace").strip().splitlines()
    parameter = response.headers.get(INVALID_PARAMETER_HEADER)
    value = response.headers.get(INVALID_VALUE_HEADER)
    return AgentHttpError(
        node,
        path,
        response.status,
        text[0] if text else str(response.reason),
        invalid_parameter=parameter,
        invalid_value=unquote(value) if parameter and value is not None else None,
    )


class _TunnelConnector(aiohttp.BaseConnector):
    """aiohttp connector whose connections are SSH channels to a port on the node."""

    def __init__(self, tunnel: SshTunnel, port: int) -> None:
        super().__init__(limit=32)
        self._tunnel = tunnel
        self._port = port

    async def _create_connection(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 (aiohttp's signature)
    ) -> ResponseHandler:
        sock = await self._tunnel.open_socket(self._port)
        try:
            _, proto = await self._loop.create_connection(self._factory, sock=sock)
        except BaseException:
            sock.close()
            raise
        return proto


class AgentClient:
    """HTTP client of one node's agent (see the module docstring)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float | None = None,
        ssh: SshOptions | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s or timeout_s
        self._ssh_options = ssh
        self._tunnel: SshTunnel | None = None
        self._session: aiohttp.ClientSession | None = None
        self._shared_session = session if endpoint.transport != "ssh" else None

    @property
    def node(self) -> str:
        ep = self.endpoint
        if ep.transport == "ssh":
            return f"ssh://{ep.node}"
        if ep.transport == "http":
            return f"http://{ep.node}"
        return f"local agent ({ep.agent_url})"

    async def __aenter__(self) -> AgentClient:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Make the session; over SSH, log in now (so login errors come first)."""
        if self._session is not None:
            return
        if self._shared_session is not None:
            self._session = self._shared_session
            return
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, connect=self.connect_timeout_s)
        connector: aiohttp.BaseConnector
        if self.endpoint.transport == "ssh":
            from controller.transport.ssh_tunnel import SshOptions, SshTunnel  # noqa: PLC0415

            options = self._ssh_options or SshOptions.from_environ()
            self._tunnel = SshTunnel(self.endpoint, options)
            try:
                await asyncio.wait_for(self._tunnel.connect(), timeout=self.timeout_s + 5)
            except TimeoutError:
                raise NodeError(
                    self.node, f"SSH login took longer than {self.timeout_s:g} s", Failure.TIMEOUT
                ) from None
            connector = _TunnelConnector(self._tunnel, self.endpoint.http_port)
        else:
            connector = aiohttp.TCPConnector(limit=32, use_dns_cache=True)
        self._session = aiohttp.ClientSession(
            base_url=None, connector=connector, timeout=timeout, raise_for_status=False
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None and session is not self._shared_session:
            await session.close()
        tunnel, self._tunnel = self._tunnel, None
        if tunnel is not None:
            await tunnel.close()

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> bytes:
        """The body of ``GET path`` (200 only); raises ``NodeError``."""
        if self._session is None:
            await self.open()
        assert self._session is not None
        url = self.endpoint.agent_url + path
        try:
            async with self._session.get(url, params=params) as response:
                body = await response.read()
                if response.status != 200:
                    raise _http_error(self.node, path, response, body)
                return body
        except NodeError:
            raise
        except TimeoutError:
            raise NodeError(
                self.node,
                f"no answer to GET {path} within {self.timeout_s:g} s: is the agent "
                "(nvidia-docker-plugin) healthy?",
                Failure.TIMEOUT,
            ) from None
        except aiohttp.ClientConnectorError as exc:
            os_error = exc.os_error
            failure = _connect_failure(exc)
            why = (
                "connection refused"
                if failure is Failure.REFUSED
                else os_error.strerror or str(os_error)
            )
            raise NodeError(
                self.node,
                f"cannot connect to the agent at {self.endpoint.agent_url} "
                f"({why}): is nvidia-docker-plugin running "
                "there, listening on that address (-l HOST:PORT)?",
                failure,
            ) from exc
        except aiohttp.ServerDisconnectedError as exc:
            raise NodeError(
                self.node, f"GET {path} failed: {exc or type(exc).__name__}", Failure.DISCONNECTED
            ) from exc
        except aiohttp.ClientError as exc:
            raise NodeError(self.node, f"GET {path} failed: {exc or type(exc).__name__}") from exc

    async def get_json(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        body = await self.get(path, params)
        try:
            return json.loads(body)
        except ValueError:
            raise NodeError(
                self.node,
                f"the answer to GET {path} is not JSON: is this an nvidia-docker agent?",
                Failure.NOT_AN_AGENT,
            ) from None


def _connect_failure(exc: aiohttp.ClientConnectorError) -> Failure:
    if isinstance(exc, aiohttp.ClientConnectorDNSError) or isinstance(
        exc.os_error, socket.gaierror
    ):
        return Failure.UNKNOWN_HOST
    if isinstance(exc.os_error, ConnectionRefusedError):
        return Failure.REFUSED
    return Failure.CANNOT_CONNECT
