"""Profiling metrics through GPM on a real GPU (Hopper or later): idle, under a matrix
multiply, and what they cost.

Run on a GPU machine: ``pytest -m gpu -s tests/gpu/test_gpm_real.py``. The test drives the
agent's own path (``NvmlBackend``: the GPM sampler runs in ``pcie_throughput``, the status
read serves its values) on GPU 0, first idle, then while a background thread keeps a child
Python with PyTorch multiplying half-precision 8192 x 8192 matrices on it (tensor cores).
It also takes the same readings with pynvml directly, bypassing the agent's code, so that a
failure tells the agent's code from GPM itself (or the machine: a sandbox that hides the
performance counters). Every figure (support, streaming state, metric ids, return codes,
raw values, sample intervals, NVML's own utilisation, the matrix multiply's TFLOPS, the
costs with GPM on and off) is printed as one JSON report, and written to
``$NVD_GPM_REPORT`` when set; assertion messages carry it too. The interpreter with torch
is ``$NVD_TORCH_PYTHON``, else the first of this Python, ``/usr/bin/python3`` and
``python3`` that imports torch; without one the load test skips.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.gpu import nvml_gpm
from agent.gpu import nvml_query as nvml
from agent.gpu.model import (
    UNKNOWN_PROFILING,
    DeviceStatus,
    DeviceTelemetry,
    PcieThroughput,
    Profiling,
)
from agent.gpu.nvml_backend import NvmlBackend
from agent.gpu.nvml_gpm import GpmSampler
from agent.metrics.exposition import render_families
from agent.metrics.gpu_families import gpu_families

pytestmark = pytest.mark.gpu

SAMPLE_EVERY_S = 0.5  # how far apart the samples are, as the agent's sampler (1 s) or less
LOAD_S = 6.0  # how long the matrix multiply runs
METRICS = {**nvml_gpm.ENGINE_METRICS, **nvml_gpm.NVLINK_METRICS}
LOAD = """
import json, sys, time, torch
seconds = float(sys.argv[1])
torch.cuda.set_device(0)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
b = torch.randn_like(a)
c = torch.empty_like(a)
torch.cuda.synchronize()
print(json.dumps({"ready": True, "device": torch.cuda.get_device_name(0)}), flush=True)
start = time.monotonic()
count = 0
while time.monotonic() - start < seconds:
    for _ in range(20):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    count += 20
took = time.monotonic() - start
print(json.dumps({"matmuls": count, "seconds": took,
                  "tflops": 2 * 8192**3 * count / took / 1e12}), flush=True)
"""


def _torch_python() -> str | None:
    candidates = [os.environ.get("NVD_TORCH_PYTHON"), sys.executable, "/usr/bin/python3",
                  shutil.which("python3")]  # fmt: skip
    for python in dict.fromkeys(c for c in candidates if c):
        done = subprocess.run([python, "-c", "import torch; assert torch.cuda.is_available()"],
                              capture_output=True, timeout=120, check=False)  # fmt: skip
        if done.returncode == 0:
            return python
    return None


class Report(dict[str, Any]):
    """Everything the test saw, printed (and written to $NVD_GPM_REPORT) at the end."""

    def text(self) -> str:
        return json.dumps(self, indent=1, default=str)

    def emit(self) -> None:
        print("\nGPM report:\n" + self.text())
        path = os.environ.get("NVD_GPM_REPORT")
        if path:
            Path(path).write_text(self.text() + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def report() -> Iterator[Report]:
    found = Report()
    yield found
    found.emit()


@pytest.fixture(scope="module")
def backend(report: Report) -> Iterator[NvmlBackend]:
    started = NvmlBackend.start()
    node = started.node_info()
    report["driver"] = node.driver_version
    report["gpu0"] = {"model": node.devices[0].model, "bus_id": node.devices[0].pci.bus_id,
                      "mig_enabled": node.devices[0].mig_enabled}  # fmt: skip
    report["nvidia_ml_py"] = metadata.version("nvidia-ml-py")
    try:
        yield started
    finally:
        started.close()


def _handle() -> Any:
    return nvml.call("nvmlDeviceGetHandleByIndex", 0)


def _profiling(values: Profiling) -> dict[str, float | None]:
    return dataclasses.asdict(values)


def _sample_agent(backend: NvmlBackend, seconds: float) -> list[dict[str, Any]]:
    """The agent's path: a sample per ``SAMPLE_EVERY_S`` (as its sampler), values served."""
    readings = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        backend.pcie_throughput(0)
        status = backend.device_status(0)
        readings.append({
            "at_s": round(time.monotonic(), 3),
            "profiling": _profiling(status.telemetry.profiling),
            "nvml_gpu_util_pct": status.utilization.gpu_pct,
        })  # fmt: skip
        time.sleep(SAMPLE_EVERY_S)
    return readings


def _raw_gpm(interval_s: float) -> dict[str, Any]:
    """The same metrics straight from pynvml, two fresh samples ``interval_s`` apart."""
    if not hasattr(pynvml, "nvmlGpmSampleAlloc"):
        return {"error": "the installed pynvml has no GPM"}
    handle = _handle()
    found: dict[str, Any] = {"metric_ids": dict(METRICS.items())}
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    try:
        pynvml.nvmlGpmSampleGet(handle, first)
        taken = time.monotonic()
        time.sleep(interval_s)
        pynvml.nvmlGpmSampleGet(handle, second)
        found["interval_s"] = time.monotonic() - taken
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(METRICS)
        request.sample1, request.sample2 = first, second
        for slot, metric_id in enumerate(METRICS):
            request.metrics[slot].metricId = metric_id
        pynvml.nvmlGpmMetricsGet(request)
        found["metrics"] = {
            str(metric_id): {
                "name": METRICS[metric_id],
                "nvmlReturn": int(request.metrics[slot].nvmlReturn),
                "value": float(request.metrics[slot].value),
                "unit": _text(request.metrics[slot].metricInfo.unit),
            }
            for slot, metric_id in enumerate(METRICS)
        }
    except Exception as err:  # what failed is the finding
        found["error"] = repr(err)
    finally:
        for sample in (first, second):
            pynvml.nvmlGpmSampleFree(sample)
    return found


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value if isinstance(value, str) else None


class Load:
    """A child Python multiplying matrices on GPU 0, driven by a background thread."""

    def __init__(self, python: str, seconds: float) -> None:
        self.result: dict[str, Any] = {}
        self.ready = threading.Event()
        self.lines: list[str] = []
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", CUDA_DEVICE_ORDER="PCI_BUS_ID")
        self._proc = subprocess.Popen([python, "-c", LOAD, str(seconds)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line.rstrip())
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("ready"):
                self.ready.set()
            else:
                self.result.update(message)
        self.ready.set()  # it ended (or failed): nobody waits for ever

    def wait(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(10)
        self._thread.join(10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _median_s(work: Callable[[], object], times: int) -> float:
    spent = []
    for _ in range(times):
        started = time.perf_counter()
        work()
        spent.append(time.perf_counter() - started)
    return statistics.median(spent)


def test_gpm_is_supported_and_streaming_is_known(backend: NvmlBackend, report: Report) -> None:
    handle = _handle()
    support = nvml.attempt("nvmlGpmQueryDeviceSupport", handle)
    report["support"] = {
        "error": None if support.error is None else nvml.error_name(support.error),
        "version": getattr(support.value, "version", None),
        "isSupportedDevice": getattr(support.value, "isSupportedDevice", None),
    }
    streaming = nvml.attempt("nvmlGpmQueryIfStreamingEnabled", handle)
    report["streaming_enabled"] = (
        streaming.value if streaming.error is None else nvml.error_name(streaming.error)
    )
    assert support.error is None, report.text()
    assert getattr(support.value, "isSupportedDevice", 0) == 1, report.text()


def test_gpm_is_near_zero_idle_and_moves_with_a_matrix_multiply(
    backend: NvmlBackend, report: Report
) -> None:
    processes = backend.device_status(0).processes
    report["processes_before"] = [p.pid for p in processes]
    idle = _sample_agent(backend, 2.0)
    report["idle"] = idle
    report["idle_raw"] = _raw_gpm(SAMPLE_EVERY_S)
    python = _torch_python()
    if python is None:
        pytest.skip("no Python with a CUDA-enabled torch (set NVD_TORCH_PYTHON)")
    load = Load(python, LOAD_S)
    try:
        assert load.ready.wait(120), "\n".join(load.lines)
        time.sleep(0.5)  # the kernels are queued
        loaded = _sample_agent(backend, LOAD_S - 2.0)
        report["load_raw"] = _raw_gpm(SAMPLE_EVERY_S)
    finally:
        load.wait(LOAD_S + 60)
    report["load"] = loaded
    report["load_child"] = load.result or load.lines[-5:]
    served = [r["profiling"] for r in loaded if r["profiling"]["graphics_pct"] is not None]
    assert served, "GPM gave the agent no values under load:\n" + report.text()
    peak = {name: max(v[name] or 0.0 for v in served) for name in nvml_gpm.ENGINE_METRICS.values()}
    report["load_peak"] = peak
    busy_util = max(r["nvml_gpu_util_pct"] or 0 for r in loaded)
    if peak["graphics_pct"] == 0.0:
        pytest.fail(
            "GPM read 0.0 under load (NVML's own utilisation said "
            f"{busy_util} %): compare load_raw (pynvml directly) with load (the agent's "
            "path) in this report:\n" + report.text()
        )
    assert busy_util >= 50, "the matrix multiply did not load the GPU:\n" + report.text()
    assert peak["graphics_pct"] >= 50, report.text()
    assert peak["sm_pct"] >= 30, report.text()
    assert peak["tensor_pct"] > 5, report.text()  # half-precision matmul: tensor cores
    assert peak["dram_pct"] > 0, report.text()
    if not processes:  # nothing else ran on the GPU: idle means idle
        quiet = [r["profiling"] for r in idle if r["profiling"]["graphics_pct"] is not None]
        assert quiet, "GPM gave the agent no values idle:\n" + report.text()
        assert max(v["graphics_pct"] for v in quiet) < 5, report.text()
        assert max(v["sm_pct"] or 0.0 for v in quiet) < 5, report.text()


def test_what_gpm_costs(backend: NvmlBackend, report: Report) -> None:
    """The sample (the background sampler's, once a second), the status read, and the
    rendering of the GPU families, with GPM on and off, in one run."""
    handles = [nvml.call("nvmlDeviceGetHandleByIndex", i)
               for i in range(len(backend.node_info().devices))]  # fmt: skip
    gpm = GpmSampler(handles, backend.node_info().devices)
    spent = []
    for _ in range(21):
        time.sleep(nvml_gpm.MIN_PAIR_S)  # a pair closer than this is not computed
        started = time.perf_counter()
        gpm.sample(0)  # a sample, and the metrics of the pair with the one before
        spent.append(time.perf_counter() - started)
    sample_s = statistics.median(spent[1:])  # the first has no pair
    gpm.close()
    backend.pcie_throughput(0)
    time.sleep(SAMPLE_EVERY_S)
    backend.pcie_throughput(0)
    status_on_s = _median_s(lambda: backend.device_status(0), 300)
    off = GpmSampler([], [])
    real, backend._gpm = backend._gpm, off  # GPM off: an empty sampler (a private swap)
    try:
        status_off_s = _median_s(lambda: backend.device_status(0), 300)
    finally:
        backend._gpm = real
    node = backend.node_info()
    status = backend.device_status(0)
    without = dataclasses.replace(
        status, telemetry=dataclasses.replace(status.telemetry, profiling=UNKNOWN_PROFILING)
    )

    def scrape(statuses: list[DeviceStatus]) -> bytes:
        families = gpu_families(node.devices[:1], statuses, [PcieThroughput(None, None)], {},
                                driver_version=node.driver_version, hostname="gpu")  # fmt: skip
        return render_families(families)

    render_on_s = _median_s(lambda: scrape([status]), 300)
    render_off_s = _median_s(lambda: scrape([without]), 300)
    report["cost"] = {
        "gpm_sample_ms": sample_s * 1e3,
        "status_read_ms": {"gpm_on": status_on_s * 1e3, "gpm_off": status_off_s * 1e3},
        "render_one_gpu_ms": {"gpm_on": render_on_s * 1e3, "gpm_off": render_off_s * 1e3},
        "render_bytes": {"gpm_on": len(scrape([status])), "gpm_off": len(scrape([without]))},
    }
    assert sample_s < 0.05, report.text()  # well within the sampler's second
    assert status_on_s < status_off_s * 1.5 + 0.0002, report.text()  # a copy, not a read


def test_telemetry_of_the_agent_carries_the_values(backend: NvmlBackend) -> None:
    backend.pcie_throughput(0)
    time.sleep(SAMPLE_EVERY_S)
    backend.pcie_throughput(0)
    telemetry: DeviceTelemetry = backend.device_status(0).telemetry
    assert telemetry.profiling.interval_s is not None
    assert SAMPLE_EVERY_S * 0.8 < telemetry.profiling.interval_s < 5
