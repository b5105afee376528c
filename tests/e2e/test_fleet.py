"""``nvidia-docker-ctl info|status|docker-cli`` end to end, as an operator runs it.

Real transports only: simulated agents from ``tests.support.agent_farm`` (the real REST app,
each node its own listening socket, some stopped to play dead nodes), a real OpenSSH sshd
listening on several ports (each port an SSH node, tunnelling to a different agent), and
small aiohttp servers that answer HTML, garbage or 500 the way a wrong service would. The
ctl runs as a subprocess (``python -m controller.ctl.main``), its output read as a person would.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support.agent_farm import AgentFarm, farms_before_and_after_free, start_farm
from tests.support.certs import make_pki
from tests.support.prerequisites import require_root
from tests.support.services import wait_until
from tests.support.sshd import SshServer, start_sshd, stop_sshd
from tests.unit.controller.ctl_lines import error_of

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
KINDS = ("h200", "hgx-h200-8")
GPUS = {"h200": 1, "hgx-h200-8": 8}
SSH_NODES = 4


@pytest.fixture(scope="module")
def farm() -> Iterator[AgentFarm]:
    """Twelve agents, h200 and hgx-h200-8 in turn; the last two are stopped (dead nodes)."""
    farm = start_farm(12, KINDS)
    try:
        farm.stop_nodes(farm.ports[-2:])
        yield farm
    finally:
        farm.stop()


@pytest.fixture(scope="module")
def fleet_sshd() -> Iterator[SshServer]:
    """One real sshd on 1 + SSH_NODES loopback ports."""
    require_root()
    server, proc = start_sshd(extra_ports=SSH_NODES)
    try:
        yield server
    finally:
        stop_sshd(server, proc)


def live(farm: AgentFarm) -> list[tuple[int, str]]:
    return [(p, k) for p, k in zip(farm.ports, farm.kinds, strict=True) if p not in farm.stopped]


def http_node(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def ssh_node(server: SshServer, ssh_port: int, agent_port: int) -> str:
    return f"ssh://{server.user}@127.0.0.1:{ssh_port}:{agent_port}"


def ssh_home(server: SshServer, base: Path, *, knows_host: bool = True) -> Path:
    """A user's HOME: the key, and (if wanted) the host key for every port in known_hosts."""
    server.client_home(base, knows_host=False)
    if knows_host:
        key = " ".join(server.host_key_pub.read_text().split()[:2])
        lines = [f"[127.0.0.1]:{p} {key}\n" for p in (server.port, *server.extra_ports)]
        (base / ".ssh" / "known_hosts").write_text("".join(lines))
    return base


def ctl_env(home: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "SSH_AUTH"))}
    env["PYTHONPATH"] = str(REPO)
    env.pop("COLUMNS", None)
    if home is not None:
        env["HOME"] = str(home)
    env.update(extra)
    return env


async def ctl(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``python -m controller.ctl.main ARGS`` without blocking this test's servers."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "controller.ctl.main",
        *args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
        env=env or ctl_env(),
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def agent_json(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
        return json.load(answer)


def rows_of(stdout: str, node: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.split()[:1] == [node]]


# --- servers that are not an agent ------------------------------------------------------------


async def _html(request: web.Request) -> web.Response:
    return web.Response(
        text="<!DOCTYPE html><html><body>It works!</body></html>", content_type="text/html"
    )


async def _garbage(request: web.Request) -> web.Response:
    return web.Response(body=b"\x00\xffgarbage\x01", content_type="application/octet-stream")


async def _fail(request: web.Request) -> web.Response:
    return web.Response(status=500, text="internal error: see the agent's log\n")


async def _other_json(request: web.Request) -> web.Response:
    return web.json_response({"hello": "world"})


@pytest.fixture
async def impostors() -> AsyncIterator[dict[str, int]]:
    """Ports that answer HTML, bytes, 500 and foreign JSON, plus one that never answers."""
    runners, ports = [], {}
    for name, handler in (
        ("html", _html),
        ("garbage", _garbage),
        ("http500", _fail),
        ("json", _other_json),
    ):
        app = web.Application()
        app.router.add_get("/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        runners.append(runner)
        ports[name] = sock.getsockname()[1]
    silent = socket.socket()  # accepts (the kernel does) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    ports["silent"] = silent.getsockname()[1]
    try:
        yield ports
    finally:
        silent.close()
        for runner in runners:
            await runner.cleanup()


# --- the tests --------------------------------------------------------------------------------


async def test_status_table_live_dead_and_wrong_nodes(
    farm: AgentFarm, impostors: dict[str, int]
) -> None:
    nodes = [http_node(p) for p in farm.ports]
    wrong = {name: http_node(port) for name, port in impostors.items()}
    code, out, err = await ctl(
        "status", "--timeout", "2", *nodes, *wrong.values(), "no-such-node.invalid:"
    )
    assert code == 1, err  # some nodes failed
    assert "Traceback" not in out + err
    lines = out.splitlines()
    assert lines[0].split() == [
        "NODE",
        "GPU",
        "MODEL",
        "MEM",
        "GiB",
        "UTIL",
        "POWER",
        "W",
        "DRIVER",
        "CUDA",
    ]
    assert "…" not in out  # not a terminal: whole values, nothing cut to a width
    for port, kind in live(farm):
        rows = rows_of(out, http_node(port))
        assert [r[1] for r in rows] == [str(i) for i in range(GPUS[kind])], out
        assert all(r[2] == "H200" and r[-2:] == ["580.159.04", "13.0"] for r in rows)
    # the hgx node's busy GPUs (2 and 3 run a training job) show as busy
    hgx = next(p for p, k in live(farm) if k == "hgx-h200-8")
    busy = {r[1]: r for r in rows_of(out, http_node(hgx))}
    assert busy["2"][3:5] == ["118/140", "97%"]
    assert busy["0"][4] == "0%"
    reasons = {
        http_node(farm.ports[-1]): "connection refused",
        wrong["html"]: "HTML, not JSON",
        wrong["garbage"]: "not JSON",
        wrong["http500"]: "HTTP 500",
        wrong["json"]: "not an agent",
        wrong["silent"]: "timeout",
        "no-such-node.invalid:": "unknown host",
    }
    said = {wrong["http500"]: ": internal error: see the agent's log"}  # the agent's own line
    for node, reason in reasons.items():
        (row,) = [line for line in lines if line.startswith(node + " ")]
        assert row.split(None, 2)[1:] == ["-", f"error: {reason}{said.get(node, '')}"], row
        # the whole reason, one line, on stderr
        assert any(e.startswith(f"nvidia-docker-ctl: {node}: ") for e in err.splitlines()), err
    assert "within 2 s" in err
    assert "HTML page" in err
    gpus = sum(GPUS[k] for _, k in live(farm))
    assert err.splitlines()[-1] == (
        f"nvidia-docker-ctl: {len(nodes) + len(wrong) + 1} nodes, {len(live(farm))} answered "
        f"({gpus} GPUs), {len(farm.stopped) + len(wrong) + 1} failed (1 answered with an error)"
    )


async def test_json_document_holds_the_agents_answers_as_is(farm: AgentFarm) -> None:
    nodes = [http_node(p) for p in farm.ports]
    code, out, err = await ctl("status", "--json", *nodes)
    assert code == 1, err
    document = json.loads(out)
    assert document["command"] == "status"
    assert list(document["nodes"]) == nodes
    for port, _kind in live(farm):
        entry = document["nodes"][http_node(port)]
        assert entry["error"] is None
        assert entry["info"] == agent_json(port, "/gpu/info/json")
        assert (
            entry["status"]["Devices"][0].keys()
            == agent_json(port, "/gpu/status/json")["Devices"][0].keys()
        )
    for port in farm.stopped:
        entry = document["nodes"][http_node(port)]
        assert entry["reason"] == "connection refused"
        assert "cannot connect" in entry["error"]
        assert "info" not in entry
    assert document["summary"] == {
        "nodes": 12,
        "answered": 10,
        "failed": 2,
        "gpus": sum(GPUS[k] for _, k in live(farm)),
    }


async def test_jsonl_one_line_per_node(farm: AgentFarm) -> None:
    nodes = [http_node(p) for p in farm.ports]
    code, out, _ = await ctl("info", "--jsonl", *nodes)
    assert code == 1
    lines = [json.loads(line) for line in out.splitlines()]
    assert sorted(entry["node"] for entry in lines) == sorted(nodes)
    by_node = {entry["node"]: entry for entry in lines}
    for port, kind in live(farm):
        assert len(by_node[http_node(port)]["info"]["Devices"]) == GPUS[kind]


async def test_exit_codes_all_answered_and_none_answered(farm: AgentFarm) -> None:
    alive = [http_node(p) for p, _ in live(farm)]
    dead = [http_node(p) for p in farm.stopped]
    assert (await ctl("info", *alive))[0] == 0
    code, _out, err = await ctl("info", *dead)
    assert code == 3
    assert "0 answered" in err


async def test_docker_cli_across_the_fleet(farm: AgentFarm) -> None:
    port8 = next(p for p, k in live(farm) if k == "hgx-h200-8")
    port1 = next(p for p, k in live(farm) if k == "h200")
    code, out, _ = await ctl("docker-cli", "--dev", "0", http_node(port8), http_node(port1))
    assert code == 0
    assert rows_of(out, http_node(port8)) == [
        [http_node(port8), "1", "nvidia0", "nvidia_driver_580.159.04"]
    ]
    code, out, err = await ctl("docker-cli", "--dev", "7", http_node(port8), http_node(port1))
    assert code == 1  # the one-GPU node has no GPU 7: the agent's 400, per node
    assert "invalid device: 7" in err
    # the agent answered: its own reason in the row
    assert rows_of(out, http_node(port1))[0][1:] == [
        "-", "error:", "HTTP", "400:", "invalid", "device:", "7"
    ]  # fmt: skip
    # every node refused, none unreachable: 1 (3 is for "no agent could be reached")
    code, out, err = await ctl("docker-cli", "--dev", "7", http_node(port1))
    assert code == 1, err


async def test_ssh_nodes_one_login_each(
    farm: AgentFarm, fleet_sshd: SshServer, tmp_path: Path
) -> None:
    home = ssh_home(fleet_sshd, tmp_path)
    agents = live(farm)
    nodes = [
        ssh_node(fleet_sshd, ssh_port, agents[i][0])
        for i, ssh_port in enumerate(fleet_sshd.extra_ports)
    ]
    dead_agent = ssh_node(fleet_sshd, fleet_sshd.port, farm.ports[-1])
    before = fleet_sshd.log.read_text(errors="replace").count("Accepted publickey")
    code, out, err = await ctl("status", "--json", *nodes, dead_agent, env=ctl_env(home))
    assert code == 1, err
    document = json.loads(out)["nodes"]
    for i, node in enumerate(nodes):
        assert document[node]["error"] is None, document[node]
        assert len(document[node]["status"]["Devices"]) == GPUS[agents[i][1]]
    # the SSH login worked, the agent behind it is dead
    assert document[dead_agent]["reason"] == "no agent behind SSH"
    # two requests per node, one SSH login per node
    logins = fleet_sshd.log.read_text(errors="replace").count("Accepted publickey") - before
    assert logins == len(nodes) + 1


async def test_free_over_ssh_asks_an_agent_before_its_route_through_the_same_login(
    fleet_sshd: SshServer, tmp_path: Path
) -> None:
    # `free` asks GET /leases/free; an agent before that route (405) is asked for its leases
    # and topology next, through the same tunnel: one SSH login a node either way.
    home = ssh_home(fleet_sshd, tmp_path)
    with farms_before_and_after_free() as (prior, current):
        ports = zip(fleet_sshd.extra_ports, (prior.ports[0], current.ports[0]), strict=False)
        nodes = [ssh_node(fleet_sshd, ssh_port, agent_port) for ssh_port, agent_port in ports]
        before = fleet_sshd.log.read_text(errors="replace").count("Accepted publickey")
        code, out, err = await ctl("free", "--json", "--gpus", "2", *nodes, env=ctl_env(home))
        assert code == 0, err
        document = json.loads(out)
        older, newer = (document["nodes"][node] for node in nodes)
        assert (set(older) >= {"info", "leases"}, "free" in older) == (True, False)
        assert ("free" in newer, "leases" in newer) == (True, False)
        assert [(c["node"], c["free"], c["link"]) for c in document["free"]] == [
            (nodes[0], 5, "NVLink"), (nodes[1], 5, "NVLink")
        ]  # fmt: skip
        logins = fleet_sshd.log.read_text(errors="replace").count("Accepted publickey") - before
        assert logins == len(nodes)


async def test_ssh_unknown_host_key_is_refused(
    farm: AgentFarm, fleet_sshd: SshServer, tmp_path: Path
) -> None:
    home = ssh_home(fleet_sshd, tmp_path, knows_host=False)
    node = ssh_node(fleet_sshd, fleet_sshd.extra_ports[0], live(farm)[0][0])
    code, out, err = await ctl("status", node, env=ctl_env(home))
    assert code == 3
    assert "error: SSH host key unknown" in out
    assert "ssh-keyscan" in err
    assert "Traceback" not in err


async def test_inventory_yaml_with_http_and_ssh_hosts(
    farm: AgentFarm, fleet_sshd: SshServer, tmp_path: Path
) -> None:
    home = ssh_home(fleet_sshd, tmp_path / "home")
    agents = live(farm)
    inventory = tmp_path / "hosts.yml"
    http_hosts = "\n".join(
        f"        gpu{i:02d}: {{ansible_host: 127.0.0.1, nvidia_docker_agent_listen_port: {port}}}"
        for i, (port, _) in enumerate(agents[:3])
    )
    ssh_hosts = "\n".join(
        f"        dgx{i}: {{ansible_port: {ssh_port}, "
        f"nvidia_docker_agent_listen_port: {agents[i][0]}}}"
        for i, ssh_port in enumerate(fleet_sshd.extra_ports[:2])
    )
    inventory.write_text(
        f"""all:
  children:
    web:
      vars:
        nvidia_docker_transport: http
      hosts:
{http_hosts}
    dgx:
      vars:
        ansible_host: 127.0.0.1
        ansible_user: {fleet_sshd.user}
      hosts:
{ssh_hosts}
"""
    )
    code, out, err = await ctl("info", "-i", str(inventory), env=ctl_env(home))
    assert code == 0, err
    names = [row[0] for row in (line.split() for line in out.splitlines()[1:])]
    assert list(dict.fromkeys(names)) == ["gpu00", "gpu01", "gpu02", "dgx0", "dgx1"]
    code, out, err = await ctl(
        "info", "--json", "-i", str(inventory), "--limit", "dgx,!dgx1", env=ctl_env(home)
    )
    assert code == 0, err
    document = json.loads(out)["nodes"]
    assert list(document) == ["dgx0"]
    assert document["dgx0"]["endpoint"] == (
        f"ssh://{fleet_sshd.user}@127.0.0.1:{fleet_sshd.extra_ports[0]}:{agents[0][0]}"
    )


async def test_inventory_ini_and_nodes_file(farm: AgentFarm, tmp_path: Path) -> None:
    agents = live(farm)
    inventory = tmp_path / "hosts"
    inventory.write_text(
        "[gpu]\n"
        + "".join(
            f"node{i} ansible_host=127.0.0.1 nvidia_docker_agent_listen_port={port}\n"
            for i, (port, _) in enumerate(agents[:2])
        )
        + "[gpu:vars]\nnvidia_docker_transport=http\n"
    )
    nodes_file = tmp_path / "nodes.txt"
    nodes_file.write_text(f"# rack 7\n{http_node(agents[2][0])}   # the spare\n\n")
    code, out, err = await ctl("info", "-i", str(inventory), "--nodes", str(nodes_file))
    assert code == 0, err
    names = list(dict.fromkeys(line.split()[0] for line in out.splitlines()[1:]))
    # NODE arguments first, then --nodes files, then the inventory, each in its own order
    assert names == [http_node(agents[2][0]), "node0", "node1"]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("hosts.yml", "all:\n  hosts:\n    - node1\n", "hosts.yml, line 3: the hosts of group"),
        ("hosts.yml", "all:\n  hosts: [\n", "hosts.yml, line 3: not valid YAML"),
        ("hosts", "[gpu\nnode1\n", "hosts, line 1: bad section header"),
        ("hosts", "[gpu]\nnode[3:1]\n", "hosts, line 2: empty host range"),
    ],
)
async def test_malformed_inventory_is_one_line(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    inventory = tmp_path / name
    inventory.write_text(text)
    code, out, err = await ctl("status", "-i", str(inventory))
    assert code == 2
    assert out == ""
    assert error_of(err).startswith(f"inventory {tmp_path}/")
    assert message in err


async def test_bad_node_argument_is_one_line() -> None:
    code, _out, err = await ctl("status", "ftp://node1")
    assert code == 2
    assert "invalid remote host URI 'ftp://node1'" in error_of(err)


def _run_with_a_terminal_for_stderr(
    command: list[str], env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[bytes], bytes]:
    """``command`` run with its standard error on a pseudo-terminal (where the progress line
    is drawn) and its standard output piped; what the terminal showed."""
    main, child = pty.openpty()
    try:
        proc = subprocess.run(
            command, check=False, stdout=subprocess.PIPE, stderr=child, cwd=REPO, env=env,
            timeout=60,
        )  # fmt: skip
        os.close(child)
        child = -1
        seen = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(main)
        if child >= 0:
            os.close(child)
    return proc, seen


def test_progress_bar_only_on_a_terminal(farm: AgentFarm) -> None:
    nodes = [http_node(p) for p in farm.ports]
    command = [sys.executable, "-m", "controller.ctl.main", "info", *nodes]
    proc, seen = _run_with_a_terminal_for_stderr(command, ctl_env())
    assert proc.returncode == 1
    assert b"/12 nodes" in seen
    assert b"\r" in seen
    assert b"12/12 nodes  2 failed" in seen
    # not on a pipe
    piped = subprocess.run(
        command, check=False, capture_output=True, cwd=REPO, env=ctl_env(), timeout=60
    )
    assert b"/12 nodes" not in piped.stderr
    assert b"\r" not in piped.stderr + piped.stdout


# --- worker processes: the same answers, the same output ----------------------------------

SPREAD_NODES = 40  # above controller.fleet.workers.MIN_NODES: a fleet the ctl spreads

# The ctl as an operator runs it, but for two things a test must decide: how many CPUs it
# sees (NVD_TEST_CPUS: 1 asks every node in its own process, as before workers; 2 spreads
# the nodes over two worker processes on any machine), and a count of the worker processes
# it forked, written at exit to NVD_TEST_FORKS with the number of its child processes still
# there then, running or unreaped (so that a test of the workers knows that they did the
# asking, and that none was left behind).
_LAUNCHER = """
import atexit, os, runpy, signal, sys
# Ctrl-C as a terminal's foreground job gets it: a run started in the background by a
# shell without job control (as CI may be) would otherwise inherit SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
import controller.fleet.workers as workers
cpus = int(os.environ["NVD_TEST_CPUS"])
workers.usable_cpus = lambda: cpus
forked = []
real_fork = os.fork
def fork():
    pid = real_fork()
    if pid:
        forked.append(pid)
    return pid
os.fork = fork
ctl = os.getpid()
def interrupt_at(where):  # NVD_TEST_SIGINT_AT: a Ctrl-C that lands right there, once, in the ctl
    wanted = os.environ.get("NVD_TEST_SIGINT_AT") == where and os.getpid() == ctl
    if wanted and not interrupt_at.done:
        interrupt_at.done = True
        os.kill(os.getpid(), signal.SIGINT)
interrupt_at.done = False
def fork_interrupted():
    pid = fork()
    if pid:
        interrupt_at("fork")
    return pid
os.fork = fork_interrupted
import asyncio.events
real_new_loop = asyncio.events.new_event_loop
def new_loop():
    interrupt_at("loop")
    return real_new_loop()
asyncio.events.new_event_loop = new_loop
def count():
    pid = os.getpid()
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        left = len(children.read().split())
    with open(os.environ["NVD_TEST_FORKS"], "w") as out:
        out.write(f"{len(forked)} {left}")
atexit.register(count)
sys.argv = ["nvidia-docker-ctl", *sys.argv[1:]]
runpy.run_module("controller.ctl.main", run_name="__main__")
"""


@dataclass(frozen=True)
class TlsFarm:
    farm: AgentFarm
    ca: Path


@pytest.fixture(scope="module")
def tls_farm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsFarm]:
    """SPREAD_NODES agents over TLS with the lease routes, h200 and hgx-h200-8 in turn, one
    lease of one GPU on each node; the last three are stopped."""
    pki = make_pki(tmp_path_factory.mktemp("spread-pki"))
    farm = start_farm(SPREAD_NODES, KINDS, leases=True, tls=(pki.pem("server"), pki.key("server")))
    try:
        context = ssl.create_default_context(cafile=pki.pem("ca"))
        ask = urllib.request.Request(
            f"https://127.0.0.1:{farm.ports[0]}/leases",
            data=b'{"count": 1, "owner": {"user": "test"}}',
            method="POST",
        )  # the nodes of one kind share one lease table: each h200 node has this lease
        with urllib.request.urlopen(ask, timeout=30, context=context) as answer:
            assert answer.status == 201
        farm.stop_nodes(farm.ports[-3:])
        yield TlsFarm(farm, pki.pem("ca"))
    finally:
        farm.stop()


def spread_nodes(tls_farm: TlsFarm, impostors: dict[str, int]) -> list[str]:
    """The TLS farm's nodes, and nodes that fail each in its own way: stopped agents,
    plain-HTTP servers asked over TLS, a silent one (a timeout), a name that does not
    resolve, and one agent asked over plain HTTP (it serves TLS only)."""
    nodes = [f"https://127.0.0.1:{port}" for port in tls_farm.farm.ports]
    nodes += [f"https://127.0.0.1:{port}" for port in impostors.values()]
    nodes += ["https://no-such-node.invalid:3476", http_node(tls_farm.farm.ports[1])]
    return nodes


async def launched_ctl(
    cpus: int, *args: str, tmp_path: Path, env: dict[str, str] | None = None
) -> tuple[int, str, str, int]:
    """The ctl seeing ``cpus`` CPUs: exit code, stdout, stderr, worker processes forked
    (and none of them left when it exited)."""
    forks = tmp_path / f"forks-{cpus}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _LAUNCHER, *args,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=REPO,
        env={**(env or ctl_env()), "NVD_TEST_CPUS": str(cpus), "NVD_TEST_FORKS": str(forks)},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    forked, left = map(int, forks.read_text().split())
    assert left == 0, f"{left} worker processes left when the ctl exited"
    return proc.returncode, out.decode(), err.decode(), forked


def _no_elapsed(text: str) -> str:
    """The output without what differs from run to run: the seconds each node took."""
    return re.sub(r'"elapsed_s": ?[0-9.]+', '"elapsed_s": 0', text)


@pytest.mark.parametrize(
    ("args", "ordered"),
    [
        (("status",), True),
        (("status", "--json"), True),
        (("info", "--jsonl"), False),
        (("health",), True),
        (("leases",), True),
        (("leases", "--json"), True),
        (("free", "--gpus", "2"), False),
        (("free", "--gpus", "2", "--json"), True),
        (("docker-cli", "--dev", "0"), True),
        (("usage",), True),  # the farm's ledgers are off: each node named, in order
        (("idle", "--json"), True),
    ],
)
async def test_workers_print_what_one_process_prints(
    tls_farm: TlsFarm,
    impostors: dict[str, int],
    tmp_path: Path,
    args: tuple[str, ...],
    ordered: bool,
) -> None:
    """Every output, exit code and per-node error kind as without workers: the nodes asked
    by two worker processes, and by the ctl's own process (one CPU), on the same fleet."""
    nodes_file = tmp_path / "nodes"
    nodes_file.write_text("\n".join(spread_nodes(tls_farm, impostors)) + "\n")
    command = (*args, "--timeout", "2", "--ca", str(tls_farm.ca), "--nodes", str(nodes_file))
    alone = await launched_ctl(1, *command, tmp_path=tmp_path)
    spread = await launched_ctl(2, *command, tmp_path=tmp_path)

    assert (alone[3], spread[3]) == (0, 2)  # one process, then two workers
    assert alone[0] == spread[0], (alone[2][-2000:], spread[2][-2000:])
    assert alone[0] in (0, 1), alone[2][-2000:]
    assert "Traceback" not in alone[2] + spread[2]
    if ordered:  # rows in the nodes' order; messages too
        assert _no_elapsed(spread[1]) == _no_elapsed(alone[1])
        assert spread[2] == alone[2]
    else:  # --jsonl and free's messages: in the order the nodes finish
        assert sorted(_no_elapsed(spread[1]).splitlines()) == sorted(
            _no_elapsed(alone[1]).splitlines()
        )
        assert sorted(spread[2].splitlines()) == sorted(alone[2].splitlines())
    # each way a node fails is there, as before: a worker's node keeps its kind
    if args == ("info", "--jsonl"):
        reasons = {json.loads(line)["reason"] for line in spread[1].splitlines()}
        assert reasons == {
            None,
            "connection refused",
            "TLS error",
            "timeout",
            "unknown host",
            "disconnected",
        }


def test_workers_draw_the_progress_line(tls_farm: TlsFarm, tmp_path: Path) -> None:
    nodes = [f"https://127.0.0.1:{port}" for port in tls_farm.farm.ports]
    forks = tmp_path / "forks"
    env = {**ctl_env(), "NVD_TEST_CPUS": "2", "NVD_TEST_FORKS": str(forks)}
    command = [sys.executable, "-c", _LAUNCHER, "info", "--ca", str(tls_farm.ca), *nodes]
    proc, seen = _run_with_a_terminal_for_stderr(command, env)
    assert forks.read_text() == "2 0"  # two workers, none left at exit
    assert proc.returncode == 1
    assert f"{SPREAD_NODES}/{SPREAD_NODES} nodes  3 failed".encode() in seen
    assert len(proc.stdout.splitlines()) == 1 + (SPREAD_NODES - 3) // 2 * 9 + 1 + 3


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(word) for word in path.read_text().split()] if path.exists() else []


def _gone(pid: int) -> bool:
    """The process has ended: no longer in /proc, or a zombie nobody waited for yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


@pytest.fixture
def silent_nodes() -> Iterator[list[str]]:
    """SPREAD_NODES ports that accept connections (the kernel does) and never answer."""
    socks = []
    try:
        for _ in range(SPREAD_NODES):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            socks.append(sock)
        yield [http_node(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _start_waiting_ctl(
    nodes: list[str], tmp_path: Path
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The ctl asking nodes that never answer (a 60 s timeout), once its two workers run."""
    nodes_file = tmp_path / "nodes"
    nodes_file.write_text("\n".join(nodes) + "\n")
    env = {**ctl_env(), "NVD_TEST_CPUS": "2", "NVD_TEST_FORKS": str(tmp_path / "forks")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, "status", "--timeout", "60", "--nodes", str(nodes_file)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
        env=env, start_new_session=True,  # its own process group, as a shell's job
    )  # fmt: skip
    wait_until(lambda: len(_children(proc.pid)) == 2, what="the ctl's workers", proc=proc)
    return proc, _children(proc.pid)


def test_ctrl_c_ends_the_workers(silent_nodes: list[str], tmp_path: Path) -> None:
    """Ctrl-C on a terminal reaches the whole job: the ctl exits 130 at once (not after the
    60 s timeout) and leaves no worker behind, running or unreaped."""
    proc, workers = _start_waiting_ctl(silent_nodes, tmp_path)
    err = b""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # ended, and its pipes read and closed, whatever happened
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
    assert proc.returncode == 130, err.decode()[-2000:]
    assert "Traceback" not in err.decode()
    for pid in workers:  # the ctl waited for them before it exited
        assert not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("where", ["fork", "loop"])
def test_ctrl_c_while_the_query_starts(where: str, silent_nodes: list[str], tmp_path: Path) -> None:
    """A Ctrl-C that lands while the ctl forks its workers (after the first) or while
    asyncio builds its event loop ends the query as one at any other moment: exit 130, no
    traceback, every worker reaped."""
    nodes_file = tmp_path / "nodes"
    nodes_file.write_text("\n".join(silent_nodes) + "\n")
    forks = tmp_path / "forks"
    env = {**ctl_env(), "NVD_TEST_CPUS": "2", "NVD_TEST_FORKS": str(forks)}
    done = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, "status", "--timeout", "60", "--nodes", str(nodes_file)],
        stdin=subprocess.DEVNULL, capture_output=True, cwd=REPO, timeout=60, check=False,
        env={**env, "NVD_TEST_SIGINT_AT": where}, start_new_session=True,
    )  # fmt: skip
    err = done.stderr.decode()
    assert done.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert "never awaited" not in err, err[-2000:]
    forked, left = (int(n) for n in forks.read_text().split())
    assert forked >= 1  # the interrupt came after a worker was forked
    assert left == 0


def test_workers_end_with_a_killed_ctl(silent_nodes: list[str], tmp_path: Path) -> None:
    """The ctl killed outright cannot stop its workers: each ends by itself, its socket to
    the ctl closed."""
    proc, workers = _start_waiting_ctl(silent_nodes, tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    wait_until(lambda: all(_gone(pid) for pid in workers), what="the workers to end", timeout_s=30)


def test_a_worker_that_dies_fails_the_query_with_its_reason(
    silent_nodes: list[str], tmp_path: Path
) -> None:
    """A worker killed (a bug, the OOM killer) is no node failure to report as the agent's:
    the query fails as an internal error naming the worker, and the other one ends too."""
    proc, workers = _start_waiting_ctl(silent_nodes, tmp_path)
    try:
        os.kill(workers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.decode()
    assert proc.returncode == 4, text[-2000:]
    assert f"fleet worker 0 (pid {workers[0]}) was killed by signal 9 before answering" in text
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists()
