"""Mesos benchmark: ``/mesos/cli`` requests per second, p99 and CPU of both sides, and
zlib-ng against zlib.

Loads ``/mesos/cli`` (legacy and native) with 1, 16, 64 and 256 keep-alive connections
(closed loop), spread over client processes as ``bench_agent`` does (``--client-procs
auto``: one per connection up to CPUs - 1), against a running agent on this machine
(``--url``, loopback only; ``--server-pid`` to read its CPU too) or one it starts itself on a
free loopback port (simulated 8-GPU HGX node by default). Then encodes that node's
``/gpu/info/json`` body with zlib-ng and with the standard library's zlib at the same level
and prints time and size ratios measured in the same run.

    python -m tests.benchmarks.bench_mesos [--url http://127.0.0.1:3476 [--server-pid PID]]
        [--simulate NODE] [--rounds 1] [--duration 3] [--clients 1,16,64,256]
        [--client-procs auto|N] [--encode-rounds 2000] [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import json
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
from pathlib import Path

from zlib_ng import zlib_ng

from mesos.blob import COMPRESSION_LEVEL, decode, encode
from tests.benchmarks.load_report import summary_table
from tests.benchmarks.loadgen import (
    LoadError,
    LoadGenerator,
    Measurement,
    client_counts_option,
    client_procs_option,
    describe_client_procs,
    plan_processes,
    require_loopback,
)
from tests.benchmarks.proc_usage import usable_cpus
from tests.support.services import free_port, port_open, stop_process, wait_until

PATHS = ("/mesos/cli", "/mesos/cli?format=native")
CLIENTS = (1, 16, 64, 256)
WARMUP_S = 0.3


@contextmanager
def agent_url(url: str | None, simulate: str, pid: int | None) -> Iterator[tuple[str, int | None]]:
    """``url`` (and the server's ``pid`` if given), or the URL and process id of an agent
    started here for the benchmark (stopped after)."""
    if url:
        yield url.rstrip("/"), pid
        return
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nvd-bench-mesos-") as workdir:
        command = [sys.executable, "-m", "agent.daemon", "--simulate", simulate]
        command += ["-l", f"127.0.0.1:{port}", "-s", f"{workdir}/sock", "-d", f"{workdir}/vol"]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: port_open(port), what="agent", timeout_s=120, proc=proc)
            yield f"http://127.0.0.1:{port}", proc.pid
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


def _load(
    url: str, server_pid: int | None, args: argparse.Namespace, cpus: int
) -> list[Measurement]:
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    results = []
    with LoadGenerator(host, port) as load:
        for round_number in range(1, args.rounds + 1):
            for path in PATHS:
                for clients in args.clients:
                    processes = plan_processes(clients, args.client_procs, cpus)
                    result = load.measure(
                        path, clients, processes, args.duration, server_pid, cpus, WARMUP_S
                    )
                    results.append(result)
                    print(f"[{round_number}] {result.row()}", flush=True)
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_mesos", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--url", help="a running agent on this machine (default: start one)")
    parser.add_argument("--server-pid", type=int, help="process id of the --url agent (its CPU)")
    parser.add_argument("--simulate", default="hgx-h200-8", help="node of the started agent")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=1, help="times every row is measured")
    parser.add_argument(
        "--clients",
        type=client_counts_option,
        default=CLIENTS,
        help="connection counts, comma-separated (default 1,16,64,256)",
    )
    parser.add_argument(
        "--client-procs",
        type=client_procs_option,
        default=None,
        metavar="auto|N",
        help="client processes per row; auto (default): one per connection, up to CPUs - 1",
    )
    parser.add_argument("--encode-rounds", type=int, default=2000, help="rounds of each encoding")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.rounds < 1 or args.duration <= 0 or args.encode_rounds < 1:
        print("bench_mesos: --rounds and --encode-rounds must be 1 or more, --duration above 0",
              file=sys.stderr)  # fmt: skip
        return 2
    cpus = usable_cpus()
    where = args.url or f"simulated node {args.simulate}"
    print(f"/mesos/cli benchmark: {where}; {platform.node()}, {cpus} CPUs; client processes "
          f"per row: {describe_client_procs(args.client_procs, cpus)}")  # fmt: skip
    print(f"Python {platform.python_version()}, zlib-ng {zlib_ng.ZLIBNG_VERSION}, "
          f"zlib {zlib.ZLIB_RUNTIME_VERSION}")  # fmt: skip
    try:
        if args.url:  # before any request: only this machine is ever loaded
            require_loopback(urllib.parse.urlsplit(args.url).hostname or "")
        with agent_url(args.url, args.simulate, args.server_pid) as (url, server_pid):
            try:
                with urllib.request.urlopen(url + "/gpu/info/json", timeout=10) as answer:
                    info_json = answer.read()
            except OSError as error:  # URLError included
                raise LoadError(f"GET {url}/gpu/info/json: {error}") from None
            results = _load(url, server_pid, args, cpus)
    except (LoadError, OSError, RuntimeError, TimeoutError) as error:
        print(f"bench_mesos: {error}", file=sys.stderr)
        return 1

    print()
    print("\n".join(summary_table(results, against_old_tool=False)))
    print(
        "1.0.1 in the side-by-side run on the H200 (4 client processes): ours 1.6-6.5x its "
        "/mesos/cli rate (docs/performance.md)"
    )
    rows = compression_rows(info_json, args.encode_rounds)
    for row in rows:
        print(row)
    if args.out:
        report = {
            "benchmark": "bench_mesos",
            "where": where,
            "host": platform.node(),
            "cpus": cpus,
            "python": platform.python_version(),
            "client_procs": "auto" if args.client_procs is None else args.client_procs,
            "duration_s": args.duration,
            "measurements": [result.as_json() for result in results],
            "compression": rows,
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
