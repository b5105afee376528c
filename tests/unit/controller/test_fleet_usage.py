"""``nvidia-docker-ctl usage`` and ``idle`` against a fleet of stand-ins on loopback.

The agents' ``/usage/json`` and ``/usage/idle/json`` routes are being written at the same
time as these commands, so the nodes here are STAND-INS of those routes, until the real routes
land: small aiohttp servers that answer what docs/fleet.md ("Usage and idle GPUs across the
fleet") says an agent answers, from the fixed ledgers below, and record the query strings
they were asked. ``n1`` and ``n2`` have ledgers (``n2``'s is behind); ``old`` is an agent
older than ledgers (aiohttp's own 404), ``off`` one started with ``--no-usage-ledger`` (its
404 says so), ``picky`` refuses the query (400), ``dead`` is a port nothing listens on. The
ctl runs through its edge and click's runner, its two streams read as a person reads them.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import socket
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from click.testing import Result

from agent.api.usage import BadQuery, parse_time
from controller.ctl.main import main
from controller.ctl.usage import check_range_time
from controller.fleet.idle_view import holder_text
from controller.fleet.usage_view import UsageAsk, duration_text, span_text, time_of
from tests.support.cli import cli_runner
from tests.support.services import free_port
from tests.unit.controller.ctl_lines import ERROR_LINE, error_of

pytestmark = pytest.mark.timeout(60)

SINCE, UNTIL = 1796083200.0, 1796169600.0  # 2026-12-01 00:00 to 2026-12-02 00:00 UTC
UUID_A = "GPU-1111aaaa-0000-0000-0000-000000000000"
UUID_B = "GPU-2222bbbb-0000-0000-0000-000000000000"
BEHIND = "the store is 3 sweeps behind (slow disk)"
LEDGER_OFF = "the usage ledger is off on this node (--no-usage-ledger)"


def _row(key: str, value: str, gpu: float, busy: float, joules: float | None,
         holds: int | None, **more: object) -> dict[str, Any]:  # fmt: skip
    return {key: value, **more, "gpu_seconds": gpu, "busy_gpu_seconds": busy,
            "energy_joules": joules, "holds": holds}  # fmt: skip


# Each ledger's rows by grouping. UUID_A is on both nodes (a copied UUID, or a test rig): a
# GPU is one node's, so it stays two rows; so do two containers named train-1.
LEDGERS: dict[str, dict[str, list[dict[str, Any]]]] = {
    "n1": {
        "label:team": [
            _row("team", "ml", 7200.0, 3600.5, 123456.0, 4),
            _row("team", "", 1800.0, 0.0, None, 1),
            _row("team", "ops", 600.0, 300.0, None, None),
        ],
        "image": [
            _row("image", "pytorch:2", 5000.0, 2500.0, 100000.0, 2),
            _row("image", "", 100.0, 10.0, None, 1),
        ],
        "gpu": [
            _row("gpu", UUID_A, 3600.0, 1800.0, 1000000.0, 2, index=0),
            _row("gpu", UUID_B, 1800.0, 0.0, None, 1, index=1),
        ],
        "container": [
            _row("container", "train-1", 3600.0, 900.0, 7200000.0, 1, container_id="a" * 64),
        ],
    },
    "n2": {
        "label:team": [
            _row("team", "research", 10000.0, 9000.0, 5000000.0, 3),
            _row("team", "ml", 3600.0, 1800.0, 1000.0, 2),
            _row("team", "", 900.0, 450.0, None, 2),
        ],
        "image": [
            _row("image", "jax:0.4", 4000.0, 4000.0, None, 1),
            _row("image", "pytorch:2", 3000.0, 1500.0, 50000.0, 1),
        ],
        "gpu": [
            _row("gpu", UUID_A, 7200.0, 7200.0, 2000000.0, 1, index=0),
        ],
        "container": [
            _row("container", "train-1", 1800.0, 1800.0, None, 1, container_id="b" * 64),
        ],
    },
}

IDLE = {
    "n1": [
        {"gpu": UUID_A, "index": 0, "unit": "0", "mig": None, "holder": "container",
         "lease_id": None, "container_id": "c" * 64, "container": "train-1",
         "image": "pytorch:2", "idle_since": UNTIL - 3720, "idle_s": 3720.0, "policy": "stop",
         "action": "stopped"},
        {"gpu": UUID_B, "index": 1, "unit": "1:0", "mig": "MIG-x", "holder": "lease",
         "lease_id": "lease-7", "container_id": None, "container": None, "image": None,
         "idle_since": UNTIL - 90000, "idle_s": 90000.0, "policy": None, "action": None},
    ],
    "n2": [],
}  # fmt: skip


@dataclass
class StandIn:
    """A stand-in agent's ledger routes, and the query strings it was asked."""

    name: str
    behind: bool = False
    asked: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/usage/json", self.usage)
        app.router.add_get("/usage/idle/json", self.idle)
        return app

    async def usage(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        self.asked.append((request.path, query))
        rows = sorted(LEDGERS[self.name][query.get("by", "gpu")], key=lambda r: -r["gpu_seconds"])
        totals = {"gpu_seconds": 0.0, "busy_gpu_seconds": 0.0, "energy_joules": 0.0, "holds": 0}
        for row in rows:
            for key in totals:
                totals[key] += row[key] or 0
        limit = int(query.get("limit", "1000"))
        return web.json_response(
            {"node": f"host-{self.name}", "since": SINCE, "until": UNTIL, "by": query.get("by"),
             "rows": rows[:limit], "totals": totals, "truncated": len(rows) > limit,
             "ledger": {"behind": self.behind, "reason": BEHIND if self.behind else None}}
        )  # fmt: skip

    async def idle(self, request: web.Request) -> web.Response:
        self.asked.append((request.path, dict(request.query)))
        return web.json_response(
            {"node": f"host-{self.name}", "idle_after_s": 3600.0, "policy": "notify",
             "idle": IDLE[self.name]}
        )  # fmt: skip


def _refusing(status: int, body: Mapping[str, str] | None) -> web.Application:
    async def answer(_: web.Request) -> web.Response:
        if body is None:
            raise web.HTTPNotFound()  # an agent older than ledgers: no such route
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    return app


@asynccontextmanager
async def _serve(app: web.Application) -> AsyncIterator[int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the kernel's free port: no race with another test run
    try:
        await web.SockSite(runner, sock).start()
        yield sock.getsockname()[1]
    finally:
        await runner.cleanup()
        sock.close()


@dataclass
class Fleet:
    stand_ins: dict[str, StandIn]
    inventory: Path

    async def ctl(self, *args: str, nodes: str | None = None) -> Result:
        """``nvidia-docker-ctl ARGS -i fleet.yml [-l NODES]``, off the loop that serves."""
        chosen = ["-i", str(self.inventory), *(["-l", nodes] if nodes else [])]
        return await asyncio.to_thread(ctl, *args, *chosen)


def ctl(*args: str) -> Result:
    """The tool through its edge, in a thread of its own: it runs its own event loop
    (``asyncio.run``), which in this thread would drop, unclosed, the loop pytest-asyncio
    0.24 leaves current (a ResourceWarning at the floor versions)."""
    env = {"NV_HOST": "", "NV_DEBUG": "", "COLUMNS": "200"}
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(cli_runner().invoke, main, list(args), env=env).result()


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    stand_ins = {"n1": StandIn("n1"), "n2": StandIn("n2", behind=True)}
    apps = {name: s.app() for name, s in stand_ins.items()}
    apps["old"] = _refusing(404, None)
    apps["off"] = _refusing(404, {"error": LEDGER_OFF})
    # the contract's {"error": ...}; the agent's routes being written say {"Error": ...}
    apps["picky"] = _refusing(400, {"Error": "since: 7 days is more than this ledger keeps"})
    ports: dict[str, int] = {}
    serving = [(name, _serve(app)) for name, app in apps.items()]
    try:
        for name, server in serving:
            ports[name] = await server.__aenter__()
        ports["dead"] = free_port()
        hosts = "".join(
            f"        {name}: {{nvidia_docker_agent_listen_port: {port}}}\n"
            for name, port in ports.items()
        )
        inventory = tmp_path / "fleet.yml"
        inventory.write_text(
            "all:\n  children:\n    gpu:\n      vars:\n        nvidia_docker_transport: http\n"
            f"        ansible_host: 127.0.0.1\n      hosts:\n{hosts}"
        )
        yield Fleet(stand_ins, inventory)
    finally:
        for _, server in reversed(serving):
            await server.__aexit__(None, None, None)


def cells(lines: list[str]) -> list[list[str]]:
    """Table lines split into their cells (two spaces or more apart)."""
    return [re.split(r"\s{2,}", line.strip()) for line in lines]


def table(result: Result) -> list[list[str]]:
    """The rows of a usage table (after the range line and the header)."""
    return cells(result.stdout.splitlines()[2:])


def notes(result: Result) -> list[str]:
    return result.stderr.splitlines()


# --- usage: the sums --------------------------------------------------------------------------


async def test_usage_by_label_sums_each_value_across_the_nodes(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--by", "label:team", nodes="n1,n2")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("usage by label:team from 2026-12-01 00:00 to 2026-12-02 00:00 UTC (24 h)")
    assert lines[1].split() == [
        "TEAM", "NODES", "GPU-H", "BUSY", "%", "BUSY", "GPU-H", "ENERGY", "kWh", "HOLDS",
    ]  # fmt: skip
    # ml: 7200 + 3600 s = 3.00 GPU-h, busy 5400.5 s (50%), 124456 J = 0.03 kWh, 6 holds
    assert table(result) == [
        ["ml", "2", "3.00", "50%", "1.50", "0.03", "6"],
        ["research", "1", "2.78", "90%", "2.50", "1.39", "3"],
        ["(no team)", "2", "0.75", "17%", "0.12", "-", "3"],  # both nodes' energy unknown
        ["ops", "1", "0.17", "50%", "0.08", "-", "-"],
        ["TOTAL", "2", "6.69", "63%", "4.21", "1.42", "12"],
    ]


async def test_usage_json_is_one_list_of_rows_keyed_by_the_label(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--by", "label:team", "--json", nodes="n1,n2")
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert isinstance(rows, list)
    assert rows == [
        {"team": "ml", "nodes": ["n1", "n2"], "gpu_seconds": 10800.0,
         "busy_gpu_seconds": 5400.5, "energy_joules": 124456.0, "holds": 6},
        {"team": "research", "nodes": ["n2"], "gpu_seconds": 10000.0,
         "busy_gpu_seconds": 9000.0, "energy_joules": 5000000.0, "holds": 3},
        {"team": "", "nodes": ["n1", "n2"], "gpu_seconds": 2700.0, "busy_gpu_seconds": 450.0,
         "energy_joules": None, "holds": 3},
        {"team": "ops", "nodes": ["n1"], "gpu_seconds": 600.0, "busy_gpu_seconds": 300.0,
         "energy_joules": None, "holds": None},
    ]  # fmt: skip


async def test_usage_by_image_sums_exactly(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--by", "image", "--json", nodes="n1,n2")
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["image"], r["nodes"], r["gpu_seconds"], r["busy_gpu_seconds"],
             r["energy_joules"], r["holds"]) for r in rows] == [
        ("pytorch:2", ["n1", "n2"], 8000.0, 4000.0, 150000.0, 3),
        ("jax:0.4", ["n2"], 4000.0, 4000.0, None, 1),
        ("", ["n1"], 100.0, 10.0, None, 1),  # a process outside any container
    ]  # fmt: skip
    text = await fleet.ctl("usage", "--by", "image", nodes="n1,n2")
    assert table(text)[-2][0] == "(no image)"
    assert table(text)[-1] == ["TOTAL", "2", "3.36", "66%", "2.23", "0.04", "5"]


async def test_usage_by_gpu_keeps_each_nodes_gpus_apart(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--json", nodes="n1,n2")  # --by gpu: the default
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["node"], r["gpu"], r["index"], r["gpu_seconds"], r["nodes"]) for r in rows] == [
        ("n2", UUID_A, 0, 7200.0, ["n2"]),
        ("n1", UUID_A, 0, 3600.0, ["n1"]),  # the same UUID on another node: its own row
        ("n1", UUID_B, 1, 1800.0, ["n1"]),
    ]
    text = await fleet.ctl("usage", nodes="n1,n2")
    assert text.stdout.splitlines()[1].split()[:3] == ["NODE", "GPU", "UUID"]
    assert table(text) == [
        ["n2", "0", "1111aaaa", "2.00", "100%", "2.00", "0.56", "1"],
        ["n1", "0", "1111aaaa", "1.00", "50%", "0.50", "0.28", "2"],
        ["n1", "1", "2222bbbb", "0.50", "0.0%", "0.00", "-", "1"],
        ["TOTAL", "-", "-", "3.50", "71%", "2.50", "0.83", "4"],
    ]


async def test_usage_by_container_keeps_each_nodes_containers_apart(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--by", "container", "--json", nodes="n1,n2")
    rows = json.loads(result.stdout)
    assert [(r["node"], r["container"], r["container_id"]) for r in rows] == [
        ("n1", "train-1", "a" * 64),
        ("n2", "train-1", "b" * 64),
    ]
    text = await fleet.ctl("usage", "--by", "container", nodes="n1,n2")
    assert table(text)[0][:3] == ["n1", "train-1", "a" * 12]


async def test_usage_csv_reads_back_with_raw_numbers_and_a_total_row(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--by", "label:team", "--csv", nodes="n1,n2")
    assert result.exit_code == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == [
        "team", "nodes", "gpu_seconds", "busy_gpu_seconds", "energy_joules", "holds",
    ]  # fmt: skip
    assert [r["team"] for r in rows] == ["ml", "research", "", "ops", "TOTAL"]
    assert rows[0] == {
        "team": "ml",
        "nodes": "n1 n2",
        "gpu_seconds": "10800.0",
        "busy_gpu_seconds": "5400.5",
        "energy_joules": "124456.0",
        "holds": "6",
    }
    assert rows[2]["energy_joules"] == ""  # unknown on every node: empty, not 0
    assert rows[-1] == {"team": "TOTAL", "nodes": "", "gpu_seconds": "24100.0",
                        "busy_gpu_seconds": "15150.5", "energy_joules": "5124456.0",
                        "holds": "12"}  # fmt: skip
    body = sum(float(r["gpu_seconds"]) for r in rows[:-1])
    assert body == float(rows[-1]["gpu_seconds"])
    gpus = list(csv.reader(io.StringIO((await fleet.ctl("usage", "--csv", nodes="n1")).stdout)))
    assert gpus[0][:3] == ["gpu", "index", "node"]
    assert gpus[-1][:3] == ["TOTAL", "", ""]


async def test_usage_jsonl_is_each_nodes_answer_as_it_came(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--jsonl", "--by", "image", nodes="n1,dead")
    assert result.exit_code == 1
    lines = {line["node"]: line for line in map(json.loads, result.stdout.splitlines())}
    assert lines["n1"]["usage"]["rows"] == LEDGERS["n1"]["image"]
    assert lines["dead"]["reason"] == "connection refused"
    assert result.stderr == ""  # the lines carry the failures, as the other commands' --jsonl


# --- usage: what the agents are asked ---------------------------------------------------------


async def test_the_agents_get_the_range_and_grouping_as_given(fleet: Fleet) -> None:
    result = await fleet.ctl(
        "usage", "--since", "-7d", "--until", "2030-01-01T00:00:00Z", "--by", "label:team",
        "--max-rows", "50", nodes="n1,n2",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    for stand_in in fleet.stand_ins.values():
        assert stand_in.asked == [
            ("/usage/json",
             {"since": "-7d", "until": "2030-01-01T00:00:00Z", "by": "label:team", "limit": "50"})
        ]  # fmt: skip
    for stand_in in fleet.stand_ins.values():
        stand_in.asked.clear()
    await fleet.ctl("usage", "--until", "now", nodes="n1")
    assert fleet.stand_ins["n1"].asked == [("/usage/json", {"by": "gpu"})]  # the defaults


async def test_max_rows_cuts_each_answer_and_the_report_says_so(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--by", "label:team", "--max-rows", "1", nodes="n1,n2")
    assert result.exit_code == 0, result.stderr
    assert [r[0] for r in table(result)] == ["research", "TOTAL"]  # n1: ml only, n2: research
    assert table(result)[-1][2] == "6.69"  # the totals are the agents', of every group
    assert "nvidia-docker-ctl: n1: its answer was cut to 1 rows: that node's smaller groups " \
        "are missing from the rows, not from the totals (--max-rows, up to 10000)" \
        in notes(result)  # fmt: skip
    assert "nvidia-docker-ctl: the 1 largest of 2 groups shown (--max-rows); the totals are " \
        "of all" in notes(result)  # fmt: skip


# --- usage: nodes that cannot answer ----------------------------------------------------------


async def test_a_ledger_behind_is_one_note_naming_the_node(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", nodes="n1,n2")
    assert result.exit_code == 0
    assert notes(result) == [
        f"nvidia-docker-ctl: n2: its usage ledger is behind ({BEHIND}): its latest figures "
        "may be missing from the report",
        "nvidia-docker-ctl: 2 nodes, 2 answered, 0 failed",
    ]


async def test_agents_without_a_ledger_are_one_line_each_and_exit_1(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--by", "image", nodes="n1,old,off")
    assert result.exit_code == 1
    assert table(result)[-1][:3] == ["TOTAL", "1", "1.42"]  # n1 alone
    assert notes(result) == [
        "nvidia-docker-ctl: old: agent too old for the usage ledger (no /usage/json): upgrade "
        "nvidia-docker-plugin there",
        f"nvidia-docker-ctl: off: no usage ledger there: {LEDGER_OFF}",
        "nvidia-docker-ctl: 3 nodes, 1 answered, 2 failed (2 answered with an error)",
    ]
    alone = await fleet.ctl("usage", nodes="off")
    assert alone.exit_code == 1  # reached (it answered), so not "no agent could be reached"
    assert alone.stdout == ""


async def test_an_agent_refusing_the_query_shows_its_reason(fleet: Fleet) -> None:
    result = await fleet.ctl("usage", "--json", nodes="n1,picky")
    assert result.exit_code == 1
    assert len(json.loads(result.stdout)) == 2  # n1's GPUs
    assert notes(result)[0] == (
        "nvidia-docker-ctl: picky: the agent refused the query (400 to GET /usage/json): "
        "since: 7 days is more than this ledger keeps"
    )


async def test_dead_nodes_exit_1_beside_live_ones_and_3_alone(fleet: Fleet) -> None:
    mixed = await fleet.ctl("usage", nodes="n1,dead")
    assert mixed.exit_code == 1
    assert table(mixed)[-1][:2] == ["TOTAL", "-"]
    assert "nvidia-docker-ctl: dead: cannot connect to the agent at http://127.0.0.1:" \
        in mixed.stderr  # fmt: skip
    assert notes(mixed)[-1] == "nvidia-docker-ctl: 2 nodes, 1 answered, 1 failed"
    dead = await fleet.ctl("usage", "--csv", nodes="dead")
    assert dead.exit_code == 3
    assert dead.stdout == ""
    assert (await fleet.ctl("usage", "--json", nodes="dead")).stdout == "[]\n"


# --- usage: the operator's mistakes -----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--by", "team"], "--by 'team' cannot be used: give gpu, container, image or label:KEY"),
        (["--by", "label:"], "--by 'label:' cannot be used: label:KEY needs the label's key"),
        (["--by", "label:team=ml"], "label:KEY groups by the label's values: give the key alone"),
        (["--since", "yesterday"], "--since 'yesterday' cannot be used: give Unix seconds"),
        (["--since", "-7x"], "--since '-7x' cannot be used: give Unix seconds"),
        (["--until", "2026-12-01T00:00:00"], "an ISO 8601 time needs its zone"),
        (["--since", "-1h", "--until", "-2h"], "--since -1h is not before --until -2h"),
        (["--since", "100000000000"], "--since '100000000000' cannot be used: 100000000000 is"),
        (
            ["--since", "-9999999999d"],
            "--since '-9999999999d' cannot be used: a time before now has at most 9 digits",
        ),
        (["--by", "label:" + "k" * 129], "a label key is 128 characters at most"),
        (["--max-rows", "0"], "--max-rows '0' cannot be used: give a whole number from 1 to"),
        (["--csv", "--json"], "--csv and --json exclude each other"),
    ],
)
def test_a_bad_range_or_grouping_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = ctl("usage", *args, "http://127.0.0.1:1")
    assert result.exit_code == 2, result.stderr
    assert result.stdout == ""
    assert message in error_of(result.stderr)
    assert ERROR_LINE.match(result.stderr.strip())


def test_the_ctl_takes_the_relative_times_the_agents_take_and_no_other() -> None:
    # a time the agents refuse was sent to every node, each refusing it (exit 1)
    for text in ("-999999999d", "-999999999.25h", "-9999999999d", "-1234567890s", "-0012345678.5m"):
        try:
            parse_time("since", text, 1796169600.0)
        except BadQuery:
            agent_takes = False
        else:
            agent_takes = True
        try:
            check_range_time(text)
        except ValueError:
            ctl_takes = False
        else:
            ctl_takes = True
        assert (text, ctl_takes) == (text, agent_takes)


def test_times_are_read_as_the_agents_read_them() -> None:
    now = 1796169600.0
    assert time_of("-24h", now) == now - 86400
    assert time_of("-30m", now) == now - 1800
    assert time_of("-7d", now) == now - 7 * 86400
    assert time_of("1796083200", now) == SINCE
    assert time_of("2026-12-01T00:00:00Z", now) == SINCE
    assert time_of("2026-12-01T01:00:00+01:00", now) == SINCE
    assert time_of("now", now) is None
    UsageAsk("gpu", "-2d", "-1d").check(now)  # a range in the past: fine


# --- idle -------------------------------------------------------------------------------------


async def test_idle_lists_every_idle_gpu_and_exits_1(fleet: Fleet) -> None:
    result = await fleet.ctl("idle", nodes="n1,n2")
    assert result.exit_code == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NODE", "UNIT", "HOLDER", "IMAGE", "IDLE", "FOR", "POLICY",
                                "ACTION"]  # fmt: skip
    assert cells(lines[1:]) == [
        ["n1", "0", "train-1", "pytorch:2", "1 h 02 min", "stop", "stopped"],
        ["n1", "1:0", "lease-7", "-", "1 d 01 h", "notify", "-"],  # the node's policy
    ]
    assert notes(result) == [
        "nvidia-docker-ctl: 2 idle GPUs on 1 node",
        "nvidia-docker-ctl: 2 nodes, 2 answered, 0 failed",
    ]
    assert fleet.stand_ins["n1"].asked == [("/usage/idle/json", {})]


async def test_idle_without_idle_gpus_prints_nothing_and_exits_0(fleet: Fleet) -> None:
    result = await fleet.ctl("idle", nodes="n2")
    assert (result.exit_code, result.stdout) == (0, "")
    assert notes(result)[0] == "nvidia-docker-ctl: no idle GPU on the 1 node that answered"


async def test_idle_with_a_failed_node_is_exit_1_and_with_none_reached_3(fleet: Fleet) -> None:
    partial = await fleet.ctl("idle", nodes="n2,dead")
    assert partial.exit_code == 1  # dead may have idle GPUs: not "all clear"
    assert partial.stdout == ""
    assert any(line.startswith("nvidia-docker-ctl: dead: cannot connect") for line in
               notes(partial))  # fmt: skip
    old = await fleet.ctl("idle", nodes="n2,old")
    assert old.exit_code == 1
    assert "nvidia-docker-ctl: old: agent too old for the usage ledger (no /usage/idle/json): " \
        "upgrade nvidia-docker-plugin there" in notes(old)  # fmt: skip
    assert (await fleet.ctl("idle", nodes="dead")).exit_code == 3


async def test_idle_json_is_a_list_of_the_agents_entries_with_their_node(fleet: Fleet) -> None:
    result = await fleet.ctl("idle", "--json", nodes="n1,n2")
    assert result.exit_code == 1
    entries = json.loads(result.stdout)
    assert [(e["node"], e["unit"], e["policy"], e["idle_after_s"]) for e in entries] == [
        ("n1", "0", "stop", 3600.0),
        ("n1", "1:0", "notify", 3600.0),
    ]
    assert entries[0]["container_id"] == "c" * 64
    none = await fleet.ctl("idle", "--json", nodes="n2")
    assert (none.exit_code, json.loads(none.stdout)) == (0, [])


async def test_idle_jsonl_is_each_nodes_answer_and_keeps_the_exit_code(fleet: Fleet) -> None:
    result = await fleet.ctl("idle", "--jsonl", nodes="n1,n2")
    assert result.exit_code == 1  # n1 has idle GPUs
    lines = {line["node"]: line for line in map(json.loads, result.stdout.splitlines())}
    assert lines["n1"]["idle"]["idle"] == IDLE["n1"]
    assert lines["n2"]["idle"]["policy"] == "notify"
    assert result.stderr == ""
    assert (await fleet.ctl("idle", "--jsonl", nodes="n2")).exit_code == 0


def test_idle_for_and_holders_read_as_a_person_says_them() -> None:
    assert [duration_text(s) for s in (42, 600, 3720, 86400 + 3 * 3600 + 59)] == [
        "42 s", "10 min", "1 h 02 min", "1 d 03 h",
    ]  # fmt: skip
    # A report's range: whole hours as hours, else as a time (not "0.0166667 h")
    assert [span_text(s) for s in (86400, 7 * 86400, 3600.0004, 60, 4800, 45)] == [
        "24 h", "168 h", "1 h", "1 min", "1 h 20 min", "45 s",
    ]  # fmt: skip
    assert holder_text({"holder": "process", "pid": 4242}) == "pid 4242"
    assert holder_text({"holder": "lease", "lease_id": "lease-3", "container": "t"}) == (
        "lease-3 (t)"
    )
    assert holder_text({"holder": "container", "container_id": "d" * 64}) == "d" * 12


def test_help_says_what_each_command_prints_and_its_exit_codes() -> None:
    usage = " ".join(ctl("usage", "--help").stdout.split())
    assert "--by GROUP" in usage
    assert "Exit codes: 0 all nodes answered, 1 some failed" in usage
    idle = " ".join(ctl("idle", "--help").stdout.split())
    assert "exit 0 every node answered and no GPU is idle, 1 some GPU is idle" in idle
    listed = ctl("--help").stdout
    assert "usage " in listed
    assert "idle " in listed
