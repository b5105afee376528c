"""The watcher of a leased ``nvidia-docker run`` (controller.wrapper.lease_watch): when docker
ends, it asks the agent for the conditional release (``DELETE /leases/{id}/pending``); it
holds none of docker's descriptors, is nobody's zombie and ends by itself within the
lease's pending time. Real processes: a Python that starts the watcher and execs a stand-in
for docker, and the wrapper itself (test_wrapper.py's recording docker), against agents on a
loopback port."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from controller.transport.endpoint import Endpoint
from controller.transport.tls import TlsOptions
from controller.wrapper.gpu_args import Reach, _watch
from controller.wrapper.lease_watch import ASK_S, budget, watchable
from controller.wrapper.leases import LeaseAsk, _grant
from tests.support.lease_agent import LeaseAgent
from tests.support.services import serve_on_loopback
from tests.unit.controller.test_wrapper import GPU_LABELS, REPO, Docker, docker, nvidia_docker

__all__ = ["docker"]  # the fixture, used by name


class Agent:
    """An agent that serves the conditional release, records it, and answers it after
    ``delay_s``."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, float]] = []  # (path, when)
        self.delay_s = 0.0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_delete("/leases/{lease}/pending", self._release)
        return app

    async def _release(self, request: web.Request) -> web.Response:
        self.asked.append((request.path, time.monotonic()))
        await asyncio.sleep(self.delay_s)
        return web.json_response({"Released": request.match_info["lease"]})


@pytest.fixture
async def agent() -> AsyncIterator[tuple[Agent, int]]:
    served = Agent()
    async with serve_on_loopback(served.app()) as port:
        yield served, port


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.02)


# The wrapper's last steps: the watcher, then docker (a shell standing in for it).
WRAPPER = """
import os, sys
from controller.transport.endpoint import Endpoint
from controller.transport.tls import TlsOptions
from controller.wrapper.gpu_args import Reach
from controller.wrapper import lease_watch
port, pending, docker = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
endpoint = Endpoint(transport="http", host="127.0.0.1", http_port=port)
lease_watch.start(lease_watch.LeaseWatch(endpoint, Reach(TlsOptions()), "lease-7", pending))
os.execvp("sh", ["sh", "-c", docker])
"""


@dataclass
class Run:
    code: int
    stdout: str
    seconds: float
    marker: str


async def wrapper(port: int, pending_s: float, docker_script: str, *, stdin: bool = True) -> Run:
    """Run the wrapper's last steps with ``docker_script`` as docker; its output is a pipe,
    read to its end. ``marker`` names the watcher's command line (it has the wrapper's).
    ``stdin=False``: the wrapper starts with its standard input closed."""
    marker = f"watch-{uuid.uuid4().hex}"
    started = time.monotonic()
    args = [sys.executable, "-c", WRAPPER, str(port), str(pending_s), docker_script, marker]
    if not stdin:
        args = ["sh", "-c", 'exec "$@" <&-', "sh", *args]
    proc = await asyncio.create_subprocess_exec(
        *args,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(), time.monotonic() - started, marker)


def watchers(marker: str) -> list[int]:
    """The processes whose command line carries ``marker`` (the watcher)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def parent_and_state(pid: int) -> tuple[int, str] | None:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    return int(fields["PPid"]), fields["State"].split()[0]


# --- decisions ------------------------------------------------------------------------------


def test_the_watch_and_the_ask_share_the_pending_time() -> None:
    assert budget(60.0) == (60.0 - ASK_S, ASK_S)
    assert budget(2.0) == (1.0, 1.0)
    watch_s, ask_s = budget(3600.0)
    assert watch_s <= 600.0
    assert ask_s == ASK_S


@pytest.mark.parametrize(
    ("lease", "pending_s", "watched"),
    [
        ("lease-3", 60.0, True),
        ("lease-3", None, False),  # an agent that does not say: it may release unconditionally
        ("lease-3", 0.0, False),
        ("lease-", 60.0, False),
        ("lease-3/../../x", 60.0, False),
        ("lease-٣", 60.0, False),
        ("other-3", 60.0, False),
    ],
)
def test_only_a_grant_that_says_its_pending_time_is_watched(
    lease: str, pending_s: float | None, watched: bool
) -> None:
    assert watchable(lease, pending_s) is watched


def _body(**extra: object) -> dict[str, Any]:
    return {"Lease": "lease-3", "Dev": "GPU-a", "Labels": {}, "Devices": [], **extra}


@pytest.mark.parametrize(
    ("value", "pending_s"),
    [(60, 60.0), (12.5, 12.5), (None, None), ("60", None), (True, None), (-1, None), (1e9, None)],
)
def test_the_grant_s_pending_time_is_read_when_it_is_one(value: object, pending_s: object) -> None:
    body = _body() if value is None else _body(PendingS=value)
    grant = _grant("node", body, LeaseAsk("NV_GPU=auto"))
    assert grant.pending_s == pending_s
    endpoint = Endpoint(transport="http", host="gpu7")
    watch = _watch(grant, endpoint, Reach(TlsOptions()))
    assert (watch is not None) is (pending_s is not None)
    if watch is not None:
        assert (watch.endpoint, watch.lease, watch.path) == (
            endpoint,
            "lease-3",
            "/leases/lease-3/pending",
        )


# --- the watcher, as a process ----------------------------------------------------------------


async def test_docker_failing_is_followed_by_the_conditional_release(
    agent: tuple[Agent, int],
) -> None:
    served, port = agent
    served.delay_s = 3.0  # the watcher still waits for its answer when docker has ended
    run = await wrapper(port, 60.0, "echo docker says no >&2; echo out; exit 125")
    assert run.code == 125  # docker's own exit code
    assert run.stdout == "out\n"
    # the pipe ended with docker, not with the watcher (still waiting for its answer)
    assert run.seconds < 2.5, run
    await until(lambda: bool(served.asked), "the watcher asks for the conditional release")
    assert [path for path, _ in served.asked] == ["/leases/lease-7/pending"]
    for pid in watchers(run.marker):
        found = parent_and_state(pid)
        assert found is None or found[1] != "Z", found


async def test_a_wrapper_without_standard_input_is_watched_until_docker_ends(
    agent: tuple[Agent, int],
) -> None:
    served, port = agent  # its pidfd may be descriptor 0, which the watcher gives /dev/null
    run = await wrapper(port, 60.0, "sleep 1; exit 3", stdin=False)
    ended = time.monotonic()
    assert run.code == 3
    await until(lambda: bool(served.asked), "the watcher asks for the conditional release")
    assert served.asked[0][1] > ended - 0.2  # when docker ended, not before


async def test_the_watcher_ends_by_itself_when_docker_outlives_the_pending_time(
    agent: tuple[Agent, int],
) -> None:
    served, port = agent
    marker_holder: list[str] = []
    task = asyncio.ensure_future(wrapper(port, 1.0, "exec sleep 4"))
    await until(lambda: bool(_any_watcher(marker_holder)), "the watcher runs", timeout_s=5)
    pid = marker_holder[0]
    found = parent_and_state(int(pid))
    assert found is not None
    assert found[1] != "Z"
    await until(lambda: parent_and_state(int(pid)) is None, "the watcher ends", timeout_s=3)
    assert not task.done()  # docker (sleep) still runs: the watcher did not wait for it
    run = await task
    assert run.code == 0
    assert served.asked == []  # it ran past the watch: the lease is bound or ended by now


def _any_watcher(holder: list[str]) -> bool:
    """Finds the watcher of a run whose marker the test does not know yet (the run is still
    going): a process whose command line has a ``watch-`` marker and that leads a session
    of its own (the watcher calls setsid; the wrapper, docker after its exec, does not)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.startswith(b"watch-") for arg in args) and os.getsid(int(entry.name)) == int(
            entry.name
        ):
            holder[:] = [entry.name]
            return True
    return False


# --- the wrapper ------------------------------------------------------------------------------


@dataclass
class WatchedAgent(LeaseAgent):
    """tests.support.lease_agent's agent, whose grants say how long they stay pending and
    which serves the conditional release (it has no engine: every lease is unused)."""

    unused: list[str] | None = None

    def _grant(self, body: dict[str, Any], units: list[Any]) -> dict[str, Any]:
        return {**super()._grant(body, units), "PendingS": 60}

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_delete("/leases/{id}/pending", self._unused)
        return app

    async def _unused(self, request: web.Request) -> web.Response:
        assert self.unused is not None
        self.unused.append(request.match_info["id"])
        return await self._release(request)


async def test_the_wrapper_gives_back_the_lease_of_a_docker_that_ends(docker: Docker) -> None:
    agent = WatchedAgent(unused=[])
    async with serve_on_loopback(agent.application()) as port:
        docker.image("nvidia/cuda:12.4", GPU_LABELS)
        env = {"NV_HOST": f"http://127.0.0.1:{port}", "DOCKER_HOST": "tcp://127.0.0.1:2375"}
        result = await nvidia_docker(docker, "run", "nvidia/cuda:12.4", NV_GPU="auto:3", **env)
        assert result.code == 0, result.stderr
        assert result.executed is not None
        assert "--label=nvidia-docker.lease=lease-1" in result.executed
        await until(lambda: agent.unused == ["lease-1"], "the watcher asks")
        await until(lambda: not any(agent.holders.values()), "the GPUs are free again")
        assert agent.requests[-1] == "DELETE /leases/lease-1/pending"
