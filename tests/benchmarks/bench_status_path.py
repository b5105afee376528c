"""Where a status request's time goes, piece by piece, in one run (medians of many calls).

- ``ping-pong``: two processes exchanging a 20-byte and a 500-byte message over a unix socket
  pair (the floor of any round trip to a child process on this machine);
- ``thread hop``: ``run_in_executor`` of a call that does nothing (what the daemon paid
  before the GPU worker, per sweep);
- ``backend read``: the status read of every GPU, in this process (NVML with ``--real``,
  the simulated node otherwise: its node file's ``timing`` is dropped, so that only our
  code is measured), after one PCIe sample, as in the agent (the sampler reads the slow
  counters, a status read serves them);
- ``worker round trip``: ``WorkerClient.read_statuses`` against a real worker process;
- ``codec``: encoding, framing, parsing and decoding the statuses, in this process.

    python -m tests.benchmarks.bench_status_path [--real] [--node h200] [--calls 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from agent.gpu import nodefile
from agent.gpu import worker_protocol as wp
from agent.gpu.backends import open_backend
from agent.gpu.worker_client import WorkerClient


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


async def _timed(call: Callable[[], Awaitable[object]], calls: int) -> float:
    for _ in range(min(200, calls)):
        await call()
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - started)
    return _median_us(samples)


async def ping_pong(calls: int) -> float:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: answer 500 bytes to every 20-byte message
        ours.close()
        while head := theirs.recv(4):
            theirs.recv(struct.unpack(">I", head)[0])
            theirs.sendall(struct.pack(">I", 500) + b"x" * 500)
        os._exit(0)
    theirs.close()
    ours.setblocking(False)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_unix_connection(sock=ours)

    async def exchange() -> None:
        writer.write(struct.pack(">I", 20) + b"y" * 20)
        await reader.readexactly(504)

    try:
        return await _timed(exchange, calls)
    finally:
        writer.close()
        await loop.run_in_executor(None, os.waitpid, pid, 0)


async def thread_hop(calls: int) -> float:
    loop = asyncio.get_running_loop()
    return await _timed(lambda: loop.run_in_executor(None, int), calls)


def _node_without_timing(name: str, directory: Path) -> str:
    raw = json.loads(nodefile.resolve(name).read_text(encoding="utf-8"))
    raw.pop("timing", None)
    path = directory / f"{name}-no-timing.json"
    path.write_text(json.dumps(raw), encoding="utf-8")
    return str(path)


async def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_status_path")
    parser.add_argument("--real", action="store_true", help="the real GPUs (NVML)")
    parser.add_argument("--node", default="h200", help="simulated node (without --real)")
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        simulate = None if args.real else _node_without_timing(args.node, Path(tmp))
        backend = open_backend(simulate)
        count = len(backend.node_info().devices)
        loop = asyncio.get_running_loop()
        for index in range(count):  # the sampler's part, as in the agent
            backend.pcie_throughput(index)

        async def read_in_process() -> object:
            return [backend.device_status(i) for i in range(count)]

        rows = {
            "ping-pong (two processes, unix socket)": await ping_pong(args.calls),
            "thread hop (run_in_executor, no work)": await thread_hop(args.calls),
            f"backend read, in process ({count} GPU(s))": await _timed(read_in_process, args.calls),
        }
        statuses = [backend.device_status(i) for i in range(count)]
        backend.close()
        frame = wp.frame({"id": 1, "ok": [wp.encode_status(s) for s in statuses]})

        async def codec() -> object:
            answer = wp.frame({"id": 1, "ok": [wp.encode_status(s) for s in statuses]})
            (message,) = wp.FrameReader().feed(answer)
            return [wp.decode_status(item) for item in message["ok"]]

        rows[f"codec (encode, frame, parse, decode; {len(frame)} bytes)"] = await _timed(
            codec, args.calls
        )
        worker = await WorkerClient.spawn(simulate=simulate)
        await worker.read_throughputs()
        try:
            rows["worker round trip (read_statuses)"] = await _timed(
                worker.read_statuses, args.calls
            )
        finally:
            await worker.stop()
        del loop
    where = "real GPUs (NVML)" if args.real else f"simulated {args.node}, no timing"
    print(f"status path, {where}, medians of {args.calls} calls:")
    for name, value in rows.items():
        print(f"  {name:<55} {value:8.1f} us")
    trip = rows["worker round trip (read_statuses)"]
    floor = rows["ping-pong (two processes, unix socket)"]
    print(f"  worker round trip / ping-pong floor: {trip / floor:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
