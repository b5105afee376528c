"""Benchmark: ``nvidia-docker-ctl status`` across 10,000 HTTP nodes and 1,000 SSH nodes.

::

    python -m tests.benchmarks.bench_fleet [--http-nodes 10000] [--ssh-nodes 1000] [--runs 3]

What an operator feels: the real ctl (``python -m controller.ctl.main status --nodes F``, the
table it prints by default) runs as a subprocess; its wall time (process start included) and
its own peak resident memory (VmHWM, which it writes at exit) are printed, with the
targets (10,000 HTTP nodes < 5 s, 1,000 SSH nodes < 30 s) as ratios, and the machine's load
average before each run (the agents share the same two cores). Every node is its own
listening socket: the agents live in one ``tests.support.agent_farm`` process; the SSH nodes
are real OpenSSH sshds (``tests.support.ssh_fleet``: four sshds of 16 ports, each node its own
login), each node tunnelling to a different agent. Measured in the same run, for scale: the
ctl's start-up alone (``--help``), a tenth of the HTTP nodes (memory must not grow with the
fleet), the JSON document and JSON lines outputs, and one node at a time (``--parallel 1``).

``--commands leases`` (the default runs both sets) measures ``leases`` and ``free`` instead,
against a second farm whose nodes serve the lease routes (hgx-h200-8 nodes, one lease of
three GPUs on each; ``--tls``: every node over TLS, with a test CA, ``status`` measured
there too for scale): the table, ``--json``, ``free --gpus 2`` (every node qualifies) and
``free --gpus 6`` (none does: exit 1).

``--agents current,prior,current`` runs the lease runs against farms of those kinds, one
after the other in that order: ``current`` nodes answer ``GET /leases/free`` (``free`` asks
them that alone), ``prior`` ones as agents before that route did (405: ``free`` asks them
again for their leases, and their topology for two or more GPUs, and picks itself).

``--ctl-cpu-list 0,1`` pins the ctl (and its workers) to those CPUs and the farm to the
others: on a machine with cores to spare, the ctl's own time on two cores, the agents' work
elsewhere as on a real fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.benchmarks.bench_fleet_tls import make_certificates
from tests.benchmarks.proc_usage import machine_busy_seconds, usable_cpus
from tests.support.agent_farm import AgentFarm, ask_lease, raise_fd_limit, start_farm
from tests.support.certs import Pki, make_pki
from tests.support.services import python_path
from tests.support.ssh_fleet import SshFleet, start_ssh_fleet

REPO = Path(__file__).resolve().parents[2]
HTTP_TARGET_S = 5.0
BENCH_LEASE = {"count": 3, "owner": {"user": "bench"}}  # every lease run's nodes: 5 of 8 free
SSH_TARGET_S = 30.0


@dataclass(frozen=True)
class Run:
    wall_s: float
    maxrss_mib: float
    exit_code: int
    answered: int
    failed: int
    ctl_cpu_s: float = 0.0  # the ctl process and its worker processes, user + system
    farm_cpu_s: float = 0.0  # the agent farm's processes over the same window
    machine_busy_s: float = 0.0  # every CPU of the machine, busy, over the same window
    main_cpu_s: float = 0.0  # the ctl's own process (the output is made there)
    workers_cpu_s: float = 0.0  # its worker processes (the nodes are asked there)
    workers_rss_mib: float = 0.0  # the largest worker's peak RSS (pages shared with the ctl too)


# The ctl under a launcher that writes its own peak RSS (VmHWM of /proc/self/status) at exit:
# ru_maxrss of a child also counts what its parent had when it forked, and this benchmark's
# process grows with the outputs it reads. It writes its own CPU time too, and its worker
# processes' (reaped by then): their CPU time and the largest one's peak RSS.
_LAUNCHER = """
import atexit, os, resource, runpy, sys
def _peak():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                own = resource.getrusage(resource.RUSAGE_SELF)
                kids = resource.getrusage(resource.RUSAGE_CHILDREN)
                with open(os.environ["NVD_BENCH_PEAK_FILE"], "w") as out:
                    out.write(f"{line.split()[1]} {own.ru_utime + own.ru_stime} "
                              f"{kids.ru_utime + kids.ru_stime} {kids.ru_maxrss}")
atexit.register(_peak)
if os.environ.get("NVD_BENCH_CTL_AFFINITY"):  # --ctl-cpu-list: the CPUs the ctl runs on
    os.sched_setaffinity(0, {int(c) for c in os.environ["NVD_BENCH_CTL_AFFINITY"].split(",")})
if os.environ.get("NVD_BENCH_CTL_CPUS"):  # --ctl-cpus: the CPUs the ctl believes it has
    import controller.fleet.workers as workers
    workers.usable_cpus = lambda: int(os.environ["NVD_BENCH_CTL_CPUS"])
sys.argv = ["nvidia-docker-ctl", *sys.argv[1:]]
runpy.run_module("controller.ctl.main", run_name="__main__")
"""


def run_ctl(args: list[str], env: dict[str, str], farm: AgentFarm | None = None) -> Run:
    """One ``nvidia-docker-ctl`` process: wall time, its own peak RSS, its answer, and the
    CPU seconds it (with the worker processes it waited for) and the ``farm`` used meanwhile."""
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.NamedTemporaryFile() as peak,
    ):
        farm_before = farm.cpu_seconds() if farm is not None else 0.0
        busy_before = machine_busy_seconds()
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, *args],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env={**env, "NVD_BENCH_PEAK_FILE": peak.name},
        )
        _, status, usage = os.wait4(proc.pid, 0)  # its rusage counts its waited-for children
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        busy = machine_busy_seconds() - busy_before
        farm_cpu = farm.cpu_seconds() - farm_before if farm is not None else 0.0
        peak_kib, own_cpu, workers_cpu, workers_kib = (
            float(word) for word in (Path(peak.name).read_text() or "0 0 0 0").split()
        )
        err.seek(0)
        last = (err.read().decode(errors="replace").strip().splitlines() or [""])[-1]
        out.seek(0)
        answered, failed = _count(out, last)
    cpu = usage.ru_utime + usage.ru_stime
    return Run(
        wall, peak_kib / 1024, proc.returncode, answered, failed, cpu, farm_cpu, busy,
        own_cpu, workers_cpu, workers_kib / 1024,
    )  # fmt: skip


def _count(out: IO[bytes], last_error_line: str) -> tuple[int, int]:
    """Nodes answered and failed, from the output (read line by line) or the summary line."""
    first = out.readline()
    if first.startswith(b'{"node"'):  # --jsonl
        answered = failed = 0
        for line in (first, *out):
            if json.loads(line)["error"] is None:
                answered += 1
            else:
                failed += 1
        return answered, failed
    if first.startswith(b"{"):  # --json: the summary is the last line but one
        tail = out.read().splitlines()
        summary = json.loads(tail[-2].split(b":", 1)[1])
        return summary["answered"], summary["failed"]
    # the table: "nvidia-docker-ctl: N nodes, A answered (G GPUs), F failed"
    words = last_error_line.replace(",", "").split()
    if "answered" not in words:
        return 0, 0
    return int(words[words.index("answered") - 1]), int(words[words.index("failed") - 1])


CTL_CPUS = 0  # --ctl-cpus (0: as the machine has)
CTL_AFFINITY: set[int] = set()  # --ctl-cpu-list (empty: wherever the scheduler puts it)


def ctl_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "SSH_AUTH"))}
    env["PYTHONPATH"] = python_path(REPO)
    env["HOME"] = str(home)
    if CTL_CPUS:
        env["NVD_BENCH_CTL_CPUS"] = str(CTL_CPUS)
    if CTL_AFFINITY:
        env["NVD_BENCH_CTL_AFFINITY"] = ",".join(map(str, sorted(CTL_AFFINITY)))
    return env


def report(label: str, runs: list[Run], nodes: int, target_s: float | None) -> None:
    walls = [r.wall_s for r in runs]
    best, median = min(walls), statistics.median(walls)
    rss = max(r.maxrss_mib for r in runs)
    codes = sorted({r.exit_code for r in runs})
    answered = min(r.answered for r in runs)
    load = os.getloadavg()[0]
    line = (
        f"{label:<34} nodes {nodes:>5}  answered {answered:>5}  exit {codes}  load {load:4.1f}  "
        f"wall best {best:6.2f} s  median {median:6.2f} s  peak RSS {rss:6.1f} MiB"
    )
    if target_s is not None:
        line += f"  median/target {median / target_s:.2f}"
    if any(r.ctl_cpu_s for r in runs):
        ctl = statistics.median(r.ctl_cpu_s for r in runs)
        farm = statistics.median(r.farm_cpu_s for r in runs)
        busy = statistics.median(r.machine_busy_s for r in runs)
        whole = statistics.median(r.wall_s for r in runs) * usable_cpus()
        main = statistics.median(r.main_cpu_s for r in runs)
        workers = statistics.median(r.workers_cpu_s for r in runs)
        worker_rss = max(r.workers_rss_mib for r in runs)
        line += (
            f"\n{'':<34} CPU s (median): ctl {ctl:5.2f} (main {main:5.2f}, workers "
            f"{workers:5.2f}, worker peak RSS {worker_rss:5.1f} MiB)  farm {farm:5.2f}  "
            f"machine busy {busy:5.2f} of {whole:5.2f}  "
            f"ctl per node {ctl / max(nodes, 1) * 1000:.3f} ms"
        )
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-nodes", type=int, default=10000)
    parser.add_argument("--ssh-nodes", type=int, default=1000)
    parser.add_argument("--ssh-servers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--commands", default="status,leases", help="status, leases (and free), or both"
    )
    parser.add_argument("--tls", action="store_true", help="the leases runs over TLS")
    parser.add_argument(
        "--farm-processes",
        type=int,
        default=0,
        help="agent-farm processes (default: the usable CPUs, as the agents' own machines)",
    )
    parser.add_argument(
        "--farm-loop", default="auto", help="the farm's event loop: auto (the agent's), asyncio"
    )
    parser.add_argument(
        "--tls-keys",
        choices=("ec", "rsa"),
        default="ec",
        help="with --tls: the test CA's EC P-256 keys, or an RSA-2048 CA and server key",
    )
    parser.add_argument(
        "--ctl-cpus",
        type=int,
        default=0,
        help="the CPUs the ctl sees (1: every node asked in its own process, no workers); "
        "default: the machine's",
    )
    parser.add_argument(
        "--ctl-cpu-list",
        default="",
        help="CPUs for the ctl alone, e.g. 0,1 (the farm and this process get the others: "
        "the agents on machines of their own, as in a real fleet)",
    )
    parser.add_argument(
        "--only", default="", help="leases runs whose names start with these (comma separated)"
    )
    parser.add_argument(
        "--agents",
        default="current",
        help="the lease runs' farms, in order: current (with GET /leases/free), prior "
        "(agents before it), e.g. current,prior,current",
    )
    args = parser.parse_args()
    commands = {c.strip() for c in args.commands.split(",")}
    global CTL_CPUS  # noqa: PLW0603 (one setting for every run of the ctl)
    CTL_CPUS = args.ctl_cpus
    if args.ctl_cpu_list:
        global CTL_AFFINITY  # noqa: PLW0603 (likewise)
        CTL_AFFINITY = {int(c) for c in args.ctl_cpu_list.split(",")}
        others = os.sched_getaffinity(0) - CTL_AFFINITY
        if not others or not CTL_AFFINITY.issubset(os.sched_getaffinity(0)):
            parser.error(
                f"--ctl-cpu-list {args.ctl_cpu_list}: name some, not all, of the "
                f"CPUs {sorted(os.sched_getaffinity(0))}"
            )
        os.sched_setaffinity(0, others)  # the farm, started from here, inherits them
    args.farm_processes = args.farm_processes or usable_cpus()
    raise_fd_limit(max(args.http_nodes, args.ssh_nodes) * 4 + 1024)
    seen = args.ctl_cpus or len(CTL_AFFINITY) or usable_cpus()
    pinned = f" (on CPUs {sorted(CTL_AFFINITY)}, the farm on the others)" if CTL_AFFINITY else ""
    print(
        f"bench_fleet: {os.cpu_count()} CPUs, farm of {args.farm_processes} processes "
        f"({args.farm_loop} loop), ctl sees {seen} CPUs{pinned}, fd limit "
        f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}, Python {sys.version.split()[0]}, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="nvd-bench-fleet-"))
    try:
        if "status" in commands:
            status_runs(args, work)
        if "leases" in commands:
            for kind in (a.strip() for a in args.agents.split(",")):
                if kind not in ("current", "prior"):
                    parser.error(f"--agents {args.agents}: current or prior, comma separated")
                lease_runs(args, work, prior=kind == "prior")
    finally:
        for path in sorted(work.rglob("*"), reverse=True):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
        work.rmdir()


def lease_runs(args: argparse.Namespace, work: Path, *, prior: bool = False) -> None:
    """``leases`` and ``free`` on nodes with the lease routes (over TLS with ``--tls``);
    ``prior``: the nodes answer as agents before ``GET /leases/free``."""
    pki: Pki | None = None
    server, ca = "server", "ca"
    if args.tls and args.tls_keys == "rsa":  # an RSA-2048 CA and server key
        make_certificates(work / "pki")
        pki, server, ca = Pki(work / "pki"), "rsa-chain", "rsa-ca"
    elif args.tls:
        pki = make_pki(work / "pki")
    tls = (pki.pem(server), pki.key(server)) if pki is not None else None
    farm = start_farm(
        args.http_nodes,
        ("hgx-h200-8",),
        timeout_s=300,
        leases=True,
        tls=tls,
        processes=args.farm_processes,
        event_loop=args.farm_loop,
        own_uuids=True,  # as a real fleet's nodes: `free` keys its picks on no UUID
        before_free=prior,
    )
    try:
        scheme = "https" if pki is not None else "http"
        context = ssl.create_default_context(cafile=pki.pem(ca)) if pki is not None else None
        # the nodes of one kind in one farm process share one lease table: node k is in
        # process k, and every node of that process has this lease
        for port in farm.ports[: args.farm_processes]:
            ask_lease(f"{scheme}://127.0.0.1:{port}", BENCH_LEASE, context)
        nodes = work / "lease-nodes"
        nodes.write_text("".join(f"{scheme}://127.0.0.1:{p}\n" for p in farm.ports))
        flags = ["--nodes", str(nodes)]
        if pki is not None:
            flags += ["--ca", str(pki.pem(ca))]
        env = ctl_env(work)
        label = ("TLS" if args.tls_keys == "ec" else "TLS, RSA") if pki is not None else "HTTP"
        label += ", agents before /leases/free" if prior else ""
        count = args.http_nodes
        runs = {
            "status": (["status", *flags], 0),
            "leases": (["leases", *flags], 0),
            "leases --json": (["leases", "--json", *flags], 0),
            "free --gpus 1": (["free", *flags], 0),
            "free --gpus 2": (["free", "--gpus", "2", *flags], 0),
            "free --gpus 6 (none)": (["free", "--gpus", "6", *flags], 1),
        }
        wanted = tuple(w.strip() for w in args.only.split(",") if w.strip())
        for name, (argv, expected) in runs.items():
            if wanted and not name.startswith(wanted):
                continue
            done = [run_ctl(argv, env, farm) for _ in range(args.runs)]
            report(f"{name}, {label}", done, count, HTTP_TARGET_S)
            bad = [r for r in done if r.exit_code != expected or r.failed]
            if bad:
                print(f"WARNING: {name}, {label}: unexpected exit or failed nodes: {bad}")
    finally:
        farm.stop()


def status_runs(args: argparse.Namespace, work: Path) -> None:
    """``status`` over HTTP and SSH (the original figures)."""
    farm = start_farm(
        max(args.http_nodes, args.ssh_nodes),
        ("h200",),
        timeout_s=300,
        processes=args.farm_processes,
        event_loop=args.farm_loop,
    )
    ssh_fleet: SshFleet | None = None
    try:
        env = ctl_env(work)

        def nodes_file(name: str, ports: list[int]) -> str:
            path = work / name
            path.write_text("".join(f"http://127.0.0.1:{p}\n" for p in ports))
            return str(path)

        every = nodes_file("http-nodes", farm.ports[: args.http_nodes])
        tenth_count = max(1, args.http_nodes // 10)
        tenth = nodes_file("tenth-nodes", farm.ports[:tenth_count])
        startup = [run_ctl(["--help"], env) for _ in range(args.runs)]
        report("ctl start-up alone (--help)", startup, 0, None)
        small = [run_ctl(["status", "--nodes", tenth], env, farm) for _ in range(args.runs)]
        report("status, HTTP, a tenth", small, tenth_count, None)
        http = [run_ctl(["status", "--nodes", every], env, farm) for _ in range(args.runs)]
        report("status, HTTP (table)", http, args.http_nodes, HTTP_TARGET_S)
        as_json = [
            run_ctl(["status", "--json", "--nodes", every], env, farm) for _ in range(args.runs)
        ]
        report("status, HTTP, --json", as_json, args.http_nodes, HTTP_TARGET_S)
        as_jsonl = [
            run_ctl(["status", "--jsonl", "--nodes", every], env, farm) for _ in range(args.runs)
        ]
        report("status, HTTP, --jsonl", as_jsonl, args.http_nodes, HTTP_TARGET_S)
        serial_count = max(1, args.http_nodes // 100)
        serial_file = nodes_file("serial-nodes", farm.ports[:serial_count])
        serial = run_ctl(["status", "--parallel", "1", "--nodes", serial_file], env, farm)
        report("status, HTTP, --parallel 1", [serial], serial_count, None)
        base = min(r.wall_s for r in startup)
        per_node_serial = (serial.wall_s - base) / serial_count
        per_node_parallel = (min(r.wall_s for r in http) - base) / args.http_nodes
        print(
            f"{'':<34} per node: one at a time {per_node_serial * 1000:.2f} ms, "
            f"64 at a time {per_node_parallel * 1000:.2f} ms "
            f"(ratio {per_node_serial / per_node_parallel:.1f}x); peak RSS "
            f"{max(r.maxrss_mib for r in small):.0f} MiB for {tenth_count} nodes, "
            f"{max(r.maxrss_mib for r in http):.0f} MiB for {args.http_nodes}",
            flush=True,
        )

        ssh_runs: list[Run] = []
        if args.ssh_nodes:
            ssh_fleet = start_ssh_fleet(work, servers=args.ssh_servers)
            home = ssh_fleet.home(work / "home")
            ssh_file = work / "ssh-nodes"
            ssh_file.write_text("\n".join(ssh_fleet.nodes(farm.ports[: args.ssh_nodes])) + "\n")
            ssh_runs = [
                run_ctl(["status", "--nodes", str(ssh_file)], ctl_env(home))
                for _ in range(max(1, args.runs - 1))
            ]
            report(
                f"status, SSH ({args.ssh_servers} sshd x 16 ports)",
                ssh_runs,
                args.ssh_nodes,
                SSH_TARGET_S,
            )
        for label, runs in (("HTTP", http + as_json + as_jsonl), ("SSH", ssh_runs)):
            bad = [r for r in runs if r.exit_code != 0 or r.failed]
            if bad:
                print(f"WARNING: {label}: some runs had failed nodes: {bad}", flush=True)
    finally:
        if ssh_fleet is not None:
            ssh_fleet.stop()
        farm.stop()


if __name__ == "__main__":
    main()
