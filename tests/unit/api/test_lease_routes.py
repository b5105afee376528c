"""The lease routes of the REST API (docs/leases.md, "The REST API"), as create_app mounts
them over a lease service of the simulated h200x2 node: through aiohttp's test client on
127.0.0.1, and, for who may write, through requests built with a non-loopback local address
(make_mocked_request: no such traffic is sent)."""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from agent.api.leases import LEASES, MAX_ASK_BYTES, Cpusets, make_routes
from agent.api.routes import create_app
from agent.leases.answers import Granted
from agent.leases.asks import Ask
from agent.leases.containers import Container, GpuUser
from agent.leases.loads import GpuLoad
from agent.leases.settings import LeaseSettings
from agent.leasing.service import LeaseService
from agent.node.facts import NodeFacts
from agent.node.state import NodeState
from agent.node.status import StatusService
from tests.support.fake_engine import eventually
from tests.unit.agent.conftest import CONTROL, CountingBackend
from tests.unit.leases.nodes import build_node, cid, healthy, leased_container

if TYPE_CHECKING:  # types only: generic from aiohttp 3.11 / pytest-aiohttp 1.1 (above the floors)
    from aiohttp.test_utils import TestClient
    from pytest_aiohttp import AiohttpClient

    Client = TestClient[web.Request, web.Application]

JSON_TYPE = "application/json; charset=utf-8"
UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
BACKEND = CountingBackend("h200x2")
NODE = BACKEND.node_info()
UUIDS = [d.uuid for d in NODE.devices]


class Node:
    """The REST app with a lease service; ``app`` to build mocked requests against."""

    def __init__(self, leases: LeaseService, status: StatusService, remote: bool) -> None:
        self.leases = leases
        self.app = create_app(
            NodeState(NodeFacts(NODE, CONTROL)),
            status,
            leases=leases,
            remote_lease_writes=remote,
        )


MakeNode = Callable[..., Node]


@pytest.fixture
async def make_node() -> AsyncIterator[MakeNode]:
    made: list[tuple[LeaseService, StatusService]] = []

    def make(settings: LeaseSettings | None = None, remote: bool = False) -> Node:
        leases = LeaseService.open(NODE, healthy(NODE), settings or LeaseSettings(), None)
        status = StatusService(BACKEND, NODE, pcie_interval_s=60)
        made.append((leases, status))
        return Node(leases, status, remote)

    yield make
    for leases, status in made:
        await leases.close()
        await status.close()


@pytest.fixture
async def node(make_node: MakeNode) -> Node:
    return make_node()


@pytest.fixture
async def client(node: Node, aiohttp_client: AiohttpClient) -> Client:
    return await aiohttp_client(node.app)


async def answer(resp: Any, status: int) -> dict[str, Any]:
    """The JSON body of ``resp``, checked: its status, content type and final newline."""
    body = await resp.read()
    assert resp.status == status, body
    assert resp.headers["Content-Type"] == JSON_TYPE
    assert body.endswith(b"\n")
    doc = json.loads(body)
    assert isinstance(doc, dict)
    return doc


async def granted(node: Node, ask: Ask) -> Granted:
    """A grant made by the service itself (not through the routes)."""
    answer = await node.leases.ask(ask)
    assert isinstance(answer, Granted), answer
    return answer


# -- POST /leases: granted ---------------------------------------------------------------------


async def test_a_grant_is_201_with_its_lease_devices_labels_and_expiry(client: Client) -> None:
    resp = await client.post("/leases", json={"count": 1, "owner": {"user": "alice"}})
    doc = await answer(resp, 201)
    assert doc["Lease"] == "lease-1"
    assert doc["State"] == "pending"
    assert doc["Dev"] == UUIDS[0]
    assert doc["Devices"] == [
        {
            "Name": "0",
            "UUID": UUIDS[0],
            "GPU": 0,
            "MIG": None,
            "Profile": None,
            "Path": "/dev/nvidia0",
            "Sharing": 1,
            "Sharers": 1,
        }
    ]
    assert doc["Labels"] == {
        "nvidia-docker.lease": "lease-1",
        "nvidia-docker.lease.devices": UUIDS[0],
        "nvidia-docker.lease.mode": "exclusive",
        "nvidia-docker.lease.owner": '{"user":"alice"}',
    }
    assert UTC.fullmatch(doc["Expires"])
    assert doc["Text"].startswith("granted lease-1")
    assert set(doc) >= {"NumaNodes", "CpusetCpus", "CpusetMems"}


async def test_an_empty_body_asks_for_one_gpu(client: Client) -> None:
    doc = await answer(await client.post("/leases"), 201)
    assert len(doc["Devices"]) == 1
    doc = await answer(await client.post("/v1.0/leases", data=b"{}"), 201)
    assert doc["Lease"] == "lease-2"


async def test_named_devices_and_a_shared_ask(make_node: MakeNode, aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_node(LeaseSettings(sharing=2)).app)
    doc = await answer(await client.post("/leases", json={"devices": "1", "exclusive": False}), 201)
    assert doc["Dev"] == UUIDS[1]
    assert (doc["Devices"][0]["Sharing"], doc["Devices"][0]["Sharers"]) == (2, 1)
    assert doc["Labels"]["nvidia-docker.lease.mode"] == "shared"
    doc = await answer(await client.post("/leases", json={"devices": "1", "exclusive": False}), 201)
    assert doc["Devices"][0]["Sharers"] == 2


async def test_the_cpuset_of_the_grants_numa_nodes(tmp_path: Path) -> None:
    """CpusetCpus from sysfs's cpulist of the GPUs' NUMA node; null when asked without."""
    cpulist = tmp_path / "devices" / "system" / "node" / "node1" / "cpulist"
    cpulist.parent.mkdir(parents=True)
    cpulist.write_text("8-15\n")
    node = build_node([1, 1])
    leases = LeaseService.open(node, healthy(node), LeaseSettings(), None)
    app = web.Application()
    app[LEASES] = leases
    routes = make_routes(Cpusets(tmp_path))
    ask = next(h for m, p, h in routes if (m, p) == ("POST", "/leases"))
    try:
        resp = await ask(_request(app, "POST", "/leases", b'{"count": 2}'))
        doc = json.loads(resp.body)
        assert (doc["NumaNodes"], doc["CpusetCpus"], doc["CpusetMems"]) == ([1], "8-15", "1")
        leases.release(doc["Lease"])
        resp = await ask(_request(app, "POST", "/leases", b'{"cpuset": false}'))
        doc = json.loads(resp.body)
        assert resp.status == 201
        assert (doc["NumaNodes"], doc["CpusetCpus"], doc["CpusetMems"]) == (None, None, None)
    finally:
        await leases.close()


def test_a_long_cpulist_is_read_whole(tmp_path: Path) -> None:
    """A node of many CPUs listed one by one (sysfs declares its cpulist 28 KiB on kernels
    built for 8,192 CPUs) still gives its cpuset."""
    cpulist = tmp_path / "devices" / "system" / "node" / "node0" / "cpulist"
    cpulist.parent.mkdir(parents=True)
    every_other = ",".join(str(cpu) for cpu in range(0, 8192, 2))
    cpulist.write_text(every_other + "\n")
    assert len(every_other) > 16 * 1024
    assert Cpusets(tmp_path).of((0,)) == (every_other, "0")


# -- POST /leases: malformed asks ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"count": "2"}', "count"),
        (b'{"count": 1.5}', "count"),
        (b'{"count": true}', "count"),
        (b'{"count": 0}', "count"),
        (b'{"count": 100000000000000000000}', "count"),
        (b'{"wait_s": 601}', "wait_s"),
        (b'{"wait_s": -1}', "wait_s"),
        (b'{"wait_s": "5"}', "wait_s"),
        (b'{"wait_s": NaN}', "wait_s"),
        (b'{"wait_s": true}', "wait_s"),
        (b'{"colour": "red"}', "colour"),
        (b'{"owner": {"user": "' + b"x" * 300 + b'"}}', "owner"),
        (b'{"owner": {"user": "' + b"x" * 200 + b'"}}', "owner"),
        (b'{"owner": ["alice"]}', "owner"),
        (b'{"owner": {"user": 7}}', "owner"),
        (b'{"exclusive": "yes"}', "exclusive"),
        (b'{"cpuset": 1}', "cpuset"),
        (b'{"devices": 0}', "devices"),
        (b'{"devices": "7"}', "devices"),
        (b'{"mig_profile": 1}', "mig_profile"),
        (b'{"mig_profile": "big"}', "mig_profile"),
        (b'{"devices": "0", "mig_profile": "1g.18gb"}', "devices"),
        (b"count=1", ""),
        (b'{"count": 1', ""),
        (b"\xff\xfe", ""),
        (b"[1]", ""),
        (b"[" * 40 + b"]" * 40, ""),
        (b'{"owner": ' * 40 + b"{}" + b"}" * 40, ""),
    ],
    ids=lambda value: value[:24].decode("latin-1") if isinstance(value, bytes) else value,
)
async def test_a_malformed_ask_is_400_naming_the_field(
    node: Node, client: Client, body: bytes, field: str
) -> None:
    doc = await answer(await client.post("/leases", data=body), 400)
    assert doc["Field"] == field
    assert isinstance(doc["Error"], str)
    assert "\n" not in doc["Error"]
    assert node.leases.view().leases == ()  # nothing granted


@pytest.mark.parametrize(
    ("owner", "bound"),
    [({"k" * 100: "v"}, "1 to 64"), ({"user": "x" * 300}, "128"), ({"user": "x" * 200}, "128")],
    ids=["long-key", "value-300", "value-200"],
)
async def test_an_owner_label_too_long_is_400_naming_its_real_bound(
    client: Client, owner: dict[str, str], bound: str
) -> None:
    doc = await answer(await client.post("/leases", json={"owner": owner}), 400)
    assert doc["Field"] == "owner"
    assert bound in doc["Error"]
    assert "256" not in doc["Error"]


@pytest.mark.parametrize(
    ("query", "field"),
    [("count=2", "count"), ("wait_s=30", "wait_s"), ("dev=1", "devices"), ("devices=1", "devices")],
)
async def test_an_ask_in_the_query_is_400_not_one_gpu(
    node: Node, client: Client, query: str, field: str
) -> None:
    """``POST /leases?count=2`` would otherwise be an ask for one GPU, the query ignored."""
    doc = await answer(await client.post(f"/leases?{query}"), 400)
    assert doc["Field"] == field
    assert "JSON body" in doc["Error"]
    assert node.leases.view().leases == ()


async def test_an_ask_over_the_bound_is_413(node: Node, client: Client) -> None:
    body = json.dumps({"owner": {"user": "x" * MAX_ASK_BYTES}}).encode()
    assert len(body) > MAX_ASK_BYTES
    doc = await answer(await client.post("/leases", data=body), 413)
    assert str(MAX_ASK_BYTES) in doc["Error"]
    assert node.leases.view().leases == ()
    fits = b'{"count": 1}' + b" " * (MAX_ASK_BYTES - 12)
    assert len(fits) == MAX_ASK_BYTES
    await answer(await client.post("/leases", data=fits), 201)


async def test_an_ask_past_the_servers_body_limit_is_413_in_json(
    node: Node, client: Client
) -> None:
    """Beyond aiohttp's 1 MiB bound too, the answer is the JSON 413 naming the ask's bound."""
    body = io.BytesIO(b"{}" + b" " * (2 * 1024 * 1024))
    doc = await answer(await client.post("/leases", data=body), 413)
    assert str(MAX_ASK_BYTES) in doc["Error"]
    assert node.leases.view().leases == ()


# -- POST /leases: refused ---------------------------------------------------------------------


async def test_not_enough_free_is_409_with_what_is_taken(client: Client) -> None:
    await answer(await client.post("/leases", json={"count": 2, "owner": {"job": "7"}}), 201)
    doc = await answer(await client.post("/leases", json={"count": 1}), 409)
    assert doc["Refusal"] == "not_enough"
    assert "\n" not in doc["Error"]
    assert [t["Unit"] for t in doc["Taken"]] == ["0", "1"]
    taken = doc["Taken"][0]
    assert (taken["Lease"], taken["Hold"], taken["Container"]) == ("lease-1", "pending", None)
    assert taken["UUID"] == UUIDS[0]
    assert UTC.fullmatch(taken["Since"])
    assert UTC.fullmatch(taken["Until"])


async def test_a_named_device_that_is_held_is_409_taken(node: Node, client: Client) -> None:
    grant = await granted(node, Ask(devices="1"))
    node.leases.started(leased_container(1, grant.lease, running=True))
    doc = await answer(await client.post("/leases", json={"devices": "1"}), 409)
    assert doc["Refusal"] == "taken"
    (taken,) = doc["Taken"]
    assert (taken["Unit"], taken["Hold"], taken["Container"]) == ("1", "running", cid(1))
    assert taken["Until"] is None


async def test_more_than_the_node_has_is_409_impossible(client: Client) -> None:
    doc = await answer(await client.post("/leases", json={"count": 3, "wait_s": 30}), 409)
    assert doc["Refusal"] == "impossible"


async def test_an_ask_that_waited_in_vain_is_408(node: Node, client: Client) -> None:
    await answer(await client.post("/leases", json={"count": 2}), 201)
    doc = await answer(await client.post("/leases", json={"count": 1, "wait_s": 0.2}), 408)
    assert doc["Refusal"] == "timed_out"
    assert [t["Lease"] for t in doc["Taken"]] == ["lease-1", "lease-1"]
    assert node.leases.view().waiting == ()


async def test_an_ask_that_waits_is_granted_when_a_release_frees_a_gpu(
    node: Node, client: Client
) -> None:
    await answer(await client.post("/leases", json={"count": 2}), 201)
    waiting = asyncio.create_task(client.post("/leases", json={"count": 1, "wait_s": 30}))
    await eventually(lambda: len(node.leases.view().waiting) == 1, "the ask waits")
    doc = await answer(await client.delete("/leases/lease-1"), 200)
    assert doc["Released"] == "lease-1"
    doc = await answer(await asyncio.wait_for(waiting, 10), 201)
    assert doc["Lease"] == "lease-2"


async def test_a_client_that_goes_away_leaves_the_queue(node: Node, client: Client) -> None:
    """aiohttp's test server cancels the handler of a connection that closes."""
    await answer(await client.post("/leases", json={"count": 2}), 201)
    waiting = asyncio.create_task(client.post("/leases", json={"count": 1, "wait_s": 30}))
    await eventually(lambda: len(node.leases.view().waiting) == 1, "the ask waits")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await eventually(lambda: node.leases.view().waiting == (), "the ask left the queue")


async def test_a_client_that_goes_away_leaves_the_queue_of_the_agents_runner(
    node: Node,
) -> None:
    runner = web.AppRunner(node.app)  # as agent/server.py's: no handler_cancellation given
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        await node.leases.ask(Ask(count=2))
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"count": 1, "wait_s": 30}'
        writer.write(
            b"POST /leases HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        await eventually(lambda: len(node.leases.view().waiting) == 1, "the ask waits")
        writer.close()
        await writer.wait_closed()
        await eventually(lambda: node.leases.view().waiting == (), "left the queue", 3)
    finally:
        await node.leases.close()  # answers the handler that still waits, if any
        await runner.cleanup()


async def test_a_client_that_hangs_up_just_before_the_queue_serves_it_holds_nothing(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue serves the ask after its client hung up, before the handler looks again:
    the grant is given back at once, not held by nobody for the pending time."""
    monkeypatch.setattr("agent.api.leases.DISCONNECT_POLL_S", 60.0)  # only the grant wakes it
    runner = web.AppRunner(node.app)  # as agent/server.py's: no handler_cancellation given
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        first = await granted(node, Ask(count=2))
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"count": 1, "wait_s": 30, "owner": {"user": "gone"}}'
        writer.write(
            b"POST /leases HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        await eventually(lambda: len(node.leases.view().waiting) == 1, "the ask waits")
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.2)  # the server sees the connection end
        node.leases.release(first.lease.id)  # the queue serves the ask now
        await eventually(lambda: node.leases.view().leases == (), "the grant was given back", 3)
        assert node.leases.view().waiting == ()
    finally:
        await node.leases.close()
        await runner.cleanup()


# -- DELETE /leases/{lease} ----------------------------------------------------------------


async def test_releasing_a_lease_is_200_and_frees_its_gpus(node: Node, client: Client) -> None:
    await answer(await client.post("/leases", json={"count": 2}), 201)
    doc = await answer(await client.delete("/v1.0/leases/lease-1"), 200)
    assert doc["Released"] == "lease-1"
    assert isinstance(doc["Text"], str)
    assert node.leases.view().leases == ()
    await answer(await client.post("/leases", json={"count": 2}), 201)


@pytest.mark.parametrize("lease", ["lease-9", "lease-1", "nonsense"])
async def test_releasing_an_unknown_lease_is_404(client: Client, lease: str) -> None:
    doc = await answer(await client.delete(f"/leases/{lease}"), 404)
    assert doc["Refusal"] == "unknown_lease"
    assert doc["Taken"] == []


async def test_releasing_twice_is_404_the_second_time(client: Client) -> None:
    await answer(await client.post("/leases"), 201)
    await answer(await client.delete("/leases/lease-1"), 200)
    await answer(await client.delete("/leases/lease-1"), 404)


async def test_releasing_a_running_containers_lease_is_409(node: Node, client: Client) -> None:
    grant = await granted(node, Ask(count=1))
    node.leases.started(leased_container(1, grant.lease, running=True))
    doc = await answer(await client.delete("/leases/lease-1"), 409)
    assert doc["Refusal"] == "in_use"
    assert node.leases.lease("lease-1") is not None


# -- GET /leases, /leases/json ----------------------------------------------------------------


async def test_the_list_as_text(node: Node, client: Client) -> None:
    grant = await granted(node, Ask(devices="1"))
    node.leases.started(leased_container(1, grant.lease, running=True))
    await answer(await client.post("/leases", json={"devices": "0"}), 201)
    resp = await client.get("/leases")
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
    lines = (await resp.text()).splitlines()
    assert lines == [
        f"GPU 0    {UUIDS[0]:<40} pending: pending lease-2",
        f"GPU 1    {UUIDS[1]:<40} leased: running lease-1 (container {cid(1)[:12]})",
    ]


async def test_the_text_list_names_foreign_holders_as_the_refusals_do(
    node: Node, client: Client
) -> None:
    node.leases.started(Container(cid(7), True, devices=("0",), how="--device /dev/nvidia0"))
    node.leases.processes_seen([GpuUser(1, None, 4242)])
    lines = (await (await client.get("/leases")).text()).splitlines()
    assert lines == [
        f"GPU 0    {UUIDS[0]:<40} foreign: container {cid(7)[:12]} (--device /dev/nvidia0)",
        f"GPU 1    {UUIDS[1]:<40} foreign: pid 4242 (a GPU process)",
    ]


async def test_the_text_list_shows_the_queue(node: Node, client: Client) -> None:
    await answer(await client.post("/leases", json={"count": 2}), 201)
    waiting = asyncio.create_task(client.post("/leases", json={"wait_s": 30}))
    await eventually(lambda: len(node.leases.view().waiting) == 1, "the ask waits")
    text = await (await client.get("/v1.0/leases")).text()
    assert re.search(r"^waiting  wait-1 since \S+Z$", text, re.MULTILINE), text
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_the_list_as_json(node: Node, client: Client) -> None:
    await answer(await client.post("/leases", json={"count": 1, "owner": {"user": "bo"}}), 201)
    doc = await answer(await client.get("/leases/json"), 200)
    assert set(doc) == {"Units", "Leases", "Foreign", "Waiting"}
    assert [(u["Name"], u["State"], u["Healthy"]) for u in doc["Units"]] == [
        ("0", "pending", True),
        ("1", "free", True),
    ]
    assert doc["Units"][0]["Holders"][0]["Lease"] == "lease-1"
    (lease,) = doc["Leases"]
    assert lease["Lease"] == "lease-1"
    assert lease["State"] == "pending"
    assert lease["Units"] == ["0"]
    assert lease["Owner"] == {"user": "bo"}
    assert lease["Container"] is None
    assert UTC.fullmatch(lease["Until"])
    assert (doc["Foreign"], doc["Waiting"]) == ([], [])


# -- GET /leases/free -----------------------------------------------------------------------------


async def test_free_says_what_an_ask_would_get_now(node: Node, client: Client) -> None:
    doc = await answer(await client.get("/leases/free"), 200)
    assert doc == {
        "Count": 1,
        "MigProfile": None,
        "GPUs": 2,
        "Units": 2,
        "Free": 2,
        "Set": [{"Name": "0", "UUID": UUIDS[0], "GPU": 0, "MIG": None, "NumaNode": 0}],
        "Link": "-",
        "Pairs": [],
    }
    doc = await answer(await client.get("/v1.0/leases/free?count=2"), 200)
    assert [u["Name"] for u in doc["Set"]] == ["0", "1"]
    assert (doc["Link"], doc["Pairs"]) == ("NVLink", [[1, 2, 3]])  # NVLink, NUMA tier, PHB
    assert node.leases.view().leases == ()  # a query: nothing was asked for
    await granted(node, Ask(count=1))
    doc = await answer(await client.get("/leases/free?count=2"), 200)
    assert (doc["Free"], doc["Units"], doc["Set"], doc["Link"]) == (1, 2, [], "-")
    doc = await answer(await client.get("/leases/free"), 200)
    assert [u["Name"] for u in doc["Set"]] == ["1"]


async def test_free_takes_the_least_loaded_gpu_as_an_ask_would(node: Node, client: Client) -> None:
    node.leases.set_load([GpuLoad(utilization_pct=95), GpuLoad(utilization_pct=2)])
    doc = await answer(await client.get("/leases/free"), 200)
    assert [u["Name"] for u in doc["Set"]] == ["1"]
    assert [u.name for u in (await granted(node, Ask(count=1))).units] == ["1"]


async def test_free_of_a_mig_profile_the_node_lacks_is_an_empty_set(client: Client) -> None:
    doc = await answer(await client.get("/leases/free?count=1&mig_profile=1g.18gb"), 200)
    assert (doc["MigProfile"], doc["Units"], doc["Free"], doc["Set"]) == ("1g.18gb", 0, 0, [])


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("count=0", "count"),
        ("count=-1", "count"),
        ("count=1025", "count"),
        ("count=99999999999999999999", "count"),
        ("count=%D9%A1", "count"),  # an Arabic-Indic one: digits are ASCII
        ("count=two", "count"),
        ("count=", "count"),
        ("mig_profile=", "mig_profile"),
        ("mig_profile=" + "g" * 65, "mig_profile"),
        ("mig_profile=1g%0A18gb", "mig_profile"),
    ],
)
async def test_free_with_a_bad_parameter_is_400_naming_it(
    client: Client, query: str, field: str
) -> None:
    doc = await answer(await client.get(f"/leases/free?{query}"), 400)
    assert doc["Field"] == field
    assert "\n" not in doc["Error"]
    assert doc["Error"].startswith(field)


async def test_head_of_the_list(client: Client) -> None:
    resp = await client.head("/leases")
    assert resp.status == 200


# -- methods -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/leases", {"GET", "HEAD", "POST"}),
        ("PATCH", "/v1.0/leases", {"GET", "HEAD", "POST"}),
        ("DELETE", "/leases", {"GET", "HEAD", "POST"}),
        ("POST", "/leases/json", {"GET", "HEAD"}),
        ("DELETE", "/leases/json", {"GET", "HEAD"}),
        ("GET", "/leases/lease-1", {"DELETE"}),
        ("POST", "/leases/lease-1", {"DELETE"}),
    ],
)
async def test_other_methods_are_405(
    client: Client, method: str, path: str, allowed: set[str]
) -> None:
    resp = await client.request(method, path)
    assert resp.status == 405
    assert set(resp.headers["Allow"].split(",")) == allowed


async def test_free_is_read_only(client: Client) -> None:
    resp = await client.post("/leases/free")
    assert resp.status == 405
    # whether /leases/{lease}'s DELETE is listed too depends on aiohttp's version
    assert {"GET", "HEAD"} <= set(resp.headers["Allow"].split(",")) <= {"GET", "HEAD", "DELETE"}


async def test_no_lease_routes_without_a_lease_service(aiohttp_client: Any) -> None:
    status = StatusService(BACKEND, NODE, pcie_interval_s=60)
    try:
        app = create_app(NodeState(NodeFacts(NODE, CONTROL)), status)
        client = await aiohttp_client(app)
        assert (await client.post("/leases")).status == 404
        assert (await client.get("/leases/json")).status == 404
    finally:
        await status.close()


# -- who may write -----------------------------------------------------------------------------


class Transport:
    """A transport that says the connection came to ``sockname`` (nothing is sent)."""

    def __init__(self, sockname: tuple[object, ...] | None) -> None:
        self.sockname = sockname

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.sockname if name == "sockname" else default

    def is_closing(self) -> bool:
        return False


def _request(
    app: web.Application,
    method: str,
    path: str,
    body: bytes = b"",
    local: tuple[object, ...] | None = ("127.0.0.1", 3476),
    match_info: dict[str, str] | None = None,
) -> web.Request:
    payload = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(body)
    payload.feed_eof()
    return make_mocked_request(
        method,
        path,
        app=app,
        transport=Transport(local),
        payload=payload,
        match_info=match_info or {},
    )


async def _served(
    node: Node,
    method: str,
    path: str,
    body: bytes = b"",
    local: tuple[object, ...] | None = ("127.0.0.1", 3476),
) -> tuple[int, dict[str, Any]]:
    """The app's answer to a request that came to ``local``, through its own routing."""
    lease = path.rsplit("/", 1)[-1] if method == "DELETE" else None
    request = _request(
        node.app, method, path, body, local, {"lease": lease} if lease is not None else None
    )
    match = await node.app.router.resolve(request)
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]] = match.handler
    resp = await handler(request)
    assert isinstance(resp, web.Response)
    assert resp.headers["Content-Type"] == JSON_TYPE
    assert isinstance(resp.body, bytes)
    doc = json.loads(resp.body)
    assert isinstance(doc, dict)
    return resp.status, doc


FROM_AFAR = [("192.0.2.1", 3476), ("2001:db8::1", 3476, 0, 0), ("::ffff:192.0.2.1", 3476, 0, 0)]
FROM_THE_NODE = [("127.0.0.1", 3476), ("127.0.0.53", 3476), ("::1", 3476, 0, 0)]


@pytest.mark.parametrize("local", FROM_AFAR, ids=lambda a: str(a[0]))
async def test_asks_and_releases_from_afar_are_403(node: Node, local: tuple[object, ...]) -> None:
    grant = await granted(node, Ask(count=1))
    status, doc = await _served(node, "POST", "/leases", b'{"count": 1}', local)
    assert (status, doc["Refusal"]) == (403, "not_local")
    assert "--token-file" in doc["Error"]
    status, doc = await _served(node, "DELETE", "/leases/lease-1", local=local)
    assert (status, doc["Refusal"]) == (403, "not_local")
    assert [lease.id for lease in node.leases.view().leases] == [grant.lease.id]


async def test_a_request_without_a_local_address_may_not_write(node: Node) -> None:
    status, doc = await _served(node, "POST", "/leases", b"{}", None)
    assert (status, doc["Refusal"]) == (403, "not_local")


@pytest.mark.parametrize("local", FROM_AFAR, ids=lambda a: str(a[0]))
async def test_the_list_may_be_read_from_afar(node: Node, local: tuple[object, ...]) -> None:
    status, doc = await _served(node, "GET", "/leases/json", local=local)
    assert status == 200
    assert "Units" in doc
    status, doc = await _served(node, "GET", "/leases/free", local=local)
    assert (status, len(doc["Set"])) == (200, 1)


@pytest.mark.parametrize("local", FROM_THE_NODE, ids=lambda a: str(a[0]))
async def test_asks_and_releases_on_the_node_are_served(
    node: Node, local: tuple[object, ...]
) -> None:
    status, doc = await _served(node, "POST", "/leases", b'{"count": 1}', local)
    assert (status, doc["Lease"]) == (201, "lease-1")
    status, doc = await _served(node, "DELETE", "/leases/lease-1", local=local)
    assert (status, doc["Released"]) == (200, "lease-1")


@pytest.mark.parametrize("local", FROM_AFAR, ids=lambda a: str(a[0]))
async def test_remote_writes_serve_asks_and_releases_from_afar(
    make_node: MakeNode, local: tuple[object, ...]
) -> None:
    node = make_node(remote=True)
    status, doc = await _served(node, "POST", "/leases", b'{"count": 2}', local)
    assert (status, doc["Lease"]) == (201, "lease-1")
    status, doc = await _served(node, "POST", "/leases", b"{}", local)
    assert (status, doc["Refusal"]) == (409, "not_enough")
    status, doc = await _served(node, "DELETE", "/leases/lease-1", local=local)
    assert (status, doc["Released"]) == (200, "lease-1")
