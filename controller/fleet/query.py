"""Ask many nodes' agents the same question at once, and say per node what went wrong.

::

    nodes = [FleetNode("node1", parse_endpoint("node1:")), ...]
    results = await query_fleet(nodes, STATUS, parallel=64, timeout_s=10, on_result=print)

- At most ``parallel`` nodes are asked at a time (that many workers take nodes in turn), so a
  fleet of ten thousand costs no more memory than ``parallel`` nodes in flight.
- ``timeout_s`` bounds each node as a whole: connecting, the SSH login and every request.
- HTTP nodes share one aiohttp session (one connection pool, one DNS cache); a node's requests
  follow one another on one keep-alive connection. SSH nodes each get one SSH connection, and
  all of that node's requests go through it (``controller.transport.client.AgentClient``).
- A node never raises: its ``NodeResult`` carries the answers, or ``error`` (one line, what
  failed and what to try) and ``reason`` (a few words for the table: ``connection refused``,
  ``timeout``, ``unknown host``, ``SSH host key unknown``, ``HTTP 500``, ``HTML, not JSON``...).
- ``on_result`` is called in the event loop as each node finishes (``--jsonl``, progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import aiohttp

from controller.errors import NodeError
from controller.transport.client import AgentClient, AgentHttpError
from controller.transport.endpoint import Endpoint

if TYPE_CHECKING:
    from controller.transport.ssh_tunnel import SshOptions

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


@dataclass(frozen=True, slots=True)
class NodeResult:
    node: FleetNode
    answers: Mapping[str, Any]
    error: str | None = None
    reason: str | None = None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


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


async def query_fleet(
    nodes: Sequence[FleetNode],
    query: Query,
    *,
    parallel: int = DEFAULT_PARALLEL,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ssh: SshOptions | None = None,
    on_result: Callable[[NodeResult], None] | None = None,
) -> list[NodeResult]:
    """Ask every node; the results come back in the order of ``nodes``."""
    raise_fd_limit()
    base_ssh: SshOptions | None = None
    if any(node.endpoint.transport == "ssh" for node in nodes):
        from controller.transport.ssh_tunnel import SshOptions  # noqa: PLC0415 (paramiko: SSH only)

        base_ssh = replace(
            ssh or SshOptions.from_environ(allow_password_prompt=False),
            timeout_s=timeout_s,
            allow_password_prompt=False,
        )
    results: list[NodeResult | None] = [None] * len(nodes)
    todo: Iterator[tuple[int, FleetNode]] = iter(enumerate(nodes))
    connector = aiohttp.TCPConnector(limit=0, use_dns_cache=True, keepalive_timeout=5.0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            for index, node in todo:
                result = await _ask_node(node, query, timeout_s, base_ssh, session)
                results[index] = result
                if on_result is not None:
                    on_result(result)

        workers = max(1, min(parallel, len(nodes)))
        await asyncio.gather(*(worker() for _ in range(workers)))
    return [r for r in results if r is not None]


async def _ask_node(
    node: FleetNode,
    query: Query,
    timeout_s: float,
    base_ssh: SshOptions | None,
    session: aiohttp.ClientSession,
) -> NodeResult:
    started = time.monotonic()
    answers: dict[str, Any] = {}
    step = "connecting"
    ssh = base_ssh
    if ssh is not None and node.identity_file:
        ssh = replace(ssh, identity_files=(node.identity_file,))
    try:
        async with asyncio.timeout(timeout_s):
            client = AgentClient(node.endpoint, timeout_s=timeout_s, ssh=ssh, session=session)
            try:
                if node.endpoint.transport == "ssh":
                    step = "the SSH login"
                    await client.open()
                for request in query.requests:
                    step = f"GET {request.path}"
                    try:
                        body = await client.get(request.path, request.params or None)
                    except AgentHttpError as exc:
                        if request.optional and exc.status == 404:
                            answers[request.key] = None
                            continue
                        raise
                    answers[request.key] = _decode(request, body)
            finally:
                await client.close()
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
        return NodeResult(node, answers, exc.reason, classify(exc), time.monotonic() - started)
    except OSError as exc:  # a socket error the transport did not wrap
        return NodeResult(
            node, answers, f"{exc.strerror or exc}", "network error", time.monotonic() - started
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


def _preview(body: bytes) -> str:
    text = body[:40].decode("utf-8", "replace")
    text = "".join(ch if ch.isprintable() else "." for ch in text)
    return repr(text + ("..." if len(body) > 40 else ""))


def classify(exc: NodeError) -> str:
    """A few words for the table's error column: the kind of failure the transport named."""
    return exc.label
