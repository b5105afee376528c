"""The node's life: the GPU worker follows the driver through upgrades, and comes back if it dies.

Once a second (and at ``SIGHUP``, and at once when NVML says the driver went away) the
daemon looks at the installed driver (the linker cache) and the loaded one (the kernel
module; the node file with ``--simulate``), ``agent.node.drivers``:

- **release**: the installed files no longer match the library the worker loaded (a
  package upgrade), or another module is loaded, or NVML reports the driver gone. The daemon
  stops the worker, which closes every ``/dev/nvidia*`` it held, so the old module can be
  unloaded; one log line; status and health answer 503 "driver upgrade in progress";
  ``/gpu/info``, ``/docker/cli`` and ``/mesos/cli`` keep serving the last facts.
- **pick-up**: a module is loaded and the installed files match it. A new worker starts on
  the new library; the plugin finds the new driver's files (``nvidia_driver_<new>`` can be
  created, old names mount it), status resumes, the node's facts are swapped
  (``NodeState.replace``), every GPU's health starts afresh; one log line. If NVML refuses
  ("driver not loaded", "versions differ": not yet), it is tried again at the next look.
- a worker that exits or stops answering is restarted the same way, with 503 "GPU worker
  restarting" meanwhile: every call to the worker has a deadline (``WorkerClient``,
  3 s), a ping each look included, so a hung worker (NVML stuck, the process stopped) is
  killed and replaced within about 4 s even when no request asks, and the requests that
  were waiting on it get the 503 at once. A worker that exits again within
  ``RESTART_STABLE_S`` of its start (NVML crashing in a loop) is started after a pause that
  doubles from 1 s up to ``RESTART_BACKOFF_MAX_S``; the exit's log line says when.

A look where nothing changed costs two ``stat``-like calls, a ``realpath`` and one ping.
docs/node-life.md is the operator's page.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.api.docker_cli import control_devices
from agent.gpu import nodefile
from agent.gpu.backend import GpuBackendError
from agent.gpu.model import NodeInfo
from agent.gpu.worker_client import WorkerClient, WorkerFailed
from agent.health.monitor import HealthMonitor
from agent.health.policy import DEFAULT_POLICY, HealthPolicy
from agent.node.drivers import InstalledDriver, LoadedModule, SimulatedModule, refresh_volumes
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import BACKEND_GONE, StatusService
from agent.node.uvm import UvmError, ensure_uvm_device
from agent.process import notify_status as tell_systemd
from plugin.volumes import VolumeStore

log = logging.getLogger("nvidia-docker-plugin")

UPGRADE_IN_PROGRESS = "driver upgrade in progress"
WORKER_RESTARTING = BACKEND_GONE
POLL_INTERVAL_S = 1.0
# A worker that exits within RESTART_STABLE_S of its start, after another did, is started
# again after a pause: 1 s, then twice as long each time, at most RESTART_BACKOFF_MAX_S.
RESTART_STABLE_S = 60.0
RESTART_BACKOFF_MAX_S = 30.0
# nvmlInit's "not yet" answers while a driver is being replaced.
NOT_YET_CODES = frozenset({9, 18})  # driver not loaded, library/module versions differ

Spawn = Callable[[], Awaitable[WorkerClient]]


class VersionSource(Protocol):
    def version(self, *, force: bool = False) -> str | None: ...


@dataclass(frozen=True, slots=True)
class DriverWatch:
    """How the daemon looks at the driver and starts GPU workers."""

    spawn: Spawn  # a new GPU worker; ``GpuBackendError`` (one line) when it cannot start
    installed: VersionSource  # the driver the linker cache names
    loaded: VersionSource  # the loaded kernel module (the node file with --simulate)
    ldcache: Path | None
    simulated: bool
    poll_interval_s: float = POLL_INTERVAL_S

    @classmethod
    def for_daemon(
        cls, *, simulate: str | None, ldcache: Path | None, health_interval_s: float = 1.0
    ) -> DriverWatch:
        """The daemon's: real module and linker cache, or the node file with ``--simulate``."""

        async def spawn() -> WorkerClient:
            return await WorkerClient.spawn(simulate=simulate, health_interval_s=health_interval_s)

        loaded: VersionSource = LoadedModule()
        if simulate is not None:
            loaded = SimulatedModule(nodefile.resolve(simulate))
        return cls(spawn, InstalledDriver(ldcache), loaded, ldcache, simulate is not None)


class NodeLife:
    """Follows the node from its first GPU worker on: health into ``state``, the driver's
    changes into ``status``, ``state`` and ``store``; replaces the worker when it must go."""

    def __init__(
        self,
        watch: DriverWatch,
        worker: WorkerClient,
        *,
        status: StatusService,
        state: NodeState,
        store: VolumeStore,
        health_checks: HealthPolicy = DEFAULT_POLICY,
    ) -> None:
        self._watch = watch
        self.worker: WorkerClient | None = worker  # None while the GPUs are released
        self.node: NodeInfo = worker.node_info()  # the last driver's facts, kept when released
        self._status, self._state, self._store = status, state, store
        self._tracked = False  # the installed files matched the running driver
        self._module_known = False  # the loaded module's version can be read here
        self._released_at: float | None = None
        self._started_at = time.monotonic()  # when the running worker was started
        self._quick_exits = 0  # workers in a row that exited within RESTART_STABLE_S
        self._restart_at = 0.0  # no worker is started before this (time.monotonic())
        self._driver_error: int | None = None
        self._waiting: str | None = None  # the last "waiting because" logged
        self._lock = asyncio.Lock()
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.health = HealthMonitor(
            len(self.node.devices),
            on_change=self._publish,
            on_driver_error=self._on_driver_error,
            policy=health_checks,
        )
        self.health.follow(worker)
        self._watch_exit(worker)

    @property
    def released(self) -> bool:
        return self.worker is None

    # -- start and stop --------------------------------------------------------------------

    async def start(self) -> None:
        """Look at the driver once (what the first worker runs on), then once a second."""
        installed, loaded = await self._look(force=True)
        self._tracked = installed == self.node.driver_version
        self._module_known = loaded is not None
        self._task = asyncio.get_running_loop().create_task(self._watch_loop(), name="driver")

    async def close(self) -> None:
        self._closing = True  # a worker that ends from now on is not restarted
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.worker is not None:
            await self.worker.stop()
            self.worker = None

    async def reread(self) -> None:
        """SIGHUP: look at the driver now (files re-read); changes nothing if nothing changed."""
        async with self._lock:
            before = self.node
            await self._poll(force=True)
            node = self.node
            if self.released or node is not before:
                return
            if self._store.driver_version != node.driver_version:
                await self._refresh_volumes(node)  # they could not be found at the pick-up
            log.info("Reload: driver %s, unchanged", node.driver_version)

    # -- the watch -------------------------------------------------------------------------

    async def _watch_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self._watch.poll_interval_s)
            self._poke.clear()
            try:
                async with self._lock:
                    await self._poll(force=False)
            except Exception as err:  # the watch must never stop; the next look retries
                log.error("Following the driver failed: %s: %s", type(err).__name__, err)
                log.debug("Following the driver failed", exc_info=True)

    def _watch_exit(self, worker: WorkerClient) -> None:
        """When ``worker`` ends unasked, status says so at once and the next look is now."""

        def ended(_: object) -> None:
            if worker is self.worker and not self._closing:
                self._status.suspend(WORKER_RESTARTING)
                self._poke.set()

        asyncio.ensure_future(worker.closed.wait()).add_done_callback(ended)

    def _on_driver_error(self, code: int) -> None:
        self._driver_error = code
        self._poke.set()

    async def _look(self, *, force: bool) -> tuple[str | None, str | None]:
        def look() -> tuple[str | None, str | None]:
            return self._watch.installed.version(force=force), self._watch.loaded.version(
                force=force
            )

        return await asyncio.to_thread(look)

    async def _poll(self, *, force: bool) -> None:
        installed, loaded = await self._look(force=force)
        if self.worker is not None:
            why = await self._release_reason(self.worker, installed, loaded)
            if why is None:
                return
            await self._release(*why)
        if not force and time.monotonic() < self._restart_at:
            return  # a worker that keeps exiting: the pause its exit's line announced
        await self._try_pick_up(installed, loaded)

    async def _release_reason(
        self, worker: WorkerClient, installed: str | None, loaded: str | None
    ) -> tuple[str, str] | None:
        """(log line, 503 text) when the worker must go; None when all is well."""
        version = self.node.driver_version
        if worker.closed.is_set():
            return (f"{worker.exit_reason}: restarting it", WORKER_RESTARTING)
        if self._driver_error is not None:
            code, self._driver_error = self._driver_error, None
            return (f"NVML says the driver went away (NVML error {code})", UPGRADE_IN_PROGRESS)
        if self._tracked and installed != version:
            what = f"{version} -> {installed}" if installed else f"{version} removed"
            return (f"The installed NVIDIA driver changed ({what})", UPGRADE_IN_PROGRESS)
        if self._module_known and loaded is not None and loaded != version:
            return (
                f"The loaded NVIDIA kernel module is {loaded}, not {version}",
                UPGRADE_IN_PROGRESS,
            )
        try:
            await worker.ping()  # a hung worker misses its deadline: killed, WorkerGone
        except Exception:  # it just went away (or was killed): its exit reason says how
            return (
                f"{worker.exit_reason or 'the GPU worker stopped'}: restarting it",
                WORKER_RESTARTING,
            )
        return None

    async def _release(self, why: str, answer: str) -> None:
        worker = self.worker
        assert worker is not None, "only a running worker is released"
        self._status.suspend(answer)
        self.health.forget()
        self.worker = None
        self._released_at = time.monotonic()
        self._waiting = None
        await worker.stop()
        tell_systemd(f"{answer}: {why}")
        if answer == WORKER_RESTARTING:
            why = self._restart_pause(why)
        else:
            self._quick_exits, self._restart_at = 0, 0.0
        if answer == UPGRADE_IN_PROGRESS:
            log.warning(
                "%s: released the GPUs (GPU worker stopped, NVML shut down, no NVIDIA device "
                "file open); status answers 503 until the new kernel module is loaded",
                why,
            )
        else:
            log.error("%s", why)

    def _restart_pause(self, why: str) -> str:
        """Count a worker's exit and set when the next one may start: at once, unless the
        previous worker exited within ``RESTART_STABLE_S`` of its start too. Returns ``why``
        with the pause, for the log."""
        now = time.monotonic()
        quick = now - self._started_at < RESTART_STABLE_S
        self._quick_exits = self._quick_exits + 1 if quick else 1
        if self._quick_exits < 2:
            self._restart_at = 0.0
            return why
        pause = min(RESTART_BACKOFF_MAX_S, 2.0 ** (self._quick_exits - 2))
        self._restart_at = now + pause
        return (
            f"{why} in {pause:.0f} s ({self._quick_exits} workers in a row exited within "
            f"{RESTART_STABLE_S:.0f} s of their start)"
        )

    async def _try_pick_up(self, installed: str | None, loaded: str | None) -> None:
        not_yet = self._not_yet(installed, loaded)
        if not_yet is not None:
            self._wait(not_yet)
            return
        try:
            worker = await self._watch.spawn()
        except WorkerFailed as err:
            ready = "NVML is not ready" if err.nvml_code in NOT_YET_CODES else "NVML failed"
            self._wait(f"{ready} ({err})")
            return
        except GpuBackendError as err:
            self._wait(f"the GPU worker cannot start ({err})")
            return
        await self._picked_up(worker, installed)

    def _not_yet(self, installed: str | None, loaded: str | None) -> str | None:
        """Why a new worker would not start yet, as far as the files tell; None: try it."""
        if not (self._module_known or self._watch.simulated):
            return None  # no module version here: NVML itself says when
        if loaded is None:
            return "no NVIDIA kernel module is loaded"
        if self._tracked and installed is not None and installed != loaded:
            return f"driver {installed} is installed, the loaded module is {loaded}"
        return None

    def _wait(self, why: str) -> None:
        if why != self._waiting:
            self._waiting = why
            log.info(
                "Waiting for the driver: %s; looking again every %.0f s",
                why,
                self._watch.poll_interval_s,
            )

    async def _picked_up(self, worker: WorkerClient, installed: str | None) -> None:
        old = self.node.driver_version
        node = worker.node_info()
        changed = node.driver_version != old
        if changed:
            await self._refresh_volumes(node)
            if not self._watch.simulated:
                await asyncio.to_thread(self._check_uvm)
        self.worker, self.node = worker, node
        self._started_at = time.monotonic()
        self._tracked = installed == node.driver_version
        await self._status.resume(worker, node)
        self.health.follow(worker, fresh=changed)
        self._watch_exit(worker)
        self._publish()
        took = time.monotonic() - (self._released_at or time.monotonic())
        if changed:
            log.warning(
                "Driver %s picked up (was %s), %.1f s after the release: %s; %d GPU(s), "
                "volume nvidia_driver_%s",
                node.driver_version,
                old,
                took,
                worker.name,
                len(node.devices),
                node.driver_version,
            )
        else:
            log.warning("GPU worker restarted (%s), %.1f s after it stopped", worker.name, took)
        self._released_at = self._waiting = None
        tell_systemd(f"serving {len(node.devices)} GPU(s), driver {node.driver_version}")

    async def _refresh_volumes(self, node: NodeInfo) -> None:
        try:
            await asyncio.to_thread(
                refresh_volumes, self._store, node.driver_version, ldcache=self._watch.ldcache
            )
        except (OSError, ValueError) as err:  # NVML works: serve it, say what is missing
            log.error(
                "The files of driver %s cannot be found (%s): nvidia_driver_%s cannot be "
                "built until a SIGHUP finds them",
                node.driver_version,
                err,
                node.driver_version,
            )

    @staticmethod
    def _check_uvm() -> None:
        try:
            log.info("Checking the NVIDIA unified memory device: %s", ensure_uvm_device())
        except UvmError as err:
            log.warning("%s", err)

    def _publish(self) -> None:
        """Serve the current node and health (a driver change or a health change)."""
        self._state.replace(NodeFacts(self.node, control_devices(), self.health.health))
