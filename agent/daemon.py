"""``nvidia-docker-plugin``: the GPU node agent.

Start-up, each step logged on one line: make sure the UVM device exists, initialise NVML
(or load the simulated node), discover the GPUs, find the driver files of each volume,
serve Docker's volume plugin API on the unix socket and the REST API on TCP. If either
server stops, the other is stopped too. The first SIGINT/SIGTERM shuts down gracefully
(the socket file is removed); a second one exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import gc
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
from aiohttp import web

from agent import __version__
from agent.backends import open_backend
from agent.docker_cli import control_devices
from agent.gpu.backend import GpuBackend, GpuBackendError
from agent.plugin_site import SOCKET_NAME, prepare_volumes, start_plugin_site
from agent.rest import NodeFacts, create_app
from agent.status_service import StatusService
from agent.uvm import UvmError, ensure_uvm_device

PROG = "nvidia-docker-plugin"
log = logging.getLogger(PROG)

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1  # driver absent, bad node file, address in use, ...
EXIT_USAGE = 2  # bad flags (click's own code)
EXIT_SERVER_STOPPED = 3  # one of the two servers stopped on its own
EXIT_FORCED = 130  # a second signal during shutdown

DEFAULT_LISTEN = "localhost:3476"
DEFAULT_VOLUMES = "/var/lib/nvidia-docker/volumes"
DEFAULT_SOCKET_DIR = "/run/docker/plugins"
SHUTDOWN_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 2.0


class StartupError(Exception):
    """A start-up step failed; the message is the one line the operator reads."""


@dataclass(frozen=True, slots=True)
class Config:
    listen_host: str | None  # None: every interface
    listen_port: int
    volume_dir: Path
    socket_dir: Path
    simulate: str | None
    ldcache: Path
    pcie_interval_s: float
    spec_file: Path | None = None


def loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """The event loop to serve with: uvloop when asked for or, with ``auto``, when installed."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop  # noqa: PLC0415 - optional, faster event loop
        except ImportError:
            if choice == "uvloop":
                raise StartupError("--event-loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.new_event_loop, "uvloop"
    return None, "asyncio"


def parse_listen(value: str) -> tuple[str | None, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (every interface)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r}: expected HOST:PORT, e.g. localhost:3476")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host or None), int(port)


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"{PROG} | %(asctime)s %(message)s", datefmt="%Y/%m/%d %H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if os.environ.get("NV_DEBUG") else logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def release_startup_memory() -> None:
    """Give back to the kernel the heap that start-up used (ELF parsing, NVML discovery).

    glibc keeps freed memory in its arenas; the agent then runs for months with that
    resident. ``malloc_trim`` returns it. A no-op where libc has no such call.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# A name such as localhost can resolve to an address this node cannot bind (::1 where IPv6
# is disabled): such addresses are skipped as long as one of the name's addresses works.
_UNBINDABLE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


async def listen(runner: web.AppRunner, host: str | None, port: int) -> None:
    """Serve ``runner`` on every address of ``host`` (all interfaces for None)."""
    where = f"{host or '*'}:{port}"
    if host is None:
        addresses: list[str | None] = [None]
    else:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
        except OSError as err:
            raise StartupError(f"cannot listen on {where}: {err} (check -l)") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    started = 0
    for address in addresses:
        try:
            await web.TCPSite(runner, address, port, reuse_address=True).start()
        except OSError as err:
            if err.errno in _UNBINDABLE and len(addresses) > 1:
                log.warning("Not listening on %s port %d: %s", address, port, err.strerror)
                continue
            raise StartupError(
                f"cannot listen on {where}: {err.strerror or err} (is another agent running? "
                "choose another address with -l)"
            ) from None
        started += 1
    if not started:
        raise StartupError(f"cannot listen on {where}: none of its addresses can be bound")


class Agent:
    """One running agent: the backend, the two servers, and their shutdown."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.backend: GpuBackend | None = None
        self.status: StatusService | None = None
        self.runners: list[web.AppRunner] = []
        self.stopping = asyncio.Event()
        self.exit_code = EXIT_OK

    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        if cfg.simulate is None:
            try:
                log.info("Checking the NVIDIA unified memory device: %s", ensure_uvm_device())
            except UvmError as err:
                raise StartupError(str(err)) from None
        else:
            log.info("Simulated node: the UVM device check is skipped")

        log.info("Initialising the GPU backend")
        try:
            self.backend = await loop.run_in_executor(None, open_backend, cfg.simulate)
        except GpuBackendError as err:
            raise StartupError(str(err)) from None
        log.info("GPU backend: %s", self.backend.name)

        node = self.backend.node_info()
        models = sorted({d.model or "unknown model" for d in node.devices})
        log.info(
            "Discovered %d GPU(s): %s; driver %s, CUDA %s",
            len(node.devices),
            ", ".join(models) or "none",
            node.driver_version,
            node.cuda_version,
        )

        log.info("Finding the driver files of each volume (ld.so.cache: %s)", cfg.ldcache)
        store = await loop.run_in_executor(
            None,
            lambda: prepare_volumes(cfg.volume_dir, node.driver_version, ldcache=cfg.ldcache),
        )

        self.status = StatusService(self.backend, node, pcie_interval_s=cfg.pcie_interval_s)
        await self.status.sample_pcie()
        self.status.start_sampler()
        facts = NodeFacts(node, control_devices())

        socket_path = cfg.socket_dir / SOCKET_NAME
        log.info("Serving the plugin API on unix://%s", socket_path)
        try:
            self.runners.append(
                await start_plugin_site(store, cfg.socket_dir, spec_file=cfg.spec_file)
            )
        except OSError as err:
            raise StartupError(f"cannot serve the plugin socket {socket_path}: {err}") from None

        where = f"{cfg.listen_host or '*'}:{cfg.listen_port}"
        log.info("Serving the REST API on %s", where)
        runner = web.AppRunner(
            create_app(facts, self.status),
            access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            handle_signals=False,
        )
        await runner.setup()
        self.runners.append(runner)
        await listen(runner, cfg.listen_host, cfg.listen_port)
        release_startup_memory()
        log.info("Ready")

    async def watch(self) -> None:
        """Wait for a signal, or for the plugin socket to vanish (then stop with an error)."""
        socket_path = self.config.socket_dir / SOCKET_NAME
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), WATCH_INTERVAL_S)
            if not self.stopping.is_set() and not socket_path.exists():
                log.error(
                    "The plugin socket %s was removed: stopping the REST API too", socket_path
                )
                self.exit_code = EXIT_SERVER_STOPPED
                self.stopping.set()

    async def stop(self) -> None:
        for runner in reversed(self.runners):
            with contextlib.suppress(Exception):
                await runner.cleanup()
        self.runners.clear()
        if self.status is not None:
            await self.status.close()
        if self.backend is not None:
            self.backend.close()
            self.backend = None


async def run(config: Config) -> int:
    agent = Agent(config)
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            log.warning("Second %s: exiting now", signal.Signals(signum).name)
            os._exit(EXIT_FORCED)
        log.info("Received %s: shutting down", signal.Signals(signum).name)
        agent.stopping.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await agent.start()
        await agent.watch()
    except StartupError as err:
        log.error("Error: %s", err)
        agent.exit_code = EXIT_STARTUP_FAILED
    finally:
        await agent.stop()
    log.info("Stopped")
    return agent.exit_code


def dump_node(simulate: str | None, target: str) -> int:
    """``--dump-node``: write this node's facts as a node file, for ``--simulate``."""
    from agent.gpu.dump import dump_node as dump  # noqa: PLC0415 - only for this command
    from agent.gpu.dump import write_node_file  # noqa: PLC0415

    try:
        backend = open_backend(simulate)
    except GpuBackendError as err:
        log.error("Error: %s", err)
        return EXIT_STARTUP_FAILED
    try:
        data = dump(backend)
    finally:
        backend.close()
    try:
        write_node_file(data, target)
    except OSError as err:
        log.error("Error: cannot write the node file %s: %s", target, err)
        return EXIT_STARTUP_FAILED
    if target != "-":
        log.info("Wrote the node file %s", target)
    return EXIT_OK


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"NVIDIA Docker plugin: {__version__}")
        ctx.exit(EXIT_OK)


@click.command(name=PROG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-l",
    "--listen",
    default=DEFAULT_LISTEN,
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
    default="/etc/ld.so.cache",
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
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.05),
    envvar="NVIDIA_DOCKER_PLUGIN_PCIE_INTERVAL",
    show_envvar=True,
    help="Seconds between two samples of the slow counters (PCIe throughput, BAR1 usage).",
)
@click.option(
    "--event-loop",
    type=click.Choice(["auto", "asyncio", "uvloop"]),
    default="auto",
    show_default=True,
    envvar="NVIDIA_DOCKER_PLUGIN_EVENT_LOOP",
    show_envvar=True,
    help="auto: uvloop when it is installed (faster), else asyncio's own.",
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
    listen: str,
    volume_dir: Path,
    socket_dir: Path,
    simulate: str | None,
    ldcache: Path,
    spec_file: Path | None,
    pcie_interval_s: float,
    event_loop: str,
    dump_target: str | None,
) -> None:
    """The NVIDIA Docker node agent: GPU discovery, REST API and Docker volume plugin."""
    setup_logging()
    if dump_target is not None:
        sys.exit(dump_node(simulate, dump_target))
    host, port = parse_listen(listen)
    config = Config(
        listen_host=host,
        listen_port=port,
        volume_dir=volume_dir,
        socket_dir=socket_dir,
        simulate=simulate,
        ldcache=ldcache,
        pcie_interval_s=pcie_interval_s,
        spec_file=spec_file,
    )
    try:
        factory, loop_name = loop_factory(event_loop)
    except StartupError as err:
        log.error("Error: %s", err)
        sys.exit(EXIT_STARTUP_FAILED)
    log.info("Event loop: %s", loop_name)
    with asyncio.Runner(loop_factory=factory) as runner:
        sys.exit(runner.run(run(config)))


def main() -> None:
    try:
        command.main(prog_name=PROG)
    except SystemExit:
        raise
    except Exception as err:  # one line, unless NV_DEBUG asks for the traceback
        if os.environ.get("NV_DEBUG"):
            traceback.print_exc()
        print(f"{PROG} | Error: {err}", file=sys.stderr)
        sys.exit(EXIT_STARTUP_FAILED)


if __name__ == "__main__":
    main()
