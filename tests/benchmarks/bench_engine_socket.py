"""Engine socket benchmark: what the agent's forwarding adds, against the engine's own socket.

Starts a private dockerd (tests.support.dockerd, with a busybox image) and a real agent on
the simulated ``hgx-h200-8`` node serving ``--engine-socket``, then, in one run and
interleaved (direct, through, direct, ...), so that both see the same machine:

1. one API call, on one kept-alive connection: ``GET /_ping`` and ``GET /containers/json``
   (``--calls`` each way): p50/p99 and the ratio;
2. ``docker ps`` and ``docker run --rm IMAGE true`` with the Docker CLI (``--rounds`` each
   way): median wall time and the ratio, and the added time per run;
3. a hijacked stream: ``docker run --rm -i IMAGE cat`` fed ``--stream-mib`` MiB and read
   back: MiB/s both ways and the ratio.

    python -m tests.benchmarks.bench_engine_socket [--calls 2000] [--rounds 20]
        [--stream-mib 256]
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.agent_process import launch_agent, wait_ready
from tests.support.dockerd import start_engine, stop_engine
from tests.support.services import stop_process, wait_until

IMAGE = "nvd-bench/busybox:1"


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("docker", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self._path)


def _call_times(path: str, target: str, calls: int) -> list[float]:
    conn = UnixConnection(path)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        conn.request("GET", target)
        answer = conn.getresponse()
        answer.read()
        times.append(time.perf_counter() - started)
        assert answer.status == 200, answer.status
    conn.close()
    return times


def _docker(host: str, *args: str, stdin: bytes | None = None) -> bytes:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
    env["DOCKER_HOST"] = host
    run = subprocess.run(
        ["docker", *args], env=env, input=stdin, capture_output=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr
    return run.stdout


def _timed(host: str, args: tuple[str, ...], stdin: bytes | None = None) -> float:
    """Seconds ``docker ARGS`` takes against ``host``; its output checked to be ``stdin``
    when there is one (the echo of ``cat``)."""
    started = time.perf_counter()
    out = _docker(host, *args, stdin=stdin)
    wall = time.perf_counter() - started
    assert stdin is None or out == stdin, (len(out), len(stdin))
    return wall


def _p(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--stream-mib", type=int, default=256)
    args = parser.parse_args()

    engine, dockerd = start_engine()
    with tempfile.TemporaryDirectory(prefix="nvd-bench-es-") as tmp:
        base = Path(tmp)
        ours = base / "engine.sock"
        agent = launch_agent(
            base / "agent",
            "--docker-socket", engine.host.removeprefix("unix://"),
            "--podman-socket", str(base / "no-podman.sock"),
            "--state-dir", str(base / "state"),
            "--cdi-spec-dir", "",
            "--engine-socket", str(ours),
            simulate="hgx-h200-8",
        )  # fmt: skip
        try:
            wait_ready(agent)
            wait_until(ours.exists, what="the engine socket", timeout_s=20)
            engine.import_busybox(IMAGE)
            direct, through = engine.host, f"unix://{ours}"
            paths = {direct: engine.host.removeprefix("unix://"), through: str(ours)}
            version = _docker(
                direct, "version", "--format", "{{.Server.Version}}/{{.Client.Version}}"
            )
            print(f"engine socket benchmark: dockerd/CLI {version.decode().strip()}")

            for target in ("/_ping", "/containers/json"):
                times: dict[str, list[float]] = {direct: [], through: []}
                for _ in range(max(1, args.calls // 200)):
                    for host in (direct, through):
                        times[host] += _call_times(paths[host], target, 200)
                d50, t50 = statistics.median(times[direct]), statistics.median(times[through])
                print(
                    f"GET {target:<17} direct p50 {d50 * 1e6:7.0f} us p99 "
                    f"{_p(times[direct], 0.99) * 1e6:7.0f} us | through p50 {t50 * 1e6:7.0f} us "
                    f"p99 {_p(times[through], 0.99) * 1e6:7.0f} us | ratio p50 {t50 / d50:.2f}, "
                    f"added {(t50 - d50) * 1e6:.0f} us"
                )

            commands: list[tuple[str, tuple[str, ...]]] = [
                ("docker ps", ("ps",)),
                ("docker run --rm IMAGE sh -c true", ("run", "--rm", IMAGE, "sh", "-c", "true")),
            ]
            for label, command in commands:
                walls: dict[str, list[float]] = {direct: [], through: []}
                for _ in range(args.rounds):
                    for host in (direct, through):
                        walls[host].append(_timed(host, command))
                d, t = statistics.median(walls[direct]), statistics.median(walls[through])
                print(
                    f"{label:<32} direct {d * 1e3:7.1f} ms | through {t * 1e3:7.1f} ms | "
                    f"ratio {t / d:.3f}, added {(t - d) * 1e3:+.1f} ms (median of {args.rounds})"
                )

            data = os.urandom(1024 * 1024) * args.stream_mib
            rates: dict[str, list[float]] = {direct: [], through: []}
            for _ in range(3):
                for host in (direct, through):
                    wall = _timed(host, ("run", "--rm", "-i", IMAGE, "cat"), stdin=data)
                    rates[host].append(args.stream_mib / wall)
            d, t = max(rates[direct]), max(rates[through])
            print(
                f"docker run -i cat {args.stream_mib} MiB    direct {d:7.0f} MiB/s | through "
                f"{t:7.0f} MiB/s | ratio {t / d:.3f} (best of 3, container start included)"
            )
        finally:
            stop_process(agent.proc)
            stop_engine(engine, dockerd)


if __name__ == "__main__":
    main()
