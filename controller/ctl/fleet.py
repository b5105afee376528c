"""``nvidia-docker-ctl info|status|docker-cli``: ask a whole fleet at once.

::

    nvidia-docker-ctl status node1: http://10.0.0.2: ssh://admin@node3:
    nvidia-docker-ctl status --inventory hosts.yml --limit gpu --json
    nvidia-docker-ctl info --nodes fleet.txt --jsonl
    nvidia-docker-ctl docker-cli --dev 0 node1:
    nvidia-docker-ctl status                  # NV_HOST, else the local agent

Rows (the table, or JSON) go to standard output; everything else (a failed node's whole
message, unhealthy GPUs and differing drivers after a ``status`` table, the summary) to
standard error, each line starting ``nvidia-docker-ctl:``. A progress line is drawn on
standard error only when it is a terminal, and erased before any row is written. On a
terminal the table fits its width; otherwise nothing is cut (grep, awk).

Exit codes (``controller.errors``; docs/fleet.md has the table): 0 every node answered;
1 some nodes failed, or every node failed but some agent answered (an HTTP error: its one-line
reason is shown); 2 usage error, or a nodes file or inventory that cannot be read (nothing
was asked); 3 no node's agent could be reached; 4 internal error; 130 interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from controller.ctl.flags import operator_options, request_options
from controller.errors import EXIT_FAILED, EXIT_NO_ANSWER, EXIT_OK
from controller.options import Options, setting

if TYPE_CHECKING:
    from controller.fleet.free_view import FreeAsk
    from controller.fleet.output import Progress
    from controller.fleet.query import FleetNode, NodeResult, Query
    from controller.fleet.report import OrderedWindow
    from controller.transport.ssh_tunnel import SshOptions
    from controller.transport.tls import TlsOptions

PROGRESS_MIN_NODES = 8  # a progress bar when more nodes than this are asked (on a terminal)
PROG = "nvidia-docker-ctl"
FLEET_OPTIONS = ("parallel", "timeout_s", "tls_ca", "tls_cert", "tls_key", "token_file", "output")
LOCAL_NODE = "localhost"  # the node's name in the output when none is given and no NV_HOST


@dataclass(frozen=True, slots=True)
class FleetNodes:
    """Which nodes a fleet command asks besides its NODE arguments (files, an inventory)."""

    files: tuple[str, ...] = setting(
        (),
        "A file of nodes, one per line (NV_HOST syntax, # comments; - for stdin).",
        flags=("--nodes",),
        kind="path",
        multiple=True,
        metavar="FILE",
    )
    inventory: str | None = setting(
        None,
        "An Ansible inventory (INI, YAML, or ansible-inventory --list JSON).",
        flags=("-i", "--inventory"),
        kind="path",
        metavar="FILE",
    )
    limit: str | None = setting(
        None,
        "With --inventory: hosts or groups, as ansible --limit (gpu,!gpu07).",
        flags=("-l", "--limit"),
        metavar="PATTERN",
    )


@dataclass(frozen=True, slots=True)
class StatusRequest:
    processes: bool = setting(
        False,
        "Also show what uses each GPU: container, Mesos task or host process.",
        flags=("--processes",),
        kind="flag",
    )


@dataclass(frozen=True, slots=True)
class DockerCliRequest:
    dev: str | None = setting(
        None,
        "GPUs: indices or UUID prefixes ('0 1', GPU-8f), MIG devices <gpu>:<mig> or MIG-...",
        flags=("--dev",),
        metavar="GPUS",
    )
    vol: str | None = setting(None, "Volumes (nvidia_driver).", flags=("--vol",), metavar="VOLUMES")


_EPILOG = (
    "NODE uses the NV_HOST syntax: node1: | http://10.0.0.1:3476 | ssh://admin@node2:[22[:3476]]; "
    "no NODE, --nodes or --inventory: NV_HOST, else the local agent. "
    "Exit codes: 0 all nodes answered, 1 some failed (or answered an error), 2 usage or "
    "inventory error, 3 no agent could be reached. See docs/fleet.md."
)


def fleet_command(
    name: str | None = None, epilog: str = _EPILOG
) -> Callable[[Callable[..., Any]], click.Command]:
    """The arguments and options of the fleet commands (``info``, ``status``,
    ``docker-cli``, ``health``, ``leases``, ``free``; ``usage`` and ``idle`` take them less
    ``--json``/``--jsonl``: ``ctl.usage.report_command``)."""

    def decorate(function: Callable[..., Any]) -> click.Command:
        function = operator_options(*FLEET_OPTIONS)(function)
        function = request_options(FleetNodes, "nodes")(function)
        function = click.argument("node", nargs=-1, metavar="[NODE]...")(function)
        return click.command(name, epilog=epilog)(function)

    return decorate


@fleet_command()
@request_options(StatusRequest, "request")
def status(
    node: tuple[str, ...], nodes: FleetNodes, options: Options, request: StatusRequest
) -> None:
    """Live GPU status of every node: memory, utilisation, power, driver, CUDA."""
    from controller.fleet.query import (  # noqa: PLC0415 (keep other commands fast)
        STATUS,
        STATUS_WITH_PROCESSES,
    )

    query = STATUS_WITH_PROCESSES if request.processes else STATUS
    sys.exit(run_fleet_command(query, node, nodes, options))


@fleet_command()
def info(node: tuple[str, ...], nodes: FleetNodes, options: Options) -> None:
    """Static GPU facts of every node: model, memory, power limit, UUID, driver, CUDA."""
    from controller.fleet.query import INFO  # noqa: PLC0415

    sys.exit(run_fleet_command(INFO, node, nodes, options))


@fleet_command("docker-cli")
@request_options(DockerCliRequest, "request")
def docker_cli(
    node: tuple[str, ...], nodes: FleetNodes, options: Options, request: DockerCliRequest
) -> None:
    """The docker run arguments (devices, driver volume) each node's agent gives."""
    from controller.fleet.query import docker_cli_query  # noqa: PLC0415

    sys.exit(run_fleet_command(docker_cli_query(request.dev, request.vol), node, nodes, options))


def gather_nodes(arguments: Sequence[str], nodes: FleetNodes, options: Options) -> list[FleetNode]:
    """NODE arguments, then the nodes files, then the inventory, each node once; none of
    them: ``NV_HOST``, else the local agent. Raises ``UsageError`` (also when the nodes files
    given, and nothing else, name no node)."""
    from controller.errors import UsageError  # noqa: PLC0415
    from controller.fleet.nodes import (  # noqa: PLC0415
        nodes_from_arguments,
        nodes_from_file,
        nodes_from_inventory,
    )
    from controller.fleet.query import FleetNode  # noqa: PLC0415
    from controller.transport.endpoint import Endpoint, parse_endpoint  # noqa: PLC0415

    if nodes.limit and not nodes.inventory:
        raise UsageError("--limit needs --inventory: give the inventory the pattern selects from")
    found: list[FleetNode] = nodes_from_arguments(arguments, options.user)
    for path in nodes.files:
        found += nodes_from_file(path, options.user)
    if nodes.files and not (found or nodes.inventory):  # as an inventory without hosts
        names = ", ".join(nodes.files)
        raise UsageError(
            f"nodes file{'s' if len(nodes.files) > 1 else ''} {names}: no node in "
            f"{'them' if len(nodes.files) > 1 else 'it'} (only comments and blank lines)"
        )
    if nodes.inventory:
        found += nodes_from_inventory(nodes.inventory, nodes.limit, options.user, options.home)
    if not (arguments or nodes.files or nodes.inventory):
        host = (options.nv_host or "").strip()
        if host:
            found = [FleetNode(host, parse_endpoint(host, source="NV_HOST", user=options.user))]
        else:
            local = Endpoint("http", LOCAL_NODE, source="local agent")
            found = [FleetNode(LOCAL_NODE, local)]
    unique: dict[str, FleetNode] = {}
    for item in found:
        unique.setdefault(item.name, item)
    return list(unique.values())


def run_fleet_command(
    query: Query,
    arguments: Sequence[str],
    nodes: FleetNodes,
    options: Options,
    *,
    free: FreeAsk | None = None,
) -> int:
    """Gather the nodes, ask them, print; returns the exit code. Usage errors (a NODE, file
    or inventory that cannot be read, TLS files that cannot be used) raise before any node is
    asked; the edge (``controller.ctl.main``) prints them.

    ``free``: the ``free`` command's ask; its table (the qualifying nodes, best first) is
    printed once every node is done, and the exit code says whether any node qualifies."""
    from controller.fleet.health_view import StatusNotes, gpu_problems  # noqa: PLC0415
    from controller.fleet.output import Progress, ProgressAware  # noqa: PLC0415
    from controller.fleet.report import (  # noqa: PLC0415
        CountingSink,
        JsonDocumentSink,
        JsonLinesSink,
        OrderedWindow,
        Output,
        ProblemSink,
        TableSink,
    )

    asked = gather_nodes(arguments, nodes, options)
    tls, ssh = transports_for(asked, options)

    progress: Progress | None = None
    out: Output = sys.stdout
    if len(asked) > PROGRESS_MIN_NODES and options.progress:
        progress = Progress(query.name, len(asked))
        out = ProgressAware(sys.stdout, progress)

    tally = None
    if free is not None:
        from controller.fleet.free_view import FreeTally  # noqa: PLC0415 (the agent's picker)

        tally = FreeTally(free)
    sink: JsonLinesSink | JsonDocumentSink | TableSink | ProblemSink | CountingSink
    if options.output == "jsonl":
        sink = JsonLinesSink(out)
    elif options.output == "json":
        sink = JsonDocumentSink(query, out, tally)
    elif query.name == "health":
        sink = ProblemSink(out)
    elif tally is not None:
        sink = CountingSink()
    else:
        sink = TableSink(query, asked, out, options.table_width, _ellipsis())
    window = OrderedWindow(sink.add, max(1024, 4 * options.parallel)) if sink.ordered else None

    # status: unhealthy GPUs and differing drivers after the table (on stderr); health: any
    # unhealthy GPU is a problem to report (exit 1) even when every node answered
    notes = StatusNotes() if query.name == "status" and options.output == "table" else None
    unhealthy = 0

    def on_result(index: int, result: NodeResult) -> None:
        nonlocal unhealthy
        if notes is not None:
            notes.add(result)
        if query.name == "health" and result.ok:
            unhealthy += len(gpu_problems(result))
        if tally is not None:
            tally.add(result, index)
        if window is None:
            sink.add(result)
        else:
            window.put(index, result)
        if progress is not None:
            progress.update(result)

    ask_each(asked, query, on_result, options, ssh=ssh, tls=tls, window=window, progress=progress)
    sink.close()

    counts = sink.summary
    if options.output == "table":
        if tally is not None:
            out.write(
                "".join(line + "\n" for line in tally.lines(options.table_width, _ellipsis()))
            )
            out.flush()
        for line in [
            *(notes.lines() if notes is not None else []),
            *(tally.notes() if tally else []),
        ]:
            click.echo(f"{PROG}: {line}", err=True)
        for name, message in counts.errors:
            click.echo(f"{PROG}: {name}: {message}", err=True)
        if counts.errors_left_out:
            reasons = ", ".join(f"{n} {why}" for why, n in counts.reasons.most_common())
            click.echo(
                f"{PROG}: and {counts.errors_left_out} more failed nodes ({reasons} in all); "
                "--jsonl gives every message",
                err=True,
            )
        refused = f" ({counts.refused} answered with an error)" if counts.refused else ""
        click.echo(
            f"{PROG}: {counts.nodes} node{'s' if counts.nodes != 1 else ''}, "
            f"{counts.answered} answered ({counts.gpus} GPUs), {counts.failed} failed{refused}",
            err=True,
        )
    if tally is not None:  # free: whether any node qualifies, unless no agent was reached
        if counts.failed and counts.reached == 0:
            return EXIT_NO_ANSWER
        return EXIT_OK if tally.found else EXIT_FAILED
    if counts.failed == 0:
        return EXIT_FAILED if unhealthy else EXIT_OK
    return EXIT_NO_ANSWER if counts.reached == 0 else EXIT_FAILED


def transports_for(
    asked: Sequence[FleetNode], options: Options
) -> tuple[TlsOptions, SshOptions | None]:
    """The TLS and SSH settings of a fleet command, their files checked once before any node
    is asked (a usage error, exit 2, when wrong); SSH (paramiko) only when a node needs it."""
    from controller.transport.tls import TlsOptions, bearer_token, client_context  # noqa: PLC0415

    tls = TlsOptions.from_options(options)
    if tls.ca or tls.cert:
        client_context(tls)
    bearer_token(tls)
    ssh = None
    if any(node.endpoint.transport == "ssh" for node in asked):
        from controller.transport.ssh_tunnel import SshOptions  # noqa: PLC0415 (paramiko)

        ssh = SshOptions.from_options(options, timeout_s=options.timeout_s)
    return tls, ssh


def ask_each(
    asked: Sequence[FleetNode],
    query: Query,
    on_result: Callable[[int, NodeResult], None],
    options: Options,
    *,
    ssh: SshOptions | None,
    tls: TlsOptions,
    window: OrderedWindow | None,
    progress: Progress | None,
) -> None:
    """Ask every node (``options.parallel`` at once, each within ``options.timeout_s``),
    ``on_result`` for each answer; the progress line closed at the end, whatever happens.

    A fleet of ``workers.MIN_NODES`` (32) or more HTTP(S) nodes is asked from worker
    processes, one per CPU up to ``options.parallel`` (``controller.fleet.workers``: TLS
    handshakes are CPU work), the output made here."""
    from controller.fleet.query import ask_fleet  # noqa: PLC0415
    from controller.fleet.workers import WorkerPool, workers_for  # noqa: PLC0415

    admit = None if window is None else window.admit
    pool = None
    # Ctrl-C is held back until the query runs in the event loop, where asyncio.run turns it
    # into the query's end; caught while the loop was being built, the half-built loop
    # printed a traceback of its own.
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        try:
            workers = workers_for(asked, options.parallel)
            if workers:
                with contextlib.suppress(OSError):  # no fork (no memory, no process left): here
                    pool = WorkerPool.start(
                        asked, query, timeout_s=options.timeout_s, workers=workers, tls=tls, ssh=ssh
                    )
            if pool is not None:
                ask = pool.ask(on_result, parallel=options.parallel, admit=admit)
            else:
                ask = ask_fleet(
                    asked,
                    query,
                    on_result,
                    parallel=options.parallel,
                    timeout_s=options.timeout_s,
                    ssh=ssh,
                    tls=tls,
                    admit=admit,
                )
            asyncio.run(_with_mask(ask, held))
        finally:
            if pool is not None:
                pool.stop()
            if progress is not None:
                progress.close()
    finally:  # last: a Ctrl-C held back until here is raised after the workers are stopped
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


async def _with_mask(query: Awaitable[None], mask: set[int | signal.Signals]) -> None:
    """``query``, run with the signal ``mask`` (the caller's) once the event loop runs."""
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    await query


def _ellipsis() -> str:
    try:
        "…".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "~"
    return "…"
