"""The usage ledger never hurts the node: real agent processes (``--simulate hgx-h200-8``)
whose leases are asked over the REST API (pending leases hold their GPUs and count in the
ledger, with the ask's owner labels), under faults (docs/usage.md, "When things go wrong").

Checked: a garbage and a truncated ``usage.db`` are moved aside with one line and a new
ledger starts; ``kill -9`` of the agent loses nothing the ledger had written, and the hold
goes on after the restart; on a full filesystem (a 1 MiB tmpfs) the agent keeps serving, the
ledger says it is behind (REST and ``/metrics``), and catches up once there is room; two
agents pointed at one ledger file: the second serves without a ledger and says why; an
agent whose lease state file is gone numbers new leases above those the ledger names. And
``nvidia-docker-ctl usage`` over two agents sums their ledgers' rows, group by group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent_process import AgentProcess, launch_agent, wait_ready
from tests.support.prerequisites import require_root
from tests.support.services import stop_process, wait_stable, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

INTERVAL = 0.3


def start(base: Path, *args: str) -> AgentProcess:
    agent = launch_agent(
        base, "--state-dir", str(base / "state"), "--cdi-spec-dir", "",
        "--docker-socket", str(base / "no-docker.sock"),
        "--podman-socket", str(base / "no-podman.sock"),
        "--usage-interval", f"{INTERVAL:g}", "--lease-pending", "600", *args,
        simulate="hgx-h200-8",
    )  # fmt: skip
    wait_ready(agent)
    return agent


@contextlib.contextmanager
def agent_at(base: Path, *args: str) -> Iterator[AgentProcess]:
    agent = start(base, *args)
    try:
        yield agent
    finally:
        stop_process(agent.proc)


def ask(agent: AgentProcess, team: str) -> str:
    status, answer = agent.call("POST", "/leases", {"count": 1, "owner": {"team": team}})
    assert status == 201, answer
    return str(answer["Lease"])


def team_seconds(agent: AgentProcess, team: str) -> float:
    status, answer = agent.call("GET", "/usage/json?by=label:team&since=-1h")
    if status == 503:  # the ledger is being opened (the agent serves meanwhile)
        return 0.0
    assert status == 200, answer
    return float(sum(row["gpu_seconds"] for row in answer["rows"] if row["team"] == team))


def wait_team_seconds(agent: AgentProcess, team: str, at_least: float) -> float:
    seen = [0.0]

    def enough() -> bool:
        seen[0] = team_seconds(agent, team)
        return seen[0] >= at_least

    wait_until(enough, what=f"{at_least} GPU-seconds of team {team}", timeout_s=30,
               proc=agent.proc)  # fmt: skip
    return float(seen[0])


def wait_settled(teams: list[tuple[AgentProcess, str]]) -> None:
    """Until the teams' GPU-seconds stop growing: three readings, two sweeps apart, alike
    (an ended hold grows until a sweep writes its end; a loaded machine delays sweeps)."""
    wait_stable(lambda: [team_seconds(agent, team) for agent, team in teams], alike=3,
                what="the ended holds written", timeout_s=30, interval_s=2 * INTERVAL)  # fmt: skip


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_ledger_is_moved_aside_and_a_new_one_starts(tmp_path: Path, damage: str) -> None:
    with agent_at(tmp_path / "first") as agent:
        ask(agent, "ml")
        wait_team_seconds(agent, "ml", 1.0)
    ledger = tmp_path / "first" / "state" / "usage.db"
    if damage == "garbage":
        ledger.write_bytes(os.urandom(64 * 1024))
    else:
        with ledger.open("r+b") as db:
            db.truncate(ledger.stat().st_size // 3)
    for sidecar in ("usage.db-wal", "usage.db-shm"):
        (ledger.parent / sidecar).unlink(missing_ok=True)
    damaged = ledger.read_bytes()
    with agent_at(tmp_path / "first") as agent:
        wait_team_seconds(agent, "ml", 0.5)  # the lease is back (leases.json), a new ledger
        status, info = agent.call("GET", "/gpu/info/json")
        log = agent.log()
    aside = [
        p
        for p in ledger.parent.iterdir()
        if re.fullmatch(r"usage\.db\.corrupt-[0-9]{8}T[0-9]{6}", p.name)
    ]
    assert len(aside) == 1, list(ledger.parent.iterdir())
    assert aside[0].read_bytes() == damaged  # the damaged file kept, as it was
    assert status == 200
    assert len(info["Devices"]) == 8
    lines = [line for line in log.splitlines() if str(aside[0].name) in line]
    assert len(lines) == 1, log
    assert "Traceback" not in log


def test_kill_9_loses_nothing_written_and_the_hold_goes_on(tmp_path: Path) -> None:
    agent = start(tmp_path / "node")
    try:
        lease = ask(agent, "ml")
        before = wait_team_seconds(agent, "ml", 2.0)
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(timeout=10)
        agent = start(tmp_path / "node")
        after = wait_team_seconds(agent, "ml", before + 1.0)
        _status, table = agent.call("GET", "/leases/json")
    finally:
        stop_process(agent.proc)
    assert [row["Lease"] for row in table["Leases"]] == [lease]
    assert after >= before + 1.0
    database = tmp_path / "node" / "state" / "usage.db"
    done = subprocess.run(
        ["sqlite3", "-readonly", str(database),
         "SELECT COUNT(*), SUM(ended_s IS NULL) FROM holds WHERE lease_id = '" + lease + "'"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "1|1"  # one hold, still open: it went on after the restart


def test_without_its_lease_state_the_agent_numbers_leases_above_the_ledgers(
    tmp_path: Path,
) -> None:
    with agent_at(tmp_path / "node") as agent:
        first, second = ask(agent, "ml"), ask(agent, "ml")
        wait_team_seconds(agent, "ml", 1.0)  # both leases are in the ledger's holds
        for lease in (first, second):
            assert agent.call("DELETE", f"/leases/{lease}")[0] == 200
    (tmp_path / "node" / "state" / "leases.json").unlink()  # lost, or deleted by hand
    with agent_at(tmp_path / "node") as agent:
        third = ask(agent, "ml")
        _status, table = agent.call("GET", "/leases/json")
    # lease-1 again would merge a new owner's figures into the old lease's in the ledger
    assert (first, second, third) == ("lease-1", "lease-2", "lease-3")
    assert [row["Lease"] for row in table["Leases"]] == ["lease-3"]


@contextlib.contextmanager
def small_tmpfs(size: str) -> Iterator[Path]:
    require_root()
    where = Path(tempfile.mkdtemp(prefix="nvd-full-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                   check=True, timeout=30)  # fmt: skip
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)
        where.rmdir()


def behind(agent: AgentProcess) -> tuple[bool, str]:
    """What ``GET /usage/json`` says of the ledger: behind, and why."""
    status, answer = agent.call("GET", "/usage/json?by=label:team&since=-1h")
    assert status == 200, answer  # asked once the ledger has figures: it is open
    return bool(answer["ledger"]["behind"]), str(answer["ledger"]["reason"])


def metric_behind(agent: AgentProcess) -> bool:
    """What ``/metrics`` says: ``nvidia_docker_usage_ledger_behind`` is 1."""
    _status, _headers, metrics = agent.get("/metrics")
    line = next(
        line for line in metrics.decode().splitlines()
        if line.startswith("nvidia_docker_usage_ledger_behind ")
    )  # fmt: skip
    return line.endswith(" 1.0")


def test_a_full_filesystem_puts_the_ledger_behind_and_it_catches_up(tmp_path: Path) -> None:
    with (
        small_tmpfs("4m") as disk,
        agent_at(tmp_path / "node", "--usage-db", str(disk / "u.db")) as agent,
    ):
        first = ask(agent, "ml")
        wait_team_seconds(agent, "ml", 1.0)
        filler = disk / "filler"
        with contextlib.suppress(OSError), filler.open("wb") as out:
            while True:  # until ENOSPC
                out.write(b"\0" * 65536)
                out.flush()
        for team in ("cv", "nlp", "ops"):  # new holds need new pages: more than is left
            ask(agent, team)
        wait_until(lambda: behind(agent)[0] and metric_behind(agent), what="the ledger behind",
                   timeout_s=30, proc=agent.proc)  # fmt: skip
        reason = behind(agent)[1]
        status, _ = agent.call("GET", "/gpu/info/json")  # the agent serves meanwhile
        assert status == 200
        assert agent.call("DELETE", f"/leases/{first}")[0] == 200
        filler.unlink()
        wait_until(lambda: not behind(agent)[0] and not metric_behind(agent),
                   what="the ledger caught up", timeout_s=60, proc=agent.proc)  # fmt: skip
        teams = ("cv", "nlp", "ops")  # the holds made while it was full: counted by a sweep
        wait_until(lambda: all(team_seconds(agent, t) > 0 for t in teams),
                   what="the holds made while full counted", timeout_s=60,
                   proc=agent.proc)  # fmt: skip
        caught_up = {team: team_seconds(agent, team) for team in teams}
        log = agent.log()
    assert "full" in reason.lower(), reason
    assert all(seconds > 0 for seconds in caught_up.values()), caught_up
    assert "caught up" in log
    assert "Traceback" not in log


def test_two_agents_on_one_ledger_file_the_second_serves_without_one(tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "usage.db"
    with (
        agent_at(tmp_path / "one", "--usage-db", str(shared)) as first,
        agent_at(tmp_path / "two", "--usage-db", str(shared)) as second,
    ):
        ask(first, "ml")
        wait_team_seconds(first, "ml", 1.0)
        wait_until(
            lambda: second.call("GET", "/usage/json")[0] != 503,
            what="the second agent's ledger opened or given up",
            proc=second.proc,
        )
        status, answer = second.call("GET", "/usage/json")
        info, _ = second.call("GET", "/gpu/info/json")
        log = second.log()
    assert status == 404
    assert str(shared) in answer["Error"]
    assert info == 200
    assert "serves without a usage ledger" in log


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("nvidia-docker-ctl")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "controller.ctl.main"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NV_")}
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60,
                          env=env, check=False)  # fmt: skip


def test_the_fleet_report_sums_the_agents_ledgers(tmp_path: Path) -> None:
    with agent_at(tmp_path / "a") as one, agent_at(tmp_path / "b") as two:
        since = time.time() - 5
        leases = [(one, ask(one, "ml")), (one, ask(one, "cv")), (two, ask(two, "ml"))]
        wait_team_seconds(one, "cv", 1.0)
        wait_team_seconds(two, "ml", 1.0)
        for agent, lease in leases:
            assert agent.call("DELETE", f"/leases/{lease}")[0] == 200
        until = time.time() + 5
        wait_settled([(one, "ml"), (one, "cv"), (two, "ml")])  # the holds' ends written
        query = f"/usage/json?by=label:team&since={since:.3f}&until={until:.3f}"
        answers = [agent.call("GET", query)[1] for agent in (one, two)]
        nodes = [f"http://127.0.0.1:{agent.port}" for agent in (one, two)]
        done = ctl("usage", "--by", "label:team", "--since", f"{since:.3f}",
                   "--until", f"{until:.3f}", "--json", *nodes)  # fmt: skip
        table = ctl("usage", "--by", "label:team", "--since", f"{since:.3f}",
                    "--until", f"{until:.3f}", *nodes)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = {row["team"]: row for row in json.loads(done.stdout)}
    expected: dict[str, float] = {}
    for answer in answers:
        for row in answer["rows"]:
            expected[row["team"]] = expected.get(row["team"], 0.0) + row["gpu_seconds"]
    assert set(report) == set(expected) >= {"ml", "cv"}
    for team in ("ml", "cv"):  # ended holds; the node file's host processes ("") go on
        assert report[team]["gpu_seconds"] == pytest.approx(expected[team], abs=0.01)
    assert len(report["ml"]["nodes"]) == 2
    assert len(report["cv"]["nodes"]) == 1
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[-1].startswith("TOTAL"), table.stdout
