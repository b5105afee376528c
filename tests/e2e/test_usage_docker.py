"""The usage ledger end to end with Docker: a private dockerd, the real ``nvidia-docker``
wrapper (``NV_GPU=auto:1``) and a real agent process serving a simulated ``hgx-h200-8`` node
whose node file the test rewrites to set the GPUs' utilisation (docs/usage.md).

Containers hold GPUs for times the test measures (from each lease's grant, in the lease
table, to the ``docker rm -f`` that ends it); the agent sweeps every ``INTERVAL`` seconds.
Checked: ``GET /usage/json`` grouped by a team label, by the Compose project label and by
container gives each group the GPU-seconds its containers held, within one sweep interval
per hold, busy GPU-seconds at the node file's utilisation and energy at its power draw
(the simulated GPUs' energy counters grow at it); the database is readable
with the ``sqlite3`` CLI; under ``--idle-policy stop`` an idle container is stopped through
the engine and one labelled ``nvidia-docker.idle=off`` is not; under ``release`` a stopped
container's lease ends at once, long before its grace time, while a running one keeps its
lease.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from agent.gpu import nodefile
from tests.support.agent_process import AgentProcess, launch_agent, wait_ready
from tests.support.device_nodes import nvidia_nodes, wanted_nodes
from tests.support.dockerd import DockerEngine, start_engine, stop_engine
from tests.support.prerequisites import require_command
from tests.support.services import stop_process, wait_stable, wait_until
from tests.support.wrapper import wrapper_command

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
IMAGE = "nvd-usage/busybox:1"
GPUS = 8
INTERVAL = 0.5  # --usage-interval
POWER_W = 400  # every GPU's draw: its energy counter grows at that rate
# A hold starts at its lease's grant and ends at the last sweep that saw it (at most one
# interval early); the lease ends at dockerd's event, which may come after `docker rm -f`
# has returned.
END_EVENT_S = 1.0
PROJECT = "com.docker.compose.project"


@pytest.fixture(scope="module")
def dockerd() -> Iterator[DockerEngine]:
    """A private dockerd with the busybox image, and /dev/nvidia0..7 where missing."""
    with nvidia_nodes(wanted_nodes(range(GPUS))):
        engine, proc = start_engine()
        try:
            engine.import_busybox(IMAGE)
            yield engine
        finally:
            stop_engine(engine, proc)


def write_node(path: Path, utilization: int) -> None:
    """The 8-GPU node, every GPU at ``utilization`` percent, drawing ``POWER_W`` and without
    processes, renamed into place (the agent's backend follows the file)."""
    raw = json.loads(nodefile.resolve("hgx-h200-8").read_text(encoding="utf-8"))
    for device in raw["devices"]:
        device["status"]["utilization"]["gpu_pct"] = utilization
        device["status"]["power_w"] = POWER_W
        device["status"]["telemetry"]["power_mw"] = POWER_W * 1000
        device["status"]["processes"] = []
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(raw), encoding="utf-8")
    os.replace(partial, path)


@dataclass
class Node:
    engine: DockerEngine
    agent: AgentProcess
    node_file: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.agent.port}"

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as resp:
            return json.loads(resp.read())

    def run(self, *options: str) -> str:
        """``NV_GPU=auto:1 nvidia-docker run -d OPTIONS IMAGE sleep 600``: the container id."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "DOCKER_"))}
        env.update(DOCKER_HOST=self.engine.host, NV_HOST=self.url, NV_CDI="no", NV_GPU="auto:1")
        env["PYTHONPATH"] = str(REPO)
        done = subprocess.run(
            [*wrapper_command(), "run", "-d", *options, IMAGE, "sleep", "600"],
            env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def docker(self, *args: str) -> str:
        return self.engine.docker(*args).stdout.strip()

    def leases(self) -> dict[str, dict[str, Any]]:
        """Container id -> its lease (GET /leases/json), for the bound ones."""
        return {
            lease["Container"]: lease
            for lease in self.get("/leases/json")["Leases"]
            if lease["Container"] is not None
        }

    def granted_at(self, container_id: str) -> float:
        since = self.leases()[container_id]["Since"]
        return datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp()

    def usage(self, by: str, since: float) -> dict[str, dict[str, Any]]:
        answer = self.get(f"/usage/json?by={by}&since={since:.3f}")
        key = by.removeprefix("label:")
        return {row[key]: row for row in answer["rows"]}

    def running(self, container_id: str) -> bool:
        return self.docker("inspect", "-f", "{{.State.Running}}", container_id) == "true"


@contextlib.contextmanager
def usage_node(engine: DockerEngine, base: Path, *args: str, utilization: int) -> Iterator[Node]:
    """An agent with its ledger following ``engine``; afterwards the containers removed."""
    base.mkdir(parents=True, exist_ok=True)
    node_file = base / "node.json"
    write_node(node_file, utilization)
    agent = launch_agent(
        base,
        "--docker-socket", engine.host.removeprefix("unix://"),
        "--podman-socket", str(base / "no-podman.sock"),
        "--state-dir", str(base / "state"),
        "--spec-file", str(engine.plugin_specs / "nvidia-docker.spec"),
        "--cdi-spec-dir", "",
        "--usage-interval", f"{INTERVAL:g}",
        *args,
        simulate=str(node_file),
        socket_dir=engine.root / "nvidia-docker-plugin",
    )  # fmt: skip
    try:
        wait_ready(agent)
        wait_until(
            lambda: f"container events of the Docker engine at {engine.host}" in agent.log(),
            what="the agent following dockerd", timeout_s=30, proc=agent.proc,
        )  # fmt: skip
        yield Node(engine, agent, node_file)
    finally:
        ids = engine.docker("ps", "-aq", check=False).stdout.split()
        if ids:
            engine.docker("rm", "-f", *ids, check=False)
        stop_process(agent.proc)


def settled(node: Node, by: str, since: float) -> dict[str, dict[str, Any]]:
    """The usage rows once they stop changing (the last holds ended and were written)."""
    what = f"the ledger's {by} rows to settle"
    return wait_stable(
        lambda: node.usage(by, since), alike=2, what=what, timeout_s=20, interval_s=1.0
    )


def test_gpu_seconds_and_busy_seconds_per_team_project_and_container(
    dockerd: DockerEngine, tmp_path: Path
) -> None:
    with usage_node(dockerd, tmp_path / "agent", utilization=50) as node:
        since = time.time() - 1
        spans: dict[str, Span] = {}
        names = {"train-a": ("ml", "alpha"), "train-b": ("ml", "beta"), "eval-c": ("cv", "alpha")}
        for name, (team, project) in names.items():
            before = time.time()
            cid = node.run(
                "--name", name, "--label", f"team={team}", "--label", f"{PROJECT}={project}"
            )
            spans[name] = Span(cid, before, time.time())
        wait_until(lambda: len(node.leases()) == 3, what="3 leases bound")
        time.sleep(3)  # the containers hold their GPUs for a while
        remove(node, spans, "train-a")
        time.sleep(2)
        remove(node, spans, "train-b", "eval-c")
        wait_until(lambda: not node.leases(), what="the leases ended")

        teams = settled(node, "label:team", since)
        projects = settled(node, f"label:{PROJECT}", since)
        by_container = settled(node, "container", since)
        rows = sqlite_rows(tmp_path / "agent" / "state" / "usage.db")

    def within(figure: float, *holders: str) -> bool:
        low = sum(spans[h].shortest for h in holders)
        high = sum(spans[h].longest for h in holders)
        return low <= figure <= high

    assert set(teams) == {"ml", "cv"}
    assert within(teams["ml"]["gpu_seconds"], "train-a", "train-b"), (teams, spans)
    assert within(teams["cv"]["gpu_seconds"], "eval-c"), (teams, spans)
    assert within(projects["alpha"]["gpu_seconds"], "train-a", "eval-c"), (projects, spans)
    assert within(projects["beta"]["gpu_seconds"], "train-b"), (projects, spans)
    for row in [*teams.values(), *projects.values(), *by_container.values()]:
        # every GPU at 50% and drawing POWER_W all along
        assert row["busy_gpu_seconds"] == pytest.approx(row["gpu_seconds"] * 0.5, rel=0.02)
        assert row["energy_joules"] == pytest.approx(row["gpu_seconds"] * POWER_W, rel=0.05)
    assert set(by_container) == set(names)
    for name, span in spans.items():
        assert by_container[name]["container_id"] == span.container_id
        assert within(by_container[name]["gpu_seconds"], name), (by_container, spans)
        assert by_container[name]["holds"] == 1
    # What an operator's sqlite3 sees: one ended hold per container, of its image.
    assert sorted(rows) == sorted((name, IMAGE, "lease", 1) for name in names)


@dataclass
class Span:
    """When a container's lease was granted (between ``run_began`` and ``run_ended``: the
    wrapper asks, then creates) and ended (between ``rm_began`` and ``rm_ended``)."""

    container_id: str
    run_began: float
    run_ended: float
    rm_began: float = 0.0
    rm_ended: float = 0.0

    @property
    def shortest(self) -> float:
        """The least the ledger may say: granted last, ended first, one interval short."""
        return self.rm_began - self.run_ended - INTERVAL

    @property
    def longest(self) -> float:
        """The most: granted first, ended after the removal returned (dockerd's event)."""
        return self.rm_ended + END_EVENT_S - self.run_began


def remove(node: Node, spans: dict[str, Span], *names: str) -> None:
    began = time.time()
    node.docker("rm", "-f", *(spans[name].container_id for name in names))
    for name in names:
        spans[name].rm_began, spans[name].rm_ended = began, time.time()


def sqlite_rows(database: Path) -> list[tuple[str, str, str, int]]:
    """(container name, image, holder, ended) of every hold, read by the sqlite3 CLI."""
    require_command("sqlite3", "apt-get install sqlite3: the usage ledger read as operators do")
    done = subprocess.run(
        ["sqlite3", "-readonly", "-separator", "\t", str(database),
         "SELECT container_name, image, holder, ended_s IS NOT NULL FROM holds"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    rows = []
    for line in done.stdout.splitlines():
        name, image, holder, ended = line.split("\t")
        rows.append((name, image, holder, int(ended)))
    return rows


def test_idle_policy_stop_stops_an_idle_container_but_not_one_that_opted_out(
    dockerd: DockerEngine, tmp_path: Path
) -> None:
    with usage_node(
        dockerd, tmp_path / "agent", "--idle-after", "2", "--idle-policy", "stop", utilization=0
    ) as node:
        kept = node.run("--name", "keep-me", "--label", "nvidia-docker.idle=off")
        stopped = node.run("--name", "idle-one")
        wait_until(lambda: not node.running(stopped), what="the idle container stopped",
                   timeout_s=40)  # fmt: skip
        idle = node.get("/usage/idle/json")
        time.sleep(2 * INTERVAL)  # more sweeps: the opted-out one is still left alone
        assert node.running(kept)
        log = node.agent.log()
    assert [(row["container"], row["action"]) for row in idle["idle"]] == [("idle-one", "stopped")]
    assert idle["policy"] == "stop"
    assert idle["idle_after_s"] == 2
    assert "Stopped container idle-one" in log
    assert "keep-me" not in log


def test_idle_policy_release_ends_a_stopped_containers_lease_at_once(
    dockerd: DockerEngine, tmp_path: Path
) -> None:
    with usage_node(
        dockerd, tmp_path / "agent", "--idle-after", "2", "--idle-policy", "release",
        "--lease-grace", "600", utilization=0,
    ) as node:  # fmt: skip
        running = node.run("--name", "still-running")
        parked = node.run("--name", "parked")
        wait_until(lambda: set(node.leases()) == {running, parked}, what="2 leases bound")
        node.docker("stop", "-t", "0", parked)
        wait_until(lambda: parked not in node.leases(), what="the stopped container's lease "
                   "released", timeout_s=40)  # fmt: skip
        assert running in node.leases()  # idle, running: notified only
        idle = {row["container"]: row for row in node.get("/usage/idle/json")["idle"]}
        log = node.agent.log()
    assert idle["still-running"]["policy"] == "release"
    assert idle["still-running"]["action"] == "notified"
    assert "(idle policy release)" in log
