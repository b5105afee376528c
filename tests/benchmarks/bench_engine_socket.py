"""Engine socket benchmark: what the agent's forwarding adds, against the engine's own socket.

Starts a private dockerd (tests.support.dockerd, with a busybox image) and a real agent on
the simulated ``hgx-h200-8`` node serving ``--engine-socket``, then, in one run and
interleaved (direct, through, direct, ...), so that both see the same machine:

1. one API call, on one kept-alive connection: ``GET /_ping`` and ``GET /containers/json``
   (``--calls`` each way): p50/p99 and the ratio;
2. ``docker ps`` and ``docker run --rm IMAGE true`` with the Docker CLI (``--rounds`` each
   way): median wall time and the ratio, and the added time per run;
3. a GPU run through the agent, ``docker run --rm --gpus 1 IMAGE sh -c true`` (a lease, the
   rewritten create, the engine's GPU setup, the lease's end at the container's removal),
   against the same run without GPUs on the engine's own socket;
4. a hijacked stream: ``docker run --rm -i IMAGE cat`` fed ``--stream-mib`` MiB and read
   back: MiB/s both ways and the ratio.

``--engine cdi`` runs Debian 13's dockerd (``.cache/docker-cdi``, as scripts/test-all unpacks
it; ``NVD_DOCKERD_CDI`` names another) reading the agent's CDI spec, so that GPU creates get
the CDI form; the default, the machine's dockerd (20.10), gets the device-node form.
``--engine podman`` puts the agent in front of Podman's API service (``--podman-engine-socket``;
the first ``podman`` on ``PATH``, which must be Podman 5 for Docker's CLI 28: scripts/test-all
unpacks one into ``.cache/podman5/bin``), whose GPU creates get device nodes and the driver
volume's directory bound; by hand, the same as ``--device`` and ``-v DIR:/usr/local/nvidia:ro``.
The simulated node's device nodes are made in /dev where missing (``tests.support.device_nodes``).

    python -m tests.benchmarks.bench_engine_socket [--calls 2000] [--rounds 20]
        [--stream-mib 256] [--engine nodes|cdi|podman]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.agent_process import launch_agent, wait_ready
from tests.support.device_nodes import nvidia_nodes, wanted_nodes
from tests.support.dockerd import FETCHED_DOCKERD, start_engine, stop_engine
from tests.support.podman import api_service, private_podman
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
    parser.add_argument(
        "--engine",
        choices=("nodes", "cdi", "podman"),
        default="nodes",
        help="nodes: the machine's dockerd, GPU creates get device nodes and the driver "
        "volume; cdi: Debian 13's dockerd reading the agent's CDI spec; podman: Podman's "
        "API service (Podman 5 first on PATH)",
    )
    args = parser.parse_args()
    with (
        nvidia_nodes(wanted_nodes(range(8))),
        tempfile.TemporaryDirectory(prefix="nvd-bench-es-") as tmp,
    ):
        _bench(args, Path(tmp))


def _by_hand(port: int, engine: str, volumes: Path) -> tuple[str, ...]:
    """The docker arguments of GPU 0 as a user would give them on the engine's own socket:
    its CDI name (``cdi``), else what ``/docker/cli`` says (device nodes, driver volume; for
    Podman, which has no volume plugins, the volume's directory under ``volumes`` bound)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    if engine == "cdi":
        conn.request("GET", "/gpu/info/json")
        uuid = json.loads(conn.getresponse().read())["Devices"][0]["UUID"]
        return ("--device", f"nvidia.com/gpu={uuid}")
    conn.request("GET", "/docker/cli?dev=0")
    words = tuple(conn.getresponse().read().decode().split())
    if engine != "podman":
        return words
    binds = []
    for word in words:
        if word.startswith("--volume="):
            name, target, mode = word.removeprefix("--volume=").split(":")
            base, _, version = name.rpartition("_")
            binds.append(f"--volume={volumes / base / version}:{target}:{mode}")
    return (*(w for w in words if w.startswith("--device=")), *binds)


def _gpu_runs(
    args: argparse.Namespace, port: int, direct: str, through: str, volumes: Path
) -> None:
    """A GPU run through the agent (leased, rewritten) against the same GPU given by hand on
    the engine's own socket, and against a run without GPUs, interleaved."""
    form = _docker(through, "run", "-d", "--gpus", "1", IMAGE, "sleep", "60").decode().strip()
    shown = _docker(
        direct, "inspect", "-f",
        "{{json .HostConfig.DeviceRequests}} {{len .HostConfig.Devices}}", form,
    ).decode().split()  # fmt: skip
    shown[0] = shown[0] if shown[0] != "[]" else "null"  # Podman says an empty list
    _docker(direct, "rm", "-f", form)
    print(f"GPU creates through the agent: DeviceRequests {shown[0]}, {shown[1]} device nodes")
    true = (IMAGE, "sh", "-c", "true")
    runs = {
        "no GPU, direct": (direct, ("run", "--rm", *true)),
        "GPU 0 by hand, direct": (
            direct,
            ("run", "--rm", *_by_hand(port, args.engine, volumes), *true),
        ),
        "--gpus 1, through": (through, ("run", "--rm", "--gpus", "1", *true)),
    }
    walls: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(args.rounds):
        for label, (host, command) in runs.items():
            walls[label].append(_timed(host, command))
    base, by_hand, leased = (statistics.median(walls[label]) for label in runs)
    print(
        f"docker run --rm [GPU] IMAGE sh -c true, median of {args.rounds}: no GPU direct "
        f"{base * 1e3:.1f} ms | GPU 0 by hand direct {by_hand * 1e3:.1f} ms | --gpus 1 through "
        f"{leased * 1e3:.1f} ms | through / by hand {leased / by_hand:.3f}, added "
        f"{(leased - by_hand) * 1e3:+.1f} ms"
    )


@contextlib.contextmanager
def _engine(args: argparse.Namespace, base: Path) -> Iterator[tuple[str, list[str], Path | None]]:
    """The engine, running with the busybox image: its socket's path, the agent's arguments
    that follow it and serve the engine socket ``base/engine.sock`` before it, and where the
    agent serves its volume plugin (None: anywhere)."""
    ours = str(base / "engine.sock")
    if args.engine == "podman":
        with private_podman() as podman:
            podman.import_busybox(IMAGE, {})
            with api_service(podman) as service:
                yield str(service.socket_path), [
                    "--docker-socket", str(base / "no-docker.sock"),
                    "--podman-socket", str(service.socket_path),
                    "--cdi-spec-dir", "",
                    "--podman-engine-socket", ours,
                ], None  # fmt: skip
        return
    cdi_dir = base / "cdi"
    if args.engine == "cdi":
        cdi_dir.mkdir()
        engine, dockerd = start_engine(
            base,
            dockerd=os.environ.get("NVD_DOCKERD_CDI") or str(FETCHED_DOCKERD),
            extra_args=["--cdi-spec-dir", str(cdi_dir)],
            daemon_json={"features": {"cdi": True}},
        )
    else:
        engine, dockerd = start_engine(base)
    try:
        engine.import_busybox(IMAGE)
        yield engine.host.removeprefix("unix://"), [
            "--docker-socket", engine.host.removeprefix("unix://"),
            "--podman-socket", str(base / "no-podman.sock"),
            "--spec-file", str(engine.plugin_specs / "nvidia-docker.spec"),
            "--cdi-spec-dir", str(cdi_dir) if args.engine == "cdi" else "",
            "--engine-socket", ours,
        ], engine.root / "nvidia-docker-plugin"  # fmt: skip
    finally:
        stop_engine(engine, dockerd)


def _bench(args: argparse.Namespace, base: Path) -> None:
    ours = base / "engine.sock"
    with _engine(args, base) as (engine_path, following, plugin_dir):
        agent = launch_agent(
            base / "agent", "--state-dir", str(base / "state"), *following,
            simulate="hgx-h200-8", socket_dir=plugin_dir,
        )  # fmt: skip
        try:
            wait_ready(agent)
            wait_until(ours.exists, what="the engine socket", timeout_s=20)
            _measure(args, agent.port, f"unix://{engine_path}", f"unix://{ours}",
                     base / "agent" / "volumes")  # fmt: skip
        finally:
            stop_process(agent.proc)


def _measure(args: argparse.Namespace, port: int, direct: str, through: str, volumes: Path) -> None:
    paths = {direct: direct.removeprefix("unix://"), through: through.removeprefix("unix://")}
    version = _docker(direct, "version", "--format", "{{.Server.Version}}/{{.Client.Version}}")
    print(f"engine socket benchmark ({args.engine}): engine/CLI {version.decode().strip()}")

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

    _gpu_runs(args, port, direct, through, volumes)

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


if __name__ == "__main__":
    main()
