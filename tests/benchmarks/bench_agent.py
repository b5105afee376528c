"""REST API benchmark: requests per second, p50/p99 and CPU of both sides on the hot routes,
and resident memory.

Starts a real ``nvidia-docker-plugin`` process (simulated node by default, or the real
GPUs with ``--real``) on a free loopback port and loads each route with 1, 16, 64 and 256
keep-alive connections (closed loop), spread over as many client processes as the machine
allows (``--client-procs auto``: one per connection up to CPUs - 1), so that the client is
not what limits the rate. Each row says how many client processes carried it and how many
cores the clients and the server used over the measured window: the server is one Python
process, so about one core is all it can use. Rounds are repeated (``--rounds``) and
summed up as ranges, with the ratios against nvidia-docker-plugin 1.0.1's side-by-side
figures (``tests/benchmarks/old_tool.py``) on a ``--real`` run. Also times, in the same
run, a status sweep done the old way (every NVML call in series, PCIe counters included)
against the backend directly.

    python -m tests.benchmarks.bench_agent [--real] [--simulate NODE] [--rounds 2]
        [--duration 3] [--clients 1,16,64,256] [--client-procs auto|N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from tests.benchmarks import old_tool
from tests.benchmarks.load_report import summary_table
from tests.benchmarks.loadgen import (
    LoadError,
    LoadGenerator,
    Measurement,
    client_counts_option,
    client_procs_option,
    describe_client_procs,
    plan_processes,
)
from tests.benchmarks.proc_usage import ResidentMemory, resident_memory, usable_cpus
from tests.support.services import free_port, port_open, python_path, stop_process, wait_until

PATHS = ("/gpu/status/json", "/gpu/info/json", "/docker/cli", "/mesos/cli")
CLIENTS = (1, 16, 64, 256)
WARMUP_S = 0.3
SETUP_S = 0.3
"""Per row, besides the measured window and the warm-up: connecting, handing out the job."""


def _old_way_sweep_ms(simulate: str | None, rounds: int) -> float:
    """Median time of one status sweep done the old way: every call in series, PCIe included."""
    from agent.gpu.backends import open_backend  # noqa: PLC0415

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


def _memory_line(idle: ResidentMemory, loaded: ResidentMemory) -> str:
    old, then = old_tool.OLD_MEMORY, old_tool.OURS_MEMORY_THEN
    return (
        f"resident memory: {idle.rss_mb:.1f} MB idle (anonymous {idle.anon_mb:.1f}, file-backed "
        f"{idle.file_mb:.1f}), {loaded.rss_mb:.1f} MB after load, peak {loaded.peak_mb:.1f} MB\n"
        f"  1.0.1 in the side-by-side run: {old.idle_mb:.0f} / {old.loaded_mb:.0f} / "
        f"{old.peak_mb:.0f} MB (ours then {then.idle_mb:.0f} / {then.loaded_mb:.0f} / "
        f"{then.peak_mb:.0f}); this run / 1.0.1: {idle.rss_mb / old.idle_mb:.2f}x idle, "
        f"{loaded.rss_mb / old.loaded_mb:.2f}x loaded, {loaded.peak_mb / old.peak_mb:.2f}x peak"
    )


def _start_agent(
    port: int, workdir: Path, simulate: str | None, agent_dir: Path | None = None
) -> subprocess.Popen[bytes]:
    """The daemon under test: this checkout's, or the one in ``agent_dir`` (an A/B run)."""
    cmd = [sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}"]
    cmd += ["-s", str(workdir / "sock"), "-d", str(workdir / "volumes")]
    if simulate:
        cmd += ["--simulate", simulate]
    env = None
    if agent_dir is not None:
        env = dict(os.environ, PYTHONPATH=python_path(agent_dir.resolve()))
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=agent_dir
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_agent", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--real", action="store_true", help="serve the real GPUs (NVML)")
    parser.add_argument("--simulate", default="hgx-h200-8", help="node file or built-in name")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="times every row is measured")
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
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--agent-dir",
        type=Path,
        help="serve another checkout's agent (e.g. a git archive of an older commit), to "
        "compare on the same machine",
    )
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.rounds < 1 or args.duration <= 0:
        print("bench_agent: --rounds must be 1 or more and --duration above 0", file=sys.stderr)
        return 2
    simulate = None if args.real else args.simulate
    cpus = usable_cpus()
    where = "real GPUs (NVML)" if args.real else f"simulated node {simulate}"
    if args.agent_dir is not None:
        where += f", the agent of {args.agent_dir}"
    procs_setting = "auto" if args.client_procs is None else str(args.client_procs)
    procs_text = describe_client_procs(args.client_procs, cpus)
    rows = len(PATHS) * len(args.clients) * args.rounds
    print(
        f"nvidia-docker-plugin benchmark: {where}; {platform.node()}, {cpus} CPUs, "
        f"Python {platform.python_version()}\n"
        f"{rows} rows ({args.rounds} rounds), {args.duration:g} s each, "
        f"about {rows * (args.duration + WARMUP_S + SETUP_S):.0f} s; "
        f"client processes per row: {procs_text}",
        flush=True,
    )

    port = free_port()
    workdir = tempfile.TemporaryDirectory(prefix="nvd-bench-")
    proc = _start_agent(port, Path(workdir.name), simulate, args.agent_dir)
    measurements: list[tuple[int, Measurement]] = []
    try:
        wait_until(lambda: port_open(port), what="agent", timeout_s=120, proc=proc)
        idle = resident_memory(proc.pid)
        with LoadGenerator("127.0.0.1", port) as load:
            for round_number in range(1, args.rounds + 1):
                for path in PATHS:
                    for clients in args.clients:
                        processes = plan_processes(clients, args.client_procs, cpus)
                        result = load.measure(
                            path, clients, processes, args.duration, proc.pid, cpus, WARMUP_S
                        )
                        measurements.append((round_number, result))
                        print(f"[{round_number}] {result.row()}", flush=True)
        loaded = resident_memory(proc.pid)
    except (LoadError, RuntimeError, TimeoutError) as error:
        print(f"bench_agent: {error}", file=sys.stderr)
        return 1
    finally:
        stop_process(proc)
        _, stderr = proc.communicate()
        if proc.returncode not in (0, None) and stderr:
            last = stderr.decode(errors="replace").strip().splitlines()[-1:]
            print(f"bench_agent: the agent said: {' '.join(last)}", file=sys.stderr)
        workdir.cleanup()
    old_way_ms = _old_way_sweep_ms(simulate, rounds=5 if simulate else 20)

    results = [result for _, result in measurements]
    summary = summary_table(results, against_old_tool=args.real)
    print()
    print("\n".join(summary))
    if not args.real:
        print("(ratios against 1.0.1 only with --real: its figures are from the H200 machine)")
    print(
        "The server is one Python process (one event loop): about one core is all it can use. "
        "Rows marked 'server' are at that limit; 'client' means raise --client-procs."
    )
    status_1 = [r for r in results if r.path == "/gpu/status/json" and r.clients == 1]
    if status_1:
        best_p50 = min(r.p50_ms for r in status_1)
        print(
            f"status sweep the old way (serial, PCIe per request): {old_way_ms:.1f} ms; "
            f"ours p50 with 1 client {best_p50:.3f} ms: {old_way_ms / best_p50:.0f}x"
        )
    print(_memory_line(idle, loaded))

    if args.out:
        report = {
            "benchmark": "bench_agent",
            "where": where,
            "host": platform.node(),
            "cpus": cpus,
            "python": platform.python_version(),
            "client_procs": procs_setting,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "measurements": [{"round": n, **r.as_json()} for n, r in measurements],
            "summary_markdown": summary,
            "old_way_sweep_ms": round(old_way_ms, 2),
            "memory_mb": {"idle": idle.as_json(), "loaded": loaded.as_json()},
            "old_tool": {
                "client_processes": old_tool.CLIENT_PROCESSES,
                "routes": [asdict(figure) for figure in old_tool.ROUTES],
                "memory_mb": asdict(old_tool.OLD_MEMORY),
                "ours_then_memory_mb": asdict(old_tool.OURS_MEMORY_THEN),
            },
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
