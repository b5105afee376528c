"""/metrics benchmark: scrape latency and rate against /gpu/status/json, and the memory it adds.

Starts a real ``nvidia-docker-plugin`` (simulated 8-GPU node by default, or the real GPUs
with ``--real``) on a free loopback port and, in the same run, loads ``/gpu/status/json``,
``/metrics`` and ``/gpu/processes/json`` with 1 and 16 closed-loop keep-alive clients
(a Prometheus server scrapes with one connection; 16 stands for many servers or a
dashboard burst). Memory:

- import: what importing the exporter (prometheus_client and ``agent.metrics``) adds to a
  fresh interpreter that has already imported the rest of the agent's serving code;
- scrapes: the agent's resident memory after the status load, then after the /metrics load
  (what scraping itself keeps: caches, counters, the last rendered sweep).

    python -m tests.benchmarks.bench_metrics [--real] [--simulate NODE] [--duration S] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from tests.benchmarks.loadgen import (
    LoadGenerator,
    Measurement,
    client_procs_option,
    describe_client_procs,
    plan_processes,
)
from tests.benchmarks.proc_usage import resident_memory, usable_cpus
from tests.support.services import free_port, port_open, stop_process, wait_until

PATHS = ("/gpu/status/json", "/metrics", "/gpu/processes/json")
CLIENTS = (1, 16)


def _import_cost_mb() -> dict[str, float]:
    """RSS a fresh interpreter gains by importing the exporter, after the rest of serving."""
    probe = """
import json, sys
def rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
import aiohttp.web, agent.node.status, agent.node.state, agent.api.render_json  # noqa
import agent.attribution.owners  # noqa
before = rss_kib()
import prometheus_client, agent.metrics.service  # noqa
after = rss_kib()
print(json.dumps({"before_mb": before / 1024, "after_mb": after / 1024,
                  "added_mb": (after - before) / 1024}))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def _body_size(port: int, path: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return len(resp.read())


def _memory_mb(pid: int) -> dict[str, float]:
    return resident_memory(pid).as_json()


def _load(
    load: LoadGenerator, path: str, duration_s: float, server_pid: int, setting: int | None
) -> list[Measurement]:
    cpus = usable_cpus()
    return [
        load.measure(
            path, clients, plan_processes(clients, setting, cpus), duration_s, server_pid, cpus
        )
        for clients in CLIENTS
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="serve the real GPUs (NVML)")
    parser.add_argument("--simulate", default="hgx-h200-8", help="node file or built-in name")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--client-procs",
        type=client_procs_option,
        default=None,
        metavar="auto|N",
        help="client processes per row (auto: one per connection, up to CPUs - 1)",
    )
    args = parser.parse_args()
    simulate = None if args.real else args.simulate

    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="nvd-bench-metrics-"))
    cmd = [sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}"]
    cmd += ["-s", str(workdir / "sock"), "-d", str(workdir / "volumes")]
    if simulate:
        cmd += ["--simulate", simulate]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    results: dict[str, list[Measurement]] = {}
    try:
        wait_until(lambda: port_open(port), what="agent", timeout_s=120, proc=proc)
        sizes = {path: _body_size(port, path) for path in PATHS}
        idle = _memory_mb(proc.pid)
        with LoadGenerator("127.0.0.1", port) as load:
            setting = args.client_procs
            results["/gpu/status/json"] = _load(
                load, "/gpu/status/json", args.duration, proc.pid, setting
            )
            after_status = _memory_mb(proc.pid)
            for path in PATHS[1:]:
                results[path] = _load(load, path, args.duration, proc.pid, setting)
        after_metrics = _memory_mb(proc.pid)
    finally:
        stop_process(proc)
        proc.communicate()
    imported = _import_cost_mb()

    where = "real GPUs (NVML)" if args.real else f"simulated node {simulate}"
    print(f"/metrics benchmark: {where}; {platform.node()}, {os.cpu_count()} CPUs")
    print(f"client processes per row: {describe_client_procs(args.client_procs, usable_cpus())}")
    for path in PATHS:
        print(f"{path}: body {sizes[path]:,} bytes")
        for result in results[path]:
            print("  " + result.row())
    status_1 = results["/gpu/status/json"][0]
    metrics_1 = results["/metrics"][0]
    print(
        f"one scrape costs {metrics_1.p50_ms:.3f} ms (p50, 1 client) against "
        f"{status_1.p50_ms:.3f} ms for /gpu/status/json: x{metrics_1.p50_ms / status_1.p50_ms:.1f}"
    )
    print(
        f"memory: importing the exporter adds {imported['added_mb']:.1f} MB; the agent "
        f"{idle['rss']:.1f} MB idle, {after_status['rss']:.1f} MB after the status load, "
        f"{after_metrics['rss']:.1f} MB after the /metrics load "
        f"(+{after_metrics['rss'] - after_status['rss']:.1f} MB)"
    )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "where": where,
                    "host": platform.node(),
                    "cpus": os.cpu_count(),
                    "body_bytes": sizes,
                    "results": [r.as_json() for path in PATHS for r in results[path]],
                    "memory_mb": {
                        "import_added": round(imported["added_mb"], 2),
                        "idle": idle,
                        "after_status_load": after_status,
                        "after_metrics_load": after_metrics,
                    },
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
