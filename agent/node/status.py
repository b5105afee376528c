"""Live GPU status: single-flight sweeps and a background PCIe sampler (docs/agent.md, "How
status stays fast").

- A sweep is one round trip to the GPU worker (``GpuReader.read_statuses``; the worker reads
  the GPUs in parallel), from the event loop: no thread hop on the daemon's side.
- Concurrent requests share one sweep (single flight): a request that arrives while a
  sweep is running waits for that sweep instead of starting another, and one that arrives
  within ``SWEEP_SHARED_S`` (2 ms) after a sweep was taken is answered from it. No value a
  status shows changes that fast (NVML averages utilization over a sixth of a second or
  more, the power draw over many milliseconds), so a client gets the same facts it would
  get from a sweep of its own, and back-to-back requests cost one worker round trip per
  2 ms instead of one each.
- The two PCIe throughput counters (about 20 ms each, as NVML samples them) are read by a
  background sampler (``read_throughputs``; the NVML backend refreshes BAR1 usage and its
  other slow values on the same call); requests are served its latest sample, whose age is
  known. The sampler runs while someone reads status (a request, a scrape) and
  rests once nobody has for ``SAMPLER_REST_AFTER_S``, so an idle node costs little
  sampling: the usage ledger's sweeps take one sample a minute then (``sample_within_s``),
  for the GPUs' energy counters; the first read after a rest waits for a fresh sample
  (about 45 ms) rather than being served an old one.
- Rendered bodies are cached on the sweep, so N requests sharing a sweep render once.
- While the node's driver is being replaced, ``suspend(why)`` makes every sweep raise
  ``StatusUnavailable(why)`` (the REST API answers 503) until ``resume(reader, node)``; a
  reader that is gone (``BackendGone``: the worker ended, or missed its deadline) is the
  503 ``GPU worker restarting`` until the node's life replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from agent.api import render_json, render_text
from agent.gpu.backend import BackendGone
from agent.gpu.model import (
    LOST_DEVICE_STATUS,
    UNKNOWN_THROUGHPUT,
    DeviceInfo,
    DeviceStatus,
    NodeInfo,
    PcieThroughput,
)

log = logging.getLogger("nvidia-docker-plugin.status")


BACKEND_GONE = "GPU worker restarting"  # the 503 while a backend that ended is replaced
SAMPLER_REST_AFTER_S = 60.0  # no status read for this long: the PCIe sampler rests
SWEEP_SHARED_S = 0.002  # a sweep also answers the requests that arrive this soon after it


class GpuReader(Protocol):
    """Every device's live facts at once: the GPU worker's client (``WorkerClient``)."""

    async def read_statuses(self) -> tuple[DeviceStatus, ...]:
        """Every device's status, in index order; ``BackendGone`` when it cannot answer."""
        ...

    async def read_throughputs(self) -> tuple[PcieThroughput, ...]:
        """Every device's PCIe throughput (the slow sample), in index order."""
        ...


class StatusUnavailable(Exception):
    """No status can be read now (the driver is being replaced); the message says why."""


class Sweep:
    """The status of every device at one moment, with its rendered bodies cached."""

    def __init__(
        self,
        node: NodeInfo,
        statuses: tuple[DeviceStatus, ...],
        throughputs: tuple[PcieThroughput, ...],
        throughput_age_s: float | None,
        taken_at: float = 0.0,
    ) -> None:
        self.node = node
        self.taken_at = taken_at  # time.monotonic() when the statuses were asked for
        self.statuses = statuses
        self.throughputs = throughputs
        self.throughput_age_s = throughput_age_s
        self._json: dict[tuple[int, ...], bytes] = {}
        self._text: dict[tuple[int, ...], str] = {}

    def json_body(self, devices: tuple[DeviceInfo, ...]) -> bytes:
        key = tuple(d.index for d in devices)
        body = self._json.get(key)
        if body is None:
            body = render_json.status(
                [self.statuses[i] for i in key], [self.throughputs[i] for i in key]
            )
            self._json[key] = body
        return body

    def text_body(self, devices: tuple[DeviceInfo, ...]) -> str:
        key = tuple(d.index for d in devices)
        body = self._text.get(key)
        if body is None:
            body = render_text.status(
                devices, [self.statuses[i] for i in key], [self.throughputs[i] for i in key]
            )
            self._text[key] = body
        return body


@dataclass(frozen=True, slots=True)
class _Sample:
    throughputs: tuple[PcieThroughput, ...]
    taken_at: float  # time.monotonic()


class StatusService:
    """Single-flight status sweeps plus the background PCIe sampler of one node."""

    def __init__(
        self,
        reader: GpuReader,
        node: NodeInfo,
        pcie_interval_s: float = 1.0,
        *,
        rest_after_s: float = SAMPLER_REST_AFTER_S,
        shared_s: float = SWEEP_SHARED_S,
    ) -> None:
        self._shared_s = shared_s
        self._last: Sweep | None = None  # the latest sweep
        self._pcie_interval_s = pcie_interval_s
        self._rest_after_s = rest_after_s
        self._last_read = time.monotonic()
        self._wake = asyncio.Event()  # a read while the sampler rests
        self._resting = False
        self._sampling: asyncio.Future[None] | None = None
        self._inflight: asyncio.Future[Sweep] | None = None
        self._sample: _Sample | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._failed: set[str] = set()
        self._unavailable: str | None = None
        self._sweep_listeners: list[Callable[[float], None]] = []
        self._reader = reader
        self._node = node
        self._count = len(node.devices)

    # -- the driver's life -----------------------------------------------------------------

    @property
    def unavailable(self) -> str | None:
        """Why status cannot be read now (``suspend``), or None."""
        return self._unavailable

    def suspend(self, why: str) -> None:
        """Answer every sweep with ``StatusUnavailable(why)`` until ``resume``."""
        self._unavailable = why

    async def resume(self, reader: GpuReader, node: NodeInfo) -> None:
        """Read from ``reader`` (a new worker's) from now on; samples its PCIe first."""
        self._reader, self._node, self._count = reader, node, len(node.devices)
        self._sample = None
        self._last = None
        self._failed.clear()
        self._unavailable = None
        with contextlib.suppress(StatusUnavailable):
            await self.sample_pcie()

    @property
    def sampler_resting(self) -> bool:
        """The PCIe sampler rests: nobody read status for ``rest_after_s``."""
        return self._resting

    def add_sweep_listener(self, listener: Callable[[float], None]) -> None:
        """Call ``listener(seconds)`` after every sweep, with how long it took (metrics)."""
        self._sweep_listeners.append(listener)

    # -- status sweeps ---------------------------------------------------------------------

    def shared(self) -> Sweep | None:
        """The latest sweep, if a read now may share it (taken within the share window),
        counted as a read; None when a read must take or join a sweep (``sweep``): none
        recent, the sampler resting, or status unavailable."""
        last = self._last
        if last is None or self._unavailable is not None or self._resting:
            return None
        now = time.monotonic()
        if now - last.taken_at >= self._shared_s:
            return None
        self._last_read = now
        return last

    async def sweep(self, *, quiet: bool = False, sample_within_s: float | None = None) -> Sweep:
        """The current status; joins the sweep in flight if there is one.

        ``quiet``: a background reader's sweep (the usage ledger's): it does not count as
        someone reading status, so it neither wakes the resting PCIe sampler nor keeps it
        sampling. ``sample_within_s``: while the sampler rests, a sample older than this is
        taken again once first (the ledger's energy counters, which come with the sample).
        Raises ``StatusUnavailable`` while suspended."""
        if self._unavailable is not None:
            raise StatusUnavailable(self._unavailable)
        if quiet and sample_within_s is not None and self._resting:
            sample = self._sample
            if sample is None or time.monotonic() - sample.taken_at > sample_within_s:
                with contextlib.suppress(StatusUnavailable):
                    await self.sample_pcie()
        if not quiet:
            self._last_read = time.monotonic()
            if self._resting:  # the sampler rested: this read gets a fresh sample
                self._resting = False
                self._wake.set()
                with contextlib.suppress(StatusUnavailable):
                    await self.sample_pcie()
        last = self._last
        if last is not None and time.monotonic() - last.taken_at < self._shared_s:
            return last
        inflight = self._inflight
        if inflight is None:
            inflight = asyncio.ensure_future(self._sweep())
            self._inflight = inflight
            inflight.add_done_callback(self._sweep_done)
        return await asyncio.shield(inflight)

    def _sweep_done(self, future: asyncio.Future[Sweep]) -> None:
        if self._inflight is future:
            self._inflight = None
        if not future.cancelled() and future.exception() is None:
            self._last = future.result()

    async def _sweep(self) -> Sweep:
        started = time.perf_counter()
        taken_at = time.monotonic()  # when the statuses were asked for
        statuses = await self._read_statuses()
        if self._sweep_listeners:
            elapsed_s = time.perf_counter() - started
            for listener in self._sweep_listeners:
                try:
                    listener(elapsed_s)
                except Exception:  # a listener must not cost anyone their status
                    log.exception("A sweep listener failed")
        sample = self._sample
        if sample is None:
            return Sweep(self._node, statuses, (UNKNOWN_THROUGHPUT,) * self._count, None, taken_at)
        age_s = time.monotonic() - sample.taken_at
        return Sweep(self._node, statuses, sample.throughputs, age_s, taken_at)

    async def _read_statuses(self) -> tuple[DeviceStatus, ...]:
        """Every device's status, one round trip; null values (one warning) when the read
        fails otherwise than by the reader's end."""
        count = self._count
        try:
            statuses = await self._reader.read_statuses()
        except BackendGone:
            raise StatusUnavailable(self._unavailable or BACKEND_GONE) from None
        except Exception as err:
            if self._unavailable is not None:
                raise StatusUnavailable(self._unavailable) from None
            self._warn_once("status", err)
            return (LOST_DEVICE_STATUS,) * count
        if len(statuses) != count:
            self._warn_once("status", ValueError(f"{len(statuses)} statuses, not {count}"))
            return (statuses + (LOST_DEVICE_STATUS,) * count)[:count]
        return statuses

    # -- PCIe sampler ----------------------------------------------------------------------

    async def sample_pcie(self) -> None:
        """Read every device's PCIe throughput once and keep it (a sample in flight is
        joined, not repeated)."""
        if self._unavailable is not None:
            raise StatusUnavailable(self._unavailable)
        if self._sampling is None or self._sampling.done():
            self._sampling = asyncio.ensure_future(self._sample_once())
        await asyncio.shield(self._sampling)

    async def _sample_once(self) -> None:
        reader, count = self._reader, self._count
        try:
            sampled = await reader.read_throughputs()
        except BackendGone:
            raise StatusUnavailable(self._unavailable or BACKEND_GONE) from None
        except Exception as err:
            if self._unavailable is not None or reader is not self._reader:
                raise StatusUnavailable(self._unavailable or "the driver changed") from None
            self._warn_once("pcie", err)
            sampled = (UNKNOWN_THROUGHPUT,) * count
        if reader is self._reader and len(sampled) == count:
            self._sample = _Sample(sampled, time.monotonic())

    async def _sample_forever(self) -> None:
        while True:
            if time.monotonic() - self._last_read > self._rest_after_s:
                self._resting = True  # nobody reads: rest until a read wakes us
                self._wake.clear()
                await self._wake.wait()
            started = time.monotonic()
            try:
                await self.sample_pcie()
            except StatusUnavailable:
                pass  # the driver is being replaced: resume() samples the new one
            except Exception:  # keep sampling; the values go stale, their age shows it
                log.exception("PCIe throughput sampling failed")
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self._pcie_interval_s - elapsed))

    def start_sampler(self) -> None:
        if self._sampler is None:
            self._sampler = asyncio.get_running_loop().create_task(
                self._sample_forever(), name="pcie-sampler"
            )

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None

    def _warn_once(self, what: str, err: Exception) -> None:
        if what not in self._failed:
            self._failed.add(what)
            log.warning("Reading the GPUs' %s failed (%s); showing null values", what, err)
