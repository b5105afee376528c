"""The command line of ``nvidia-docker-plugin``: flags (each with an env var) -> ``Config``.

A thin click command, as uvicorn's: it only builds the ``Config`` and hands it to
``agent.server.run``; ``--dump-node`` and ``-v`` answer and exit. Every option also reads
an ``NVIDIA_DOCKER_PLUGIN_*`` environment variable (the flag wins); docs/agent.md lists them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import traceback
from pathlib import Path

import click

from agent import __version__
from agent.config import (
    DEFAULT_LDCACHE,
    DEFAULT_LISTEN,
    DEFAULT_PCIE_INTERVAL_S,
    DEFAULT_SOCKET_DIR,
    DEFAULT_VOLUMES,
    SOCKET_NAME,
    Config,
    ListenAddressError,
    parse_listen,
)
from agent.errors import StartupError
from agent.event_loop import CHOICES as EVENT_LOOPS
from agent.event_loop import loop_factory
from agent.exit_codes import EXIT_OK, EXIT_STARTUP_FAILED
from agent.logs import PROG, debug_enabled, setup_logging

log = logging.getLogger(PROG)


def _listen(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str | None, int]:
    try:
        return parse_listen(value)
    except ListenAddressError as err:
        raise click.BadParameter(str(err)) from None


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
    help="Serve a simulated node from a node file (or a built-in: h200, h200x2, hgx-h200-8) "
    "instead of the GPUs NVML finds. Never used unless given.",
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
    "--event-loop",
    type=click.Choice(EVENT_LOOPS),
    default="auto",
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_EVENT_LOOP",
    show_envvar=True,
    help="auto: uvloop when it is installed (faster), else asyncio's own.",
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
    pcie_interval_s: float,
    event_loop: str,
    tls_cert: Path | None,
    tls_key: Path | None,
    tls_client_ca: Path | None,
    token_file: Path | None,
    dump_target: str | None,
) -> None:
    """The NVIDIA Docker node agent: GPU discovery, REST API and Docker volume plugin."""
    setup_logging()
    if dump_target is not None:
        from agent.dump_command import dump_node  # noqa: PLC0415 - only for this command

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
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        token_file=token_file,
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
