"""A closed-loop HTTP/1.1 load generator: N keep-alive connections, one request in flight each.

Written on raw asyncio streams so that the client costs little next to the server it
measures. Bounded in time (and by an optional request count): it always stops by itself.
Loopback targets only.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadResult:
    path: str
    clients: int
    requests: int
    errors: int
    elapsed_s: float
    p50_ms: float
    p99_ms: float

    @property
    def rate_per_s(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0

    def row(self) -> str:
        return (
            f"{self.path:<20} {self.clients:>4} clients {self.rate_per_s:>10,.0f} req/s "
            f"p50 {self.p50_ms:>8.3f} ms  p99 {self.p99_ms:>8.3f} ms"
            + (f"  ({self.errors} errors)" if self.errors else "")
        )


async def _client(
    host: str,
    port: int,
    request: bytes,
    deadline: float,
    latencies: list[float],
    errors: list[int],
    budget: list[int],
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while budget[0] > 0 and time.perf_counter() < deadline:
            budget[0] -= 1
            started = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
                    break
            if length:
                await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            if not head.startswith(b"HTTP/1.1 200"):
                errors[0] += 1
    finally:
        writer.close()
        await writer.wait_closed()


async def _closed_loop(
    host: str,
    port: int,
    path: str,
    clients: int,
    duration_s: float,
    max_requests: int = 2_000_000,
    warmup_s: float = 0.3,
) -> tuple[list[float], int, float]:
    """Warm up, then ``clients`` connections for ``duration_s``: latencies, errors, elapsed."""
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    if warmup_s:
        await asyncio.gather(
            *(
                _client(host, port, request, time.perf_counter() + warmup_s, [], [0], [10_000])
                for _ in range(clients)
            )
        )
    latencies: list[float] = []
    errors = [0]
    budget = [max_requests]
    started = time.perf_counter()
    deadline = started + duration_s
    await asyncio.gather(
        *(_client(host, port, request, deadline, latencies, errors, budget) for _ in range(clients))
    )
    return latencies, errors[0], time.perf_counter() - started


async def run_load(
    host: str,
    port: int,
    path: str,
    clients: int,
    duration_s: float,
    max_requests: int = 2_000_000,
    warmup_s: float = 0.3,
) -> LoadResult:
    """Closed-loop load for ``duration_s`` (after a short warm-up) with ``clients`` connections."""
    latencies, errors, elapsed = await _closed_loop(
        host, port, path, clients, duration_s, max_requests, warmup_s
    )
    return _result(path, clients, latencies, errors, elapsed)


def _result(
    path: str, clients: int, latencies: list[float], errors: int, elapsed: float
) -> LoadResult:
    latencies.sort()
    p50 = statistics.median(latencies) if latencies else float("nan")
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else 0.0
    return LoadResult(path, clients, len(latencies), errors, elapsed, p50 * 1e3, p99 * 1e3)


def _load_in_child(
    host: str, port: int, path: str, clients: int, duration_s: float
) -> tuple[list[float], int, float]:
    return asyncio.run(_closed_loop(host, port, path, clients, duration_s))


def run_load_processes(
    host: str, port: int, path: str, clients: int, duration_s: float, processes: int
) -> LoadResult:
    """The same closed loop spread over several client processes (is the client the limit?)."""
    per = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        parts = list(
            pool.map(
                _load_in_child, *zip(*[(host, port, path, n, duration_s) for n in per], strict=True)
            )
        )
    latencies = [lat for part in parts for lat in part[0]]
    errors = sum(part[1] for part in parts)
    elapsed = max(part[2] for part in parts)
    return _result(path, clients, latencies, errors, elapsed)
