"""SIGHUP under load: does a re-read with nothing changed disturb a single request?

Starts a real ``nvidia-docker-plugin`` (the real GPUs with ``--real``, else a simulated
node), loads ``/gpu/status/json`` with ``--clients`` keep-alive connections (closed loop),
sends ``--sighups`` SIGHUPs one after another (each once the previous re-read has logged
its line), and prints: requests, failures (any answer but 200, any broken connection), the
longest request overall and the longest one that overlapped a re-read.

    python -m tests.benchmarks.bench_reload [--real] [--clients 64] [--sighups 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.benchmarks.status_loop import Loop, client
from tests.support.services import free_port, port_open, stop_process, wait_until

REREAD_LINE = "Reload: driver"


def _rereads(log: Path) -> int:
    return log.read_text(errors="replace").count(REREAD_LINE)


async def _run(
    port: int, proc: subprocess.Popen[bytes], log: Path, args: argparse.Namespace
) -> int:
    load = Loop()
    clients = [asyncio.create_task(client(port, args.path, load)) for _ in range(args.clients)]
    windows: list[tuple[float, float]] = []
    try:
        await asyncio.sleep(args.warmup)
        for number in range(1, args.sighups + 1):
            sent = time.monotonic()
            proc.send_signal(signal.SIGHUP)
            while (await asyncio.to_thread(_rereads, log)) < number:
                if time.monotonic() - sent > 30:
                    print(f"SIGHUP {number}: no re-read logged within 30 s", file=sys.stderr)
                    return 1
                await asyncio.sleep(0.005)
            windows.append((sent, time.monotonic()))
            await asyncio.sleep(args.pause)
    finally:
        load.stop = True
        await asyncio.gather(*clients, return_exceptions=True)
    failed = [r for r in load.requests if r[2] != 200]
    longest = max(end - start for start, end, _ in load.requests)
    during = [
        end - start
        for start, end, _ in load.requests
        if any(start <= w_end and end >= w_start for w_start, w_end in windows)
    ]
    reread_ms = [1e3 * (end - start) for start, end in windows]
    print(
        f"{len(load.requests)} requests, {len(failed)} failed, {len(load.broken)} broken "
        f"connections; longest request {1e3 * longest:.2f} ms overall, "
        f"{1e3 * max(during, default=0.0):.2f} ms during a re-read ({len(during)} requests "
        f"overlapped one); re-read took {min(reread_ms):.1f}-{max(reread_ms):.1f} ms"
    )
    for reason in load.broken[:5]:
        print(f"  broken: {reason}")
    return 0 if not failed and not load.broken else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="serve the real GPUs (NVML)")
    parser.add_argument("--simulate", default="h200", help="node file or built-in name")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--sighups", type=int, default=10)
    parser.add_argument("--pause", type=float, default=0.3, help="seconds between re-reads")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--path", default="/gpu/status/json")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="nvd-bench-reload-"))
    port = free_port()
    command = [sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}"]
    command += ["-s", str(workdir / "sock"), "-d", str(workdir / "volumes")]
    if not args.real:
        command += ["--simulate", args.simulate]
    log = workdir / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: port_open(port), what="agent", timeout_s=120, proc=proc)
        where = "real GPUs (NVML)" if args.real else f"simulated node {args.simulate}"
        print(
            f"SIGHUP under load: {where}; {args.clients} keep-alive clients on {args.path}, "
            f"{args.sighups} SIGHUPs; {platform.node()}, {os.cpu_count()} CPUs"
        )
        code = asyncio.run(_run(port, proc, log, args))
        if "Traceback" in log.read_text(errors="replace"):
            print(log.read_text(errors="replace"), file=sys.stderr)
            code = 1
        return code
    finally:
        stop_process(proc)


if __name__ == "__main__":
    sys.exit(main())
