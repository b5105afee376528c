"""``nvidia-docker-ctl`` as a newcomer meets it: one error line and exit-code scheme for every
command, a default node, ``--version``, output that behaves like the tools operators know.

The node is a small aiohttp server answering as docs/api.md says (one GPU whose health the
test sets); the tool runs through its edge (``controller.ctl.main``), as the console script
does. tests/e2e/test_fleet.py and test_docs_examples.py run it against real agents.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from click.testing import Result

from controller.ctl import fleet as fleet_commands
from controller.ctl.main import main
from controller.fleet.output import Progress, ProgressAware
from controller.fleet.query import INFO, FleetNode, NodeResult
from controller.fleet.report import TableSink
from controller.transport.endpoint import parse_endpoint
from tests.support.cli import cli_runner
from tests.support.services import serve_on_loopback
from tests.unit.controller.ctl_lines import ERROR_LINE, error_of

UUID = "GPU-825bd660-d5ca-57d3-b40a-8a8f99e88dc9"
SICK = (
    "GPU 0 ("
    + UUID
    + ") is unhealthy since 2026-12-01T09:00:41Z: XID 79 (GPU has fallen off the bus)"
)


@dataclass
class Node:
    port: int
    healthy: bool = True
    driver: str = "580.159.04"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _info(node: Node) -> dict[str, Any]:
    device = {"UUID": UUID, "Model": "NVIDIA H200", "Power": 700, "Memory": {"Global": 143771}}
    return {"Version": {"Driver": node.driver, "CUDA": "13.0"}, "Devices": [device]}


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    state = Node(port=0)

    async def info(_: web.Request) -> web.Response:
        return web.json_response(_info(state))

    async def status(_: web.Request) -> web.Response:
        live = {"Power": 76, "Utilization": {"GPU": 0}, "Memory": {"GlobalUsed": 600}}
        return web.json_response({"Devices": [live]})

    async def health(_: web.Request) -> web.Response:
        entry: dict[str, Any] = {"Healthy": state.healthy}
        if not state.healthy:
            entry.update(Reason="XID 79 (GPU has fallen off the bus)", XID=79)
            entry["Since"] = "2026-12-01T09:00:41Z"
        return web.json_response({"Devices": [entry]})

    async def docker_cli(request: web.Request) -> web.Response:
        if request.query.get("dev") == "0" and not state.healthy:  # as agent.api.routes does
            headers = {"X-Invalid-Parameter": "dev", "X-Invalid-Value": "0"}
            return web.Response(status=409, text=f"unhealthy device: 0: {SICK}\n", headers=headers)
        devices = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"]
        volumes = [f"nvidia_driver_{state.driver}:/usr/local/nvidia:ro"]
        return web.json_response(
            {"VolumeDriver": "nvidia-docker", "Volumes": volumes, "Devices": devices}
        )

    app = web.Application()
    app.router.add_get("/gpu/info/json", info)
    app.router.add_get("/gpu/status/json", status)
    app.router.add_get("/gpu/health/json", health)
    app.router.add_get("/docker/cli/json", docker_cli)
    async with serve_on_loopback(app) as port:
        state.port = port
        yield state


def ctl(*args: str, **env: str) -> Result:
    """``nvidia-docker-ctl ARGS`` through its edge, in a clean environment plus ``env``, in
    a thread of its own: the tool runs its own event loop (``asyncio.run``), which in this
    thread would drop, unclosed, the loop pytest-asyncio 0.24 leaves current after an async
    test (a ResourceWarning at the floor versions)."""
    base = {"NV_HOST": "", "NV_DEBUG": "", "HOME": "/nonexistent", "USER": "alice"}
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(cli_runner().invoke, main, list(args), env={**base, **env}).result()


async def run(*args: str, **env: str) -> Result:
    """``ctl`` off the event loop that serves the node (the tool runs its own)."""
    import asyncio  # noqa: PLC0415

    return await asyncio.to_thread(ctl, *args, **env)


# --- no node given -------------------------------------------------------------------------


async def test_status_without_a_node_asks_nv_host(node: Node) -> None:
    result = await run("status", NV_HOST=node.url)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[1].split()[:3] == [node.url, "0", "H200"]


def test_status_without_a_node_or_nv_host_asks_the_local_agent() -> None:
    """Not the old "internal error: UsageError: no nodes ... report it", exit 4."""
    for debug in ("", "1"):
        result = ctl("status", NV_DEBUG=debug)
        assert "internal error" not in result.stderr
        assert result.stdout.splitlines()[1].split()[0] == "localhost"
        if result.exit_code == 3:  # nothing listens on localhost:3476 here
            assert "cannot connect to the agent at http://localhost:3476" in result.stderr


# --- one error line, one scheme of exit codes ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["endpoint", "ftp://x"], "invalid remote host URI 'ftp://x': unknown scheme ftp://"),
        (["status", "ftp://x"], "NODE invalid remote host URI 'ftp://x'"),
        (["status", "--json", "--jsonl", "n1:"], "--json and --jsonl exclude each other"),
        (["status", "--limit", "gpu", "n1:"], "--limit needs --inventory"),
        (["info", "--parallel", "0", "n1:"], "--parallel '0' cannot be used: give a whole number"),
        (["status", "--bogus"], "No such option"),
        (["mesos", "flags", "--format", "xml"], "--format 'xml' cannot be used: give legacy or"),
        (["mesos", "exec"], "Missing argument"),
        (["nope"], "No such command"),
    ],
)
def test_every_usage_error_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    for debug in ("", "1"):  # NV_DEBUG adds a traceback, never another exit code
        result = ctl(*args, NV_DEBUG=debug)
        assert result.exit_code == 2, result.stderr
        assert result.stdout == ""
        if not debug:
            assert message in error_of(result.stderr)
        assert ERROR_LINE.match(result.stderr.strip().splitlines()[-1])


def test_a_bad_variable_is_a_usage_error_naming_it() -> None:
    result = ctl("info", "n1:", NV_FLEET_TIMEOUT="soon")
    assert result.exit_code == 2
    assert error_of(result.stderr) == (
        "NV_FLEET_TIMEOUT='soon' cannot be used: give a number from 0.1 to 3600"
    )


def test_a_bug_is_the_one_internal_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(fleet_commands, "run_fleet_command", broken)
    result = ctl("info", "n1:")
    assert result.exit_code == 4
    assert error_of(result.stderr) == (
        "internal error: RuntimeError: boom (set NV_DEBUG=1 for the traceback, and report it)"
    )


async def test_an_agents_refusal_shows_its_reason_and_exits_1(node: Node) -> None:
    """docker-cli --dev 0 on an unhealthy GPU: the agent answered (409), so not exit 3."""
    node.healthy = False
    result = await run("docker-cli", "--dev", "0", node.url)
    assert result.exit_code == 1, result.stderr
    row = result.stdout.splitlines()[1]
    assert row.split(None, 2)[1:] == ["-", f"error: HTTP 409: unhealthy device: 0: {SICK}"]
    assert result.stderr.splitlines()[-1] == (
        "nvidia-docker-ctl: 1 node, 0 answered (0 GPUs), 1 failed (1 answered with an error)"
    )


def test_no_agent_reached_is_exit_3() -> None:
    result = ctl("info", "http://127.0.0.1:1")
    assert result.exit_code == 3
    assert "connection refused" in result.stdout


def test_version() -> None:
    from agent import __version__  # noqa: PLC0415

    for flag in ("--version", "-v"):
        result = ctl(flag)
        assert (result.exit_code, result.stdout) == (0, f"nvidia-docker-ctl {__version__}\n")


def test_help_names_the_variables_and_the_exit_codes() -> None:
    text = ctl("--help").stdout
    for name in (
        "NV_HOST",
        "NV_SSH_STRICT_HOST_KEY_CHECKING",
        "NV_SSH_KNOWN_HOSTS",
        "NV_SSH_IDENTITY",
        "NV_SSH_CONFIG",
        "NV_SSH_MAX_HANDSHAKES",
        "NV_DEBUG",
    ):
        assert f"\n    {name} " in text, name
    assert "Exit codes: 0 done, 1 failed" in text
    status = " ".join(ctl("status", "--help").stdout.split())
    assert "[default: 64; env: NV_FLEET_PARALLEL]" in status
    assert "[env: NV_TLS_CA]" in status


# --- output: rows on stdout, notes on stderr, whole values in a pipe, --json everywhere ----


async def test_notes_after_a_status_table_go_to_stderr(node: Node) -> None:
    node.healthy = False
    result = await run("status", node.url)
    assert result.exit_code == 0
    rows = result.stdout.splitlines()
    assert [r.split()[0] for r in rows] == ["NODE", node.url]  # | grep sees rows only
    assert result.stderr.splitlines()[0] == (
        f"nvidia-docker-ctl: {node.url} GPU 0 unhealthy: XID 79 (GPU has fallen off the bus) "
        "since 2026-12-01T09:00:41Z"
    )


async def test_a_pipe_gets_whole_values(node: Node) -> None:
    """80 columns used to cut node names (``127.0.0.1:4…``) when output was not a terminal."""
    nodes = [node.url, f"http://127.0.0.1:{node.port}:{node.port}"]  # 85 columns and more
    result = await run("status", "--processes", *nodes)
    assert result.exit_code == 0, result.stderr
    for name in nodes:
        assert any(line.split()[0] == name for line in result.stdout.splitlines()[1:])
    assert "…" not in result.stdout
    wide = " ".join(["gpu-rack07-node-with-a-very-long-inventory-name"] * 3)
    sink = TableSink(INFO, [FleetNode(wide, parse_endpoint("n:"))], out := io.StringIO(), None)
    sink.add(NodeResult(FleetNode(wide, parse_endpoint("n:")), {}, "down", "timeout"))
    sink.close()
    assert out.getvalue().splitlines()[1].startswith(wide + "  ")


def test_every_command_with_a_table_has_json() -> None:
    for name in ("status", "info", "docker-cli", "health", "endpoint"):
        command = main.get_command(None, name)  # type: ignore[arg-type]
        assert command is not None
        assert "--json" in {o for p in command.params for o in p.opts}, name


def test_progress_is_erased_before_any_row() -> None:
    """Stdout and stderr on one terminal: the header was glued to ``status [##..] 1/11``."""
    terminal = io.StringIO()
    progress = Progress("info", 11, terminal)
    progress.update(NodeResult(FleetNode("a:", parse_endpoint("a:")), {}, "down", "timeout"))
    assert "1/11 nodes" in terminal.getvalue()
    rows = ProgressAware(terminal, progress)
    rows.write("NODE  GPU\na:    -  error: timeout\n")
    screen = terminal.getvalue()
    assert "\r\033[KNODE  GPU\n" in screen  # the line was erased, the header starts it
    progress.update(NodeResult(FleetNode("b:", parse_endpoint("b:")), {}, "down", "timeout"))
    assert terminal.getvalue().endswith("\033[K")  # drawn again below the rows
