"""``nvidia-docker-ctl mesos``: a node's Mesos agent flags, for launch scripts.

::

    nvidia-docker-ctl mesos flags [--format legacy|native] [--dev GPUS] [NODE]
    nvidia-docker-ctl mesos decode [BLOB|-]
    nvidia-docker-ctl mesos exec [--format ...] [--dev ...] [--node NODE] -- mesos-agent ARGS...

``flags`` prints what the node's agent answers on ``/mesos/cli``; ``decode`` turns a ``gpus``
attribute back into the GPU info JSON; ``exec`` fetches the flags, merges them into the
agent's arguments (Mesos refuses a flag given twice) and executes the agent in its place.
NODE follows the ``NV_HOST`` grammar; without it, ``NV_HOST``, else the local agent.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import click

from controller.errors import ControllerError
from controller.transport.client import AgentClient
from controller.transport.endpoint import LOCAL, parse_endpoint
from mesos.agent_args import MergeError, merge_agent_args
from mesos.blob import BlobError, decode
from mesos.flags import FlagsError, parse_flag_line

FORMATS = ("legacy", "native")
TIMEOUT_S = 10.0

LEFT_OUT_HEADER = "X-Left-Out"  # what the agent's line does not offer, and why (docs/mesos.md)


@dataclass(frozen=True, slots=True)
class AgentAnswer:
    body: bytes
    left_out: str | None = None  # the agent's X-Left-Out header


@dataclass(frozen=True, slots=True)
class FlagsLine:
    line: str
    left_out: str | None = None


Fetch = Callable[[str | None, str, Mapping[str, str]], AgentAnswer]
"""``fetch(node, path, params)``: GET from a node's agent; raises ``ControllerError``."""


def fetch(node: str | None, path: str, params: Mapping[str, str]) -> AgentAnswer:
    """GET ``path`` from ``node``'s agent (NV_HOST grammar; None: the local agent)."""
    endpoint = LOCAL if node is None else parse_endpoint(node, source="NODE")

    async def get() -> AgentAnswer:
        async with AgentClient(endpoint, timeout_s=TIMEOUT_S) as agent:
            body, headers = await agent.get_with_headers(path, params)
            return AgentAnswer(body, headers.get(LEFT_OUT_HEADER))

    return asyncio.run(get())


def flags_query(fmt: str, dev: str | None) -> dict[str, str]:
    """The ``/mesos/cli`` query for a format and a GPU selection."""
    query = {"format": fmt}
    if dev:
        query["dev"] = dev
    return query


def fetch_flags(
    node: str | None, fmt: str, dev: str | None, *, get: Fetch | None = None
) -> FlagsLine:
    """The node's flags line, checked as Mesos would read it, and what it leaves out;
    raises ``ControllerError``."""
    answer = (get or fetch)(node, "/mesos/cli", flags_query(fmt, dev))
    line = answer.body.decode("utf-8", "replace").strip()
    try:
        flags = parse_flag_line(line)
    except FlagsError as error:
        raise ControllerError(
            f"{_node_name(node)}: the agent's /mesos/cli is not usable: {error}"
        ) from None
    if fmt == "native" and "nvidia_gpu_devices" not in flags:
        raise ControllerError(
            f"{_node_name(node)}: the agent answered the legacy format to format=native "
            "(an nvidia-docker-plugin 1.0 agent?): upgrade it or use --format legacy"
        )
    return FlagsLine(line, answer.left_out)


def report_left_out(node: str | None, flags: FlagsLine) -> None:
    """One line on stderr naming the GPUs the line does not offer (stdout stays the line)."""
    if flags.left_out:
        where = _node_name(node)
        click.echo(f"nvidia-docker-ctl: {where}: not offered: {flags.left_out}", err=True)


def node_from_environment(node: str | None, environ: Mapping[str, str]) -> str | None:
    """NODE if given, else ``NV_HOST``, else None (the local agent)."""
    return node or environ.get("NV_HOST") or None


def _node_name(node: str | None) -> str:
    return node or "local node"


_FORMAT = click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="legacy",
    show_default=True,
    help="legacy: the gpus attribute and a gpus SET resource (nvidia-docker 1.0); "
    "native: Mesos's own GPU support (gpus:N, --nvidia_gpu_devices).",
)
_DEV = click.option(
    "--dev",
    metavar="GPUS",
    help="GPUs to offer: indices or UUID prefixes (GPU-...), space or comma separated. "
    "Default: all.",
)


@click.group(name="mesos")
def mesos() -> None:
    """Mesos agent flags of a node's GPUs: print, decode, or launch the agent with them."""


@mesos.command(name="flags")
@_FORMAT
@_DEV
@click.argument("node", required=False)
def flags_command(fmt: str, dev: str | None, node: str | None) -> None:
    """Print NODE's Mesos agent flags (NODE: NV_HOST grammar; default NV_HOST, else local).

    GPUs the line does not offer (MIG mode for --format native, ...) are named on stderr."""
    node = node_from_environment(node, os.environ)
    flags = _or_fail(lambda: fetch_flags(node, fmt, dev))
    report_left_out(node, flags)
    click.echo(flags.line)


@mesos.command(name="decode")
@click.argument("blob", required=False, default="-")
def decode_command(blob: str) -> None:
    """Print the GPU info JSON inside a gpus attribute.

    BLOB is the blob, gpus:BLOB, an --attributes flag or a whole /mesos/cli line; - (the
    default) reads it from standard input.
    """
    text = sys.stdin.read() if blob == "-" else blob
    try:
        document = decode(text)
    except BlobError as error:
        raise click.ClickException(f"not a gpus blob: {error}") from None
    sys.stdout.buffer.write(document)
    sys.stdout.buffer.flush()


@mesos.command(
    name="exec",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@_FORMAT
@_DEV
@click.option("--node", metavar="NODE", help="The agent to ask (NV_HOST grammar).")
@click.option("--dry-run", is_flag=True, help="Print the merged command instead of running it.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def exec_command(
    fmt: str, dev: str | None, node: str | None, dry_run: bool, command: tuple[str, ...]
) -> None:
    """Run COMMAND (mesos-agent ARGS...) with the node's GPU flags merged into ARGS.

    --attributes and --resources are joined with the node's (Mesos refuses a flag given
    twice); for --format native, --isolation gets cgroups/devices, filesystem/linux and
    gpu/nvidia in an order every Mesos version accepts. The agent replaces this process.
    """
    program, *args = command
    node = node_from_environment(node, os.environ)
    flags = _or_fail(lambda: fetch_flags(node, fmt, dev))
    report_left_out(node, flags)
    try:
        merged = merge_agent_args(args, flags.line, environ=os.environ)
    except MergeError as error:
        raise click.ClickException(str(error)) from None
    if dry_run:
        click.echo(" ".join([program, *merged]))
        return
    try:
        os.execvp(program, [program, *merged])  # noqa: S606 - exec is the point
    except OSError as error:
        raise click.ClickException(f"cannot run {program}: {error.strerror}") from None


def _or_fail(action: Callable[[], FlagsLine]) -> FlagsLine:
    try:
        return action()
    except ControllerError as error:
        raise click.ClickException(str(error)) from None
