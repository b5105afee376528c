"""Keep-alive closed-loop clients for the node-life benchmarks (bench_worker, bench_reload).

``clients`` HTTP/1.1 connections on raw asyncio streams, one request in flight each, every
request kept as (start, end, status). Small and self-contained on purpose: these
benchmarks measure one route under one load and must not move when the general load
generator (loadgen) changes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from tests.benchmarks.loadgen import read_answer


@dataclass
class Loop:
    requests: list[tuple[float, float, int]] = field(default_factory=list)  # start, end, status
    broken: list[str] = field(default_factory=list)  # connections that failed, and how
    stop: bool = False

    def latencies_ms(self) -> list[float]:
        return sorted(1e3 * (end - start) for start, end, _ in self.requests)

    def p50_ms(self) -> float:
        return statistics.median(self.latencies_ms()) if self.requests else float("nan")

    def p99_ms(self) -> float:
        latencies = self.latencies_ms()
        return latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0.0

    def failed(self) -> int:
        return sum(1 for _, _, status in self.requests if status != 200) + len(self.broken)


async def client(port: int, path: str, loop: Loop) -> None:
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as err:
        loop.broken.append(f"connect: {err}")
        return
    try:
        while not loop.stop:
            started = time.monotonic()
            writer.write(request)
            head = await read_answer(reader)
            loop.requests.append((started, time.monotonic(), int(head.split(b" ", 2)[1])))
    except (OSError, asyncio.IncompleteReadError) as err:
        loop.broken.append(f"{type(err).__name__}: {err}")
    finally:
        writer.close()


async def run_for(
    port: int, path: str, clients: int, duration_s: float, warmup_s: float = 0.3
) -> tuple[Loop, float]:
    """``clients`` connections for ``duration_s`` after a warm-up; the loop and its seconds."""
    if warmup_s:
        warm = Loop()
        tasks = [asyncio.create_task(client(port, path, warm)) for _ in range(clients)]
        await asyncio.sleep(warmup_s)
        warm.stop = True
        await asyncio.gather(*tasks)
    loop = Loop()
    started = time.monotonic()
    tasks = [asyncio.create_task(client(port, path, loop)) for _ in range(clients)]
    await asyncio.sleep(duration_s)
    loop.stop = True
    await asyncio.gather(*tasks)
    return loop, time.monotonic() - started
