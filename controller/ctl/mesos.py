"""``nvidia-docker-ctl mesos``: a node's Mesos agent flags, for launch scripts.

::

    nvidia-docker-ctl mesos flags [--format legacy|native] [--dev GPUS] [NODE]
    nvidia-docker-ctl mesos decode [BLOB|-]
    nvidia-docker-ctl mesos exec [--format ...] [--dev ...] [--node NODE] -- mesos-agent ARGS...

``flags`` prints what the node's agent answers on ``/mesos/cli``; ``decode`` turns a ``gpus``
attribute back into the GPU info JSON; ``exec`` fetches the flags, merges them into the
agent's arguments (Mesos refuses a flag given twice) and executes the agent in its place
(``--dry-run`` prints the command, shell-quoted, instead). NODE follows the ``NV_HOST``
grammar; without it, ``NV_HOST``, else the local agent. TLS, tokens and SSH come from the
edge's options (``NV_TLS_*``, ``NV_TOKEN_FILE``, ``NV_SSH_*``); errors are the edge's one
line and exit code (``controller.ctl.main``): an agent's refusal (400 ``invalid device``)
exits 1 with its reason, an agent that cannot be reached 3.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import click

from controller.ctl.flags import operator_options, request_options
from controller.errors import ControllerError, UsageError
from controller.options import Options, setting
from controller.transport.endpoint import LOCAL, parse_endpoint
from mesos.agent_args import MergeError, merge_agent_args
from mesos.blob import BlobError, decode
from mesos.flags import FlagsError, parse_flag_line

FORMATS = ("legacy", "native")
TIMEOUT_S = 10.0
MAX_QUOTED = 200  # characters of why an answer is not a flags line, on the error line

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


@dataclass(frozen=True, slots=True)
class FlagsRequest:
    """What ``flags`` and ``exec`` ask the agent for."""

    fmt: str = setting(
        "legacy",
        "legacy: the gpus attribute and a gpus SET resource (nvidia-docker 1.0); native: "
        "Mesos's own GPU support (gpus:N, --nvidia_gpu_devices).",
        flags=("--format",),
        kind="choice",
        choices=FORMATS,
        metavar="legacy|native",
    )
    dev: str | None = setting(
        None,
        "GPUs to offer: indices or UUID prefixes (GPU-...), space or comma separated; MIG "
        "devices (<gpu>:<mig>, MIG-...) with --format legacy only (native offers whole GPUs, "
        "and leaves GPUs in MIG mode out). Default: all.",
        flags=("--dev",),
        metavar="GPUS",
    )


@dataclass(frozen=True, slots=True)
class ExecRequest:
    node: str | None = setting(
        None, "The agent to ask (NV_HOST grammar).", flags=("--node",), metavar="NODE"
    )
    dry_run: bool = setting(
        False,
        "Print the merged command, shell-quoted, instead of running it.",
        flags=("--dry-run",),
        kind="flag",
    )


def fetcher(options: Options) -> Fetch:
    """GET from a node's agent (NV_HOST grammar; None: the local agent) with the edge's TLS,
    token and SSH options."""
    # aiohttp only here: importing it (and the SSL contexts it makes at import) costs every
    # other ctl command about 0.1 s of start-up (docs/fleet.md, "Figures").
    from controller.transport.client import AgentClient  # noqa: PLC0415
    from controller.transport.tls import TlsOptions  # noqa: PLC0415

    tls = TlsOptions.from_options(options)

    def fetch(node: str | None, path: str, params: Mapping[str, str]) -> AgentAnswer:
        endpoint = LOCAL if node is None else parse_endpoint(node, source="NODE", user=options.user)
        ssh = None
        if endpoint.transport == "ssh":
            from controller.transport.ssh_tunnel import SshOptions  # noqa: PLC0415

            ssh = SshOptions.from_options(options, timeout_s=TIMEOUT_S, prompt=True)

        async def get() -> AgentAnswer:
            async with AgentClient(endpoint, timeout_s=TIMEOUT_S, ssh=ssh, tls=tls) as agent:
                body, headers = await agent.get_with_headers(path, params)
                return AgentAnswer(body, headers.get(LEFT_OUT_HEADER))

        return asyncio.run(get())

    return fetch


def flags_query(fmt: str, dev: str | None) -> dict[str, str]:
    """The ``/mesos/cli`` query for a format and a GPU selection."""
    query = {"format": fmt}
    if dev:
        query["dev"] = dev
    return query


def fetch_flags(node: str | None, fmt: str, dev: str | None, *, get: Fetch) -> FlagsLine:
    """The node's flags line, checked as Mesos would read it, and what it leaves out;
    raises ``ControllerError`` (``NodeError`` when the agent failed or refused)."""
    answer = get(node, "/mesos/cli", flags_query(fmt, dev))
    line = answer.body.decode("utf-8", "replace").strip()
    try:
        flags = parse_flag_line(line)
    except FlagsError as error:
        said = str(error)  # quotes the answer's word: a web page's, or megabytes, cut short
        if len(said) > MAX_QUOTED:
            said = said[: MAX_QUOTED - 1] + "…"
        raise ControllerError(
            f"{_node_name(node)}: the agent's /mesos/cli is not usable: {said}"
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


def node_or_default(node: str | None, options: Options) -> str | None:
    """NODE if given, else ``NV_HOST``, else None (the local agent)."""
    return node or (options.nv_host or "").strip() or None


def _node_name(node: str | None) -> str:
    return node or "local node"


@click.group(name="mesos")
def mesos() -> None:
    """Mesos agent flags of a node's GPUs: print, decode, or launch the agent with them."""


@mesos.command(name="flags")
@click.argument("node", required=False)
@request_options(FlagsRequest, "request")
@operator_options("tls_ca", "tls_cert", "tls_key", "token_file")
def flags_command(node: str | None, request: FlagsRequest, options: Options) -> None:
    """Print NODE's Mesos agent flags (NODE: NV_HOST grammar; default NV_HOST, else local).

    GPUs the line does not offer (MIG mode for --format native, ...) are named on stderr."""
    node = node_or_default(node, options)
    flags = fetch_flags(node, request.fmt, request.dev, get=fetcher(options))
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
        raise ControllerError(f"not a gpus blob: {error}") from None
    sys.stdout.buffer.write(document)
    sys.stdout.buffer.flush()


@mesos.command(
    name="exec",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@request_options(FlagsRequest, "request")
@request_options(ExecRequest, "run")
@operator_options("tls_ca", "tls_cert", "tls_key", "token_file")
def exec_command(
    command: tuple[str, ...], request: FlagsRequest, run: ExecRequest, options: Options
) -> None:
    """Run COMMAND (mesos-agent ARGS...) with the node's GPU flags merged into ARGS.

    --attributes and --resources are joined with the node's (Mesos refuses a flag given
    twice); for --format native, --isolation gets cgroups/devices, filesystem/linux and
    gpu/nvidia in an order every Mesos version accepts. The agent replaces this process.
    """
    program, *args = command
    node = node_or_default(run.node, options)
    flags = fetch_flags(node, request.fmt, request.dev, get=fetcher(options))
    report_left_out(node, flags)
    try:
        merged = merge_agent_args(args, flags.line, environ=dict(options.mesos_environment))
    except MergeError as error:
        raise UsageError(str(error)) from None
    if run.dry_run:
        click.echo(shlex.join([program, *merged]))
        return
    try:
        os.execvp(program, [program, *merged])  # noqa: S606 - exec is the point
    except OSError as error:
        raise ControllerError(
            f"cannot run {program}: {error.strerror}: check the command after --"
        ) from None
