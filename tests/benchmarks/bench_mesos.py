"""Mesos benchmark: ``/mesos/cli`` requests per second and p99, and zlib-ng against zlib.

Loads ``/mesos/cli`` (legacy and native) with one closed-loop client process, 1, 16 and 64
keep-alive connections, against a running agent (``--url``) or one it starts itself on a
free loopback port (simulated 8-GPU HGX node by default). Then encodes that node's
``/gpu/info/json`` body with zlib-ng and with the standard library's zlib at the same level
and prints time and size ratios measured in the same run.

    python -m tests.benchmarks.bench_mesos [--url http://127.0.0.1:3476] [--simulate NODE]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from zlib_ng import zlib_ng

from mesos.blob import COMPRESSION_LEVEL, decode, encode
from tests.benchmarks.loadgen import LoadResult, run_load
from tests.support.services import free_port, port_open, stop_process, wait_until

PATHS = ("/mesos/cli", "/mesos/cli?format=native")
CLIENTS = (1, 16, 64)
OLD_TOOL_64 = {"rate": 7_960.0, "p99_ms": 31.0}
"""nvidia-docker-plugin 1.0.1 on one H200, /mesos/cli with 64 clients."""


@contextmanager
def agent_url(url: str | None, simulate: str) -> Iterator[str]:
    """``url``, or the URL of an agent started here for the benchmark (stopped after)."""
    if url:
        yield url.rstrip("/")
        return
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nvd-bench-mesos-") as workdir:
        command = [sys.executable, "-m", "agent.daemon", "--simulate", simulate]
        command += ["-l", f"127.0.0.1:{port}", "-s", f"{workdir}/sock", "-d", f"{workdir}/vol"]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: port_open(port), what="agent", timeout_s=120, proc=proc)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop_process(proc)


def _median_s(action: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def compression_rows(info_json: bytes, rounds: int) -> list[str]:
    """zlib-ng against the standard zlib on the blob's encoding, same data, same run."""
    rows = [f"info JSON: {len(info_json)} bytes; median of {rounds} rounds each"]
    for level in sorted({COMPRESSION_LEVEL, 6, 1}, reverse=True):
        ng_s = _median_s(lambda lv=level: zlib_ng.compress(info_json, lv), rounds)  # type: ignore[misc]
        std_s = _median_s(lambda lv=level: zlib.compress(info_json, lv), rounds)  # type: ignore[misc]
        ng_size = len(zlib_ng.compress(info_json, level))
        std_size = len(zlib.compress(info_json, level))
        mark = "  <- the blob's level" if level == COMPRESSION_LEVEL else ""
        rows.append(
            f"level {level}: zlib-ng {ng_s * 1e6:7.1f} us, {ng_size} B; "
            f"zlib {std_s * 1e6:7.1f} us, {std_size} B; "
            f"zlib-ng {std_s / ng_s:.1f}x faster, size ratio {ng_size / std_size:.3f}{mark}"
        )
    blob = encode(info_json)
    encode_s = _median_s(lambda: encode(info_json), rounds)
    decode_s = _median_s(lambda: decode(blob), rounds)
    padded = blob + "=" * (-len(blob) % 4)
    assert zlib.decompress(base64.urlsafe_b64decode(padded)) == info_json
    rows.append(
        f"blob: {len(blob)} characters ({len(blob) / len(info_json):.2f} of the JSON); "
        f"encode {encode_s * 1e6:.1f} us, decode {decode_s * 1e6:.1f} us"
    )
    return rows


async def _load(url: str, duration_s: float) -> list[LoadResult]:
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    return [
        await run_load(host, port, path, clients, duration_s)
        for path in PATHS
        for clients in CLIENTS
    ]


def _notes(result: LoadResult) -> str:
    if result.clients != 64 or result.path != "/mesos/cli":
        return ""
    rate = result.rate_per_s / OLD_TOOL_64["rate"]
    p99 = OLD_TOOL_64["p99_ms"] / result.p99_ms if result.p99_ms else float("inf")
    return f"  [1.0.1 on an H200: 7,960/s, p99 31 ms: rate x{rate:.2f}, p99 {p99:.1f}x lower]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running agent (default: start a simulated one)")
    parser.add_argument("--simulate", default="hgx-h200-8", help="node of the started agent")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=2000, help="rounds of each encoding")
    args = parser.parse_args()

    with agent_url(args.url, args.simulate) as url:
        with urllib.request.urlopen(url + "/gpu/info/json", timeout=10) as answer:
            info_json = answer.read()
        results = asyncio.run(_load(url, args.duration))

    where = args.url or f"simulated node {args.simulate}"
    print(f"/mesos/cli benchmark: {where}; {platform.node()}, {os.cpu_count()} CPUs")
    print(f"Python {platform.python_version()}, zlib-ng {zlib_ng.ZLIBNG_VERSION}, "
          f"zlib {zlib.ZLIB_RUNTIME_VERSION}")  # fmt: skip
    for result in results:
        print(result.row() + _notes(result))
    for row in compression_rows(info_json, args.rounds):
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
