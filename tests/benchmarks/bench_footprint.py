"""The agent's footprint: resident memory of the daemon and its GPU worker (idle, after load),
the CPU both use while idle, and which NVIDIA libraries the worker maps.

Starts a real ``nvidia-docker-plugin`` (the real GPUs with ``--real``, a simulated node
otherwise), waits until it is ready, lets it settle, measures ``--idle`` seconds of CPU
(user + system of both processes, from ``/proc``) with no request at all (after
``--settle`` seconds: start-up done, and the PCIe sampler at rest), then loads
``/gpu/status/json`` and ``/metrics`` for ``--load`` seconds and reads the memory again.

    python -m tests.benchmarks.bench_footprint [--real] [--simulate h200] [--idle 20] [--settle 65]
        [--agent-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.benchmarks.proc_usage import resident_memory
from tests.benchmarks.status_loop import run_for
from tests.support.services import free_port, port_open, python_path, stop_process, wait_until

TICKS = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def _mapped_nvidia(pid: int) -> list[str]:
    names = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "libcuda" in path or "libnvidia" in path:
            names.add(Path(path).name)
    return sorted(names)


def _mappings(pid: int) -> dict[str, tuple[int, int]]:
    """Resident and proportional kB per mapped file (anonymous maps as ``[anon]``), from smaps."""
    sizes: dict[str, tuple[int, int]] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode [path]
            name = (
                Path(fields[5]).name
                if len(fields) >= 6 and fields[5].startswith("/")
                else (fields[5] if len(fields) >= 6 else "[anon]")
            )
        elif fields[0] in ("Rss:", "Pss:"):
            rss, pss = sizes.get(name, (0, 0))
            kb = int(fields[1])
            sizes[name] = (rss + kb, pss) if fields[0] == "Rss:" else (rss, pss + kb)
    return sizes


def _pss_mb(pid: int) -> float:
    return sum(pss for _, pss in _mappings(pid).values()) / 1024


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_footprint")
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--simulate", default="h200")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of idle CPU measured")
    parser.add_argument(
        "--settle",
        type=float,
        default=65.0,
        help="seconds after start before the idle measure (the PCIe sampler rests after 60)",
    )
    parser.add_argument("--load", type=float, default=5.0, help="seconds of load before RSS")
    parser.add_argument("--agent-dir", type=Path, help="serve another checkout's agent")
    parser.add_argument(
        "--top", type=int, default=0, help="after load, each process's N largest mappings"
    )
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nvd-footprint-") as tmp:
        base = Path(tmp)
        command = [
            sys.executable, "-m", "agent.daemon", "-l", f"127.0.0.1:{port}",
            "-s", str(base / "plugins"), "-d", str(base / "volumes"), "--cdi-spec-dir", "",
        ]  # fmt: skip
        if not args.real:
            command += ["--simulate", args.simulate]
        env = dict(os.environ)
        if args.agent_dir is not None:
            env["PYTHONPATH"] = python_path(args.agent_dir.resolve())
        proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            cwd=args.agent_dir or None,
        )  # fmt: skip
        try:
            wait_until(lambda: port_open(port), what="agent", timeout_s=120, proc=proc)
            time.sleep(args.settle)  # past start-up, and past the PCIe sampler's rest (60 s)
            pids = [proc.pid, *_children(proc.pid)]
            idle_rss = [resident_memory(pid).rss_mb for pid in pids]
            before = [_cpu_s(pid) for pid in pids]
            started = time.monotonic()
            time.sleep(args.idle)
            elapsed = time.monotonic() - started
            idle_cpu = [
                (_cpu_s(pid) - b) / elapsed * 100 for pid, b in zip(pids, before, strict=True)
            ]
            for path in ("/gpu/status/json", "/metrics"):
                asyncio.run(run_for(port, path, 16, args.load / 2))
            loaded_rss = [resident_memory(pid).rss_mb for pid in [proc.pid, *_children(proc.pid)]]
            mapped = [_mapped_nvidia(pid) for pid in pids]
            loaded_pss = [_pss_mb(pid) for pid in pids]
            tops = [
                sorted(_mappings(pid).items(), key=lambda kv: -kv[1][0])[: args.top] for pid in pids
            ]
        finally:
            stop_process(proc)
    names = ["daemon", *(f"worker {i}" for i in range(1, len(pids)))]
    where = "real GPUs" if args.real else f"simulated {args.simulate}"
    print(f"footprint, {where}, {args.agent_dir or 'this checkout'}:")
    for name, rss, cpu, libs in zip(names, idle_rss, idle_cpu, mapped, strict=True):
        print(f"  {name:<9} idle RSS {rss:6.1f} MB, idle CPU {cpu:5.2f}% of a core; maps "
              f"{', '.join(libs) or 'no NVIDIA library'}")  # fmt: skip
    print(f"  together: idle RSS {sum(idle_rss):.1f} MB, after load {sum(loaded_rss):.1f} MB, "
          f"idle CPU {sum(idle_cpu):.2f}% of a core over {args.idle:g} s")  # fmt: skip
    print(f"  after load, proportional (PSS: shared pages split between the two): "
          f"{' + '.join(f'{p:.1f}' for p in loaded_pss)} = {sum(loaded_pss):.1f} MB")  # fmt: skip
    for name, top in zip(names, tops, strict=True):
        if top:
            print(f"  {name}'s largest mappings after load (RSS / PSS kB): " + ", ".join(
                f"{path} {rss}/{pss}" for path, (rss, pss) in top))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
