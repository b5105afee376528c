"""A real agent following a node's life, and load that watches it: for tests and benchmarks.

- ``NodeFile``: a node file the agent serves with ``--simulate``, changed the way the
  simulation contract says (a new version renamed into place): another driver version
  (a new kernel module), health events, health flags.
- ``start_agent``: the daemon process on a free loopback port, its log in a file;
  ``gpu_worker_pids``: its GPU worker (or none, between a killed worker and the next).
- ``StatusLoad``: N client threads asking one route over and over, each request on a new
  connection (so that a refused connection would show), every outcome kept with its time.
- ``ContainerLoop``: ``docker run`` again and again with the volume ``/docker/cli`` names
  at that moment, as the ``nvidia-docker`` wrapper does.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.gpu import nodefile
from tests.support.dockerd import DockerEngine
from tests.support.services import free_port, port_open, stop_process, wait_until


class NodeFile:
    """A node file on disk that a test rewrites as the simulation contract says."""

    def __init__(self, path: Path, builtin: str = "h200", *, timing: bool = True) -> None:
        self.path = path
        self.data: dict[str, Any] = json.loads(nodefile.resolve(builtin).read_text())
        if not timing:
            self.data.pop("timing", None)
        self.data["events"] = []
        self._next_event = 0
        self.write()

    def write(self) -> None:
        """Write the new version next to the file and rename it into place (atomic)."""
        staged = self.path.with_name(f".{self.path.name}.new")
        staged.write_text(json.dumps(self.data, indent=1))
        os.replace(staged, self.path)

    @property
    def driver_version(self) -> str:
        return str(self.data["driver_version"])

    def load_driver(self, version: str) -> None:
        """The simulated kernel module of another driver is loaded."""
        self.data["driver_version"] = version
        self.write()

    def event(self, gpu: int, kind: str, xid: int | None = None) -> None:
        self._next_event += 1
        entry: dict[str, Any] = {"id": f"e{self._next_event}", "gpu": gpu, "kind": kind}
        if xid is not None:
            entry["xid"] = xid
        self.data = copy.deepcopy(self.data)
        self.data["events"].append(entry)
        self.write()

    def flag(self, gpu: int, name: str, value: bool) -> None:
        self.data["devices"][gpu][name] = value
        self.write()


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    port: int
    socket_dir: Path
    volume_dir: Path
    log_path: Path

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / "nvidia-docker.sock"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, timeout_s: float = 10) -> tuple[int, bytes]:
        url = f"http://127.0.0.1:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def get_json(self, path: str) -> Any:
        status, body = self.get(path)
        assert status == 200, (path, status, body)
        return json.loads(body)

    def driver_version(self) -> str:
        return str(self.get_json("/gpu/info/json")["Version"]["Driver"])


@contextlib.contextmanager
def start_agent(
    base: Path,
    node: NodeFile,
    *,
    ldcache: Path | None = None,
    search_path: str | None = None,
    spec_file: Path | None = None,
    extra: Sequence[str] = (),
    preexec: Callable[[], None] | None = None,
) -> Iterator[Agent]:
    """The daemon serving ``node``; stopped at the end. A port that another process took
    between choosing and binding it (other test runs on the machine) is chosen again.
    ``preexec`` runs in the child before exec (``MemoryCgroup.enter``)."""
    for attempt in range(3):
        agent = _spawn_agent(base, node, ldcache, search_path, spec_file, extra, preexec)
        try:
            wait_until(
                functools.partial(_ready, agent),
                what=f"agent (log: {agent.log_path})",
                timeout_s=60,
                proc=agent.proc,
            )
        except RuntimeError:
            stop_process(agent.proc)
            if "cannot listen on" in agent.log() and attempt < 2:
                continue
            raise
        except BaseException:
            stop_process(agent.proc)
            raise
        break
    try:
        yield agent
    finally:
        stop_process(agent.proc)


def gpu_worker_pids(daemon_pid: int) -> list[int]:
    """The daemon's children that run ``agent.gpu.worker`` (a killed worker not yet reaped has
    no command line, so it is not one)."""
    children = Path(f"/proc/{daemon_pid}/task/{daemon_pid}/children").read_text().split()
    found = []
    for child in children:
        try:
            if b"agent.gpu.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
        except OSError:
            continue
    return found


def _ready(agent: Agent) -> bool:
    return port_open(agent.port) and agent.socket_path.exists() and "Ready" in agent.log()


def _spawn_agent(
    base: Path,
    node: NodeFile,
    ldcache: Path | None,
    search_path: str | None,
    spec_file: Path | None,
    extra: Sequence[str],
    preexec: Callable[[], None] | None = None,
) -> Agent:
    port = free_port()
    socket_dir, volume_dir, log_path = base / "plugins", base / "volumes", base / "agent.log"
    command = [
        sys.executable, "-m", "agent.daemon",
        "-l", f"127.0.0.1:{port}", "-s", str(socket_dir), "-d", str(volume_dir),
        "--simulate", str(node.path), *extra,
    ]  # fmt: skip
    if ldcache is not None:
        command += ["--ldcache", str(ldcache)]
    if spec_file is not None:
        command += ["--spec-file", str(spec_file)]
    env = dict(os.environ)
    env.pop("NV_DEBUG", None)
    if search_path is not None:
        env["PATH"] = search_path
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=preexec,  # noqa: PLW1509 - it only moves the child into a cgroup
        )
    return Agent(proc, port, socket_dir, volume_dir, log_path)


@dataclass(frozen=True, slots=True)
class Outcome:
    started_s: float  # time.monotonic()
    latency_s: float
    status: int | None  # None: no HTTP answer at all
    body: bytes = b""
    error: str | None = None  # the connection failed: how


class StatusLoad:
    """``clients`` threads on ``path``, a new connection per request, until ``stop()``."""

    def __init__(self, port: int, path: str = "/gpu/status/json", clients: int = 16) -> None:
        self.port, self.path, self.clients = port, path, clients
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._outcomes: list[list[Outcome]] = [[] for _ in range(clients)]

    def start(self) -> StatusLoad:
        for number in range(self.clients):
            thread = threading.Thread(target=self._client, args=(number,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def count(self) -> int:
        """Requests answered (or failed) so far."""
        return sum(len(part) for part in self._outcomes)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        return sorted((o for part in self._outcomes for o in part), key=lambda o: o.started_s)

    def _client(self, number: int) -> None:
        keep = self._outcomes[number]
        while not self._stop.is_set():
            started = time.monotonic()
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                connection.request("GET", self.path)
                response = connection.getresponse()
                body = response.read()
                keep.append(Outcome(started, time.monotonic() - started, response.status, body))
            except (OSError, http.client.HTTPException) as err:
                keep.append(
                    Outcome(started, time.monotonic() - started, None, error=type(err).__name__)
                )
            finally:
                connection.close()


@dataclass(frozen=True, slots=True)
class ContainerRun:
    started_s: float
    volume: str
    returncode: int
    output: str


@dataclass
class ContainerLoop:
    """``docker run --rm`` in a loop with the driver volume ``/docker/cli`` names now."""

    engine: DockerEngine
    agent: Agent
    image: str
    volume_driver: str
    runs: list[ContainerRun] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ContainerLoop:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[ContainerRun]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=180)
        return self.runs

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            status, body = self.agent.get("/docker/cli/json")
            if status != 200:
                self.runs.append(ContainerRun(started, "", -1, f"/docker/cli: {status} {body!r}"))
                continue
            (volume,) = json.loads(body)["Volumes"]
            done = self.engine.docker(
                "run", "--rm", f"--volume-driver={self.volume_driver}", "-v", volume, self.image,
                "readlink", "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
                check=False,
            )  # fmt: skip
            self.runs.append(
                ContainerRun(started, volume, done.returncode, (done.stdout + done.stderr).strip())
            )
