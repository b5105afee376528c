"""The command line of ``nvidia-docker-plugin``: flags (each with an env var) -> ``Config``.

A thin click command, as uvicorn's: it only builds the ``Config`` and hands it to
``agent.server.run``; ``--dump-node`` and ``-v`` answer and exit. Every option also reads
an ``NVIDIA_DOCKER_PLUGIN_*`` environment variable (the flag wins); docs/agent.md lists them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import traceback
from pathlib import Path

import click
from click.core import ParameterSource

from agent import __version__
from agent.config import (
    DEFAULT_CDI_SPEC_DIR,
    DEFAULT_DOCKER_SOCKET,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_LDCACHE,
    DEFAULT_LISTEN,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PCIE_INTERVAL_S,
    DEFAULT_PODMAN_SOCKET,
    DEFAULT_RESERVED_FDS,
    DEFAULT_SOCKET_DIR,
    DEFAULT_VOLUMES,
    SOCKET_NAME,
    Config,
    ListenAddressError,
    parse_listen,
)
from agent.errors import EXIT_OK, EXIT_STARTUP_FAILED, StartupError
from agent.logs import PROG, debug_enabled, setup_logging
from agent.process import CHOICES as EVENT_LOOPS
from agent.process import loop_factory

log = logging.getLogger(PROG)


def _listen(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str | None, int]:
    try:
        return parse_listen(value)
    except ListenAddressError as err:
        raise click.BadParameter(str(err)) from None


CDI_SPEC_DIR_ENV = "NVIDIA_DOCKER_PLUGIN_CDI_SPEC_DIR"


def _cdi_spec_dir(ctx: click.Context, param: click.Parameter, value: str) -> Path | None:
    """Empty turns the spec off, as a flag or in the environment: click takes an empty
    variable for an unset one (and would use the default), so that case is read here."""
    from_default = param.name is not None and (
        ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT
    )
    if from_default and os.environ.get(CDI_SPEC_DIR_ENV) == "":
        return None
    return Path(value) if value else None


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"NVIDIA Docker plugin: {__version__}")
        ctx.exit(EXIT_OK)


@click.command(name=PROG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-l",
    "--listen",
    default=DEFAULT_LISTEN,
    callback=_listen,
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_LISTEN",
    show_envvar=True,
    help="Address of the REST API (HOST:PORT, [IPv6]:PORT, or :PORT for every interface).",
)
@click.option(
    "-d",
    "--volumes",
    "volume_dir",
    default=DEFAULT_VOLUMES,
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_VOLUMES",
    show_envvar=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory where the driver volumes are stored.",
)
@click.option(
    "-s",
    "--socket-dir",
    default=DEFAULT_SOCKET_DIR,
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_SOCKET_DIR",
    show_envvar=True,
    type=click.Path(file_okay=False, path_type=Path),
    help=f"Directory of the plugin socket {SOCKET_NAME}.",
)
@click.option(
    "--simulate",
    metavar="FILE",
    envvar="NVIDIA_DOCKER_PLUGIN_SIMULATE",
    show_envvar=True,
    help="Serve a simulated node from a node file (or a built-in: h200, h200x2, hgx-h200-8, "
    "h200x2-mig) instead of the GPUs NVML finds. Never used unless given.",
)
@click.option(
    "--ldcache",
    default=DEFAULT_LDCACHE,
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_LDCACHE",
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The dynamic linker cache that locates the driver's libraries.",
)
@click.option(
    "--spec-file",
    envvar="NVIDIA_DOCKER_PLUGIN_SPEC_FILE",
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write this Docker plugin spec file (unix://<socket>) while serving, for a socket "
    "outside /run/docker/plugins; e.g. /etc/docker/plugins/nvidia-docker.spec.",
)
@click.option(
    "--cdi-spec-dir",
    default=DEFAULT_CDI_SPEC_DIR,
    show_default=True,
    callback=_cdi_spec_dir,
    envvar=CDI_SPEC_DIR_ENV,
    show_envvar=True,
    help="Write the CDI spec of kind nvidia.com/gpu (nvidia-docker.json) into this "
    "directory and keep it current, for Podman and Docker 25+; empty: no spec.",
)
@click.option(
    "--cdi-dev-root",
    default="/",
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_CDI_DEV_ROOT",
    show_envvar=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the device nodes the CDI spec names are on this host (a driver container "
    "that makes them under its own root, e.g. /run/nvidia/driver).",
)
@click.option(
    "--pcie-interval",
    "pcie_interval_s",
    default=DEFAULT_PCIE_INTERVAL_S,
    show_default=True,
    type=click.FloatRange(min=0.05),
    envvar="NVIDIA_DOCKER_PLUGIN_PCIE_INTERVAL",
    show_envvar=True,
    help="Seconds between two samples of the slow counters (PCIe throughput, BAR1 usage).",
)
@click.option(
    "--docker-socket",
    default=DEFAULT_DOCKER_SOCKET,
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_DOCKER_SOCKET",
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The Docker engine's API socket, asked for the name and image of containers "
    "using GPUs (/metrics, /gpu/processes/json). If it does not answer, containers are "
    "shown by id.",
)
@click.option(
    "--podman-socket",
    default=DEFAULT_PODMAN_SOCKET,
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_PODMAN_SOCKET",
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Podman's API socket (podman system service, the podman.socket unit), asked the "
    "same for Podman containers using GPUs. Without it, they are shown by id.",
)
@click.option(
    "--event-loop",
    type=click.Choice(EVENT_LOOPS),
    default="auto",
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_EVENT_LOOP",
    show_envvar=True,
    help="auto: uvloop when it is installed (faster), else asyncio's own.",
)
@click.option(
    "--header-timeout",
    "header_timeout_s",
    default=DEFAULT_HEADER_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(min=0.1),
    envvar="NVIDIA_DOCKER_PLUGIN_HEADER_TIMEOUT",
    show_envvar=True,
    help="Seconds a client has to send a request's header (both servers), from the "
    "connection's opening or the first byte of its next request.",
)
@click.option(
    "--idle-timeout",
    "idle_timeout_s",
    default=DEFAULT_IDLE_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(min=0.1),
    envvar="NVIDIA_DOCKER_PLUGIN_IDLE_TIMEOUT",
    show_envvar=True,
    help="Seconds a kept-alive connection may wait for its next request (both servers).",
)
@click.option(
    "--max-connections",
    default=DEFAULT_MAX_CONNECTIONS,
    show_default=True,
    type=click.IntRange(min=1),
    envvar="NVIDIA_DOCKER_PLUGIN_MAX_CONNECTIONS",
    show_envvar=True,
    help="Most REST connections open at once (at most the descriptor limit minus "
    "--reserved-fds); beyond it, the one longest without a request is dropped.",
)
@click.option(
    "--reserved-fds",
    default=DEFAULT_RESERVED_FDS,
    show_default=True,
    type=click.IntRange(min=0),
    envvar="NVIDIA_DOCKER_PLUGIN_RESERVED_FDS",
    show_envvar=True,
    help="File descriptors kept from REST connections, for the plugin socket, volume "
    "builds and the daemon itself.",
)
@click.option(
    "--tls-cert",
    metavar="FILE",
    envvar="NVIDIA_DOCKER_PLUGIN_TLS_CERT",
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Serve the REST API over TLS with this PEM certificate (chain); needs --tls-key. "
    "Re-read on SIGHUP.",
)
@click.option(
    "--tls-key",
    metavar="FILE",
    envvar="NVIDIA_DOCKER_PLUGIN_TLS_KEY",
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The PEM private key of --tls-cert (mode 0600 or 0640).",
)
@click.option(
    "--tls-client-ca",
    metavar="FILE",
    envvar="NVIDIA_DOCKER_PLUGIN_TLS_CLIENT_CA",
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Mutual TLS: only clients with a certificate signed by this CA (PEM) get an answer.",
)
@click.option(
    "--token-file",
    metavar="FILE",
    envvar="NVIDIA_DOCKER_PLUGIN_TOKEN_FILE",
    show_envvar=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Bearer tokens, one per line (two during a rotation): every request must send one "
    "(Authorization: Bearer TOKEN). Re-read on SIGHUP.",
)
@click.option(
    "--plain-loopback/--no-plain-loopback",
    default=True,
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_PLAIN_LOOPBACK",
    show_envvar=True,
    help="With TLS or tokens on: connections to a loopback address (curl localhost:3476 on "
    "the node, SSH tunnels) may still use plain HTTP without a token, on the same port.",
)
@click.option(
    "--dump-node",
    "dump_target",
    metavar="FILE",
    help="Write this node's GPU facts as a node file (- for stdout) and exit.",
)
@click.option(
    "-v",
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the version and exit.",
)
def command(
    listen: tuple[str | None, int],
    volume_dir: Path,
    socket_dir: Path,
    simulate: str | None,
    ldcache: Path,
    spec_file: Path | None,
    cdi_spec_dir: Path | None,
    cdi_dev_root: Path,
    pcie_interval_s: float,
    docker_socket: Path,
    podman_socket: Path,
    event_loop: str,
    header_timeout_s: float,
    idle_timeout_s: float,
    max_connections: int,
    reserved_fds: int,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_client_ca: Path | None,
    token_file: Path | None,
    plain_loopback: bool,
    dump_target: str | None,
) -> None:
    """The NVIDIA Docker node agent: GPU discovery, REST API and Docker volume plugin."""
    setup_logging()
    if dump_target is not None:
        sys.exit(dump_node(simulate, dump_target))
    host, port = listen
    _check_tls_options(tls_cert, tls_key, tls_client_ca)
    config = Config(
        listen_host=host,
        listen_port=port,
        volume_dir=volume_dir,
        socket_dir=socket_dir,
        simulate=simulate,
        ldcache=ldcache,
        pcie_interval_s=pcie_interval_s,
        spec_file=spec_file,
        docker_socket=docker_socket,
        podman_socket=podman_socket,
        header_timeout_s=header_timeout_s,
        idle_timeout_s=idle_timeout_s,
        max_connections=max_connections,
        reserved_fds=reserved_fds,
        cdi_spec_dir=cdi_spec_dir,
        cdi_dev_root=cdi_dev_root,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        token_file=token_file,
        plain_loopback=plain_loopback,
    )
    try:
        factory, loop_name = loop_factory(event_loop)
    except StartupError as err:
        log.error("Error: %s", err)
        sys.exit(EXIT_STARTUP_FAILED)
    log.info("Event loop: %s", loop_name)
    from agent.server import run  # noqa: PLC0415 - aiohttp and NVML only when serving

    with asyncio.Runner(loop_factory=factory) as runner:
        sys.exit(runner.run(run(config)))


def _check_tls_options(cert: Path | None, key: Path | None, client_ca: Path | None) -> None:
    if (cert is None) != (key is None):
        raise click.UsageError("--tls-cert and --tls-key go together: give both, or neither")
    if client_ca is not None and cert is None:
        raise click.UsageError("--tls-client-ca needs TLS: give --tls-cert and --tls-key too")


def main() -> None:
    """Console script ``nvidia-docker-plugin``."""
    try:
        command.main(prog_name=PROG)
    except SystemExit:
        raise
    except Exception as err:  # one line, unless NV_DEBUG asks for the traceback
        if debug_enabled():
            traceback.print_exc()
        print(f"{PROG} | Error: {err}", file=sys.stderr)
        sys.exit(EXIT_STARTUP_FAILED)


def dump_node(simulate: str | None, target: str) -> int:
    """``--dump-node FILE``: read the node (NVML, or ``simulate``), write it as a node file
    to ``target`` (``-``: stdout); the exit code (docs/agent.md), with one log line for an
    error or for what was written."""
    from agent.gpu.dump import dump_to  # noqa: PLC0415 - only for this command

    def report(line: str) -> None:
        (log.error if line.startswith("Error") else log.info)("%s", line)

    return dump_to(simulate, target, report)
