"""``nvidia-docker-ctl info|status|docker-cli``: ask a whole fleet at once.

::

    nvidia-docker-ctl status node1: http://10.0.0.2: ssh://admin@node3:
    nvidia-docker-ctl status --inventory hosts.yml --limit gpu --json
    nvidia-docker-ctl info --nodes fleet.txt --jsonl
    nvidia-docker-ctl docker-cli --dev 0 node1:

Exit codes (``EXIT_*``): 0 every node answered; 1 some nodes failed (listed with the reason);
2 usage error, or a nodes file or inventory that cannot be read (nothing was asked);
3 no node answered; 4 internal error (a bug: set ``NV_DEBUG=1`` for the traceback);
130 interrupted. See docs/fleet.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from controller.errors import ControllerError

if TYPE_CHECKING:
    from controller.transport.tls import TlsOptions

EXIT_OK = 0
EXIT_SOME_FAILED = 1
EXIT_USAGE = 2
EXIT_ALL_FAILED = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130

PROGRESS_MIN_NODES = 8  # a progress bar when more nodes than this are asked (on a terminal)
PROG = "nvidia-docker-ctl"


def _fleet_options(function: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.argument("node", nargs=-1, metavar="[NODE]..."),
        click.option(
            "--nodes",
            "nodes_files",
            multiple=True,
            metavar="FILE",
            help="A file of nodes, one per line (NV_HOST syntax, # comments; - for stdin).",
        ),
        click.option(
            "-i",
            "--inventory",
            metavar="FILE",
            help="An Ansible inventory (INI, YAML, or ansible-inventory --list JSON).",
        ),
        click.option(
            "-l",
            "--limit",
            metavar="PATTERN",
            help="With --inventory: hosts or groups, as ansible --limit (gpu,!gpu07).",
        ),
        click.option(
            "-p",
            "--parallel",
            type=click.IntRange(1, 4096),
            default=64,
            show_default=True,
            envvar="NV_FLEET_PARALLEL",
            help="Nodes asked at the same time.  [env: NV_FLEET_PARALLEL]",
        ),
        click.option(
            "-t",
            "--timeout",
            "timeout_s",
            type=click.FloatRange(0.1, 3600),
            default=10.0,
            show_default=True,
            envvar="NV_FLEET_TIMEOUT",
            help="Seconds for each node as a whole (connect, SSH login, requests).  "
            "[env: NV_FLEET_TIMEOUT]",
        ),
        click.option(
            "--ca",
            "tls_ca",
            metavar="FILE",
            envvar="NV_TLS_CA",
            help="CA certificate(s) that signed the agents' TLS certificates (https:// nodes); "
            "default: the system's CAs.  [env: NV_TLS_CA]",
        ),
        click.option(
            "--cert",
            "tls_cert",
            metavar="FILE",
            envvar="NV_TLS_CERT",
            help="Client certificate, for agents with mutual TLS.  [env: NV_TLS_CERT]",
        ),
        click.option(
            "--key",
            "tls_key",
            metavar="FILE",
            envvar="NV_TLS_KEY",
            help="The key of --cert (default: in the --cert file).  [env: NV_TLS_KEY]",
        ),
        click.option(
            "--token-file",
            metavar="FILE",
            envvar="NV_TOKEN_FILE",
            help="Bearer token for agents with --token-file (the first token in the file).  "
            "[env: NV_TOKEN_FILE]",
        ),
        click.option("--json", "as_json", is_flag=True, help="One JSON document, nodes by name."),
        click.option(
            "--jsonl", "as_jsonl", is_flag=True, help="One JSON line per node, as they answer."
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


fleet_options = _fleet_options  # for commands of other modules (ctl.health)

_EPILOG = (
    "NODE uses the NV_HOST syntax: node1: | http://10.0.0.1:3476 | ssh://admin@node2:[22[:3476]]. "
    "Exit codes: 0 all nodes answered, 1 some failed, 2 usage or inventory error, "
    "3 none answered. See docs/fleet.md."
)


@click.command(epilog=_EPILOG)
@_fleet_options
@click.option(
    "--processes",
    is_flag=True,
    help="Also show what uses each GPU: container, Mesos task or host process.",
)
def status(processes: bool, **options: Any) -> None:
    """Live GPU status of every node: memory, utilisation, power, driver, CUDA."""
    from controller.fleet.query import (  # noqa: PLC0415 (keep other commands fast)
        STATUS,
        STATUS_WITH_PROCESSES,
    )

    sys.exit(run_fleet_command(STATUS_WITH_PROCESSES if processes else STATUS, **options))


@click.command(epilog=_EPILOG)
@_fleet_options
def info(**options: Any) -> None:
    """Static GPU facts of every node: model, memory, power limit, UUID, driver, CUDA."""
    from controller.fleet.query import INFO  # noqa: PLC0415

    sys.exit(run_fleet_command(INFO, **options))


@click.command("docker-cli", epilog=_EPILOG)
@_fleet_options
@click.option("--dev", metavar="GPUS", help="GPUs: indices or UUID prefixes ('0 1', GPU-8f).")
@click.option("--vol", metavar="VOLUMES", help="Volumes (nvidia_driver).")
def docker_cli(dev: str | None, vol: str | None, **options: Any) -> None:
    """The docker run arguments (devices, driver volume) each node's agent gives."""
    from controller.fleet.query import docker_cli_query  # noqa: PLC0415

    sys.exit(run_fleet_command(docker_cli_query(dev, vol), **options))


def run_fleet_command(
    query: Any,
    *,
    node: Sequence[str],
    nodes_files: Sequence[str],
    inventory: str | None,
    limit: str | None,
    parallel: int,
    timeout_s: float,
    as_json: bool,
    as_jsonl: bool,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    token_file: str | None = None,
) -> int:
    """Gather the nodes, ask them, print; returns the exit code."""
    if as_json and as_jsonl:
        raise click.UsageError("--json and --jsonl exclude each other")
    if limit and not inventory:
        raise click.UsageError("--limit needs --inventory")
    try:
        from controller.transport.tls import TlsOptions  # noqa: PLC0415

        tls = TlsOptions(tls_ca, tls_cert, tls_key, token_file)
        return _run(
            query, node, nodes_files, inventory, limit, parallel, timeout_s, as_json, as_jsonl, tls
        )
    except ControllerError as exc:
        click.echo(f"{PROG}: error: {exc}", err=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        click.echo(f"{PROG}: interrupted", err=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader went away (| head): say nothing more
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        if os.environ.get("NV_DEBUG"):
            raise
        click.echo(
            f"{PROG}: internal error: {type(exc).__name__}: {exc} "
            "(set NV_DEBUG=1 for the traceback, and report it)",
            err=True,
        )
        return EXIT_INTERNAL


def _run(
    query: Any,
    node: Sequence[str],
    nodes_files: Sequence[str],
    inventory: str | None,
    limit: str | None,
    parallel: int,
    timeout_s: float,
    as_json: bool,
    as_jsonl: bool,
    tls: TlsOptions,
) -> int:
    from controller.fleet.health_view import StatusNotes, gpu_problems  # noqa: PLC0415
    from controller.fleet.nodes import (  # noqa: PLC0415
        nodes_from_arguments,
        nodes_from_file,
        nodes_from_inventory,
    )
    from controller.fleet.output import Progress  # noqa: PLC0415
    from controller.fleet.query import FleetNode, NodeResult, ask_fleet  # noqa: PLC0415
    from controller.fleet.report import (  # noqa: PLC0415
        JsonDocumentSink,
        JsonLinesSink,
        OrderedWindow,
        ProblemSink,
        TableSink,
    )
    from controller.transport.tls import bearer_token, client_context  # noqa: PLC0415

    nodes: list[FleetNode] = nodes_from_arguments(node)
    for path in nodes_files:
        nodes += nodes_from_file(path)
    if inventory:
        nodes += nodes_from_inventory(inventory, limit)
    if not nodes:
        raise click.UsageError("no nodes: give NODE arguments, --nodes FILE or --inventory FILE")
    unique: dict[str, FleetNode] = {}
    for item in nodes:
        unique.setdefault(item.name, item)
    nodes = list(unique.values())
    # the options' files are checked once, before any node is asked (exit 2 when wrong)
    if tls.ca or tls.cert:
        client_context(tls)
    bearer_token(tls)

    progress: Progress | None = None
    if len(nodes) > PROGRESS_MIN_NODES and _is_terminal(sys.stderr):
        progress = Progress(query.name, len(nodes))

    sink: JsonLinesSink | JsonDocumentSink | TableSink | ProblemSink
    if as_jsonl:
        sink = JsonLinesSink(sys.stdout)
    elif as_json:
        sink = JsonDocumentSink(query, sys.stdout)
    elif query.name == "health":
        sink = ProblemSink(sys.stdout)
    else:
        width = shutil.get_terminal_size((80, 24)).columns
        sink = TableSink(query, nodes, sys.stdout, width, _ellipsis())
    window = OrderedWindow(sink.add, max(1024, 4 * parallel)) if sink.ordered else None

    # status: unhealthy GPUs and differing drivers after the table; health: any unhealthy
    # GPU is a problem to report (exit 1) even when every node answered
    notes = StatusNotes() if query.name == "status" and not (as_json or as_jsonl) else None
    unhealthy = 0

    def on_result(index: int, result: NodeResult) -> None:
        nonlocal unhealthy
        if notes is not None:
            notes.add(result)
        if query.name == "health" and result.ok:
            unhealthy += len(gpu_problems(result))
        if window is None:
            sink.add(result)
        else:
            window.put(index, result)
        if progress is not None:
            progress.update(result)

    try:
        asyncio.run(
            ask_fleet(
                nodes,
                query,
                on_result,
                parallel=parallel,
                timeout_s=timeout_s,
                tls=tls,
                admit=None if window is None else window.admit,
            )
        )
    finally:
        if progress is not None:
            progress.close()
    sink.close()
    if notes is not None:
        lines = notes.lines()
        if lines:
            sys.stdout.write("\n".join(lines) + "\n")
            sys.stdout.flush()

    counts = sink.summary
    if not (as_json or as_jsonl):
        for name, message in counts.errors:
            click.echo(f"{PROG}: {name}: {message}", err=True)
        if counts.errors_left_out:
            reasons = ", ".join(f"{n} {why}" for why, n in counts.reasons.most_common())
            click.echo(
                f"{PROG}: and {counts.errors_left_out} more failed nodes ({reasons} in all); "
                "--jsonl gives every message",
                err=True,
            )
        click.echo(
            f"{PROG}: {counts.nodes} node{'s' if counts.nodes != 1 else ''}, "
            f"{counts.answered} answered "
            f"({counts.gpus} GPUs), {counts.failed} failed",
            err=True,
        )
    if counts.failed == 0:
        return EXIT_SOME_FAILED if unhealthy else EXIT_OK
    return EXIT_ALL_FAILED if counts.failed == counts.nodes else EXIT_SOME_FAILED


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _ellipsis() -> str:
    try:
        "…".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "~"
    return "…"
