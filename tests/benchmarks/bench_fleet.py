"""Benchmark: ``nvidia-docker-ctl status`` across 1,000 HTTP nodes and 100 SSH nodes.

::

    python -m tests.benchmarks.bench_fleet [--http-nodes 1000] [--ssh-nodes 100] [--runs 3]

What an operator feels: the real ctl (``python -m controller.ctl.main status --json --nodes F``)
runs as a subprocess; its wall time (process start included) and its own peak resident
memory (``os.wait4`` rusage of that one child) are printed, with the targets (1,000 HTTP nodes
< 3 s, 100 SSH nodes < 10 s) as ratios. Every node is its own listening socket: the agents
live in one ``tests.support.agent_farm`` process; the SSH nodes are the ports of real OpenSSH
sshds (one sshd listens on at most 16 ports, so 100 nodes take 7), each port tunnelling to a
different agent. Measured in the same run, for scale:
the ctl's start-up alone (``--help``), and the same query one node at a time
(``--parallel 1``) on a tenth of the HTTP nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.agent_farm import raise_fd_limit, start_farm
from tests.support.sshd import MAX_EXTRA_PORTS, SshServer, start_sshd, stop_sshd

REPO = Path(__file__).resolve().parents[2]
HTTP_TARGET_S = 3.0
SSH_TARGET_S = 10.0


@dataclass(frozen=True)
class Run:
    wall_s: float
    maxrss_mib: float
    exit_code: int
    answered: int
    failed: int


def run_ctl(args: list[str], env: dict[str, str]) -> Run:
    """One ``nvidia-docker-ctl`` process: wall time, its own peak RSS, its answer."""
    with tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "controller.ctl.main", *args],
            stdout=out,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env=env,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        body = out.read()
    answered = failed = 0
    if body.startswith(b"{"):
        summary = json.loads(body)["summary"]
        answered, failed = summary["answered"], summary["failed"]
    # ru_maxrss is in KiB on Linux
    return Run(wall, usage.ru_maxrss / 1024, proc.returncode, answered, failed)


def ctl_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "SSH_AUTH"))}
    env["PYTHONPATH"] = str(REPO)
    env["HOME"] = str(home)
    return env


def start_sshds(base: Path, count: int) -> list[tuple[SshServer, subprocess.Popen[bytes]]]:
    """Enough real sshds for ``count`` SSH nodes: each listens on 16 ports (its limit)."""
    servers: list[tuple[SshServer, subprocess.Popen[bytes]]] = []
    try:
        while sum(1 + len(s.extra_ports) for s, _ in servers) < count:
            left = count - sum(1 + len(s.extra_ports) for s, _ in servers)
            servers.append(start_sshd(base, extra_ports=min(MAX_EXTRA_PORTS, left - 1)))
    except BaseException:
        for server, proc in servers:
            stop_sshd(server, proc)
        raise
    # one user key for all of them (sshd reads authorized_keys at each login)
    public = servers[0][0].user_key.with_name(servers[0][0].user_key.name + ".pub").read_text()
    for server, _ in servers[1:]:
        (server.root / "authorized_keys").write_text(public)
    return servers


def ssh_home(servers: list[SshServer], base: Path) -> Path:
    """A HOME with the user key and every sshd's host key on every port in known_hosts."""
    servers[0].client_home(base, knows_host=False)
    lines = []
    for server in servers:
        key = " ".join(server.host_key_pub.read_text().split()[:2])
        lines += [f"[127.0.0.1]:{p} {key}\n" for p in (server.port, *server.extra_ports)]
    (base / ".ssh" / "known_hosts").write_text("".join(lines))
    return base


def report(label: str, runs: list[Run], nodes: int, target_s: float | None) -> None:
    walls = [r.wall_s for r in runs]
    best, median = min(walls), statistics.median(walls)
    rss = max(r.maxrss_mib for r in runs)
    codes = sorted({r.exit_code for r in runs})
    answered = min(r.answered for r in runs)
    line = (
        f"{label:<34} nodes {nodes:>5}  answered {answered:>5}  exit {codes}  "
        f"wall best {best:6.2f} s  median {median:6.2f} s  peak RSS {rss:6.1f} MiB"
    )
    if target_s is not None:
        line += f"  median/target {median / target_s:.2f}"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-nodes", type=int, default=1000)
    parser.add_argument("--ssh-nodes", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    raise_fd_limit(args.http_nodes * 4 + 1024)
    print(
        f"bench_fleet: {os.cpu_count()} CPUs, fd limit "
        f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}, Python {sys.version.split()[0]}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="nvd-bench-fleet-"))
    farm = start_farm(args.http_nodes, ("h200",), timeout_s=120)
    sshds: list[tuple[SshServer, subprocess.Popen[bytes]]] = []
    try:
        env = ctl_env(work)
        nodes_file = work / "http-nodes"
        nodes_file.write_text("".join(f"http://127.0.0.1:{p}\n" for p in farm.ports))
        startup = [run_ctl(["--help"], env) for _ in range(args.runs)]
        report("ctl start-up alone (--help)", startup, 0, None)
        http = [
            run_ctl(["status", "--json", "--nodes", str(nodes_file)], env) for _ in range(args.runs)
        ]
        report("status, HTTP", http, args.http_nodes, HTTP_TARGET_S)
        tenth = max(1, args.http_nodes // 10)
        serial_file = work / "serial-nodes"
        serial_file.write_text("".join(f"http://127.0.0.1:{p}\n" for p in farm.ports[:tenth]))
        serial = run_ctl(["status", "--json", "--parallel", "1", "--nodes", str(serial_file)], env)
        report("status, HTTP, --parallel 1", [serial], tenth, None)
        per_node_serial = (serial.wall_s - min(r.wall_s for r in startup)) / tenth
        per_node_parallel = (min(r.wall_s for r in http) - min(r.wall_s for r in startup)) / (
            args.http_nodes
        )
        print(
            f"{'':<34} per node: one at a time {per_node_serial * 1000:.2f} ms, "
            f"64 at a time {per_node_parallel * 1000:.2f} ms "
            f"(ratio {per_node_serial / per_node_parallel:.1f}x)",
            flush=True,
        )

        sshds = start_sshds(work, args.ssh_nodes)
        servers = [server for server, _ in sshds]
        home = ssh_home(servers, work / "home")
        ssh_ports = [p for s in servers for p in (s.port, *s.extra_ports)]
        ssh_file = work / "ssh-nodes"
        ssh_file.write_text(
            "".join(
                f"ssh://{servers[0].user}@127.0.0.1:{ssh_port}:{agent_port}\n"
                for ssh_port, agent_port in zip(ssh_ports, farm.ports, strict=False)
            )
        )
        ssh_runs = [
            run_ctl(["status", "--json", "--nodes", str(ssh_file)], ctl_env(home))
            for _ in range(max(1, args.runs - 1))
        ]
        report(
            f"status, SSH ({len(sshds)} sshd x 16 ports)", ssh_runs, args.ssh_nodes, SSH_TARGET_S
        )
        for label, runs in (("HTTP", http), ("SSH", ssh_runs)):
            bad = [r for r in runs if r.exit_code != 0 or r.failed]
            if bad:
                print(f"WARNING: {label}: some runs had failed nodes: {bad}", flush=True)
    finally:
        for server, proc in sshds:
            stop_sshd(server, proc)
        farm.stop()
        for path in sorted(work.rglob("*"), reverse=True):
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()
        work.rmdir()


if __name__ == "__main__":
    main()
