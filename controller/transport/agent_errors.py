"""What a node's answer other than 200 means, and the one-line messages of a failed connection.

Shared by the HTTP clients of the controller: ``client.AgentClient`` (aiohttp; the wrapper
over HTTPS or SSH, and the Mesos helper, one node at a time), ``plain_http`` (the standard
library's; the wrapper over plain HTTP) and ``fleet_http`` (lean, for thousands of nodes).
This module imports no HTTP library.
"""

from __future__ import annotations

import _socket  # socket's C module, whose gaierror socket.gaierror is (no enum to import)
import os

from controller import json_codec
from controller.errors import Failure, NodeError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from controller.transport.endpoint import Endpoint

# Headers of the agent's 400 answers (agent.api.routes): which query parameter, which entry.
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
        method: str = "GET",
    ) -> None:
        self.status = status
        self.agent_message = text
        self.invalid_parameter = invalid_parameter
        self.invalid_value = invalid_value
        super().__init__(
            node, f"the agent answered {status} to {method} {path}: {text}", Failure.HTTP_STATUS
        )

    @property
    def label(self) -> str:
        return f"HTTP {self.status}"


class TokenRefusedError(AgentHttpError):
    """The agent answered 401: it wants a token, or not the one sent (``Failure.TOKEN_REFUSED``)."""

    def __init__(
        self, node: str, path: str, text: str, *, token_file: str | None, method: str = "GET"
    ) -> None:
        super().__init__(node, path, 401, text, method=method)
        if token_file is None:
            self.reason = (
                f"the agent asks for a token (401 to {method} {path}: {text}): give the token "
                "file with --token-file FILE or NV_TOKEN_FILE"
            )
        else:
            self.reason = (
                f"the agent refused the token of {token_file} (401 to {method} {path}: {text}): "
                "is it one of the tokens in the agent's --token-file?"
            )
        self.failure = Failure.TOKEN_REFUSED
        self.args = (f"{node}: {self.reason}",)

    @property
    def label(self) -> str:
        return self.failure.value


def http_error(
    node: str,
    path: str,
    status: int,
    reason_phrase: str,
    headers: Mapping[str, str],
    body: bytes,
    token_file: str | None,
    method: str = "GET",
) -> AgentHttpError:
    """The error for a non-200 answer (``headers`` looked up case-insensitively by the caller's
    mapping: aiohttp's, or lower-cased names)."""
    text = body.decode("utf-8", "replace").strip().splitlines()
    first = text[0] if text else reason_phrase
    if status == 401:
        return TokenRefusedError(node, path, first, token_file=token_file, method=method)
    parameter = headers.get(INVALID_PARAMETER_HEADER) or headers.get(
        INVALID_PARAMETER_HEADER.lower()
    )
    value = headers.get(INVALID_VALUE_HEADER) or headers.get(INVALID_VALUE_HEADER.lower())
    if parameter and value is not None:
        from urllib.parse import unquote  # noqa: PLC0415 (a refusal only)

        value = unquote(value)
    return AgentHttpError(
        node,
        path,
        status,
        first,
        invalid_parameter=parameter,
        invalid_value=value if parameter else None,
        method=method,
    )


def decode_json(node: str, path: str, body: bytes) -> Any:
    """The body of a 200 answer to ``GET path``, decoded; ``NodeError`` when it is not JSON."""
    try:
        return json_codec.loads(body)
    except ValueError:
        raise NodeError(
            node,
            f"the answer to GET {path} is not JSON: is this an nvidia-docker agent?",
            Failure.NOT_AN_AGENT,
        ) from None


def node_label(endpoint: Endpoint) -> str:
    """How messages name a node: ``http://10.0.0.1:3476``, ``ssh://admin@node2:22``."""
    if endpoint.transport == "ssh":
        return f"ssh://{endpoint.node}"
    if endpoint.transport == "http":
        return f"{endpoint.scheme}://{endpoint.node}"
    return f"local agent ({endpoint.agent_url})"


def connect_failure(error: BaseException) -> Failure:
    """The kind of a failed TCP connect (the OS error behind it)."""
    if isinstance(error, _socket.gaierror):
        return Failure.UNKNOWN_HOST
    if isinstance(error, ConnectionRefusedError):
        return Failure.REFUSED
    return Failure.CANNOT_CONNECT


def os_reason(error: OSError) -> str:
    """What went wrong, in the operating system's words (``No route to host``) for an error
    of the system (a built-in ``OSError`` class with its errno): the same whichever event
    loop raised it (asyncio's connect says ``Connect call failed (ADDRESS)``, uvloop's says
    the error's name) and whichever client (aiohttp keeps the loop's words). Others keep
    their own text: ``socket.gaierror`` (the resolver's words), ``ssl.SSLError`` (OpenSSL's
    codes, not errno's)."""
    if type(error).__module__ == "builtins" and error.errno and error.errno > 0:
        return os.strerror(error.errno)
    return error.strerror or str(error)


def connect_error(node: str, agent_url: str, error: OSError, failure: Failure) -> NodeError:
    """``cannot connect to the agent at URL (why): is nvidia-docker-plugin running there...``"""
    why = "connection refused" if failure is Failure.REFUSED else os_reason(error)
    return NodeError(
        node,
        f"cannot connect to the agent at {agent_url} ({why}): is nvidia-docker-plugin running "
        "there, listening on that address (-l HOST:PORT)?",
        failure,
    )


def timeout_error(node: str, path: str, timeout_s: float, method: str = "GET") -> NodeError:
    return NodeError(
        node,
        f"no answer to {method} {path} within {timeout_s:g} s: is the agent "
        "(nvidia-docker-plugin) healthy?",
        Failure.TIMEOUT,
    )


def disconnected_error(
    node: str, path: str, why: str, *, plain_http: bool, method: str = "GET"
) -> NodeError:
    """The connection ended before an answer's status line; over plain HTTP, an agent
    serving TLS does exactly that, so say so."""
    hint = " (an agent serving TLS closes plain HTTP connections: https://?)" if plain_http else ""
    return NodeError(node, f"{method} {path} failed: {why}{hint}", Failure.DISCONNECTED)


def cut_off_error(
    node: str, path: str, got: int, expected: int | None, method: str = "GET"
) -> NodeError:
    """The connection ended in the middle of an answer's body, after its status line and
    headers had come: ``got`` bytes of the body came, of ``expected`` (its Content-Length;
    None for a chunked body, whose size is not known)."""
    of = "" if expected is None else f" of {expected}"
    return NodeError(
        node,
        f"{method} {path} failed: the answer was cut off after {got}{of} bytes (the "
        "connection ended in the middle of its body): was the agent restarted? try again",
        Failure.DISCONNECTED,
    )


def too_big_error(node: str, path: str, limit: int, method: str = "GET") -> NodeError:
    """The answer's body is over ``limit`` bytes (the clients' bound on what they keep)."""
    return NodeError(
        node,
        f"{method} {path} failed: the answer is over {limit // 2**20} MiB: "
        "is this an nvidia-docker agent?",
        Failure.NOT_AN_AGENT,
    )
