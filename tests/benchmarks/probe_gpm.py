"""Everything NVML's GPM gives on this machine, straight from pynvml (none of the agent's code).

For each GPU: its name, bus id and MIG mode, ``nvmlGpmQueryDeviceSupport``'s answer,
``nvmlGpmQueryIfStreamingEnabled``, then every metric id pynvml knows
(``NVML_GPM_METRIC_*``) between two samples ``--interval`` seconds apart: its return code,
value and unit, with the measured interval and NVML's own utilisation at the same time; on
a GPU in MIG mode the same per GPU instance (``nvmlGpmMigSampleGet``). With ``--load`` it
reads once idle and once while PyTorch multiplies half-precision matrices on GPU 0 (a child
process of ``--python``), so that "GPM reads 0 under load" can be told apart from "the load
did not run" or "this machine hides the counters". One JSON document on stdout (or
``--out``).

    python -m tests.benchmarks.probe_gpm [--interval S] [--load] [--python PY] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pynvml

LOAD = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
b = torch.randn_like(a)
torch.cuda.synchronize()
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
"""


def metric_ids() -> dict[int, str]:
    """Every ``NVML_GPM_METRIC_*`` of the installed pynvml, by id."""
    return {
        value: name.removeprefix("NVML_GPM_METRIC_")
        for name, value in vars(pynvml).items()
        if name.startswith("NVML_GPM_METRIC_") and name != "NVML_GPM_METRIC_MAX"
        and isinstance(value, int)
    }  # fmt: skip


def _text(value: Any) -> Any:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


def read_metrics(handle: Any, interval_s: float, gpu_instance: int | None) -> dict[str, Any]:
    """All metrics between two samples ``interval_s`` apart (of a GPU instance if given)."""
    ids = metric_ids()
    samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
    found: dict[str, Any] = {}
    try:

        def take(sample: Any) -> None:
            if gpu_instance is None:
                pynvml.nvmlGpmSampleGet(handle, sample)
            else:
                pynvml.nvmlGpmMigSampleGet(handle, gpu_instance, sample)

        take(samples[0])
        started = time.monotonic()
        time.sleep(interval_s)
        take(samples[1])
        found["interval_s"] = round(time.monotonic() - started, 4)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        found["nvml_utilization_pct"] = {"gpu": util.gpu, "memory": util.memory}
        metrics: dict[str, Any] = {}
        chunk = 64  # one request holds up to NVML_GPM_METRIC_MAX; ask in chunks, any order
        ordered = sorted(ids)
        for start in range(0, len(ordered), chunk):
            part = ordered[start : start + chunk]
            request = pynvml.c_nvmlGpmMetricsGet_t()
            request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(part)
            request.sample1, request.sample2 = samples
            for slot, metric_id in enumerate(part):
                request.metrics[slot].metricId = metric_id
            try:
                pynvml.nvmlGpmMetricsGet(request)
            except pynvml.NVMLError as err:
                metrics[f"ids {part[0]}-{part[-1]}"] = {"error": _error(err)}
                continue
            for slot, metric_id in enumerate(part):
                metric = request.metrics[slot]
                metrics[str(metric_id)] = {
                    "name": ids[metric_id],
                    "nvmlReturn": int(metric.nvmlReturn),
                    "value": float(metric.value),
                    "unit": _text(metric.metricInfo.unit),
                }
        found["metrics"] = metrics
    except pynvml.NVMLError as err:
        found["error"] = _error(err)
    finally:
        for sample in samples:
            pynvml.nvmlGpmSampleFree(sample)
    return found


def probe_gpu(index: int, interval_s: float) -> dict[str, Any]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    info: dict[str, Any] = {
        "index": index,
        "name": _text(pynvml.nvmlDeviceGetName(handle)),
        "bus_id": _text(pynvml.nvmlDeviceGetPciInfo(handle).busId),
    }
    for key, call in (
        ("mig_mode", lambda: list(pynvml.nvmlDeviceGetMigMode(handle))),
        ("support", lambda: _struct(pynvml.nvmlGpmQueryDeviceSupport(handle))),
        ("streaming_enabled", lambda: pynvml.nvmlGpmQueryIfStreamingEnabled(handle)),
    ):
        try:
            info[key] = call()
        except (pynvml.NVMLError, AttributeError) as err:
            info[key] = {"error": _error(err)}
    info["gpu"] = read_metrics(handle, interval_s, None)
    mode = info.get("mig_mode")
    if isinstance(mode, list) and mode and mode[0] == 1:
        info["gpu_instances"] = {}
        for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError:
                continue
            gi = pynvml.nvmlDeviceGetGpuInstanceId(mig)
            if str(gi) not in info["gpu_instances"]:
                info["gpu_instances"][str(gi)] = read_metrics(handle, interval_s, gi)
    return info


def _struct(value: Any) -> dict[str, Any]:
    """A ctypes structure's fields (or an object's attributes) as a dict."""
    fields = [name for name, *_ in getattr(value, "_fields_", ())] or list(vars(value))
    return {name: getattr(value, name) for name in fields}


def under_load(python: str, seconds: float, work: Any) -> tuple[Any, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    proc = subprocess.Popen([python, "-c", LOAD, str(seconds)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()
    try:
        if first != "ready":
            return None, first + proc.stdout.read()
        time.sleep(0.5)
        return work(), "ran"
    finally:
        proc.kill()
        proc.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--load", action="store_true", help="also read GPU 0 under a matmul")
    parser.add_argument("--python", default=sys.executable, help="a Python with torch")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    pynvml.nvmlInit()
    try:
        doc: dict[str, Any] = {
            "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
            "nvml": _text(pynvml.nvmlSystemGetNVMLVersion()),
            "has_gpm": hasattr(pynvml, "nvmlGpmSampleGet"),
            "gpus": [probe_gpu(i, args.interval) for i in range(pynvml.nvmlDeviceGetCount())],
        }
        if args.load:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            doc["gpu0_under_load"], doc["load"] = under_load(
                args.python, args.interval + 10, lambda: read_metrics(handle, args.interval, None)
            )
    finally:
        pynvml.nvmlShutdown()
    text = json.dumps(doc, indent=1, default=str)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
