"""Ask many nodes' agents the same question at once, and say per node what went wrong.

::

    nodes = [FleetNode("node1", parse_endpoint("node1:")), ...]
    await ask_fleet(nodes, STATUS, lambda index, result: print(result), parallel=64, timeout_s=10)

- At most ``parallel`` nodes are asked at a time (that many workers take nodes in turn), so a
  fleet of ten thousand costs no more memory than ``parallel`` nodes in flight.
- ``timeout_s`` bounds each node as a whole: connecting, the SSH login and every request
  (an SSH node's clock starts again when its login starts: waiting for a login slot is not
  counted).
- Each node gets one connection (``controller.transport.fleet_http``, a lean HTTP/1.1 client:
  aiohttp's per-request cost would be most of a 10,000-node query's time); its requests go
  in one write (pipelined) and the last one closes it, so no idle socket is kept. A request
  with ``instead`` that the agent does not have (HTTP 404 or 405: an older agent) is
  replaced by those requests, on the same connection (kept open for them; this side closes
  it when the route answered): a new route for new agents, the old ones' routes for the
  rest, one TLS handshake either way. HTTPS
  nodes share one TLS context per CA and certificate. SSH nodes each get one SSH connection
  (``controller.transport.ssh_tunnel``, logins bounded in number), and the node's requests
  go through it.
- ``ask_fleet`` hands each result on as it comes and keeps none (the output streams).
  ``ask_node`` asks one node; ``controller.fleet.workers`` runs it in worker processes for
  a large fleet (TLS handshakes are CPU work: one process per CPU).
- A node never raises: its ``NodeResult`` carries the answers, or ``error`` (one line, what
  failed and what to try) and ``reason`` (a few words for the table: ``connection refused``,
  ``timeout``, ``unknown host``, ``SSH host key unknown``, ``HTTP 500``, ``HTML, not JSON``...);
  when the agent answered with an error, ``http_status`` and ``agent_message`` (the first
  line of its body: ``GPU 3 is unhealthy: ...``) too: that node was reached.
- ``tls`` and ``ssh`` are the edge's (``TlsOptions.from_options``, ``SshOptions.from_options``);
  an inventory host's own TLS settings win over ``tls``.
- ``on_result(index, result)`` is called in the event loop as each node finishes (the
  output, the progress line).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from controller.errors import ControllerError, Failure, NodeError
from controller.transport.agent_errors import AgentHttpError, node_label, os_reason
from controller.transport.endpoint import Endpoint
from controller.transport.fleet_http import AgentConnection, answer_error
from controller.transport.tls import NO_TLS_OPTIONS, TlsOptions

if TYPE_CHECKING:
    from controller.transport.ssh_tunnel import SshOptions, SshTunnel

DEFAULT_PARALLEL = 64
DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Request:
    """One GET a fleet query makes on every node; ``key`` names its answer."""

    key: str
    path: str
    params: Mapping[str, str] = field(default_factory=dict)
    must_have: str | None = None  # a top-level JSON key every agent answer has
    optional: bool = False  # an agent without the route (HTTP 404) answers None: older agents
    # asked in its place, next on the same connection, of an agent without the route (404, 405)
    instead: tuple[Request, ...] = ()


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    requests: tuple[Request, ...]


INFO_REQUEST = Request("info", "/gpu/info/json", must_have="Devices")
STATUS_REQUEST = Request("status", "/gpu/status/json", must_have="Devices")
HEALTH_REQUEST = Request("health", "/gpu/health/json", must_have="Devices")
PROCESSES_REQUEST = Request("processes", "/gpu/processes/json", must_have="Devices", optional=True)
INFO = Query("info", (INFO_REQUEST,))
# status shows unhealthy GPUs too: from agents that have /gpu/health (older ones: without).
STATUS = Query("status", (INFO_REQUEST, STATUS_REQUEST, replace(HEALTH_REQUEST, optional=True)))
STATUS_WITH_PROCESSES = Query("status", (*STATUS.requests, PROCESSES_REQUEST))
HEALTH = Query("health", (INFO_REQUEST, HEALTH_REQUEST))


def docker_cli_query(dev: str | None = None, vol: str | None = None) -> Query:
    params = {k: v for k, v in (("dev", dev), ("vol", vol)) if v}
    return Query(
        "docker-cli", (Request("docker_cli", "/docker/cli/json", params, must_have="Devices"),)
    )


@dataclass(frozen=True, slots=True)
class FleetNode:
    """A node as the operator named it, and where its agent answers."""

    name: str
    endpoint: Endpoint
    identity_file: str | None = None  # SSH key for this node only (inventory)
    tls: TlsOptions | None = None  # CA, client certificate, token for this node (inventory)


@dataclass(frozen=True, slots=True)
class NodeResult:
    node: FleetNode
    answers: Mapping[str, Any]
    error: str | None = None
    reason: str | None = None
    elapsed_s: float = 0.0
    http_status: int | None = None  # the agent answered this error status
    agent_message: str | None = None  # ... with this one-line reason (its body's first line)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def reached(self) -> bool:
        """The node's agent answered: with the answers, or with an HTTP error."""
        return self.ok or self.http_status is not None


class _Failure(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def raise_fd_limit() -> None:
    """Every node in flight holds sockets: lift the soft open-files limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def ask_fleet(
    nodes: Sequence[FleetNode],
    query: Query,
    on_result: Callable[[int, NodeResult], None],
    *,
    parallel: int = DEFAULT_PARALLEL,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ssh: SshOptions | None = None,
    tls: TlsOptions | None = None,
    admit: Callable[[int], Awaitable[None]] | None = None,
) -> None:
    """Ask every node, handing each result on as it comes (``on_result(index, result)``),
    keeping none. ``admit(index)``, when given, is awaited before node ``index`` is asked
    (an ordered printer holds the query back so that what waits for it stays bounded).

    ``tls``: the CA, client certificate and token for every node (``--ca``, ``--cert``,
    ``--key``, ``--token-file``); a node's own (inventory) settings win over them.
    """
    raise_fd_limit()
    base_ssh, base_tls = base_transports(nodes, timeout_s, ssh, tls)
    todo: Iterator[tuple[int, FleetNode]] = iter(enumerate(nodes))

    async def worker() -> None:
        for index, node in todo:
            if admit is not None:
                await admit(index)
            on_result(index, await ask_node(node, query, timeout_s, base_ssh, base_tls))

    workers = max(1, min(parallel, len(nodes)))
    await asyncio.gather(*(worker() for _ in range(workers)))


def base_transports(
    nodes: Sequence[FleetNode], timeout_s: float, ssh: SshOptions | None, tls: TlsOptions | None
) -> tuple[SshOptions | None, TlsOptions]:
    """The SSH settings every SSH node starts from (the query's timeout, never a password
    prompt; None without SSH nodes) and the TLS settings every node starts from."""
    base_ssh: SshOptions | None = None
    if any(node.endpoint.transport == "ssh" for node in nodes):
        if ssh is None:
            raise ValueError("ssh:// nodes need SshOptions (SshOptions.from_options)")
        base_ssh = replace(ssh, timeout_s=timeout_s, allow_password_prompt=False)
    return base_ssh, NO_TLS_OPTIONS if tls is None else tls


async def ask_node(
    node: FleetNode,
    query: Query,
    timeout_s: float,
    base_ssh: SshOptions | None,
    base_tls: TlsOptions,
) -> NodeResult:
    """Ask one node (``base_transports``' settings, the node's own TLS settings winning);
    never raises but for cancellation: what failed is in the result."""
    started = time.monotonic()
    answers: dict[str, Any] = {}
    step = "connecting"
    ssh = base_ssh
    if ssh is not None and node.identity_file:
        ssh = replace(ssh, identity_files=(node.identity_file,))
    tunnel: SshTunnel | None = None
    try:
        async with asyncio.timeout(timeout_s) as deadline:

            def restart_clock() -> None:  # the SSH login starts after waiting for a slot
                deadline.reschedule(asyncio.get_running_loop().time() + timeout_s)

            tls = base_tls if node.tls is None else node.tls.over(base_tls)
            name = node_label(node.endpoint)
            connection: AgentConnection | None = None
            try:
                unix_path = None
                if node.endpoint.transport == "ssh":
                    from controller.transport.ssh_tunnel import SshTunnel  # noqa: PLC0415

                    step = "the SSH login"
                    assert ssh is not None  # ask_fleet made it for the SSH nodes
                    tunnel = SshTunnel(node.endpoint, ssh)
                    deadline.reschedule(None)  # no clock while waiting for a login slot
                    await tunnel.connect(restart_clock)
                    unix_path = await tunnel.serve(node.endpoint.http_port)
                batch = query.requests
                while batch:  # a second round only for routes an older agent lacks
                    if connection is None or not connection.reusable:
                        if connection is not None:
                            connection.close()
                        connection = await AgentConnection.open(
                            node.endpoint, name, tls=tls, unix_path=unix_path
                        )
                    # all of the node's requests in one write (pipelined), the last closing
                    # the connection: a fleet of ten thousand keeps no idle socket open;
                    # kept open where an answer may call for more (a route older agents lack)
                    step = "GET " + ", ".join(r.path for r in batch)
                    replies = await connection.get_all(
                        [(r.path, r.params or None) for r in batch],
                        last=not any(r.instead for r in batch),
                    )
                    later: list[Request] = []
                    for request, answer in zip(batch, replies, strict=True):
                        if request.instead and answer.status in (404, 405):
                            later.extend(replace(r, instead=()) for r in request.instead)
                            continue
                        if request.optional and answer.status == 404:
                            answers[request.key] = None  # an older agent, without the route
                            continue
                        if answer.status != 200:
                            raise answer_error(name, request.path, answer, tls)
                        answers[request.key] = _decode(request, answer.body)
                    batch = tuple(later)
            finally:
                if connection is not None:
                    connection.close()
                if tunnel is not None:
                    await tunnel.close()
    except TimeoutError:
        where = "connecting" if step == "connecting" else f"waiting for {step}"
        return NodeResult(
            node,
            answers,
            f"no answer within {timeout_s:g} s ({where}): is the node up and its agent "
            "healthy? (raise --timeout for slow links)",
            "timeout",
            time.monotonic() - started,
        )
    except _Failure as exc:
        return NodeResult(node, answers, exc.message, exc.reason, time.monotonic() - started)
    except NodeError as exc:
        error = exc
        if tunnel is not None and tunnel.channel_error is not None:
            error = tunnel.channel_error  # the tunnel knows why the connection ended
        elapsed = time.monotonic() - started
        if isinstance(error, AgentHttpError):
            return NodeResult(
                node, answers, error.reason, classify(error), elapsed,
                error.status, error.agent_message,
            )  # fmt: skip
        return NodeResult(node, answers, error.reason, classify(error), elapsed)
    except ControllerError as exc:  # this node's own settings (inventory TLS files) are wrong
        return NodeResult(node, answers, str(exc), Failure.ERROR.value, time.monotonic() - started)
    except OSError as exc:  # a socket error the transport did not wrap
        return NodeResult(
            node, answers, os_reason(exc), "network error", time.monotonic() - started
        )
    return NodeResult(node, answers, None, None, time.monotonic() - started)


def _decode(request: Request, body: bytes) -> Any:
    """The agent's JSON, or a ``_Failure`` saying what came back instead."""
    try:
        value = json.loads(body)
    except ValueError:
        head = body.lstrip()[:200].lower()
        if head.startswith((b"<!doctype", b"<html", b"<")):
            raise _Failure(
                "HTML, not JSON",
                f"GET {request.path} answered an HTML page, not the agent's JSON: is another "
                "web server on that port? (check the node's HTTP port)",
            ) from None
        raise _Failure(
            "not JSON",
            f"GET {request.path} answered something that is not JSON "
            f"({_preview(body)}): is this an nvidia-docker agent?",
        ) from None
    if request.must_have and not (isinstance(value, dict) and request.must_have in value):
        raise _Failure(
            "not an agent",
            f"GET {request.path} answered JSON without {request.must_have!r}: "
            "is this an nvidia-docker agent?",
        )
    return value


def json_int(value: Any) -> int | None:
    """An integer of an agent's decoded JSON answer; None for anything else (JSON's true and
    false included, which Python reads as ints)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _preview(body: bytes) -> str:
    text = body[:40].decode("utf-8", "replace")
    text = "".join(ch if ch.isprintable() else "." for ch in text)
    return repr(text + ("..." if len(body) > 40 else ""))


def classify(exc: NodeError) -> str:
    """A few words for the table's error column: the kind of failure the transport named."""
    return exc.label
