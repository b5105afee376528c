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
from typing import Any

import click

from controller.errors import ControllerError

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
) -> int:
    """Gather the nodes, ask them, print; returns the exit code."""
    if as_json and as_jsonl:
        raise click.UsageError("--json and --jsonl exclude each other")
    if limit and not inventory:
        raise click.UsageError("--limit needs --inventory")
    try:
        return _run(
            query, node, nodes_files, inventory, limit, parallel, timeout_s, as_json, as_jsonl
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
) -> int:
    from controller.fleet.health_view import problems, status_notes  # noqa: PLC0415
    from controller.fleet.nodes import (  # noqa: PLC0415
        nodes_from_arguments,
        nodes_from_file,
        nodes_from_inventory,
    )
    from controller.fleet.output import (  # noqa: PLC0415
        Progress,
        json_document,
        json_line,
        summary,
        table_lines,
    )
    from controller.fleet.query import FleetNode, NodeResult, query_fleet  # noqa: PLC0415

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

    progress: Progress | None = None
    if len(nodes) > PROGRESS_MIN_NODES and _is_terminal(sys.stderr):
        progress = Progress(query.name, len(nodes))

    def on_result(result: NodeResult) -> None:
        if as_jsonl:
            sys.stdout.write(json_line(result) + "\n")
            sys.stdout.flush()
        if progress is not None:
            progress.update(result)

    try:
        results = asyncio.run(
            query_fleet(nodes, query, parallel=parallel, timeout_s=timeout_s, on_result=on_result)
        )
    finally:
        if progress is not None:
            progress.close()

    if as_json:
        sys.stdout.write(json_document(query, results))
    elif not as_jsonl:
        width = shutil.get_terminal_size((80, 24)).columns
        lines = table_lines(query, results, width, _ellipsis())
        if query.name == "status":  # unhealthy GPUs, drivers that differ
            lines += status_notes(results)
        if lines:
            sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        for result in results:
            if not result.ok:
                click.echo(f"{PROG}: {result.node.name}: {result.error}", err=True)
        counts = summary(results)
        click.echo(
            f"{PROG}: {counts['nodes']} node{'s' if counts['nodes'] != 1 else ''}, "
            f"{counts['answered']} answered "
            f"({counts['gpus']} GPUs), {counts['failed']} failed",
            err=True,
        )
    failed = sum(1 for r in results if not r.ok)
    if failed == 0:
        if query.name == "health" and problems(results):
            return EXIT_SOME_FAILED  # health: any unhealthy GPU is a problem to report
        return EXIT_OK
    return EXIT_ALL_FAILED if failed == len(results) else EXIT_SOME_FAILED


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
