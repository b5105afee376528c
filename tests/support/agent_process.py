"""One real ``nvidia-docker-plugin`` process for a test, and plain clients of its two servers.

``start_agent(base, ...)`` runs ``python -m agent.daemon`` on a free loopback port with its
socket and volume directories under ``base``, its log in ``base/agent.log``, optionally
under a descriptor limit (set in the child before exec), and waits until both servers
answer. The clients are the standard library's (``http.client`` over TCP or the unix
socket), so that what they send is exactly what a test asks for.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.fake_driver import FakeDriver
from tests.support.services import free_port, port_open, stop_process, wait_until

V12 = {"Accept": "application/vnd.docker.plugins.v1.2+json"}


class UnixHTTPConnection(http.client.HTTPConnection):
    """``http.client`` over a unix socket (the plugin's)."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        super().__init__("plugin", timeout=timeout_s)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self.socket_path))
        self.sock = sock


@dataclass
class AgentProcess:
    proc: subprocess.Popen[bytes]
    port: int
    base: Path
    socket_dir: Path

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / "nvidia-docker.sock"

    @property
    def volume_dir(self) -> Path:
        return self.base / "volumes"

    @property
    def log_path(self) -> Path:
        return self.base / "agent.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def open_descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def settled_descriptors(self, timeout_s: float = 30.0) -> int:
        """The daemon's descriptors once it has opened everything it opens after Ready: the
        usage ledger's database opens on a thread after the REST API serves (503 until
        then; 404 without a ledger)."""
        wait_until(
            lambda: self.get("/usage/json")[0] != 503,
            what=f"the agent's usage ledger opened (log: {self.log_path})",
            timeout_s=timeout_s,
            proc=self.proc,
        )
        return self.open_descriptors()

    def get(self, path: str, *, timeout_s: float = 10.0) -> tuple[int, Mapping[str, str], bytes]:
        """One GET on a new connection: status, headers, body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        """One REST request with an optional JSON body: status and decoded JSON answer
        (error answers included)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def plugin(
        self,
        method: str,
        body: bytes | Any = b"",
        *,
        headers: Mapping[str, str] = V12,
        timeout_s: float = 10.0,
    ) -> tuple[int, dict[str, Any]]:
        """One POST to the plugin socket on a new connection: status and JSON answer."""
        return plugin_call(self.socket_path, method, body, headers=headers, timeout_s=timeout_s)


def plugin_call(
    socket_path: Path,
    method: str,
    body: bytes | Any = b"",
    *,
    headers: Mapping[str, str] = V12,
    timeout_s: float = 10.0,
) -> tuple[int, dict[str, Any]]:
    """One POST to a plugin socket on a new connection: status and JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = UnixHTTPConnection(socket_path, timeout_s)
    try:
        conn.request("POST", f"/{method}", body=data, headers=dict(headers))
        resp = conn.getresponse()
        answer: dict[str, Any] = json.loads(resp.read())
        return resp.status, answer
    finally:
        conn.close()


def _descriptor_limit(limit: int) -> Callable[[], None]:
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return set_limit


def _in_child(*steps: Callable[[], None] | None) -> Callable[[], None] | None:
    """One ``preexec_fn`` that runs each of ``steps`` given, in order; None for none."""
    given = [step for step in steps if step is not None]
    if not given:
        return None

    def run_all() -> None:
        for step in given:
            step()

    return run_all


def launch_agent(
    base: Path,
    *args: str,
    port: int | None = None,
    socket_dir: Path | None = None,
    nofile: int | None = None,
    driver: FakeDriver | None = None,
    simulate: str = "h200",
    preexec: Callable[[], None] | None = None,
    python_flags: Sequence[str] = (),
    environment: Mapping[str, str] | None = None,
    python: Path | None = None,
) -> AgentProcess:
    """Start the daemon without waiting for it (``wait_ready`` waits). ``preexec`` runs in
    the child before exec, after the descriptor limit is set (a memory cgroup's ``enter``);
    ``python_flags`` go to its interpreter (``python``: this one by default; the daemon
    looks for the CDI spec's hook beside it), ``environment`` adds to this process's
    (``NV_DEBUG`` is dropped from it)."""
    base.mkdir(parents=True, exist_ok=True)
    port = free_port() if port is None else port
    socket_dir = base / "plugins" if socket_dir is None else socket_dir
    env = dict(os.environ)
    env.pop("NV_DEBUG", None)
    env.update(environment or {})
    command = [
        str(python or sys.executable), *python_flags, "-m", "agent.daemon",
        "-l", f"127.0.0.1:{port}",
        "-s", str(socket_dir),
        "-d", str(base / "volumes"),
        "--simulate", simulate,
    ]  # fmt: skip
    if driver is not None:
        env["PATH"] = driver.search_path
        command += ["--ldcache", str(driver.ldcache)]
    with (base / "agent.log").open("ab") as log:
        proc = subprocess.Popen(
            [*command, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_in_child(  # noqa: PLW1509
                _descriptor_limit(nofile) if nofile is not None else None, preexec
            ),
        )
    return AgentProcess(proc, port, base, socket_dir)


def wait_ready(agent: AgentProcess, timeout_s: float = 60.0, host: str = "127.0.0.1") -> None:
    """Until the agent answers on ``host`` (where its ``-l`` listens) and its plugin socket."""
    wait_until(
        lambda: port_open(agent.port, host) and agent.socket_path.is_socket(),
        what=f"agent (log: {agent.log_path})",
        timeout_s=timeout_s,
        proc=agent.proc,
    )


@contextmanager
def running_agent(
    base: Path,
    *args: str,
    preexec: Callable[[], None] | None = None,
    ready_host: str = "127.0.0.1",
    **kwargs: Any,
) -> Iterator[AgentProcess]:
    """A started agent, ready once it answers on ``ready_host``; stopped (SIGTERM, then
    SIGKILL) afterwards."""
    agent = launch_agent(base, *args, preexec=preexec, **kwargs)
    try:
        wait_ready(agent, host=ready_host)
        yield agent
    finally:
        stop_process(agent.proc)
