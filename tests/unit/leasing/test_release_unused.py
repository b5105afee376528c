"""Releasing an unused lease (``DELETE /leases/{id}/pending``, docs/leases.md): what the
wrapper's watcher asks when docker ended before creating the container. Only a pending
lease that no container of the engines carries is released; the engines' lists are asked
first (a fake engine, tests.support.fake_engine), so a container whose create event was not
read yet binds the lease instead."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent.api.leases import LEASES, make_routes
from agent.engines.http import EngineClient
from agent.leases.answers import Granted, Refusal, Refused, Released
from agent.leases.asks import Ask
from agent.leases.holders import Lease, LeaseState
from agent.leases.labels import labels_for
from agent.leases.settings import LeaseSettings
from agent.leases.view import UnitState
from agent.leasing.engine_feed import EngineFeed
from agent.leasing.service import LeaseService
from tests.support.fake_engine import FakeEngine, eventually, json_answer
from tests.unit.leases.nodes import build_node, cid, healthy, leased_container

NODE = build_node([0, 0])
LABELLED = "/containers/json?all=1&filters="


@pytest.fixture
async def service() -> AsyncIterator[LeaseService]:
    leases = LeaseService.open(NODE, healthy(NODE), LeaseSettings(), None)
    yield leases
    await leases.close()


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(tmp_path / "docker.sock")
    # dockerd's list filtered by label: every container the fake has, as a list shows it
    # (the feed checks each one's label itself)
    fake.answers[LABELLED] = lambda: json_answer(
        [
            {"Id": c["Id"], "State": c["State"]["Status"], "Labels": c["Config"]["Labels"]}  # type: ignore[index]
            for c in fake.containers.values()
        ]
    )
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def feed(service: LeaseService, engine: FakeEngine) -> AsyncIterator[EngineFeed]:
    followed = EngineFeed(service)
    followed.follow(EngineClient(engine.socket_path, timeout_s=5), first_backoff_s=0.05)
    followed.start()
    await eventually(lambda: engine.streams_opened == 1, "the feed follows the events")
    await followed.drained()
    yield followed
    await followed.close()


async def granted(service: LeaseService) -> Lease:
    answer = await service.ask(Ask(count=1))
    assert isinstance(answer, Granted), answer
    return answer.lease


async def test_a_pending_lease_no_container_carries_is_released(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    lease = await granted(service)
    answer = await service.release_unused(lease.id)
    assert isinstance(answer, Released), answer
    assert service.lease(lease.id) is None
    assert service.view().unit("0").state is UnitState.FREE
    assert any(path.startswith(LABELLED) for path in engine.requests)
    again = await service.ask(Ask(count=2))  # every GPU is free again at once
    assert isinstance(again, Granted), again


async def test_a_bound_lease_is_kept(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    lease = await granted(service)
    service.created(leased_container(1, lease))
    answer = await service.release_unused(lease.id)
    assert isinstance(answer, Refused)
    assert answer.kind is Refusal.BOUND
    assert "stopped with container 0001abababab" in answer.text
    kept = service.lease(lease.id)
    assert kept is not None
    assert (kept.state, kept.container_id) == (LeaseState.STOPPED, cid(1))


async def test_a_container_whose_create_event_was_not_read_binds_the_lease(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    lease = await granted(service)
    engine.add(cid(2), labels=labels_for(lease))  # created; its event not sent yet
    answer = await service.release_unused(lease.id)
    assert isinstance(answer, Refused), answer
    assert answer.kind is Refusal.BOUND
    kept = service.lease(lease.id)
    assert kept is not None
    assert (kept.state, kept.container_id) == (LeaseState.STOPPED, cid(2))
    assert service.view().unit("0").state is not UnitState.FREE


async def test_a_container_with_another_leases_label_does_not_keep_it(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    first = await granted(service)
    second = await granted(service)
    engine.add(cid(3), labels=labels_for(first))
    answer = await service.release_unused(second.id)
    assert isinstance(answer, Released), answer
    assert service.lease(second.id) is None
    kept = service.lease(first.id)  # its container's create event binds it, when read
    assert kept is not None


async def test_a_lease_already_gone_is_unknown_and_changes_nothing(
    service: LeaseService, feed: EngineFeed
) -> None:
    lease = await granted(service)
    assert isinstance(service.release(lease.id), Released)
    other = await granted(service)
    answer = await service.release_unused(lease.id)
    assert isinstance(answer, Refused)
    assert answer.kind is Refusal.UNKNOWN_LEASE
    assert [x.id for x in service.view().leases] == [other.id]


async def test_an_engine_that_cannot_list_keeps_the_lease(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    lease = await granted(service)
    engine.answers[LABELLED] = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
    answer = await service.release_unused(lease.id)
    assert isinstance(answer, Refused)
    assert answer.kind is Refusal.UNCHECKED
    assert "answered HTTP 500" in answer.text
    kept = service.lease(lease.id)
    assert kept is not None
    assert kept.state is LeaseState.PENDING


async def test_an_engine_followed_before_that_does_not_answer_now_keeps_the_lease(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    # Podman's CLI creates containers while its API service (whose events tell them) is down
    (events,) = feed.engines()
    lease = await granted(service)
    await engine.stop()
    await eventually(lambda: not events.following, "the feed sees the engine go")
    answer = await service.release_unused(lease.id)
    assert isinstance(answer, Refused)
    assert answer.kind is Refusal.UNCHECKED
    assert "does not answer now (its events are not followed)" in answer.text
    kept = service.lease(lease.id)
    assert kept is not None
    assert kept.state is LeaseState.PENDING


async def test_an_engine_with_no_socket_and_not_followed_is_not_asked(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed, tmp_path: Path
) -> None:
    # a Docker-only node: the Podman socket the feed also follows does not exist
    podman = EngineFeed(service)
    podman.follow(EngineClient(tmp_path / "podman.sock", timeout_s=1), name="podman")
    lease = await granted(service)
    assert await podman.labelled(lease.id) == []
    answer = await service.release_unused(lease.id)
    assert isinstance(answer, Released), answer


# -- the route ---------------------------------------------------------------------------------


@pytest.fixture
async def client(service: LeaseService, feed: EngineFeed, aiohttp_client: Any) -> Any:
    app = web.Application()
    app[LEASES] = service
    for method, path, handler in make_routes():
        app.router.add_route(method, path, handler)
    return await aiohttp_client(app)


async def test_the_route_answers_200_409_404(
    service: LeaseService, engine: FakeEngine, client: Any
) -> None:
    grant = await client.post("/leases", json={"count": 1})
    body = await grant.json()
    assert grant.status == 201
    assert 59 <= body["PendingS"] <= 60  # what is left of the pending time
    resp = await client.delete("/leases/lease-1/pending")
    assert resp.status == 200
    assert (await resp.json())["Released"] == "lease-1"
    resp = await client.delete("/leases/lease-1/pending")
    assert resp.status == 404
    assert (await resp.json())["Refusal"] == "unknown_lease"
    lease = await granted(service)
    engine.add(cid(4), labels=labels_for(lease))
    resp = await client.delete(f"/leases/{lease.id}/pending")
    doc = json.loads(await resp.read())
    assert (resp.status, doc["Refusal"]) == (409, "bound")
    engine.answers[LABELLED] = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
    other = await granted(service)
    resp = await client.delete(f"/leases/{other.id}/pending")
    doc = json.loads(await resp.read())
    assert (resp.status, doc["Refusal"]) == (503, "unchecked")
