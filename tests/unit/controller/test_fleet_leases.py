"""``nvidia-docker-ctl leases`` and ``free`` against real agents on loopback.

Real ``nvidia-docker-plugin`` processes (``--simulate``, ``tests.support.agent_process``):
``busy`` (hgx-h200-8) with two leases asked over its REST API, ``full`` (hgx-h200-8) whose
eight GPUs are all leased, ``mig`` (h200x2-mig: GPU 0 in MIG mode, two free ``1g.18gb``
devices); ``old`` is the agent's REST app without the lease routes (an agent older than
leases: 404), served by ``tests.support.agent_farm``; ``prior`` (hgx-h200-8, one lease of
three GPUs) is its app with the lease routes as they were before ``GET /leases/free`` (that
GET answers 405, as it did), served by a second farm; ``dead`` is a port nothing listens on.
The ctl runs through click's runner, its two streams read as a person reads them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import Result

from controller.ctl.main import main
from tests.support.agent_farm import ask_lease, farms_before_and_after_free, start_farm
from tests.support.agent_process import running_agent
from tests.support.cli import cli_runner
from tests.support.services import free_port

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Fleet:
    ports: dict[str, int]
    inventory: Path

    def node(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"


def _ask(port: int, body: dict[str, object]) -> dict[str, object]:
    return ask_lease(f"http://127.0.0.1:{port}", body)


def _agent(base: Path, simulate: str) -> Generator[int, None, None]:
    with running_agent(
        base, "--state-dir", str(base / "state"), "--lease-pending", "600", simulate=simulate
    ) as agent:
        yield agent.port


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("lease-fleet")
    busy = _agent(root / "busy", "hgx-h200-8")
    full = _agent(root / "full", "hgx-h200-8")
    mig = _agent(root / "mig", "h200x2-mig")
    farm = start_farm(1, ("h200",))
    prior = start_farm(1, ("hgx-h200-8",), before_free=True)
    try:
        ports = {"busy": next(busy), "full": next(full), "mig": next(mig)}
        ports["old"] = farm.ports[0]
        ports["prior"] = prior.ports[0]
        ports["dead"] = free_port()
        _ask(ports["busy"], {"count": 2, "owner": {"user": "alice", "job": "42"}})
        _ask(ports["busy"], {"count": 1, "owner": {"user": "bob"}})
        _ask(ports["full"], {"count": 8, "owner": {"user": "carol"}})
        _ask(ports["prior"], {"count": 3, "owner": {"user": "dave"}})
        inventory = root / "fleet.yml"
        hosts = "".join(
            f"        {name}: {{nvidia_docker_agent_listen_port: {port}}}\n"
            for name, port in ports.items()
        )
        inventory.write_text(
            "all:\n  children:\n    gpu:\n      vars:\n        nvidia_docker_transport: http\n"
            f"        ansible_host: 127.0.0.1\n      hosts:\n{hosts}"
        )
        yield Fleet(ports, inventory)
    finally:
        for started in (busy, full, mig):
            started.close()  # leaves running_agent: SIGTERM, then SIGKILL
        farm.stop()
        prior.stop()


def ctl(*args: str) -> Result:
    """``nvidia-docker-ctl ARGS``, in a thread of its own: the tool runs its own event loop
    (``asyncio.run``), which in this thread would drop, unclosed, the loop pytest-asyncio
    0.24 leaves current after an async test (a ResourceWarning at the floor versions)."""
    env = {"NV_HOST": "", "COLUMNS": "200"}
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(cli_runner().invoke, main, list(args), env=env).result()


def rows(result: Result, node: str) -> list[list[str]]:
    return [line.split() for line in result.stdout.splitlines() if line.split()[:1] == [node]]


def test_leases_show_who_holds_each_gpu_and_a_summary_per_node(fleet: Fleet) -> None:
    result = ctl("leases", "-i", str(fleet.inventory), "-l", "busy,full,old")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0].split() == [
        "NODE", "UNIT", "STATE", "LEASE", "CONTAINER", "OWNER", "SINCE",
    ]  # fmt: skip
    busy = rows(result, "busy")
    units = [r for r in busy if r[1] != "-"]
    assert [r[1] for r in units] == [str(i) for i in range(8)]
    held = {r[1]: r for r in units if r[2] != "free"}
    assert sorted(r[3] for r in held.values()) == ["lease-1", "lease-1", "lease-2"]
    for row in held.values():
        assert row[2] == "pending"  # granted, no container created with it yet
        assert row[4] == "-"
        assert row[5] == ("job=42,user=alice" if row[3] == "lease-1" else "user=bob")
        assert row[6].endswith("Z")
    assert all(r[2:] == ["free", "-", "-", "-", "-"] for r in units if r[1] not in held)
    assert " ".join(busy[-1]) == "busy - 5 free of 8; 2 leases; queue 0"
    assert " ".join(rows(result, "full")[-1]) == "full - 0 free of 8; 1 lease; queue 0"
    assert " ".join(rows(result, "old")[0]) == (
        "old - agent too old for leases (no /leases/json): upgrade nvidia-docker-plugin there"
    )
    assert len(rows(result, "old")) == 1
    assert result.stderr.splitlines()[-1] == (
        "nvidia-docker-ctl: 3 nodes, 3 answered (16 GPUs), 0 failed"  # old: unknown
    )


def test_leases_json_is_each_agents_answer_keyed_by_node(fleet: Fleet) -> None:
    result = ctl("leases", "--json", "-i", str(fleet.inventory), "-l", "busy,old,dead")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["command"] == "leases"
    busy = document["nodes"]["busy"]
    assert [lease["Owner"] for lease in busy["leases"]["Leases"]] == [
        {"job": "42", "user": "alice"},
        {"user": "bob"},
    ]
    assert len(busy["leases"]["Units"]) == 8
    assert document["nodes"]["old"]["leases"] is None
    assert document["nodes"]["old"]["error"] is None
    assert document["nodes"]["dead"]["reason"] == "connection refused"
    assert document["summary"] == {"nodes": 3, "answered": 2, "failed": 1, "gpus": 8}


def test_free_lists_nodes_with_enough_free_gpus_and_omits_full_ones(fleet: Fleet) -> None:
    result = ctl("free", "--gpus", "2", "-i", str(fleet.inventory), "-l", "full,busy,old,mig")
    assert result.exit_code == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines()]
    assert lines[0] == ["NODE", "FREE", "SET", "LINK", "NUMA"]
    (busy,) = lines[1:]  # full has none free; old cannot say; mig has one whole GPU
    assert busy[:2] == ["busy", "5/8"]
    chosen = busy[2].split(",")
    assert len(chosen) == 2
    assert busy[3] == "NVLink"  # every pair of an HGX board: NVSwitch
    errors = result.stderr.splitlines()
    assert "nvidia-docker-ctl: old: agent too old for leases (no /leases/json): upgrade " \
        "nvidia-docker-plugin there" in errors  # fmt: skip
    assert "nvidia-docker-ctl: 1 node with 2 free healthy GPUs" in errors


def test_free_exits_1_when_no_node_qualifies(fleet: Fleet) -> None:
    result = ctl("free", "--gpus", "6", "-i", str(fleet.inventory), "-l", "busy,full")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "nvidia-docker-ctl: 0 nodes with 6 free healthy GPUs" in result.stderr.splitlines()


def test_free_counts_mig_devices_of_a_profile(fleet: Fleet) -> None:
    result = ctl("free", "--gpus", "2", "--mig", "1g.18gb", fleet.node("mig"), fleet.node("busy"))
    assert result.exit_code == 0, result.stderr
    (mig,) = [line.split() for line in result.stdout.splitlines()[1:]]
    assert mig == [fleet.node("mig"), "2/2", "0:2,0:3", "-", mig[-1]]
    three = ctl("free", "--gpus", "3", "--mig", "1g.18gb", fleet.node("mig"))
    assert three.exit_code == 1


def test_free_json_has_the_qualifying_nodes_best_first(fleet: Fleet) -> None:
    result = ctl("free", "--json", "--gpus", "1", "-i", str(fleet.inventory), "-l", "busy,mig")
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert [c["node"] for c in document["free"]] == ["busy", "mig"]
    assert document["free"][0]["free"] == 5
    # each node's own answer to GET /leases/free: the set it picked, not its whole table
    busy = document["nodes"]["busy"]
    assert "leases" not in busy
    assert "info" not in busy
    assert (busy["free"]["Count"], busy["free"]["Free"], busy["free"]["Units"]) == (1, 5, 8)
    assert [u["Name"] for u in busy["free"]["Set"]] == document["free"][0]["set"]
    assert document["summary"]["gpus"] == 8 + 2  # the nodes' GPUs, from the same answers


def test_free_asks_agents_older_than_its_route_for_their_leases_and_topology(
    fleet: Fleet,
) -> None:
    # `prior` has the lease routes but not GET /leases/free (405, as such agents answer):
    # the ctl asks it again, on a second connection, for what it asked before the route,
    # and picks the set itself; an agent without leases is still named too old.
    result = ctl(
        "free", "--json", "--gpus", "2", "-i", str(fleet.inventory), "-l", "prior,busy,old"
    )
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    prior, busy = document["nodes"]["prior"], document["nodes"]["busy"]
    assert set(prior) >= {"info", "leases"}
    assert "free" not in prior
    assert set(busy) >= {"free"}
    assert "leases" not in busy
    found = {c["node"]: c for c in document["free"]}
    assert sorted(found) == ["busy", "prior"]
    assert (found["prior"]["free"], found["prior"]["units"]) == (5, 8)
    assert found["prior"]["link"] == found["busy"]["link"] == "NVLink"
    held = {u["Name"] for u in prior["leases"]["Units"] if u["State"] != "free"}
    assert len(held) == 3
    assert not held & set(found["prior"]["set"])
    assert document["summary"]["gpus"] == 8 + 8 + 1  # old's GPU, from its /gpu/info/json
    text = ctl("free", "--gpus", "1", "-i", str(fleet.inventory), "-l", "prior,old")
    assert text.exit_code == 0, text.stderr
    assert [line.split()[:2] for line in text.stdout.splitlines()[1:]] == [["prior", "5/8"]]
    assert "nvidia-docker-ctl: old: agent too old for leases (no /leases/json): upgrade " \
        "nvidia-docker-plugin there" in text.stderr.splitlines()  # fmt: skip


def test_unreachable_nodes_exit_3_and_a_qualifying_node_wins_over_a_dead_one(
    fleet: Fleet,
) -> None:
    for command in ("leases", "free"):
        dead = ctl(command, "-i", str(fleet.inventory), "-l", "dead")
        assert dead.exit_code == 3, dead.stderr
        assert "nvidia-docker-ctl: dead: cannot connect to the agent" in dead.stderr
    assert ctl("leases", "-i", str(fleet.inventory), "-l", "dead").stdout.splitlines()[1] == (
        "dead  -     error: connection refused"
    )
    mixed = ctl("free", "--gpus", "2", "-i", str(fleet.inventory), "-l", "busy,dead")
    assert mixed.exit_code == 0
    assert "nvidia-docker-ctl: 2 nodes, 1 answered (8 GPUs), 1 failed" in mixed.stderr


def test_a_bad_gpu_count_is_a_usage_error() -> None:
    result = ctl("free", "--gpus", "0", "localhost:1")
    assert result.exit_code == 2
    assert "--gpus" in result.stderr


def _info(links: dict[tuple[int, int], tuple[int, int]], numa: list[int]) -> dict[str, object]:
    """``/gpu/info/json`` of len(numa) GPUs; ``links[(a, b)] = (PCI link, NVLinks)``."""
    bus = [f"00000000:{0x18 + i:02X}:00.0" for i in range(len(numa))]
    devices = []
    for index, node in enumerate(numa):
        peers = []
        for other in range(len(numa)):
            if other != index:
                link, nvlinks = links.get((min(index, other), max(index, other)), (1, 0))
                peers.append({"BusID": bus[other], "Link": link, "NVLinks": nvlinks})
        devices.append({"CPUAffinity": node, "PCI": {"BusID": bus[index]}, "Topology": peers})
    return {"Version": {"Driver": "580.159.04", "CUDA": "13.0"}, "Devices": devices}


def _leases(free: set[int], numa: list[int], sick: frozenset[int] = frozenset()) -> object:
    return {
        "Units": [
            {"Name": str(i), "GPU": i, "MIG": None, "Profile": None, "NumaNode": n,
             "State": "free" if i in free else "leased", "Healthy": i not in sick, "Holders": []}
            for i, n in enumerate(numa)
        ],
        "Leases": [], "Foreign": [], "Waiting": [],
    }  # fmt: skip


def test_free_sorts_nodes_by_their_best_sets_connectivity() -> None:
    from controller.fleet.free_view import FreeAsk, FreeTally  # noqa: PLC0415
    from controller.fleet.query import FleetNode, NodeResult  # noqa: PLC0415
    from controller.transport.endpoint import parse_endpoint  # noqa: PLC0415

    numa = [0, 0, 1, 1]
    shapes = {
        # free GPUs 0 and 2 only: across the sockets
        "sockets": ({}, {0, 2}, frozenset()),
        # 0 and 1 under one PCIe switch (PIX), 2 free too: the picker takes the switch pair
        "switch": ({(0, 1): (5, 0)}, {0, 1, 2}, frozenset()),
        # 0 and 1 on one NUMA node through its host bridges (NODE)
        "numa": ({(0, 1): (2, 0)}, {0, 1}, frozenset()),
        # 2 and 3 joined by NVLink; 1 is free too
        "nvlink": ({(2, 3): (1, 18)}, {1, 2, 3}, frozenset()),
        # three free, but one of them unhealthy: not enough
        "sick": ({}, {0, 1, 2}, frozenset({0, 1})),
    }
    tally = FreeTally(FreeAsk(2))
    for order, (name, (links, free, sick)) in enumerate(shapes.items()):
        answers = {"info": _info(links, numa), "leases": _leases(free, numa, sick)}
        tally.add(NodeResult(FleetNode(name, parse_endpoint(f"{name}:")), answers), order)
    best = [(c.node, c.names, c.link, c.numa) for c in tally.best_first()]
    assert best == [
        ("nvlink", ("2", "3"), "NVLink", (1,)),
        ("switch", ("0", "1"), "PCIe switch", (0,)),
        ("numa", ("0", "1"), "NUMA node", (0,)),
        ("sockets", ("0", "2"), "across sockets", (0, 1)),
    ]
    lines = tally.lines(None)
    assert lines[1].split() == ["nvlink", "3/4", "2,3", "NVLink", "1"]
    assert lines[4].split() == ["sockets", "2/4", "0,2", "across", "sockets", "0,1"]


def test_free_picks_once_for_a_fleet_of_one_model_whose_gpus_have_their_own_uuids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A real fleet: the nodes of one model answer the same topology, each with its own GPU
    # UUIDs. The pick (a quarter of a millisecond on 8 GPUs) is made once per topology and
    # set of free GPUs, not once per node: 10,000 nodes would otherwise take seconds here.
    import controller.fleet.free_view as free_view  # noqa: PLC0415
    from agent.leases.picking import Connectivity, LoadOf, pick_gpus  # noqa: PLC0415
    from agent.leases.units import Unit  # noqa: PLC0415
    from controller.fleet.query import FleetNode, NodeResult  # noqa: PLC0415
    from controller.transport.endpoint import parse_endpoint  # noqa: PLC0415

    picked = []

    def counted(
        candidates: Sequence[Unit], count: int, conn: Connectivity, load_of: LoadOf
    ) -> tuple[Unit, ...]:
        picked.append(count)
        return pick_gpus(candidates, count, conn, load_of)

    monkeypatch.setattr(free_view, "pick_gpus", counted)
    numa = [0, 0, 0, 0, 1, 1, 1, 1]
    links = {(a, b): (1, 18) for a in range(8) for b in range(a + 1, 8) if a // 2 == b // 2}
    info = _info(links, numa)
    tally = free_view.FreeTally(free_view.FreeAsk(2))
    for order in range(50):
        free = {1, 2, 3, 6, 7} if order % 10 else {0, 2, 5}  # every tenth node: other GPUs free
        leases = _leases(free, numa)
        for unit in leases["Units"]:  # type: ignore[index]
            unit["UUID"] = f"GPU-{order:08x}-0000-0000-0000-{unit['GPU']:012x}"
        node = FleetNode(f"node{order}", parse_endpoint(f"node{order}:"))
        tally.add(NodeResult(node, {"info": info, "leases": leases}), order)
    assert len(picked) == 2  # one pick per set of free GPUs, whatever the UUIDs
    found = {c.node: (c.names, c.link, c.numa) for c in tally.found}
    assert len(found) == 50
    assert found["node1"] == found["node49"] == (("2", "3"), "NVLink", (0,))
    assert found["node0"] == found["node40"] == (("0", "2"), "across sockets", (0,))


def test_free_for_one_gpu_asks_no_topology_and_takes_the_pickers_gpu() -> None:
    # Each node is asked one small route; an agent older than it, for its leases alone when
    # there is no pair to score (one GPU, the default, or MIG devices), and `free` takes the
    # GPU the picker would take on any topology.
    import itertools  # noqa: PLC0415

    import controller.fleet.free_view as free_view  # noqa: PLC0415
    from agent.leases.picking import Connectivity, pick_gpus  # noqa: PLC0415
    from controller.fleet.query import FleetNode, NodeResult  # noqa: PLC0415
    from controller.transport.endpoint import parse_endpoint  # noqa: PLC0415

    asks = (free_view.FreeAsk(1), free_view.FreeAsk(3, "1g.18gb"), free_view.FreeAsk(2))
    asked = {ask: free_view.free_query(ask).requests for ask in asks}
    assert {ask: [(r.path, dict(r.params)) for r in asked[ask]] for ask in asks} == {
        asks[0]: [("/leases/free", {"count": "1"})],
        asks[1]: [("/leases/free", {"count": "3", "mig_profile": "1g.18gb"})],
        asks[2]: [("/leases/free", {"count": "2"})],
    }
    assert {ask: [r.path for r in asked[ask][0].instead] for ask in asks} == {
        asks[0]: ["/leases/json"],
        asks[1]: ["/leases/json"],
        asks[2]: ["/gpu/info/json", "/leases/json"],
    }
    numa = [0, 0, 1, 1]
    topologies = [{}, {(2, 3): (1, 18)}, {(0, 1): (5, 0), (1, 3): (1, 18)}]
    for links, size in itertools.product(topologies, (1, 2, 3)):
        for free in itertools.combinations(range(4), size):
            node = FleetNode("n", parse_endpoint("n:"))
            leases = _leases(set(free), numa)
            alone = free_view.candidate(NodeResult(node, {"leases": leases}), free_view.FreeAsk(1))
            info = free_view.node_topology(_info(links, numa))
            units = [free_view._unit(u) for u in leases["Units"] if u["State"] == "free"]  # type: ignore[index]
            picked = pick_gpus(
                [u for u in units if u is not None], 1, Connectivity(info), free_view._no_load
            )
            assert alone is not None
            assert alone.names == tuple(u.name for u in picked)
            assert (alone.link, alone.rank, alone.free, alone.total) == ("-", (), size, 4)


def test_the_agents_own_pick_and_the_ctls_agree_on_idle_gpus() -> None:
    # An agent with GET /leases/free picks the set itself; for an older agent the ctl picks
    # it from the node's leases and topology. On idle GPUs both are the same picker's choice:
    # the same set, link, rank and counts, on every free set of two shapes of node.
    import itertools  # noqa: PLC0415

    from agent.api.leases import free_json, view_json  # noqa: PLC0415
    from agent.gpu.model import PciLink  # noqa: PLC0415
    from agent.leases.asks import Ask  # noqa: PLC0415
    from agent.leases.table import LeaseTable  # noqa: PLC0415
    from agent.node.facts import NodeFacts  # noqa: PLC0415
    from controller.fleet.free_view import FreeAsk, agents_pick, candidate  # noqa: PLC0415
    from controller.fleet.query import FleetNode, NodeResult  # noqa: PLC0415
    from controller.transport.endpoint import parse_endpoint  # noqa: PLC0415
    from tests.unit.agent.conftest import CONTROL  # noqa: PLC0415
    from tests.unit.leases.nodes import T0, build_node, healthy  # noqa: PLC0415

    nvlink = (PciLink.CROSS_CPU, 18)
    # NVLink pairs on two sockets, one PCIe switch per socket's first two GPUs
    links = {(a, a + 1): nvlink for a in (0, 2, 4, 6)}
    links |= {(0, 2): (PciLink.SINGLE_SWITCH, 0), (4, 6): (PciLink.MULTIPLE_SWITCHES, 0)}
    shapes = [
        build_node([0, 0, 0, 0, 1, 1, 1, 1], links),
        build_node([0, 0, 1, 1, None]),  # links unknown, one GPU's NUMA node unknown
    ]
    node = FleetNode("n", parse_endpoint("n:"))
    compared = 0
    for shape in shapes:
        info = json.loads(NodeFacts(shape, CONTROL).info_json)
        gpus = len(shape.devices)
        for held in itertools.chain.from_iterable(
            itertools.combinations(range(gpus), k) for k in range(gpus)
        ):
            table = LeaseTable(shape, healthy(shape), now_s=T0)
            if held:
                table.ask(Ask(devices=" ".join(map(str, held))), T0)
            for count in range(1, gpus - len(held) + 2):
                ask = FreeAsk(count)
                route = {"free": free_json(table.free_set(count), count, None)}
                older = {"info": info, "leases": view_json(table.view())}
                theirs = agents_pick(NodeResult(node, route), ask)
                ours = candidate(NodeResult(node, older), ask)
                assert theirs == ours, (held, count)
                compared += theirs is not None
    assert compared > 500


def test_free_over_tls_asks_an_older_agent_again_and_names_both_sets(tmp_path: Path) -> None:
    # Over TLS the second round (the older agent's leases and topology, after its 405) goes
    # on the TLS connection already made (query.ask_node keeps it open for that round).
    import ssl  # noqa: PLC0415

    from tests.support.certs import make_pki  # noqa: PLC0415

    pki = make_pki(tmp_path / "pki")
    tls = (pki.pem("server"), pki.key("server"))
    context = ssl.create_default_context(cafile=pki.pem("ca"))
    with farms_before_and_after_free(tls=tls, context=context) as farms:
        urls = [f"https://127.0.0.1:{farm.ports[0]}" for farm in farms]
        result = ctl("free", "--json", "--gpus", "2", "--ca", str(pki.pem("ca")), *urls)
        assert result.exit_code == 0, result.stderr
        document = json.loads(result.stdout)
        older, newer = (document["nodes"][url] for url in urls)
        assert (set(older) >= {"info", "leases"}, "free" in older) == (True, False)
        assert ("free" in newer, "leases" in newer) == (True, False)
        assert [(c["free"], c["units"], c["link"]) for c in document["free"]] == [
            (5, 8, "NVLink"), (5, 8, "NVLink")
        ]  # fmt: skip


async def test_a_node_with_malformed_lease_answers_gets_its_rows_and_the_others_theirs() -> None:
    # An agent older than /leases/free whose topology is not a list, and whose lease list
    # names a lease by an object: `free` and `leases` show that node like any other; both
    # used to end the whole query as an internal error (exit 4).
    import asyncio  # noqa: PLC0415

    from aiohttp import web  # noqa: PLC0415

    from tests.unit.controller.test_fleet import serve  # noqa: PLC0415

    numa = [0, 0]
    odd_info = {**_info({}, numa), "Devices": [{"Topology": 5}, {"Topology": 5}]}
    odd_leases = {**_leases({0, 1}, numa), "Leases": [{"Lease": {"id": 1}, "Owner": {}}]}  # type: ignore[dict-item]

    def older(info: object, leases: object) -> Callable[[web.Request], object]:
        async def handler(request: web.Request) -> web.Response:
            if request.path == "/gpu/info/json":
                return web.json_response(info)
            if request.path == "/leases/json":
                return web.json_response(leases)
            return web.Response(status=404, text="404: Not Found")

        return handler

    odd_runner, odd_port = await serve(older(odd_info, odd_leases))
    well_runner, well_port = await serve(older(_info({}, numa), _leases({0, 1}, numa)))
    odd, well = f"http://127.0.0.1:{odd_port}", f"http://127.0.0.1:{well_port}"
    try:
        found = await asyncio.to_thread(ctl, "free", "--gpus", "2", odd, well)
        held = await asyncio.to_thread(ctl, "leases", odd, well)
    finally:
        await odd_runner.cleanup()
        await well_runner.cleanup()
    assert "internal error" not in found.stderr + held.stderr
    assert (found.exit_code, held.exit_code) == (0, 0)
    assert {row[0]: row[1:4] for row in map(str.split, found.stdout.splitlines()[1:])} == {
        well: ["2/2", "0,1", "across"],  # across sockets
        odd: ["2/2", "0,1", "unknown"],  # no topology to read
    }
    assert rows(held, odd)[-1] == [odd, "-", "2", "free", "of", "2;", "1", "lease;", "queue", "0"]
    assert rows(held, well)[-1][2:] == ["2", "free", "of", "2;", "0", "leases;", "queue", "0"]

    # a unit on a GPU index the topology does not have (negative here): that node does not
    # qualify, instead of ending the query
    from controller.fleet.free_view import FreeAsk, candidate  # noqa: PLC0415
    from controller.fleet.query import FleetNode, NodeResult  # noqa: PLC0415
    from controller.transport.endpoint import parse_endpoint  # noqa: PLC0415

    negative = _leases({0, 1}, numa)
    negative["Units"][0]["GPU"] = -1  # type: ignore[index]
    answers = {"info": _info({}, numa), "leases": negative}
    assert candidate(NodeResult(FleetNode("n", parse_endpoint("n:")), answers), FreeAsk(2)) is None
