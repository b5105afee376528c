"""What the GPU worker costs on the status hot path: NVML in the daemon (before) vs in a child.

"Before" is the agent as it was before the worker (by default commit ``b813a62``, exported
with ``git archive``; or any checkout with ``--before-dir``), "after" is this checkout. In
one run, interleaved ``--rounds`` times, each variant's daemon serves the same simulated
node (or the real GPUs with ``--real``) on a free loopback port and is measured with the
keep-alive closed-loop clients of ``status_loop``: ``/gpu/status/json`` with 1 client (p50) and 64
(rate); then resident memory (the daemon, plus its worker after).

    python -m tests.benchmarks.bench_worker [--node h200 --node hgx-h200-8] [--real]
        [--before-rev REV | --before-dir DIR] [--rounds 2] [--duration 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.benchmarks.status_loop import run_for
from tests.support.services import free_port, port_open, python_path, stop_process, wait_until

REPO = Path(__file__).resolve().parents[2]
BEFORE_REV = "b813a62"  # the last commit with NVML inside the daemon
PATH = "/gpu/status/json"


@dataclass
class Result:
    p50_1_ms: float
    rate_64: float
    p99_64_ms: float
    rss_mb: float  # the daemon, plus its GPU worker when there is one
    errors: int


def _export(rev: str, into: Path) -> Path:
    archive = into / "before.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(REPO), "archive", rev], stdout=out, check=True)
    target = into / "before"
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target


def _rss_mb(pid: int) -> float:
    total = 0.0
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        pids += [int(child) for child in children]
    for each in pids:
        for line in Path(f"/proc/{each}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


def _measure(source: Path, node: str | None, duration_s: float, workdir: Path) -> Result:
    port = free_port()
    command = [sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}"]
    command += ["-s", str(workdir / "sock"), "-d", str(workdir / "volumes")]
    if node is not None:
        command += ["--simulate", node]
    env = dict(os.environ, PYTHONPATH=python_path(source))
    proc = subprocess.Popen(
        command, cwd=source, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: port_open(port), what="agent", timeout_s=120, proc=proc)
        one, _ = asyncio.run(run_for(port, PATH, 1, duration_s))
        many, elapsed_s = asyncio.run(run_for(port, PATH, 64, duration_s))
        rss = _rss_mb(proc.pid)
    finally:
        stop_process(proc)
    rate = len(many.requests) / elapsed_s
    return Result(one.p50_ms(), rate, many.p99_ms(), rss, one.failed() + many.failed())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", action="append", help="simulated node (default h200, hgx-h200-8)")
    parser.add_argument("--real", action="store_true", help="the real GPUs (NVML) instead")
    parser.add_argument("--before-rev", default=BEFORE_REV)
    parser.add_argument("--before-dir", type=Path, help="a checkout of the agent before")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    args = parser.parse_args()
    nodes: list[str | None] = [None] if args.real else (args.node or ["h200", "hgx-h200-8"])
    workdir = Path(tempfile.mkdtemp(prefix="nvd-bench-worker-"))
    try:
        before = args.before_dir or _export(args.before_rev, workdir)
        variants = {"before (NVML in the daemon)": before, "after (GPU worker)": REPO}
        print(
            f"GPU worker cost: {PATH}; {platform.node()}, {os.cpu_count()} CPUs; before = "
            f"{args.before_dir or args.before_rev}; {args.rounds} interleaved rounds of "
            f"{args.duration:g} s"
        )
        for node in nodes:
            results: dict[str, list[Result]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, source in variants.items():
                    results[name].append(_measure(source, node, args.duration, workdir))
            print(f"node: {node or 'real GPUs'}")
            for name, rounds in results.items():
                p50 = ", ".join(f"{r.p50_1_ms:.3f}" for r in rounds)
                rate = ", ".join(f"{r.rate_64:,.0f}" for r in rounds)
                p99 = ", ".join(f"{r.p99_64_ms:.1f}" for r in rounds)
                rss = statistics.mean(r.rss_mb for r in rounds)
                errors = sum(r.errors for r in rounds)
                print(
                    f"  {name:<28} 1 client p50 {p50} ms | 64 clients {rate} req/s, "
                    f"p99 {p99} ms | RSS {rss:.1f} MB | {errors} errors"
                )
            names = list(results)
            p50_cost = statistics.median(r.p50_1_ms for r in results[names[1]]) - statistics.median(
                r.p50_1_ms for r in results[names[0]]
            )
            rate_ratio = statistics.median(
                r.rate_64 for r in results[names[1]]
            ) / statistics.median(r.rate_64 for r in results[names[0]])
            print(
                f"  worker: p50 {p50_cost * 1e3:+.0f} µs with 1 client, "
                f"rate x{rate_ratio:.2f} with 64"
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
