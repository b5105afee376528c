"""Where the agent's time and memory go on a real GPU node.

Prints the median time of every NVML call that one status read makes (through the
backend's own choke point), the time of one whole ``device_status`` and of a parallel
sweep, and the process's resident memory after each start-up stage (interpreter,
aiohttp, pynvml + nvmlInit, the whole backend with libcuda).

    python -m tests.benchmarks.profile_nvml [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    stages = {"python": rss_mb()}
    import aiohttp.web  # noqa: F401, PLC0415

    stages["+ aiohttp"] = rss_mb()
    import pynvml  # noqa: PLC0415

    pynvml.nvmlInit()
    stages["+ nvmlInit"] = rss_mb()
    pynvml.nvmlShutdown()

    from agent.gpu import nvml_query  # noqa: PLC0415
    from agent.gpu.nvml_backend import NvmlBackend  # noqa: PLC0415

    started = time.perf_counter()
    backend = NvmlBackend.start()
    start_s = time.perf_counter() - started
    stages["+ NvmlBackend.start (libcuda facts)"] = rss_mb()

    timings: dict[str, list[float]] = defaultdict(list)
    real_invoke = nvml_query._invoke

    def timed_invoke(name: str, *call_args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_invoke(name, *call_args)
        finally:
            timings[name].append(time.perf_counter() - t0)

    nvml_query._invoke = timed_invoke  # type: ignore[assignment]
    count = len(backend.node_info().devices)
    whole: list[float] = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        backend.device_status(0)
        whole.append(time.perf_counter() - t0)
    nvml_query._invoke = real_invoke

    sweeps: list[float] = []
    with ThreadPoolExecutor(max(1, count)) as pool:
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            list(pool.map(backend.device_status, range(count)))
            sweeps.append(time.perf_counter() - t0)
        # The hot path once the background sampler has read the slow counters (BAR1, PCIe).
        for index in range(count):
            backend.pcie_throughput(index)
        hot: list[float] = []
        hot_serial: list[float] = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            list(pool.map(backend.device_status, range(count)))
            hot.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for index in range(count):
                backend.device_status(index)
            hot_serial.append(time.perf_counter() - t0)
    backend.close()

    report = {
        "gpus": count,
        "backend_start_s": round(start_s, 3),
        "rss_mb": {k: round(v, 1) for k, v in stages.items()},
        "device_status_median_us": round(statistics.median(whole) * 1e6, 1),
        "parallel_sweep_median_us": round(statistics.median(sweeps) * 1e6, 1),
        "sampled_parallel_sweep_median_us": round(statistics.median(hot) * 1e6, 1),
        "sampled_serial_sweep_median_us": round(statistics.median(hot_serial) * 1e6, 1),
        "query_median_us": {
            name: round(statistics.median(values) * 1e6, 1)
            for name, values in sorted(timings.items(), key=lambda kv: -statistics.median(kv[1]))
        },
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
