"""Lease benchmark: what an ask costs, and 100 asks at once for 8 GPUs.

Starts a real ``nvidia-docker-plugin`` on a simulated 8-GPU node (``hgx-h200-8``; its lease
state in a private directory) on a free loopback port, then, in one run:

1. on one kept-alive connection, ``--rounds`` times each: ``POST /leases`` for 1 GPU and
   for 4 (the best-connected set of 8), each followed by its ``DELETE``, and, for scale,
   ``GET /gpu/info/json`` (the API's cheapest JSON route): p50/p99 of each and their ratio;
2. 100 asks at once (``--procs`` processes of ``--asks`` threads, each its own
   connection), each for 1 GPU with ``wait_s`` 60, holding its lease ``--hold`` seconds and
   then releasing it: the 8 GPUs serve them in turn through the queue. It reports how long
   the last one waited, p50/p99 of the time to a grant, and checks from the clients' own
   clocks (``CLOCK_MONOTONIC``, one clock for every process) that no two clients ever held
   the same GPU at once.

    python -m tests.benchmarks.bench_leases [--rounds 1000] [--procs 10] [--asks 10]
        [--hold 0.05]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.support.services import free_port, port_open, stop_process, wait_until

NODE = "hgx-h200-8"
HOST = "127.0.0.1"

Held = tuple[str, float, float]  # (GPU UUID, granted at, released at): the clients' clock


def _start_agent(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    log = (workdir / "agent.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.daemon", "--simulate", NODE, "--listen", f"{HOST}:{port}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).resolve().parents[2],
    )
    wait_until(lambda: port_open(port, HOST), timeout_s=30, what="the agent's REST port", proc=proc)
    return proc


def _request(
    conn: http.client.HTTPConnection, method: str, path: str, body: object = None
) -> tuple[int, dict[str, object]]:
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    answer = conn.getresponse()
    raw = answer.read()
    decoded = json.loads(raw) if raw.startswith(b"{") else {}
    return answer.status, decoded


def _percentiles(times_s: list[float]) -> tuple[float, float]:
    ordered = sorted(times_s)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered) * 1e3, p99 * 1e3


def sequential(port: int, rounds: int) -> dict[str, tuple[float, float]]:
    """p50/p99 (ms) of each request kind, on one kept-alive connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    times: dict[str, list[float]] = {
        "info": [],
        "ask 1": [],
        "release 1": [],
        "ask 4": [],
        "release 4": [],
    }
    for _ in range(rounds):
        for count in (1, 4):
            started = time.perf_counter()
            status, body = _request(conn, "POST", "/leases", {"count": count})
            times[f"ask {count}"].append(time.perf_counter() - started)
            if status != 201:
                raise SystemExit(f"ask for {count} answered {status}: {body}")
            started = time.perf_counter()
            status, body = _request(conn, "DELETE", f"/leases/{body['Lease']}")
            times[f"release {count}"].append(time.perf_counter() - started)
            if status != 200:
                raise SystemExit(f"release answered {status}: {body}")
        started = time.perf_counter()
        status, _ = _request(conn, "GET", "/gpu/info/json")
        times["info"].append(time.perf_counter() - started)
    conn.close()
    return {name: _percentiles(values) for name, values in times.items()}


def _asker(port: int, hold_s: float, go: threading.Event, out: list[object]) -> None:
    conn = http.client.HTTPConnection(HOST, port, timeout=120)
    conn.connect()
    go.wait()
    asked = time.monotonic()
    status, body = _request(conn, "POST", "/leases", {"count": 1, "wait_s": 60})
    granted = time.monotonic()
    if status != 201:
        out.append(f"{status}: {body.get('Error')}")
        return
    time.sleep(hold_s)
    released = time.monotonic()
    status, answer = _request(conn, "DELETE", f"/leases/{body['Lease']}")
    conn.close()
    if status != 200:
        out.append(f"release {status}: {answer.get('Error')}")
        return
    devices = body["Devices"]
    assert isinstance(devices, list)
    out.append((granted - asked, str(devices[0]["UUID"]), granted, released))


def _process(port: int, asks: int, hold_s: float, start_at: float, queue: object) -> None:
    go = threading.Event()
    out: list[object] = []
    threads = [threading.Thread(target=_asker, args=(port, hold_s, go, out)) for _ in range(asks)]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, start_at - time.monotonic()))  # every process starts together
    go.set()
    for thread in threads:
        thread.join()
    queue.put(out)  # type: ignore[attr-defined]


def concurrent(port: int, procs: int, asks: int, hold_s: float) -> dict[str, object]:
    """Every ask at once; what each waited and whether any GPU had two holders."""
    queue: multiprocessing.Queue[list[object]] = multiprocessing.Queue()
    start_at = time.monotonic() + 1.0
    workers = [
        multiprocessing.Process(target=_process, args=(port, asks, hold_s, start_at, queue))
        for _ in range(procs)
    ]
    for worker in workers:
        worker.start()
    results: list[object] = []
    for _ in workers:
        results += queue.get(timeout=300)
    for worker in workers:
        worker.join()
    failures = [r for r in results if isinstance(r, str)]
    served = [r for r in results if isinstance(r, tuple)]
    waits = [float(r[0]) for r in served]
    held: list[Held] = [(str(r[1]), float(r[2]), float(r[3])) for r in served]
    overlaps = 0
    by_gpu: dict[str, list[Held]] = {}
    for hold in held:
        by_gpu.setdefault(hold[0], []).append(hold)
    for holds in by_gpu.values():
        holds.sort(key=lambda h: h[1])
        overlaps += sum(1 for a, b in itertools.pairwise(holds) if b[1] < a[2])
    p50, p99 = _percentiles(waits) if waits else (0.0, 0.0)
    return {
        "asks": procs * asks,
        "served": len(served),
        "failures": failures[:5],
        "gpus used": len(by_gpu),
        "overlaps": overlaps,
        "grant p50 ms": p50,
        "grant p99 ms": p99,
        "longest wait ms": max(waits) * 1e3 if waits else 0.0,
        "ideal longest wait ms": (procs * asks / len(by_gpu) - 1) * hold_s * 1e3 if by_gpu else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=10)
    parser.add_argument("--asks", type=int, default=10)
    parser.add_argument("--hold", type=float, default=0.05)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-leases-") as tmp:
        port = free_port()
        agent = _start_agent(port, Path(tmp))
        try:
            figures = sequential(port, args.rounds)
            crowd = concurrent(port, args.procs, args.asks, args.hold)
        finally:
            stop_process(agent, timeout_s=30)
    info_p50 = figures["info"][0]
    print(f"lease requests on {NODE} (simulated), {args.rounds} rounds, one connection:")
    for name, (p50, p99) in figures.items():
        ratio = p50 / info_p50 if info_p50 else 0.0
        print(
            f"  {name:<10} p50 {p50:6.3f} ms  p99 {p99:6.3f} ms  ({ratio:.2f}x GET /gpu/info/json)"
        )
    print(
        f"{crowd['asks']} asks at once ({args.procs} processes x {args.asks}), 1 GPU each, "
        f"held {args.hold * 1e3:.0f} ms:"
    )
    for name, value in crowd.items():
        shown = f"{value:.1f}" if isinstance(value, float) else value
        print(f"  {name}: {shown}")
    if crowd["overlaps"] or crowd["failures"] or crowd["served"] != crowd["asks"]:
        raise SystemExit("FAILED: a GPU had two holders, or an ask was not served")


if __name__ == "__main__":
    main()
