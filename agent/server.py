"""One running agent: built once, in order, by ``start``; served until a signal; stopped.

Start-up, each step logged on one line (docs/agent.md, "Start-up"): bind the REST API's
address (an address in use is the first thing said), read the TLS and token files, make
sure the UVM device exists, start the GPU worker (NVML, or the simulated node) and discover
the GPUs, check that the state directory can be written (made if missing), find the driver
files of each volume, start the PCIe sampler, serve Docker's volume plugin API on the unix
socket, write the CDI spec (only once this agent owns its socket directory), open the lease
table and follow the engines, open the usage ledger, serve the REST API on TCP, check that
both servers answer, serve ``--engine-socket`` (when given), then follow the node and start
the ledger's ticks. Each part is built once, given what it needs when it is built; each
registers its own cleanup on the ``AsyncExitStack`` that ``run`` holds, so a start that
fails half-way undoes what it did, and a stop ends the parts in the reverse order. If the
plugin socket file is removed (checked every ``WATCH_INTERVAL_S``), the agent stops with
``EXIT_SERVER_STOPPED``. The first SIGINT/SIGTERM shuts down gracefully (the socket file is
removed); a second one exits at once; SIGHUP re-reads what can change (``Agent.reload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from agent import files
from agent.api import render_text
from agent.api.docker_cli import control_devices
from agent.api.fast_routes import fast_gets
from agent.api.leases import Cpusets
from agent.api.routes import create_app
from agent.attribution.docker_engine import DockerEngine
from agent.attribution.owners import Attributor
from agent.cdi_spec.writer import CdiSettings, CdiSpecWriter, find_linker_cache_hook, volume_builder
from agent.config import Config
from agent.edge import listen
from agent.edge.access import RemoteAccess
from agent.edge.connections import ConnectionGuard, ConnectionLimits
from agent.edge.descriptors import DescriptorBudget, descriptor_budget
from agent.edge.error_log import HttpErrorLog, loop_exception_handler
from agent.edge.fast_gets import FastGets
from agent.edge.plugin_socket import start_plugin_site
from agent.edge.readiness import NotAnswering, check_plugin, check_rest
from agent.engine_socket.cdi_form import CdiForm
from agent.engine_socket.gpus import GpuCreates
from agent.engine_socket.site import serve_engine_socket
from agent.engines.events import EngineEvents
from agent.errors import (
    EXIT_FORCED,
    EXIT_OK,
    EXIT_SERVER_STOPPED,
    EXIT_STARTUP_FAILED,
    StartupError,
)
from agent.gpu.backend import GpuBackendError
from agent.gpu.worker_client import WorkerClient
from agent.leases.settings import LeaseSettings
from agent.leasing.engine_feed import EngineFeed
from agent.leasing.service import LeaseService
from agent.leasing.start_gate import StartGate
from agent.metrics.agent_metrics import AgentMetrics
from agent.metrics.service import MetricsService
from agent.metrics.usage_families import usage_families
from agent.node.drivers import VolumeSetupError, prepare_volumes
from agent.node.facts import NodeFacts
from agent.node.life import DriverWatch, NodeLife
from agent.node.state import NodeState
from agent.node.status import StatusService
from agent.node.uvm import UvmError, ensure_uvm_device
from agent.process import notify, release_startup_memory
from agent.usage.idle import IdlePolicy
from agent.usage.ledger import LEDGER_FILE, UsageLedger, UsageSettings
from agent.usage.queries import LedgerUnreadable, newest_lease_number
from plugin.volumes import VolumeStore

log = logging.getLogger("nvidia-docker-plugin")

SHUTDOWN_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class ReloadStep:
    """One thing SIGHUP re-reads: ``name`` for the log, ``run`` does it (raises on failure)."""

    name: str
    run: Callable[[], Awaitable[None]]


async def start(config: Config, parts: contextlib.AsyncExitStack) -> Agent:
    """Build and start every part of the agent, in order; ``StartupError`` (one line)."""
    rest_sockets = await _bind_rest(config, parts)
    budget = _connection_budget(config)
    access = RemoteAccess.from_config(config)  # certificates and tokens: fail fast
    _check_uvm(config)
    watch = DriverWatch.for_daemon(simulate=config.simulate, ldcache=config.ldcache)
    worker = await _first_worker(watch, parts)
    node = worker.node_info()
    _check_state_dir(config)  # a node without a driver has stopped before: nothing made
    log.info("Finding the driver files of each volume (ld.so.cache: %s)", config.ldcache or "none")
    try:
        store = await asyncio.to_thread(
            prepare_volumes, config.volume_dir, node.driver_version, ldcache=config.ldcache
        )
    except VolumeSetupError as err:
        raise StartupError(str(err)) from None
    status = StatusService(worker, node, pcie_interval_s=config.pcie_interval_s)
    parts.push_async_callback(status.close)
    await status.sample_pcie()
    status.start_sampler()
    state = NodeState(NodeFacts(node, control_devices()))
    life = NodeLife(
        watch, worker, status=status, state=state, store=store, health_checks=config.health_checks
    )
    parts.push_async_callback(life.close)
    counters = AgentMetrics()
    counters.follow_certificate(access.certificate_expiry)  # TLS: its notAfter
    status.add_sweep_listener(counters.observe_sweep)
    store.build_listeners.append(counters.observe_volume_build)
    engines = _engines(config)  # one client per engine: its request limit is the engine's
    # The authorization plugin's gate: it allows everything until the lease table is open.
    table: asyncio.Future[LeaseService] = asyncio.get_running_loop().create_future()
    await _serve_plugin(config, store, parts, StartGate(engines[0], table))
    cdi = await _write_cdi_spec(config, store, state, parts)
    leases, feed, docker_events = await _leases(config, state, engines, parts)
    table.set_result(leases)
    attributor = Attributor(engines[0], podman=engines[1])
    usage, usage_off = await _usage(config, status, leases, attributor, parts)
    metrics = MetricsService(
        state,
        status,
        attributor=attributor,
        agent=counters,
        health=life.health,
        leases=leases.view,
        usage=lambda: usage_families(usage, metrics.hostname) if usage is not None else [],
    )
    parts.push_async_callback(metrics.close)
    guard = ConnectionGuard(
        "REST API",
        ConnectionLimits(config.header_timeout_s, config.idle_timeout_s, budget.max_connections),
        on_answer=counters.count,  # every answer, refusals included, is counted
    )
    app = create_app(
        state,
        status,
        # The guard first: every answer, refusals included, is progress and is counted;
        # then the token check (where --token-file asks for one).
        around=[guard.wrap, *access.wrappers],
        metrics=metrics,
        cdi=cdi,
        leases=leases,
        remote_lease_writes=access.authenticated,
        usage=usage,
        usage_off=usage_off,
        engines=feed.engines,
        engine_socket=config.engine_socket,
    )
    fast = fast_gets(app, counters.count_resource, access.token_free)
    bound = await _serve_rest(config, app, guard, fast, rest_sockets, access, parts)
    await _check_ready(config, access, bound)
    await _serve_engine_sockets(config, state, leases, docker_events, cdi, store, parts)
    await life.start()
    if usage is not None:
        usage.start()
    steps = [ReloadStep(name, run) for name, run in access.reloaders()]
    steps.append(ReloadStep("driver", life.reread))
    if cdi is not None:  # after the driver: the spec of the facts it found
        steps.append(ReloadStep("CDI spec", lambda: cdi.reload(state.facts)))
    release_startup_memory()
    log.info("Ready")
    notify(f"READY=1\nSTATUS=serving {len(node.devices)} GPU(s), driver {node.driver_version}")
    return Agent(config, life, steps)


async def _bind_rest(config: Config, parts: contextlib.AsyncExitStack) -> list[socket.socket]:
    """The REST API's address, bound (not yet served): in use is the first thing said."""
    sockets = await listen.bind(config.listen_host, config.listen_port)
    for sock in sockets:
        parts.callback(sock.close)
    return sockets


def _connection_budget(config: Config) -> DescriptorBudget:
    budget = descriptor_budget(
        config.max_connections,
        config.reserved_fds,
        engine_connections=config.engine_connections * config.engine_sockets,
    )
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
        config.header_timeout_s,
        config.idle_timeout_s,
    )
    return budget


def _check_uvm(config: Config) -> None:
    if config.simulate is not None:
        log.info("Simulated node: the UVM device check is skipped")
        return
    try:
        log.info("Checking the NVIDIA unified memory device: %s", ensure_uvm_device())
    except UvmError as err:
        raise StartupError(str(err)) from None


async def _first_worker(watch: DriverWatch, parts: contextlib.AsyncExitStack) -> WorkerClient:
    log.info("Initialising the GPU backend")
    try:
        worker = await watch.spawn()
    except GpuBackendError as err:
        raise StartupError(str(err)) from None
    parts.push_async_callback(worker.stop)  # a start that fails before the node's life
    log.info("GPU backend: %s (GPU worker, pid %s)", worker.name, worker.pid)
    node = worker.node_info()
    models = sorted({d.model or "unknown model" for d in node.devices})
    log.info(
        "Discovered %d GPU(s): %s; driver %s, CUDA %s",
        len(node.devices),
        ", ".join(models) or "none",
        node.driver_version,
        node.cuda_version,
    )
    log.info("MIG mode: %s", render_text.mig_summary(node))
    return worker


def _check_state_dir(config: Config) -> None:
    """The state directory, made if missing and found writable before a volume, a socket or
    the CDI spec is written: the lease table always keeps ``leases.json`` there (and the
    usage ledger its ``usage.db``, unless ``--usage-db`` or ``--no-usage-ledger``); one that
    is not would fail only at the first lease or sweep, the agent serving meanwhile."""
    kept = "the lease table's leases.json"
    if config.usage_ledger and config.usage_db is None:
        kept += f" and the usage ledger's {LEDGER_FILE}"
    try:
        files.writable_directory(config.state_dir, what="state directory")
    except files.UnusableFile as err:
        raise StartupError(
            f"cannot use the {err}: give --state-dir a directory the agent can create and "
            f"write (it holds {kept})"
        ) from None


async def _serve_plugin(
    config: Config, store: VolumeStore, parts: contextlib.AsyncExitStack, gate: StartGate
) -> None:
    log.info("Serving the plugin API on unix://%s", config.socket_path)
    try:
        runner = await start_plugin_site(
            store,
            config.socket_dir,
            spec_file=config.spec_file,
            limits=ConnectionLimits(config.header_timeout_s, config.idle_timeout_s),
            authz_gate=gate,
        )
    except OSError as err:
        raise StartupError(f"cannot serve the plugin socket {config.socket_path}: {err}") from None
    parts.push_async_callback(runner.cleanup)


async def _write_cdi_spec(
    config: Config, store: VolumeStore, state: NodeState, parts: contextlib.AsyncExitStack
) -> CdiSpecWriter | None:
    """The CDI spec, written now (a failure is retried, with backoff and at SIGHUP) and
    rewritten on every node change; None without ``--cdi-spec-dir``."""
    if config.cdi_spec_dir is None:
        return None
    settings = CdiSettings(
        config.cdi_spec_dir, config.cdi_dev_root, find_linker_cache_hook(), config.cdi_kind
    )
    # an unhealthy GPU leaves the spec's `all` (NodeFacts knows which, agent.node.life)
    cdi = CdiSpecWriter(
        settings,
        volume_builder(store),
        unhealthy=lambda facts: facts.unhealthy | facts.unhealthy_migs,
    )
    parts.push_async_callback(cdi.close)
    log.info("Writing the CDI spec %s (with the driver volume it mounts)", cdi.path)
    cdi.start(state.facts)
    await cdi.settled()
    state.subscribe(cdi.on_node_change)
    return cdi


async def _leases(
    config: Config,
    state: NodeState,
    engines: tuple[DockerEngine, DockerEngine],
    parts: contextlib.AsyncExitStack,
) -> tuple[LeaseService, EngineFeed, EngineEvents]:
    """The lease table: restored from the state directory, following the node's health and
    driver changes and the engines' container events (docs/leases.md); the feed of those
    events, and the Docker engine's, which read its facts too (``/engines/json``)."""
    settings = LeaseSettings(
        pending_s=config.lease_pending_s, grace_s=config.lease_grace_s, sharing=config.gpu_sharing
    )
    facts = state.facts
    numbered_above = await _ledger_lease_number(config)
    leases = LeaseService.open(
        facts.node, facts.health, settings, config.state_dir, numbered_above=numbered_above
    )
    parts.push_async_callback(leases.close)
    log.info("Leases: %s (state in %s)", leases.describe(), leases.state_file)
    feed = EngineFeed(leases)
    docker, podman = engines
    docker_events = feed.follow(docker, with_facts=True)  # its version and CDI spec dirs
    feed.follow(podman)
    seen = [facts.node]

    def on_node_change(facts: NodeFacts) -> None:
        if facts.node is seen[0]:
            leases.set_health(facts.health)
        else:  # a new driver, a MIG change: the containers' devices are read anew
            seen[0] = facts.node
            leases.set_node(facts.node, facts.health)
            feed.relist()

    state.subscribe(on_node_change)
    parts.push_async_callback(feed.close)
    feed.start()
    return leases, feed, docker_events


def _ledger_path(config: Config) -> Path:
    return config.usage_db or config.state_dir / LEDGER_FILE


async def _ledger_lease_number(config: Config) -> int:
    """The highest lease number the usage ledger names (0 without a ledger): new leases are
    numbered above it, so an agent whose lease state file is gone does not give a lease the
    id of one the ledger already names (docs/leases.md)."""
    if not config.usage_ledger:
        return 0
    try:
        return await asyncio.to_thread(newest_lease_number, _ledger_path(config))
    except LedgerUnreadable as err:
        log.warning("%s: new lease ids are numbered from the lease table alone", err)
        return 0


async def _usage(
    config: Config,
    status: StatusService,
    leases: LeaseService,
    attributor: Attributor,
    parts: contextlib.AsyncExitStack,
) -> tuple[UsageLedger | None, str | None]:
    """The usage ledger (docs/usage.md), or None and why there is none."""
    if not config.usage_ledger:
        log.info("Usage ledger: off (--no-usage-ledger)")
        return None, "the usage ledger is off on this node (--no-usage-ledger)"
    settings = UsageSettings(
        path=_ledger_path(config),
        interval_s=config.usage_interval_s,
        retention_s=config.usage_retention_days * 86400.0,
        max_bytes=config.usage_max_mib << 20,
        label_keys=config.usage_labels.keys,
        idle_after_s=config.idle_after_s,
        idle_policy=IdlePolicy(config.idle_policy),
    )
    ledger = UsageLedger.for_agent(settings, status, leases, attributor)
    parts.push_async_callback(ledger.close)
    log.info(
        "Usage ledger: %s, a sweep every %g s, holds kept %g days; idle after %g s, policy %s",
        settings.path,
        settings.interval_s,
        config.usage_retention_days,
        settings.idle_after_s,
        settings.idle_policy.value,
    )
    return ledger, None


async def _serve_engine_sockets(
    config: Config,
    state: NodeState,
    leases: LeaseService,
    docker: EngineEvents,
    cdi: CdiSpecWriter | None,
    store: VolumeStore,
    parts: contextlib.AsyncExitStack,
) -> None:
    """``--engine-socket``: the Docker Engine API of ``--docker-socket``, forwarded, GPU
    creates leased (in the CDI form where the engine reads the spec ``cdi`` writes: as
    ``docker``, its followed events, last read it, or as it answers).
    ``--podman-engine-socket``: the same for Podman's Docker-compatible service
    (``--podman-socket``), which ignores GPU requests itself and has no Docker volume
    plugins: always the device-node form, the driver volume's directory bound."""
    if config.engine_socket is not None and config.engine_socket == config.podman_engine_socket:
        raise StartupError(
            f"--engine-socket and --podman-engine-socket both name {config.engine_socket}: "
            "give each its own file"
        )
    if config.engine_socket is not None:
        form = None
        if cdi is not None:
            form = CdiForm(docker.engine, cdi, facts=lambda: docker.facts)
        creates = GpuCreates(
            leases, lambda: state.facts, Cpusets(), form, engine=str(docker.engine.socket_path)
        )
        await _serve_one_engine_socket(
            config, config.engine_socket, "--engine-socket", config.docker_socket, creates, parts
        )
    if config.podman_engine_socket is not None:
        creates = GpuCreates(
            leases,
            lambda: state.facts,
            Cpusets(),
            driver_volumes=lambda name: store.create(name, keep=True),
            engine=str(config.podman_socket),  # the feed's name of it: its socket's path
        )
        await _serve_one_engine_socket(
            config,
            config.podman_engine_socket,
            "--podman-engine-socket",
            config.podman_socket,
            creates,
            parts,
        )


async def _serve_one_engine_socket(
    config: Config,
    path: Path,
    flag: str,
    engine: Path,
    creates: GpuCreates,
    parts: contextlib.AsyncExitStack,
) -> None:
    """``path`` served (asked for by ``flag``), forwarded to ``engine``'s socket; closed
    with ``parts``. One line and a stop when it cannot be bound."""
    try:
        site = await serve_engine_socket(
            path,
            engine,
            creates,
            head_timeout_s=config.idle_timeout_s + config.header_timeout_s,
            max_connections=config.engine_connections,
            flag=flag,
        )
    except OSError as err:
        raise StartupError(f"cannot serve the engine socket {path} ({flag}): {err}") from None
    parts.push_async_callback(site.close)
    log.info(
        "Serving the Docker Engine API on unix://%s (%s), forwarded to unix://%s; GPU "
        "creates get leases",
        site.path,
        site.rights,
        engine,
    )


def _engines(config: Config) -> tuple[DockerEngine, DockerEngine]:
    """The Docker engine's client and Podman's, shared by the scrape's lookups and the
    lease table's feed."""
    return (
        DockerEngine(config.docker_socket),
        DockerEngine(config.podman_socket, what="Podman's API service"),
    )


async def _serve_rest(
    config: Config,
    app: web.Application,
    guard: ConnectionGuard,
    fast: FastGets,
    sockets: list[socket.socket],
    access: RemoteAccess,
    parts: contextlib.AsyncExitStack,
) -> list[tuple[str, int]]:
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        handle_signals=False,
        logger=HttpErrorLog("REST API"),
        keepalive_timeout=config.idle_timeout_s,
    )
    await runner.setup()
    parts.push_async_callback(runner.cleanup)
    bound = await listen.serve(
        runner,
        sockets,
        guard=guard,
        ssl_context=access.ssl_context,
        plain_loopback=access.plain_loopback,
        fast=fast,
    )
    log.info("Serving the REST API on %s: %s", config.listen, access.describe())
    access.warn_if_exposed([host for host, _ in bound], config.listen_port)
    return bound


async def _check_ready(config: Config, access: RemoteAccess, bound: list[tuple[str, int]]) -> None:
    """What is ordered after the agent at boot must find both servers answering."""
    try:
        await check_plugin(config.socket_path)
        await check_rest(
            bound[0],
            tls=access.ssl_context is not None,
            token=access.tokens is not None,
            mark=access.readiness_mark,
        )
    except NotAnswering as err:
        raise StartupError(str(err)) from None


class Agent:
    """A started agent: what SIGHUP re-reads, and the watch of its plugin socket."""

    def __init__(self, config: Config, life: NodeLife, reload_steps: list[ReloadStep]) -> None:
        self.config = config
        self.life = life
        self.reload_steps = reload_steps  # in order; see reload()
        self._reloading: asyncio.Task[None] | None = None

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

    async def serve(self, stopping: asyncio.Event) -> int:
        """Serve until ``stopping`` is set (a signal) or the plugin socket vanishes; the
        exit code."""
        code = EXIT_OK
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), WATCH_INTERVAL_S)
            if not stopping.is_set() and not self.config.socket_path.exists():
                log.error(
                    "The plugin socket %s was removed: stopping the REST API too",
                    self.config.socket_path,
                )
                code = EXIT_SERVER_STOPPED
                break
        if self._reloading is not None:
            self._reloading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reloading
        return code


async def run(config: Config) -> int:
    """Start, serve until a signal (or the plugin socket's removal), stop; returns the exit
    code."""
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(loop_exception_handler)
    stopping = asyncio.Event()
    signals_seen = 0
    agent: Agent | None = None

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            log.warning("Second %s: exiting now", signal.Signals(signum).name)
            os._exit(EXIT_FORCED)
        log.info("Received %s: shutting down", signal.Signals(signum).name)
        notify("STOPPING=1")
        stopping.set()

    def on_hangup() -> None:
        if agent is None:
            log.info("Received SIGHUP while starting: the start reads everything anyway")
        else:
            agent.request_reload()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    async with contextlib.AsyncExitStack() as parts:
        try:
            agent = await start(config, parts)
        except StartupError as err:
            log.error("Error: %s", err)
            code = EXIT_STARTUP_FAILED
        else:
            code = await agent.serve(stopping)
    log.info("Stopped")
    return code
