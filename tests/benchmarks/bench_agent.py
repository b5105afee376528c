"""REST API benchmark: requests per second and p50/p99 of the hot routes, and resident memory.

Starts a real ``nvidia-docker-plugin`` process (simulated node by default, or the real
GPUs with ``--real``) on a free loopback port, loads it with one closed-loop client process
(1, 16 and 64 keep-alive connections, as the old tool was measured), and prints a table
with the old tool's figures on an H200 beside ours, as ratios. Also times, in the same
run, a status sweep done the old way (every NVML call in series, PCIe counters included)
against the backend directly.

    python -m tests.benchmarks.bench_agent [--real] [--simulate NODE] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.benchmarks.loadgen import LoadResult, run_load, run_load_processes
from tests.support.services import free_port, port_open, stop_process, wait_until

PATHS = ("/gpu/status/json", "/gpu/info/json", "/docker/cli")
CLIENTS = (1, 16, 64)

# nvidia-docker-plugin 1.0.1 on one H200 (driver 580), one closed-loop client process.
OLD_TOOL = {
    ("/gpu/status/json", 1): {"rate": 23.0, "p50_ms": 43.0},
    ("/gpu/status/json", 64): {"rate": 416.0, "p50_ms": 153.0, "p99_ms": 184.0},
    ("/gpu/info/json", 64): {"rate": 25_700.0, "p99_ms": 5.6},
    ("/docker/cli", 64): {"rate": 21_500.0},
}
OLD_TOOL_RSS_MB = 57.0


def _memory_mb(pid: int) -> dict[str, float]:
    """Resident memory of a process, MB: total, peak, anonymous (heap, stacks) and file."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    keys = {"rss": "VmRSS", "peak": "VmHWM", "anon": "RssAnon", "file": "RssFile"}
    return {name: int(fields[key].split()[0]) / 1024 for name, key in keys.items() if key in fields}


def _old_way_sweep_ms(simulate: str | None, rounds: int) -> float:
    """Median time of one status sweep done the old way: every call in series, PCIe included."""
    from agent.backends import open_backend  # noqa: PLC0415

    backend = open_backend(simulate)
    try:
        count = len(backend.node_info().devices)
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            for index in range(count):
                backend.device_status(index)
                backend.pcie_throughput(index)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1e3
    finally:
        backend.close()


def _ratio_notes(result: LoadResult, real: bool) -> str:
    old = OLD_TOOL.get((result.path, result.clients))
    if not old or not real:
        return ""
    notes = [f"rate x{result.rate_per_s / old['rate']:.1f} vs 1.0.1"]
    if "p50_ms" in old:
        notes.append(f"p50 {old['p50_ms'] / result.p50_ms:.0f}x lower")
    if "p99_ms" in old:
        notes.append(f"p99 {old['p99_ms'] / result.p99_ms:.1f}x lower")
    return "  [" + ", ".join(notes) + "]"


async def _measure(port: int, duration_s: float) -> list[LoadResult]:
    results = []
    for path in PATHS:
        for clients in CLIENTS:
            results.append(await run_load("127.0.0.1", port, path, clients, duration_s))
    return results


def _measure_spread(port: int, duration_s: float, processes: int) -> list[LoadResult]:
    """64 clients spread over several client processes: shows whether one client process
    (the old tool's method) is what limits the rate."""
    return [
        run_load_processes("127.0.0.1", port, path, 64, duration_s, processes) for path in PATHS
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="serve the real GPUs (NVML)")
    parser.add_argument("--simulate", default="hgx-h200-8", help="node file or built-in name")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="also measure 64 clients spread over this many client processes",
    )
    args = parser.parse_args()
    simulate = None if args.real else args.simulate

    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="nvd-bench-"))
    cmd = [sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}"]
    cmd += ["-s", str(workdir / "sock"), "-d", str(workdir / "volumes")]
    if simulate:
        cmd += ["--simulate", simulate]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: port_open(port), what="agent", timeout_s=120, proc=proc)
        idle = _memory_mb(proc.pid)
        results = asyncio.run(_measure(port, args.duration))
        spread = (
            _measure_spread(port, args.duration, args.client_procs) if args.client_procs > 1 else []
        )
        loaded = _memory_mb(proc.pid)
    finally:
        stop_process(proc)
        proc.communicate()
    old_way_ms = _old_way_sweep_ms(simulate, rounds=5 if simulate else 20)

    where = "real GPUs (NVML)" if args.real else f"simulated node {simulate}"
    print(f"nvidia-docker-plugin benchmark: {where}; {platform.node()}, {os.cpu_count()} CPUs")
    for result in results:
        print(result.row() + _ratio_notes(result, args.real))
    for result in spread:
        print(result.row() + f"  [{args.client_procs} client processes]")
    status_1 = next(r for r in results if r.path == "/gpu/status/json" and r.clients == 1)
    print(
        f"status sweep the old way (serial, PCIe per request): {old_way_ms:.1f} ms; "
        f"ours p50 with 1 client {status_1.p50_ms:.3f} ms: {old_way_ms / status_1.p50_ms:.0f}x"
    )
    print(
        f"resident memory: {idle['rss']:.1f} MB idle (anonymous {idle.get('anon', 0):.1f}, "
        f"file-backed {idle.get('file', 0):.1f}), {loaded['rss']:.1f} MB after load (peak "
        f"{loaded['peak']:.1f} MB); 1.0.1: {OLD_TOOL_RSS_MB:.0f} MB, ratio "
        f"{loaded['rss'] / OLD_TOOL_RSS_MB:.2f}"
    )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "where": where,
                    "host": platform.node(),
                    "cpus": os.cpu_count(),
                    "results": [
                        {
                            "path": r.path,
                            "clients": r.clients,
                            "rate_per_s": round(r.rate_per_s),
                            "p50_ms": round(r.p50_ms, 3),
                            "p99_ms": round(r.p99_ms, 3),
                            "errors": r.errors,
                        }
                        for r in results
                    ],
                    "spread_64_clients": [
                        {
                            "path": r.path,
                            "processes": args.client_procs,
                            "rate_per_s": round(r.rate_per_s),
                            "p50_ms": round(r.p50_ms, 3),
                            "p99_ms": round(r.p99_ms, 3),
                        }
                        for r in spread
                    ],
                    "old_way_sweep_ms": round(old_way_ms, 2),
                    "memory_mb": {"idle": idle, "loaded": loaded},
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
