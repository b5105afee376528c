"""An engine's containers, listed and inspected, against a fake engine on a unix socket."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import pytest

from agent.engines.containers import (
    INSPECTS_AT_ONCE,
    MAX_LIST_BYTES,
    inspect_container,
    list_containers,
)
from agent.engines.http import (
    MAX_CONCURRENT,
    BadAnswer,
    EngineClient,
    EngineError,
    EngineTimeout,
)
from agent.leases.containers import Container
from agent.leases.labels import LeaseLabel
from tests.support.fake_engine import FakeEngine, json_answer
from tests.support.fixture_files import ENGINES


def cid(n: int) -> str:
    return f"{n:064x}"


LABELS = {"nvidia-docker.lease": "lease-7", "nvidia-docker.lease.devices": "GPU-a,GPU-b"}
GPUS_ALL = {"DeviceRequests": [{"Driver": "", "Count": -1, "Capabilities": [["gpu"]]}]}


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(tmp_path / "engine.sock")
    await fake.start()
    yield fake
    await fake.stop()


def client(engine: FakeEngine) -> EngineClient:
    return EngineClient(engine.socket_path, timeout_s=5)


async def test_every_container_with_its_label_devices_and_state(engine: FakeEngine) -> None:
    engine.add(cid(1), running=True, labels=LABELS)
    engine.add(cid(2), host_config=GPUS_ALL)
    engine.add(cid(3), labels={"maintainer": "x"})
    assert await list_containers(client(engine)) == [
        Container(cid(1), True, LeaseLabel("lease-7", ("GPU-a", "GPU-b"))),
        Container(cid(2), False, None, ("all",), "--gpus all"),
        Container(cid(3)),
    ]
    assert engine.requests == [
        "/containers/json?all=1",
        *(f"/containers/{cid(n)}/json" for n in (1, 2, 3)),
    ]


async def test_a_container_that_vanished_between_list_and_inspect(engine: FakeEngine) -> None:
    engine.add(cid(1))
    engine.add(cid(2))
    engine.answers[f"/containers/{cid(1)}/json"] = json_answer({}, "404 Not Found")
    assert [c.id for c in await list_containers(client(engine))] == [cid(2)]
    assert await inspect_container(client(engine), cid(1)) is None


async def test_a_real_list(engine: FakeEngine) -> None:
    """dockerd's own list answer (7 containers, with their labels, mounts and networks)."""
    listed = json.loads((ENGINES / "docker-20.10-list.json").read_text())
    engine.answers["/containers/json"] = json_answer(listed)
    for entry in listed:
        engine.add(entry["Id"])
    assert [c.id for c in await list_containers(client(engine))] == [e["Id"] for e in listed]


async def test_more_containers_than_the_bound_is_refused_not_cut(engine: FakeEngine) -> None:
    for n in range(5):
        engine.add(cid(n))
    assert len(await list_containers(client(engine), max_containers=5)) == 5
    with pytest.raises(BadAnswer) as refused:
        await list_containers(client(engine), max_containers=4)
    assert str(refused.value).endswith(
        "gave no usable answer to its container list: it lists more than 4 containers"
    )


@pytest.mark.parametrize(
    ("listed", "why"),
    [
        ({"Id": cid(1)}, "it is not a JSON array (of containers)"),
        ([{"Id": cid(1)}, {"Names": ["/x"]}], "one of its containers has no 64-hex Id"),
        ([{"Id": "../../x"}], "one of its containers has no 64-hex Id"),
        ([{"Id": 5}], "one of its containers has no 64-hex Id"),
        ([[cid(1)]], "one of its containers has no 64-hex Id"),
    ],
)
async def test_a_list_that_is_no_list(engine: FakeEngine, listed: object, why: str) -> None:
    engine.answers["/containers/json"] = json_answer(listed)
    with pytest.raises(BadAnswer) as refused:
        await list_containers(client(engine))
    assert str(refused.value).endswith(f"to its container list: {why}")


async def test_the_lists_bounds(engine: FakeEngine) -> None:
    """Larger than one answer (4 MiB), up to MAX_LIST_BYTES; its labels and mounts cost no
    objects (only the ids are kept); past the bound, refused."""
    label = "v" * 1000
    entry = {"Labels": {f"l{i}": label for i in range(900)}, "Mounts": [{"Type": "bind"}] * 50}
    listed = [{"Id": cid(n), **entry} for n in range(12)]  # about 11 MB
    engine.answers["/containers/json"] = json_answer(listed)
    for n in range(12):
        engine.add(cid(n))
    assert len(await list_containers(client(engine))) == 12
    engine.answers["/containers/json"] = json_answer(["x" * MAX_LIST_BYTES])
    with pytest.raises(BadAnswer, match="it is larger than 16 MiB"):
        await list_containers(client(engine))


async def test_a_bad_inspect_fails_the_list(engine: FakeEngine) -> None:
    """A resync with part of the list would end the leases of the rest: the whole list fails,
    with the first failure's line, and the other inspects are cancelled."""
    for n in range(20):
        engine.add(cid(n))
    engine.answers[f"/containers/{cid(3)}/json"] = json_answer([1, 2])
    with pytest.raises(BadAnswer) as refused:
        await list_containers(client(engine))
    assert str(refused.value).endswith(
        f"gave no usable answer about container {cid(3)[:12]}: it is not a JSON object "
        "(a container)"
    )
    engine.answers[f"/containers/{cid(3)}/json"] = b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n"
    with pytest.raises(EngineError, match=r"answered HTTP 500$"):
        await list_containers(client(engine))


LISTED = "/containers/json?all=1&filters="  # one container's entry (EngineClient.list_entry)


def held_inspect(engine: FakeEngine, container_id: str, entry: dict[str, object] | None) -> None:
    """``container_id``'s inspect never answers (dockerd holds a container while it starts)
    and its list entry is ``entry`` (None: a list that waits too, as Podman's does)."""
    inspect = f"/containers/{container_id}/json"
    engine.answers[inspect] = b""
    engine.hold_open.add(inspect)
    if entry is None:
        engine.answers[LISTED] = b""
        engine.hold_open.add(LISTED)
    else:
        engine.answers[LISTED] = json_answer([entry])


async def test_a_starting_container_is_taken_from_the_list(engine: FakeEngine) -> None:
    """A resync while a container starts for longer than an inspect waits: the starting one
    as the list shows it (not running, its lease label), the others inspected; the list
    does not fail (it failed until the start was done, and was retried with backoff)."""
    engine.add(cid(1), running=True, host_config={"Devices": [{"PathOnHost": "/dev/nvidia3"}]})
    engine.add(cid(2))
    engine.add(cid(3), labels={"maintainer": "x"})
    held_inspect(engine, cid(2), {"Id": cid(2), "State": "created", "Labels": LABELS})
    quick = EngineClient(engine.socket_path, timeout_s=0.3)
    assert await list_containers(quick) == [
        Container(cid(1), True, None, ("/dev/nvidia3",), "--device /dev/nvidia3"),
        Container(cid(2), False, LeaseLabel("lease-7", ("GPU-a", "GPU-b"))),
        Container(cid(3)),
    ]
    assert [r for r in engine.requests if r.startswith(LISTED)] == [
        LISTED + quote(json.dumps({"id": [cid(2)]}, separators=(",", ":")), safe="")
    ]


@pytest.mark.parametrize(
    "entry",
    [{"State": "running", "Labels": {}}, None],
    ids=["running: its devices may make it a holder", "a list that waits too (Podman)"],
)
async def test_an_inspect_that_times_out_still_fails_the_list(
    engine: FakeEngine, entry: dict[str, object] | None
) -> None:
    engine.add(cid(1))
    engine.add(cid(2), running=True)
    held_inspect(engine, cid(2), None if entry is None else {"Id": cid(2), **entry})
    quick = EngineClient(engine.socket_path, timeout_s=0.3)
    with pytest.raises(EngineTimeout, match=r"did not answer within 0\.3 s$"):
        await list_containers(quick)


async def test_a_slow_list_times_out_as_a_whole(engine: FakeEngine) -> None:
    for n in range(3):
        engine.add(cid(n))
    engine.answers[f"/containers/{cid(2)}/json"] = b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n"
    engine.hold_open.add(f"/containers/{cid(2)}/json")  # and the rest never comes
    with pytest.raises(EngineError, match=r"did not list its containers within 0\.3 s$"):
        await list_containers(client(engine), timeout_s=0.3)


async def test_inspects_leave_request_slots_to_others(engine: FakeEngine, tmp_path: Path) -> None:
    """At most INSPECTS_AT_ONCE inspects at a time, so attribution's lookups to the same
    client always find a free slot."""
    assert INSPECTS_AT_ONCE < MAX_CONCURRENT
    in_flight, most = 0, 0
    all_slots_taken = asyncio.Event()  # INSPECTS_AT_ONCE inspects are held
    release = asyncio.Event()
    for n in range(10):
        engine.add(cid(n))
    held_path = tmp_path / "held.sock"

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal in_flight, most
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ")[1].decode()
        if path == "/containers/json?all=1":
            writer.write(json_answer([{"Id": cid(n)} for n in range(10)]))
        else:
            in_flight += 1
            most = max(most, in_flight)
            if in_flight == INSPECTS_AT_ONCE:
                all_slots_taken.set()
            await release.wait()
            writer.write(json_answer(engine.containers[path.split("/")[2]]))
            in_flight -= 1
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(held, held_path)
    shared = EngineClient(held_path, timeout_s=5)
    listing = asyncio.ensure_future(list_containers(shared))
    try:
        await asyncio.wait_for(all_slots_taken.wait(), 5)
        # the other slots are free: a lookup of someone else's goes through at once
        other = await asyncio.wait_for(shared.get("/containers/json?all=1", "to it"), 5)
        assert other is not None
        release.set()
        assert len(await listing) == 10
        assert most == INSPECTS_AT_ONCE
    finally:
        release.set()
        listing.cancel()
        await asyncio.gather(listing, return_exceptions=True)
        server.close()
        await server.wait_closed()


async def test_inspect_takes_ids_and_names_only(engine: FakeEngine) -> None:
    engine.add(cid(1), running=True)
    found = await inspect_container(client(engine), cid(1))
    assert found == Container(cid(1), True)
    for bad in ("../x", "", "a b", "x" * 200):
        with pytest.raises(ValueError, match="not a container id"):
            await inspect_container(client(engine), bad)
    assert engine.requests == [f"/containers/{cid(1)}/json"]
