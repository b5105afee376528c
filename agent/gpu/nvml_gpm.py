"""Profiling metrics without DCGM: NVML's GPU Performance Monitoring (GPM), Hopper and later.

GPM counts inside the GPU; a metric is what two samples (``nvmlGpmSampleGet``) say about
the time between them (``nvmlGpmMetricsGet``). So ``GpmSampler`` keeps, for each GPU and,
on a GPU in MIG mode, for each of its GPU instances (``nvmlGpmMigSampleGet``), the previous
sample: ``sample(index)`` takes a new one, computes the metrics against the previous, and
keeps them; ``profiling(index)`` serves what was kept. The NVML backend samples from the
background sampler (with the PCIe counters, about once a second), never from a status
read, so a status read only copies the last values (``Profiling.interval_s`` says over how
long they were averaged).

A value is ``None`` (the metric absent, never 0) where GPM cannot give it: the GPU has no
GPM (``nvmlGpmQueryDeviceSupport``, before Hopper), the installed pynvml or driver has no
GPM functions, a call failed, a metric failed on its own (each has its return code), or no
pair of samples is recent: two samples further apart than ``MAX_PAIR_S`` give nothing (the
sampler rested: nobody read status), and values older than ``MAX_AGE_S`` are not served.
NVLink traffic is asked only of GPUs that have NVLinks. Each of these situations is logged
once per GPU; a GPU (or GPU instance) that GPM says it cannot sample at all is not asked
again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.gpu import nvml_query as nvml
from agent.gpu.model import UNKNOWN_PROFILING, DeviceInfo, Profiling

log = logging.getLogger(__name__)

# nvmlGpmMetricId_t (nvml.h NVML_GPM_METRIC_*), what each becomes in ``Profiling``.
GRAPHICS_UTIL = 1
SM_UTIL = 2
SM_OCCUPANCY = 3
ANY_TENSOR_UTIL = 5
DRAM_BW_UTIL = 10
PCIE_TX_PER_SEC = 20
PCIE_RX_PER_SEC = 21
NVLINK_TOTAL_RX_PER_SEC = 60
NVLINK_TOTAL_TX_PER_SEC = 61
ENGINE_METRICS = {
    GRAPHICS_UTIL: "graphics_pct",
    SM_UTIL: "sm_pct",
    SM_OCCUPANCY: "sm_occupancy_pct",
    ANY_TENSOR_UTIL: "tensor_pct",
    DRAM_BW_UTIL: "dram_pct",
    PCIE_TX_PER_SEC: "pcie_tx_mib_s",
    PCIE_RX_PER_SEC: "pcie_rx_mib_s",
}
NVLINK_METRICS = {
    NVLINK_TOTAL_TX_PER_SEC: "nvlink_tx_mib_s",
    NVLINK_TOTAL_RX_PER_SEC: "nvlink_rx_mib_s",
}

METRICS_GET_VERSION = 1  # NVML_GPM_METRICS_GET_VERSION
MIN_PAIR_S = 0.1  # two samples closer than this: keep the older one, and the last values
MAX_PAIR_S = 60.0  # further apart than this (the sampler rested): no values from the pair
MAX_AGE_S = 60.0  # values computed longer ago than this are not served
# Answers that say a series can never be sampled (not another try each second).
_NEVER = frozenset(
    {nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_FUNCTION_NOT_FOUND, nvml.ERROR_NOT_IN_PYNVML}
)


@dataclass(frozen=True, slots=True)
class Target:
    """What one series of GPM samples is taken of: GPU ``gpu``, or one of its GPU instances
    (``gpu_instance_id``, the MIG device ``mig`` belongs to)."""

    gpu: int
    mig: int | None = None
    gpu_instance_id: int | None = None
    nvlink: bool = False  # ask the NVLink metrics too

    @property
    def name(self) -> str:
        return f"GPU {self.gpu}" if self.mig is None else f"MIG device {self.gpu}:{self.mig}"


class _Series:
    """The two samples of one target, alternately the previous and the next."""

    def __init__(self, target: Target, handle: Any) -> None:
        self.target = target
        self.handle = handle
        self.samples: list[Any] = []
        self.previous: int | None = None  # which sample holds the previous one
        self.taken_at = 0.0
        self.latest = UNKNOWN_PROFILING
        self.latest_at = 0.0
        self.dead = False  # no sample can be taken: nothing is asked again
        self.logged: set[str] = set()


def targets_of(devices: Sequence[DeviceInfo]) -> list[Target]:
    """Every GPU, and every GPU instance of a GPU in MIG mode (once, at its first MIG
    device: a GPU instance with several compute instances is sampled once)."""
    found: list[Target] = []
    for device in devices:
        nvlink = any(peer.nvlinks for peer in device.topology)
        found.append(Target(device.index, nvlink=nvlink))
        seen: set[int] = set()
        for mig in device.mig_devices:
            gi = mig.gpu_instance_id
            if gi is None or gi in seen:
                continue
            seen.add(gi)
            found.append(Target(device.index, mig.index, gi))
    return found


class GpmSampler:
    """GPM samples of every GPU that has GPM; ``sample`` and ``profiling`` may run in
    different threads (one thread per GPU samples)."""

    def __init__(
        self,
        handles: Sequence[Any | None],
        devices: Sequence[DeviceInfo],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._series: dict[int, list[_Series]] = {}
        self._request_type = nvml.pynvml_name("c_nvmlGpmMetricsGet_t")
        supported = self._supported(handles)
        for target in targets_of(devices):
            handle = handles[target.gpu] if target.gpu < len(handles) else None
            if handle is not None and target.gpu in supported:
                self._series.setdefault(target.gpu, []).append(_Series(target, handle))

    @property
    def gpus(self) -> tuple[int, ...]:
        """The GPUs sampled (those with GPM)."""
        return tuple(sorted(self._series))

    def _supported(self, handles: Sequence[Any | None]) -> set[int]:
        if self._request_type is None:
            log.info(
                "The installed nvidia-ml-py has no GPM (profiling metrics, DCGM_FI_PROF_*): "
                "they are absent; upgrade the nvidia-ml-py package to get them"
            )
            return set()
        found: set[int] = set()
        without: list[str] = []
        for index, handle in enumerate(handles):
            if handle is None:
                continue
            outcome = nvml.attempt("nvmlGpmQueryDeviceSupport", handle)
            if outcome.error is None and getattr(outcome.value, "isSupportedDevice", None):
                found.add(index)
            else:
                why = "no" if outcome.error is None else nvml.error_name(outcome.error)
                without.append(f"{index} ({why})")
        if without:
            log.info(
                "GPU(s) %s: no GPM support, so no profiling metrics (DCGM_FI_PROF_*) for them",
                ", ".join(without),
            )
        return found

    def sample(self, index: int) -> None:
        """Take GPU ``index``'s next samples (and its GPU instances'); never raises."""
        for series in self._series.get(index, ()):
            try:
                self._sample(series)
            except Exception as err:  # a pynvml surprise must cost only this series
                self._note(series, "failed", f"GPM sampling failed ({err!r})")
                self._forget(series)

    def profiling(self, index: int) -> Profiling:
        """The whole GPU's last values; unknown when there are none recent enough."""
        for series in self._series.get(index, ()):
            if series.target.mig is None:
                return self._fresh(series)
        return UNKNOWN_PROFILING

    def mig_profiling(self, index: int) -> dict[int, Profiling]:
        """``{GPU instance id: values}`` of GPU ``index``'s GPU instances (every MIG device
        of an instance shares them)."""
        return {
            s.target.gpu_instance_id: self._fresh(s)
            for s in self._series.get(index, ())
            if s.target.gpu_instance_id is not None
        }

    def close(self) -> None:
        """Free every sample (before NVML shuts down)."""
        for series_list in self._series.values():
            for series in series_list:
                for sample in series.samples:
                    nvml.attempt("nvmlGpmSampleFree", sample)
                series.samples = []
                series.dead = True

    # -- one series -----------------------------------------------------------------------

    def _fresh(self, series: _Series) -> Profiling:
        with self._lock:
            latest, at = series.latest, series.latest_at
        if latest is UNKNOWN_PROFILING or self._clock() - at > MAX_AGE_S:
            return UNKNOWN_PROFILING
        return latest

    def _sample(self, series: _Series) -> None:
        if series.dead:
            return
        if not series.samples and not self._allocate(series):
            return
        now = self._clock()
        if series.previous is not None and now - series.taken_at < MIN_PAIR_S:
            return  # too soon after the last one: the pair would measure nothing
        slot = 0 if series.previous != 0 else 1
        sample = series.samples[slot]
        target = series.target
        if target.gpu_instance_id is None:
            taken = nvml.attempt("nvmlGpmSampleGet", series.handle, sample)
        else:
            taken = nvml.attempt(
                "nvmlGpmMigSampleGet", series.handle, target.gpu_instance_id, sample
            )
        if taken.error is not None:
            self._note(series, "sample", f"no GPM sample ({nvml.error_name(taken.error)})")
            self._forget(series)
            if taken.error in _NEVER:
                series.dead = True  # it will not work later either: not asked again
            return
        previous, previous_at = series.previous, series.taken_at
        series.previous, series.taken_at = slot, now
        if previous is None or now - previous_at > MAX_PAIR_S:
            return  # the first sample, or one after a rest: the next pair gives values
        values = self._metrics(series, series.samples[previous], sample, now - previous_at)
        with self._lock:
            series.latest, series.latest_at = values, now

    def _allocate(self, series: _Series) -> bool:
        for _ in range(2):
            outcome = nvml.attempt("nvmlGpmSampleAlloc")
            if outcome.value is None:
                self._note(series, "alloc", "no GPM sample can be allocated")
                for sample in series.samples:
                    nvml.attempt("nvmlGpmSampleFree", sample)
                series.samples = []
                series.dead = True
                return False
            series.samples.append(outcome.value)
        return True

    def _forget(self, series: _Series) -> None:
        series.previous = None
        with self._lock:
            series.latest = UNKNOWN_PROFILING

    def _metrics(self, series: _Series, first: Any, second: Any, interval_s: float) -> Profiling:
        wanted = dict(ENGINE_METRICS)
        if series.target.nvlink:
            wanted.update(NVLINK_METRICS)
        ids = list(wanted)
        request = self._request_type() if self._request_type is not None else None
        if request is None:
            return UNKNOWN_PROFILING
        request.version = nvml.pynvml_name("NVML_GPM_METRICS_GET_VERSION") or METRICS_GET_VERSION
        request.numMetrics = len(ids)
        request.sample1 = first
        request.sample2 = second
        for slot, metric_id in enumerate(ids):
            request.metrics[slot].metricId = metric_id
        answer = nvml.attempt("nvmlGpmMetricsGet", request)
        if answer.error is not None:
            self._note(series, "metrics", f"no GPM metrics ({nvml.error_name(answer.error)})")
            return UNKNOWN_PROFILING
        values: dict[str, float] = {}
        failed: list[int] = []
        for slot, metric_id in enumerate(ids):
            metric = request.metrics[slot]
            value = _number(getattr(metric, "value", None))
            if getattr(metric, "nvmlReturn", None) == nvml.SUCCESS and value is not None:
                values[wanted[metric_id]] = value
            else:
                failed.append(metric_id)
        if failed:
            self._note(series, "metric", f"GPM gives no metric {', '.join(map(str, failed))}")
        if not values:
            return UNKNOWN_PROFILING
        return Profiling(**values, interval_s=interval_s)

    @staticmethod
    def _note(series: _Series, what: str, text: str) -> None:
        if what in series.logged:
            return
        series.logged.add(what)
        log.info("%s: %s: the profiling metrics it concerns are absent", series.target.name, text)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None
