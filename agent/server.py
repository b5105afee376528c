"""One running agent: start-up in order, the two servers, the watch, and shutdown.

Start-up, each step logged on one line: make sure the UVM device exists, initialise NVML
(or load the simulated node), discover the GPUs, find the driver files of each volume,
serve Docker's volume plugin API on the unix socket and the REST API on TCP. If either
server stops, the other is stopped too. The first SIGINT/SIGTERM shuts down gracefully
(the socket file is removed); a second one exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from agent.api import render_text
from agent.api.docker_cli import control_devices
from agent.api.routes import create_app
from agent.attribution.docker_engine import DockerEngine
from agent.attribution.owners import Attributor
from agent.cdi_spec.writer import CdiSettings, CdiSpecWriter, find_linker_cache_hook, volume_builder
from agent.config import SOCKET_NAME, Config
from agent.edge.access import RemoteAccess
from agent.edge.connections import ConnectionGuard, ConnectionLimits
from agent.edge.descriptors import descriptor_budget
from agent.edge.error_log import HttpErrorLog, loop_exception_handler
from agent.edge.listen import listen
from agent.edge.plugin_socket import prepare_volumes, start_plugin_site
from agent.edge.readiness import NotAnswering, check_plugin, check_rest
from agent.errors import (
    EXIT_FORCED,
    EXIT_OK,
    EXIT_SERVER_STOPPED,
    EXIT_STARTUP_FAILED,
    StartupError,
)
from agent.gpu.backend import GpuBackendError
from agent.gpu.worker_client import WorkerClient
from agent.metrics.agent_metrics import AgentMetrics
from agent.metrics.health_hook import GpuHealth
from agent.metrics.service import MetricsService
from agent.node.facts import NodeFacts
from agent.node.life import NodeLife
from agent.node.state import NodeState
from agent.node.status import StatusService
from agent.node.uvm import UvmError, ensure_uvm_device
from agent.process import notify, release_startup_memory

log = logging.getLogger("nvidia-docker-plugin")

SHUTDOWN_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class ReloadStep:
    """One thing SIGHUP re-reads: ``name`` for the log, ``run`` does it (raises on failure)."""

    name: str
    run: Callable[[], Awaitable[None]]


class Agent:
    """One running agent: the backend, the node state, the two servers, and their shutdown."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # NVML lives in a child process, the GPU worker (agent.gpu.worker), that ``life``
        # replaces when the driver changes: read the current one as ``agent.backend``.
        self.life = NodeLife.for_daemon(simulate=config.simulate, ldcache=config.ldcache)
        self.status: StatusService | None = None
        self.node: NodeState | None = None
        self.metrics: MetricsService | None = None
        self.cdi: CdiSpecWriter | None = None
        self.runners: list[web.AppRunner] = []
        self.rest_connections: ConnectionGuard | None = None
        self.stopping = asyncio.Event()
        self.exit_code = EXIT_OK
        # What SIGHUP re-reads, in order (each part of the agent that can be refreshed
        # without a restart adds its step at start-up); see reload().
        self.reload_steps: list[ReloadStep] = []
        self._reloading: asyncio.Task[None] | None = None

    def _gpu_health(self) -> dict[int, GpuHealth]:
        """Each GPU's health and last XID, for /metrics (nothing before health is followed)."""
        monitor = self.life.health
        if monitor is None:
            return {}
        return {
            index: GpuHealth(health.healthy, xid)
            for index, (health, xid) in enumerate(
                zip(monitor.health, monitor.last_xids, strict=False)
            )
        }

    @property
    def backend(self) -> WorkerClient | None:
        """The GPU worker serving now (None while a driver upgrade has released the GPUs)."""
        return self.life.worker

    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        budget = descriptor_budget(cfg.max_connections, cfg.reserved_fds)
        if budget.lowered:
            log.warning(
                "--max-connections %d lowered to %d: the descriptor limit is %d and %d are "
                "reserved (raise LimitNOFILE= or ulimit -n for more)",
                budget.asked,
                budget.max_connections,
                budget.limit,
                budget.reserved,
            )
        log.info(
            "Connection limits: %d REST connections (descriptor limit %d, %d reserved), "
            "request headers within %g s, idle connections closed after %g s",
            budget.max_connections,
            budget.limit,
            budget.reserved,
            cfg.header_timeout_s,
            cfg.idle_timeout_s,
        )
        access = RemoteAccess.from_config(cfg)  # certificates and tokens: fail fast
        if cfg.simulate is None:
            try:
                log.info("Checking the NVIDIA unified memory device: %s", ensure_uvm_device())
            except UvmError as err:
                raise StartupError(str(err)) from None
        else:
            log.info("Simulated node: the UVM device check is skipped")

        log.info("Initialising the GPU backend")
        try:
            backend = await self.life.start()
        except GpuBackendError as err:
            raise StartupError(str(err)) from None
        log.info("GPU backend: %s (GPU worker, pid %s)", backend.name, backend.pid)

        node = backend.node_info()
        models = sorted({d.model or "unknown model" for d in node.devices})
        log.info(
            "Discovered %d GPU(s): %s; driver %s, CUDA %s",
            len(node.devices),
            ", ".join(models) or "none",
            node.driver_version,
            node.cuda_version,
        )
        log.info("MIG mode: %s", render_text.mig_summary(node))

        log.info("Finding the driver files of each volume (ld.so.cache: %s)", cfg.ldcache)
        store = await loop.run_in_executor(
            None,
            lambda: prepare_volumes(cfg.volume_dir, node.driver_version, ldcache=cfg.ldcache),
        )

        self.status = StatusService(backend, node, pcie_interval_s=cfg.pcie_interval_s)
        await self.status.sample_pcie()
        self.status.start_sampler()
        self.node = NodeState(NodeFacts(node, control_devices()))
        counters = AgentMetrics()
        counters.follow_certificate(access.certificate_expiry)  # TLS: its notAfter
        self.status.add_sweep_listener(counters.observe_sweep)
        store.build_listeners.append(counters.observe_volume_build)
        self.metrics = MetricsService(
            self.node,
            self.status,
            attributor=Attributor(
                DockerEngine(cfg.docker_socket),
                podman=DockerEngine(cfg.podman_socket, what="Podman's API service"),
            ),
            agent=counters,
            health=self._gpu_health,
        )
        socket_path = cfg.socket_dir / SOCKET_NAME
        log.info("Serving the plugin API on unix://%s", socket_path)
        try:
            self.runners.append(
                await start_plugin_site(
                    store,
                    cfg.socket_dir,
                    spec_file=cfg.spec_file,
                    limits=ConnectionLimits(cfg.header_timeout_s, cfg.idle_timeout_s),
                )
            )
        except OSError as err:
            raise StartupError(f"cannot serve the plugin socket {socket_path}: {err}") from None

        if cfg.cdi_spec_dir is not None:  # only once this agent owns its socket directory
            settings = CdiSettings(cfg.cdi_spec_dir, cfg.cdi_dev_root, find_linker_cache_hook())
            # an unhealthy GPU leaves the spec's `all` (NodeFacts knows which, agent.node.life)
            cdi = self.cdi = CdiSpecWriter(
                settings, volume_builder(store), unhealthy=lambda facts: facts.unhealthy
            )
            log.info("Writing the CDI spec %s (with the driver volume it mounts)", cdi.path)
            cdi.start(self.node.facts)  # a failure is retried, with backoff and at SIGHUP
            await cdi.settled()
            self.node.subscribe(cdi.on_node_change)

        where = f"{cfg.listen_host or '*'}:{cfg.listen_port}"
        log.info("Serving the REST API on %s: %s", where, access.describe())
        guard = ConnectionGuard(
            "REST API",
            ConnectionLimits(cfg.header_timeout_s, cfg.idle_timeout_s, budget.max_connections),
        )
        self.rest_connections = guard
        runner = web.AppRunner(
            # The guard's middleware first: every answer, refusals included, is progress;
            # then the token check, then the counters (refusals are requests too).
            create_app(
                self.node,
                self.status,
                middlewares=[guard.middleware, *access.middlewares, counters.middleware],
                metrics=self.metrics,
                cdi=self.cdi,
            ),
            access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            handle_signals=False,
            logger=HttpErrorLog("REST API"),
            keepalive_timeout=cfg.idle_timeout_s,
        )
        await runner.setup()
        self.runners.append(runner)
        bound = await listen(
            runner,
            cfg.listen_host,
            cfg.listen_port,
            guard=guard,
            ssl_context=access.ssl_context,
            plain_loopback=access.plain_loopback,
        )
        access.warn_if_exposed([host for host, _ in bound], cfg.listen_port)
        self.reload_steps += [ReloadStep(name, run) for name, run in access.reloaders()]
        try:  # what is ordered after the agent at boot must find both answering
            await check_plugin(socket_path)
            await check_rest(
                bound[0], tls=access.ssl_context is not None, token=access.tokens is not None
            )
        except NotAnswering as err:
            raise StartupError(str(err)) from None
        self.life.serve(status=self.status, node_state=self.node, store=store)
        self.reload_steps.append(ReloadStep("driver", self.life.reread))
        if self.cdi is not None:  # after the driver: the spec of the facts it found
            cdi, node_state = self.cdi, self.node
            self.reload_steps.append(ReloadStep("CDI spec", lambda: cdi.reload(node_state.facts)))
        release_startup_memory()
        log.info("Ready")
        notify(f"READY=1\nSTATUS=serving {len(node.devices)} GPU(s), driver {node.driver_version}")

    def request_reload(self) -> None:
        """SIGHUP: run the reload steps once; a SIGHUP during a reload is folded into it."""
        if self._reloading is not None and not self._reloading.done():
            log.info("Received SIGHUP during a reload: already re-reading")
            return
        self._reloading = asyncio.get_running_loop().create_task(self.reload(), name="reload")

    async def reload(self) -> None:
        """Re-read what can change while the agent runs; a failing step is logged (one line)
        and the agent keeps serving what it had."""
        log.info("Received SIGHUP: re-reading (%d step(s))", len(self.reload_steps))
        notify("RELOADING=1")
        try:
            for step in self.reload_steps:
                try:
                    await step.run()
                except Exception as err:
                    log.error("Reload: %s failed: %s; keeping the previous one", step.name, err)
        finally:
            notify("READY=1")

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
        if self._reloading is not None:
            self._reloading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reloading
        for runner in reversed(self.runners):
            with contextlib.suppress(Exception):
                await runner.cleanup()
        self.runners.clear()
        if self.metrics is not None:
            await self.metrics.close()
            self.metrics = None
        if self.cdi is not None:
            await self.cdi.close()
        if self.status is not None:
            await self.status.close()
        await self.life.close()


async def run(config: Config) -> int:
    """Start, serve until a signal (or a server's end), stop; returns the exit code."""
    agent = Agent(config)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(loop_exception_handler)
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            log.warning("Second %s: exiting now", signal.Signals(signum).name)
            os._exit(EXIT_FORCED)
        log.info("Received %s: shutting down", signal.Signals(signum).name)
        notify("STOPPING=1")
        agent.stopping.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, agent.request_reload)
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
