"""Talk to a node's agent REST API, over plain HTTP or through SSH, with one HTTP client.

Public API::

    from controller.transport.endpoint import parse_endpoint
    from controller.transport.client import AgentClient

    async with AgentClient(parse_endpoint("ssh://admin@node2:")) as agent:
        info = await agent.get_json("/gpu/info/json")
        cli = await agent.get("/docker/cli", params={"dev": "0 1", "vol": "nvidia_driver"})

- ``AgentClient(endpoint, timeout_s=10, ssh=SshOptions(...), tls=TlsOptions(...))`` is an
  async context manager. Transport ``http`` (and ``local``, the agent on localhost) uses
  aiohttp's TCP connector, over TLS for ``https://`` endpoints; ``ssh`` logs in once
  (``ssh_tunnel.SshTunnel``), which serves a private unix socket whose every connection is a
  ``direct-tcpip`` channel to ``localhost:http_port`` on the node, and aiohttp's public
  ``UnixConnector`` connects there. Everything above the connector (requests, keep-alive,
  timeouts, errors) is the same code for both. An IPv6 zone (``[fe80::1%eth0]``) reaches
  the connector only: requests to an ``http`` node carry ``Endpoint.host_header`` and check
  the certificate for ``Endpoint.server_name``, both without it.
- TLS and tokens (``controller.transport.tls``): ``tls`` names the CA to trust, a client
  certificate and a token file (``TlsOptions.from_options``: the edge's; default none, the
  system's CAs). ``ssh`` (``SshOptions.from_options``) is needed for ``ssh://`` nodes.
  A token is sent on every request, whatever the transport. A TLS failure
  says which one it is (``Failure.TLS_UNTRUSTED``, ``TLS_NAME_MISMATCH``,
  ``TLS_CLIENT_CERT_REFUSED``); a 401 is ``TokenRefusedError`` (``Failure.TOKEN_REFUSED``).
- ``get(path, params=None) -> bytes`` returns the body of a 200 answer. Every failure raises
  ``controller.errors.NodeError`` with one line: which node, what failed, what to do;
  ``AgentHttpError`` (a ``NodeError``) for an answer other than 200, with ``status`` and the
  agent's message in ``reason``. A body is read up to ``MAX_BODY_BYTES`` (16 MiB, as the
  other clients'): a longer one is a ``NodeError`` saying so, as is a body the connection
  ends in the middle of (how many of its bytes came).
- ``get_json(path, params=None)`` decodes the body as JSON.
- ``request(method, path, payload=..., answers=(201, 409), timeout_s=...)``: any method,
  with a JSON body; the answers whose status is one of ``answers`` come back as they are
  (status, body, headers), the rest raise as ``get`` does (the wrapper's lease ask: a 409
  is an answer to read, not a failure).
- Timeouts: ``timeout_s`` (default 10 s) bounds each request, connecting included; the SSH
  login, made once at ``open``, gets ``timeout_s`` plus 5 s; ``connect_timeout_s`` can be
  shorter (the wrapper probes the local agent with a short one).

Many requests may run concurrently on one client: over SSH they share the one SSH connection.
Fleet queries do not use this client (``fleet_http``, one lean connection per node).
``BlockingAgentClient`` drives one client from code without an event loop (the wrapper over
HTTPS, with a token, or over SSH; over plain HTTP it uses ``plain_http`` instead).

Only this module imports aiohttp; only ``ssh_tunnel`` and ``ssh_config`` import paramiko.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Collection, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import aiohttp

from controller.errors import Failure, NodeError
from controller.transport.agent_errors import (
    INVALID_PARAMETER_HEADER,
    INVALID_VALUE_HEADER,
    AgentHttpError,
    TokenRefusedError,
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
from controller.transport.endpoint import Endpoint
from controller.transport.tls import (
    NO_TLS_OPTIONS,
    TlsOptions,
    bearer_token,
    client_context,
    tls_failure,
)

if TYPE_CHECKING:
    from controller.transport.ssh_tunnel import SshOptions, SshTunnel

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "INVALID_PARAMETER_HEADER",
    "INVALID_VALUE_HEADER",
    "AgentClient",
    "AgentHttpError",
    "BlockingAgentClient",
    "TokenRefusedError",
]

DEFAULT_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 16 * 1024 * 1024  # an agent's answer is a few kilobytes (as fleet_http's)
SSH_LOGIN_EXTRA_S = 5.0  # the SSH login (once, at open) gets this much more than a request


class AgentClient:
    """HTTP client of one node's agent (see the module docstring)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float | None = None,
        ssh: SshOptions | None = None,
        tls: TlsOptions | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s or timeout_s
        self.tls = NO_TLS_OPTIONS if tls is None else tls
        if endpoint.transport == "ssh" and ssh is None:
            raise ValueError(f"{endpoint.uri()}: an ssh:// node needs SshOptions (from_options)")
        self._ssh_options = ssh
        self._tunnel: SshTunnel | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ssl: ssl.SSLContext | bool = True
        self._headers: dict[str, str] = {}
        # the name checked in the certificate of a direct https:// node: never an IPv6 zone
        self._server_name: str | None = None

    @property
    def node(self) -> str:
        return node_label(self.endpoint)

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
        if self.endpoint.scheme == "https":
            self._ssl = client_context(self.tls)
        if self.endpoint.transport == "http":
            # aiohttp would write the URL's host, an IPv6 zone (%eth0) included
            self._headers["Host"] = self.endpoint.host_header
            if self.endpoint.scheme == "https":
                self._server_name = self.endpoint.server_name
        token = bearer_token(self.tls)
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, connect=self.connect_timeout_s)
        connector: aiohttp.BaseConnector
        if self.endpoint.transport == "ssh":
            from controller.transport.ssh_tunnel import SshTunnel  # noqa: PLC0415

            assert self._ssh_options is not None
            self._tunnel = SshTunnel(self.endpoint, self._ssh_options)
            login_s = self.timeout_s + SSH_LOGIN_EXTRA_S
            try:
                await asyncio.wait_for(self._tunnel.connect(), timeout=login_s)
            except TimeoutError:
                await self.close()
                raise NodeError(
                    self.node, f"SSH login took longer than {login_s:g} s", Failure.TIMEOUT
                ) from None
            except BaseException:
                await self.close()
                raise
            path = await self._tunnel.serve(self.endpoint.http_port)
            connector = aiohttp.UnixConnector(path=path, limit=32)
        else:
            connector = aiohttp.TCPConnector(limit=32, use_dns_cache=True)
        self._session = aiohttp.ClientSession(
            base_url=None, connector=connector, timeout=timeout, raise_for_status=False
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
            await asyncio.sleep(0)  # its connections' transports finish closing (aiohttp < 3.12)
        tunnel, self._tunnel = self._tunnel, None
        if tunnel is not None:
            await tunnel.close()

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> bytes:
        """The body of ``GET path`` (200 only); raises ``NodeError``."""
        body, _headers = await self.get_with_headers(path, params)
        return body

    async def get_with_headers(
        self, path: str, params: Mapping[str, str] | None = None
    ) -> tuple[bytes, Mapping[str, str]]:
        """The body and headers of ``GET path`` (200 only); raises ``NodeError``."""
        _status, body, headers = await self.request("GET", path, params=params)
        return body, headers

    async def request(
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
        ``timeout_s`` for this request (an ask that may wait in the node's queue)."""
        if self._session is None:
            await self.open()
        assert self._session is not None
        url = self.endpoint.agent_url + path
        limit = self.timeout_s if timeout_s is None else timeout_s
        timeout = (
            self._session.timeout
            if timeout_s is None
            else aiohttp.ClientTimeout(total=timeout_s, connect=self.connect_timeout_s)
        )
        try:
            async with self._session.request(
                method,
                url,
                params=params,
                json=payload,
                ssl=self._ssl,
                server_hostname=self._server_name,
                headers=self._headers,
                timeout=timeout,
            ) as response:
                body = await self._read_body(response, path, method)
                if response.status not in answers:
                    raise http_error(
                        self.node,
                        path,
                        response.status,
                        str(response.reason),
                        response.headers,
                        body,
                        self.tls.token_file,
                        method,
                    )
                return response.status, body, response.headers
        except NodeError:
            raise
        except TimeoutError:
            raise timeout_error(self.node, path, limit, method) from None
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientConnectorSSLError) as exc:
            raise self._tls_error(exc.os_error) from exc
        except aiohttp.ClientConnectorError as exc:
            failure = (
                Failure.UNKNOWN_HOST
                if isinstance(exc, aiohttp.ClientConnectorDNSError)
                else connect_failure(exc.os_error)
            )
            raise connect_error(self.node, self.endpoint.agent_url, exc.os_error, failure) from exc
        except aiohttp.ClientError as exc:
            raise self._request_error(path, exc, method) from exc

    async def _read_body(self, response: aiohttp.ClientResponse, path: str, method: str) -> bytes:
        """The answer's body, at most ``MAX_BODY_BYTES`` (more: ``NodeError``, the rest left
        unread); a body the connection ends in the middle of is a ``NodeError`` saying so."""
        length = response.content_length
        if length is not None and length > MAX_BODY_BYTES:
            raise too_big_error(self.node, path, MAX_BODY_BYTES, method)
        body = bytearray()
        try:
            async for chunk in response.content.iter_any():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise too_big_error(self.node, path, MAX_BODY_BYTES, method)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            tunnel = self._tunnel
            if tunnel is not None and tunnel.channel_error is not None:
                raise tunnel.channel_error from None
            encoded = "Content-Encoding" in response.headers  # length is not the body's then
            raise cut_off_error(
                self.node, path, len(body), None if encoded else length, method
            ) from None
        return bytes(body)

    def _tls_error(self, error: BaseException) -> NodeError:
        failure, message = tls_failure(error, self.tls, self.endpoint.server_name)
        return NodeError(self.node, message, failure)

    def _request_error(self, path: str, exc: aiohttp.ClientError, method: str) -> NodeError:
        """What a failed request means: the tunnel's reason, a TLS alert, a plain close."""
        tunnel = self._tunnel
        if tunnel is not None and tunnel.channel_error is not None:
            return tunnel.channel_error
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ssl.SSLError):
            return self._tls_error(cause)
        if isinstance(exc, aiohttp.ServerDisconnectedError):
            plain = self.endpoint.scheme == "http" and self.endpoint.transport == "http"
            return disconnected_error(
                self.node, path, str(exc or type(exc).__name__), plain_http=plain, method=method
            )
        return NodeError(self.node, f"{method} {path} failed: {exc or type(exc).__name__}")

    async def get_json(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        return decode_json(self.node, path, await self.get(path, params))


class BlockingAgentClient:
    """``AgentClient`` for a caller without an event loop (the wrapper over HTTPS, with a
    token, or over SSH): one loop (``asyncio.Runner``) for the client's whole life, so an SSH
    tunnel lives from the first request to the last; the methods of
    ``plain_http.PlainAgentClient``. Ctrl-C in a request cancels it, as ``asyncio.run`` does."""

    def __init__(self, endpoint: Endpoint, **settings: Any) -> None:
        self._client = AgentClient(endpoint, **settings)
        self._runner = asyncio.Runner()

    @property
    def node(self) -> str:
        return self._client.node

    def __enter__(self) -> BlockingAgentClient:
        try:
            self._runner.run(self._client.open())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._runner.run(self._client.close())
        finally:
            self._runner.close()

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
        return self._runner.run(
            self._client.request(
                method, path, params=params, payload=payload, answers=answers, timeout_s=timeout_s
            )
        )

    def get(self, path: str, params: Mapping[str, str] | None = None) -> bytes:
        return self._runner.run(self._client.get(path, params))

    def get_json(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        return self._runner.run(self._client.get_json(path, params))
