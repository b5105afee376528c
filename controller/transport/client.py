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
  timeouts, errors) is the same code for both.
- TLS and tokens (``controller.transport.tls``): ``tls`` names the CA to trust, a client
  certificate and a token file (default: ``NV_TLS_CA``, ``NV_TLS_CERT``, ``NV_TLS_KEY``,
  ``NV_TOKEN_FILE``). A token is sent on every request, whatever the transport. A TLS failure
  says which one it is (``Failure.TLS_UNTRUSTED``, ``TLS_NAME_MISMATCH``,
  ``TLS_CLIENT_CERT_REFUSED``); a 401 is ``TokenRefusedError`` (``Failure.TOKEN_REFUSED``).
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
import ssl
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import aiohttp

from controller.errors import Failure, NodeError
from controller.transport.endpoint import Endpoint
from controller.transport.tls import TlsOptions, bearer_token, client_context, tls_failure

if TYPE_CHECKING:
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


class TokenRefusedError(AgentHttpError):
    """The agent answered 401: it wants a token, or not the one sent (``Failure.TOKEN_REFUSED``)."""

    def __init__(self, node: str, path: str, text: str, *, token_file: str | None) -> None:
        super().__init__(node, path, 401, text)
        if token_file is None:
            self.reason = (
                f"the agent asks for a token (401 to GET {path}: {text}): give the token file "
                "with --token-file FILE or NV_TOKEN_FILE"
            )
        else:
            self.reason = (
                f"the agent refused the token of {token_file} (401 to GET {path}: {text}): "
                "is it one of the tokens in the agent's --token-file?"
            )
        self.failure = Failure.TOKEN_REFUSED
        self.args = (f"{node}: {self.reason}",)

    @property
    def label(self) -> str:
        return self.failure.value


def _http_error(
    node: str,
    path: str,
    response: aiohttp.ClientResponse,
    body: bytes,
    token_file: str | None,
) -> AgentHttpError:
    text = body.decode("utf-8", "replace").strip().splitlines()
    if response.status == 401:
        return TokenRefusedError(
            node, path, text[0] if text else str(response.reason), token_file=token_file
        )
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
        tls: TlsOptions | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s or timeout_s
        self.tls = TlsOptions.from_environ() if tls is None else tls
        self._ssh_options = ssh
        self._tunnel: SshTunnel | None = None
        self._session: aiohttp.ClientSession | None = None
        self._shared_session = session if endpoint.transport != "ssh" else None
        self._ssl: ssl.SSLContext | bool = True
        self._headers: dict[str, str] | None = None

    @property
    def node(self) -> str:
        ep = self.endpoint
        if ep.transport == "ssh":
            return f"ssh://{ep.node}"
        if ep.transport == "http":
            return f"{ep.scheme}://{ep.node}"
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
        if self.endpoint.scheme == "https":
            self._ssl = client_context(self.tls)
        token = bearer_token(self.tls)
        if token is not None:
            self._headers = {"Authorization": f"Bearer {token}"}
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
                await self.close()
                raise NodeError(
                    self.node, f"SSH login took longer than {self.timeout_s:g} s", Failure.TIMEOUT
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
            async with self._session.get(
                url, params=params, ssl=self._ssl, headers=self._headers
            ) as response:
                body = await response.read()
                if response.status != 200:
                    raise _http_error(self.node, path, response, body, self.tls.token_file)
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
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientConnectorSSLError) as exc:
            raise self._tls_error(exc.os_error) from exc
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
        except aiohttp.ClientError as exc:
            raise self._request_error(path, exc) from exc

    def _tls_error(self, error: BaseException) -> NodeError:
        failure, message = tls_failure(error, self.tls, self.endpoint.host)
        return NodeError(self.node, message, failure)

    def _request_error(self, path: str, exc: aiohttp.ClientError) -> NodeError:
        """What a failed request means: the tunnel's reason, a TLS alert, a plain close."""
        tunnel = self._tunnel
        if tunnel is not None and tunnel.channel_error is not None:
            return tunnel.channel_error
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ssl.SSLError):
            return self._tls_error(cause)
        if isinstance(exc, aiohttp.ServerDisconnectedError):
            hint = ""
            if self.endpoint.scheme == "http" and self.endpoint.transport == "http":
                hint = " (an agent serving TLS closes plain HTTP connections: https://?)"
            return NodeError(
                self.node,
                f"GET {path} failed: {exc or type(exc).__name__}{hint}",
                Failure.DISCONNECTED,
            )
        return NodeError(self.node, f"GET {path} failed: {exc or type(exc).__name__}")

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
