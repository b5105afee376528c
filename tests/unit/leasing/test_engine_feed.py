"""The engine feed: container events of fake engines (tests.support.fake_engine) applied to
a lease service in order; a flood of events dropped and replaced by one list."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.engines.events import EventKind
from agent.engines.http import EngineClient, EngineError
from agent.gpu.model import NodeInfo
from agent.leases.answers import Granted, Refused
from agent.leases.asks import Ask
from agent.leases.containers import Container
from agent.leases.holders import Lease, LeaseState
from agent.leases.labels import labels_for, read_label
from agent.leases.settings import LeaseSettings
from agent.leases.view import UnitState
from agent.leasing.engine_feed import CREATED_INSPECT_S, MAX_QUEUED, EngineFeed
from agent.leasing.service import LeaseService
from tests.support.fake_engine import FakeEngine, event_line, eventually, json_answer
from tests.unit.leases.nodes import build_node, cid, healthy

LOGGER = "nvidia-docker-plugin.leases"
NODE = build_node([0, 0])


@pytest.fixture
async def service() -> AsyncIterator[LeaseService]:
    leases = LeaseService.open(NODE, healthy(NODE), LeaseSettings(), None)
    yield leases
    await leases.close()


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(tmp_path / "docker.sock")
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def feed(service: LeaseService) -> AsyncIterator[EngineFeed]:
    followed = EngineFeed(service)
    yield followed
    await followed.close()


def client(engine: FakeEngine) -> EngineClient:
    return EngineClient(engine.socket_path, timeout_s=5)


async def granted(service: LeaseService, count: int = 1) -> Lease:
    answer = await service.ask(Ask(count=count))
    assert isinstance(answer, Granted), answer
    return answer.lease


def state_of(service: LeaseService, lease: Lease) -> tuple[LeaseState, str | None] | None:
    now = service.lease(lease.id)
    return None if now is None else (now.state, now.container_id)


async def test_created_and_started_bind_the_lease_destroyed_frees_it(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    lease = await granted(service)
    feed.follow(client(engine), first_backoff_s=0.05)
    feed.start()
    await eventually(lambda: engine.streams_opened == 1, "the feed follows the events")
    await feed.drained()

    engine.add(cid(1), labels=labels_for(lease))
    await engine.send(event_line("create", cid(1)))
    await eventually(
        lambda: state_of(service, lease) == (LeaseState.STOPPED, cid(1)), "created binds"
    )
    engine.add(cid(1), running=True, labels=labels_for(lease))
    await engine.send(event_line("start", cid(1)))
    await eventually(
        lambda: state_of(service, lease) == (LeaseState.RUNNING, cid(1)), "started runs it"
    )
    await engine.send(event_line("die", cid(1)))
    await eventually(
        lambda: state_of(service, lease) == (LeaseState.STOPPED, cid(1)), "died stops it"
    )
    del engine.containers[cid(1)]
    await engine.send(event_line("destroy", cid(1)))
    await eventually(lambda: service.lease(lease.id) is None, "destroyed ends it")
    assert service.view().unit("0").state is UnitState.FREE
    assert f"/containers/{cid(1)}/json" in engine.requests  # inspected for its labels


async def test_a_created_container_that_is_starting_is_bound_from_the_list_at_once(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    """dockerd holds a container while it starts, and an inspect waits for that (seconds,
    with a slow runtime hook): the created event's inspect gives up after
    CREATED_INSPECT_S, the list (which dockerd answers at once) binds the lease, and the
    events behind it (another container removed) are not held up for the client's 5 s."""
    lease, other = await granted(service), await granted(service)
    feed.follow(client(engine), first_backoff_s=0.05)
    feed.start()
    await eventually(lambda: engine.streams_opened == 1, "the feed follows the events")
    engine.add(cid(2), running=True, labels=labels_for(other))
    await engine.send(event_line("create", cid(2)) + event_line("start", cid(2)))
    await eventually(lambda: state_of(service, other) == (LeaseState.RUNNING, cid(2)), "bound")

    inspect = f"/containers/{cid(1)}/json"
    engine.answers[inspect] = b""  # no answer while the start holds the container
    engine.hold_open.add(inspect)
    engine.answers["/containers/json?all=1&filters="] = json_answer(
        [{"Id": cid(1), "Names": ["/starting"], "State": "created", "Labels": labels_for(lease)}]
    )
    del engine.containers[cid(2)]
    loop = asyncio.get_running_loop()
    began = loop.time()
    await engine.send(event_line("create", cid(1)) + event_line("destroy", cid(2)))
    await eventually(lambda: service.lease(other.id) is None, "the removed one's lease ended")
    took_s = loop.time() - began
    assert state_of(service, lease) == (LeaseState.STOPPED, cid(1))  # bound by the list
    assert CREATED_INSPECT_S <= took_s < CREATED_INSPECT_S + 1.0
    assert inspect in engine.requests


async def test_a_created_container_neither_inspect_nor_list_tells_waits_for_its_start(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed, caplog: pytest.LogCaptureFixture
) -> None:
    """Podman's list waits for a starting container as its inspect does: the created event
    is left to the start event (no warning), which binds the lease."""
    lease = await granted(service)
    feed.follow(EngineClient(engine.socket_path, timeout_s=1), first_backoff_s=0.05)
    feed.start()
    await eventually(lambda: engine.streams_opened == 1, "the feed follows the events")
    inspect, listed = f"/containers/{cid(1)}/json", "/containers/json?all=1&filters="
    for path in (inspect, listed):
        engine.answers[path] = b""
        engine.hold_open.add(path)
    await engine.send(event_line("create", cid(1)))
    await eventually(lambda: engine.requests.count(listed) == 0 and any(
        r.startswith(listed) for r in engine.requests), "the list asked")  # fmt: skip
    await eventually(lambda: feed.applied >= 2, "the created event applied", timeout_s=5)
    assert state_of(service, lease) == (LeaseState.PENDING, None)
    for path in (inspect, listed):
        del engine.answers[path]
    engine.add(cid(1), running=True, labels=labels_for(lease))
    await engine.send(event_line("start", cid(1)))
    await eventually(lambda: state_of(service, lease) == (LeaseState.RUNNING, cid(1)), "started")
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


async def test_a_container_without_lease_labels_binds_nothing(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    lease = await granted(service)
    feed.follow(client(engine), first_backoff_s=0.05)
    feed.start()
    await eventually(lambda: engine.streams_opened == 1, "the feed follows the events")
    engine.add(cid(2), labels={"maintainer": "someone"})
    await engine.send(event_line("create", cid(2)))
    await eventually(lambda: feed.applied >= 2, "the event is applied")
    await feed.drained()
    assert state_of(service, lease) == (LeaseState.PENDING, None)


async def test_the_first_list_binds_the_leases_of_existing_containers(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    lease = await granted(service)
    engine.add(cid(1), running=True, labels=labels_for(lease))
    feed.follow(client(engine), first_backoff_s=0.05)
    feed.start()
    await eventually(
        lambda: state_of(service, lease) == (LeaseState.RUNNING, cid(1)), "the resync binds"
    )


async def test_one_engines_resync_keeps_the_other_engines_leases(
    service: LeaseService, tmp_path: Path, feed: EngineFeed
) -> None:
    docker, podman = FakeEngine(tmp_path / "docker.sock"), FakeEngine(tmp_path / "podman.sock")
    await docker.start()
    await podman.start()
    try:
        lease = await granted(service)
        podman.add(cid(7), running=True, labels=labels_for(lease))
        feed.follow(client(docker), first_backoff_s=0.05)
        feed.follow(client(podman), first_backoff_s=0.05)
        feed.start()
        await eventually(
            lambda: state_of(service, lease) == (LeaseState.RUNNING, cid(7)), "podman's binds"
        )
        await eventually(lambda: docker.streams_opened == 1, "docker followed")
        await docker.end_streams()  # docker restarts: its stream reopens, it lists again
        await eventually(lambda: docker.streams_opened == 2, "docker followed again")
        await eventually(lambda: feed.applied >= 3, "docker's second resync applied")
        await feed.drained()
        assert state_of(service, lease) == (LeaseState.RUNNING, cid(7))
    finally:
        await feed.close()
        await docker.stop()
        await podman.stop()


async def test_an_engines_containers_carry_its_name_its_socket_path(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    lease = await granted(service)
    feed.follow(client(engine), first_backoff_s=0.05)
    with pytest.raises(ValueError, match="two engines named"):
        feed.follow(client(engine))
    feed.start()
    await eventually(lambda: engine.streams_opened == 1, "the feed follows the events")
    engine.add(cid(1), running=True, labels=labels_for(lease))
    await engine.send(event_line("start", cid(1)))
    await eventually(lambda: state_of(service, lease) == (LeaseState.RUNNING, cid(1)), "runs")
    bound = service.lease(lease.id)
    assert bound is not None
    assert bound.engine == str(engine.socket_path)


async def test_an_agent_restarted_while_podman_is_absent_keeps_podmans_leases_till_it_lists(
    tmp_path: Path,
) -> None:
    """The agent runs with Docker and Podman, and is restarted (its state file written after
    its last change, as a kill -9 leaves it) while Podman's API service is down, its socket
    gone. Docker lists at once: Podman's containers keep their
    leases, their GPUs are not leased again. Podman's service comes back: its list ends the
    lease of its container removed meanwhile, and only that one."""
    node = build_node([0, 0, 0])
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    docker, podman = FakeEngine(tmp_path / "docker.sock"), FakeEngine(tmp_path / "podman.sock")

    await docker.start()
    await podman.start()
    try:
        await _restart_while_podman_is_absent(node, state_dir, docker, podman)
    finally:
        await docker.stop()
        await podman.stop()


async def _restart_while_podman_is_absent(
    node: NodeInfo, state_dir: Path, docker: FakeEngine, podman: FakeEngine
) -> None:
    first = LeaseService.open(node, healthy(node), LeaseSettings(), state_dir)
    feed = EngineFeed(first)
    try:
        leases = [await granted(first) for _ in range(3)]
        docker.add(cid(1), running=True, labels=labels_for(leases[0]))
        podman.add(cid(2), running=True, labels=labels_for(leases[1]))
        podman.add(cid(3), running=True, labels=labels_for(leases[2]))
        feed.follow(client(docker), first_backoff_s=0.05)
        feed.follow(client(podman), first_backoff_s=0.05)
        feed.start()
        await eventually(
            lambda: (
                [state_of(first, x) for x in leases]
                == [(LeaseState.RUNNING, cid(n)) for n in (1, 2, 3)]
            ),
            "the three leases bound",
        )
        await first.settled()
    finally:
        await feed.close()
        await first.close()
    await podman.stop()  # its service down, its socket gone; its containers live on
    del podman.containers[cid(3)]  # removed meanwhile (podman rm, no service to tell)

    again = LeaseService.open(node, healthy(node), LeaseSettings(), state_dir)
    feed = EngineFeed(again)
    try:
        feed.follow(client(docker), first_backoff_s=0.05)
        podmans = feed.follow(client(podman), first_backoff_s=0.05, most_backoff_s=0.1)
        feed.start()
        await eventually(lambda: docker.streams_opened == 2, "docker followed again")
        await eventually(lambda: feed.applied >= 1, "docker's list applied")
        await feed.drained()
        assert not podman.socket_path.exists()
        assert [state_of(again, x) for x in leases] == [
            (LeaseState.RUNNING, cid(n)) for n in (1, 2, 3)
        ]
        refused = await again.ask(Ask(count=1))
        assert isinstance(refused, Refused)
        assert f"by container {cid(3)[:12]} ({leases[2].id})" in refused.text

        await podman.start()
        await eventually(lambda: podmans.following, "podman listed once it answers")
        await feed.drained()
        assert [state_of(again, x) for x in leases] == [
            (LeaseState.RUNNING, cid(1)),
            (LeaseState.RUNNING, cid(2)),
            None,
        ]
        assert [u.state for u in again.view().units] == [
            UnitState.LEASED,
            UnitState.LEASED,
            UnitState.FREE,
        ]
    finally:
        await feed.close()
        await again.close()


async def test_a_lease_of_an_engine_not_followed_waits_for_an_engines_list(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    """A lease bound to a container of another engine name (an agent restarted with another
    socket path): unknown at start; the engine that lists the container takes it up."""
    lease = await granted(service)
    service.started(
        Container(cid(1), True, read_label(labels_for(lease)), engine="/var/run/docker.sock")
    )
    engine.add(cid(1), running=True, labels=labels_for(lease))
    events = feed.follow(client(engine), first_backoff_s=0.05)
    feed.start()
    after_start = service.lease(lease.id)
    assert after_start is not None
    assert after_start.engine is None  # followed: not an engine of this feed
    await eventually(lambda: events.following, "the engine listed")
    await feed.drained()
    listed = service.lease(lease.id)
    assert listed is not None
    assert (listed.state, listed.engine) == (LeaseState.RUNNING, str(engine.socket_path))


async def test_a_container_gone_before_its_inspect_is_left_to_its_destroy(
    service: LeaseService, engine: FakeEngine, feed: EngineFeed
) -> None:
    lease = await granted(service)
    feed.follow(client(engine), first_backoff_s=0.05)
    feed.start()
    await eventually(lambda: engine.streams_opened == 1, "the feed follows the events")
    await engine.send(event_line("create", cid(3)))  # not in the engine any more: 404
    await engine.send(event_line("destroy", cid(3)))
    await eventually(lambda: feed.applied >= 3, "both events applied")
    await feed.drained()
    assert state_of(service, lease) == (LeaseState.PENDING, None)


async def test_an_inspect_that_fails_is_one_line_and_the_feed_goes_on(
    service: LeaseService, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    lease = await granted(service)
    calls: list[str] = []

    async def inspect(
        engine: EngineClient, container_id: str, *, timeout_s: float | None = None
    ) -> Container | None:
        calls.append(container_id)
        if len(calls) == 1:
            raise EngineError("the engine went away")
        return Container(container_id, False, None)

    fake = FakeEngine(tmp_path / "e.sock")
    feed = EngineFeed(service, inspect=inspect)
    events = feed.follow(EngineClient(fake.socket_path, timeout_s=1))
    events.on_event(EventKind.CREATED, cid(1))
    events.on_event(EventKind.CREATED, cid(2))
    try:
        _start_queue_only(feed)
        await asyncio.wait_for(feed.drained(), 5)
    finally:
        await feed.close()
    assert calls == [cid(1), cid(2)]
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1
    assert "not inspected" in warnings[0]
    assert cid(1)[:12] in warnings[0]
    assert state_of(service, lease) == (LeaseState.PENDING, None)


def _start_queue_only(feed: EngineFeed) -> None:
    """Start the feed's task but not the event streams (the test calls the callbacks)."""
    streams = feed._events
    feed._events = []
    try:
        feed.start()
    finally:
        feed._events = streams


async def test_a_burst_over_the_bound_is_dropped_and_relisted(
    service: LeaseService,
    engine: FakeEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """More events than MAX_QUEUED before any is applied: the queue does not grow past the
    bound, the events are dropped and the containers listed once instead, and what the list
    says (here: a leased container that runs) is what the table holds."""
    lease = await granted(service)
    inspected: list[str] = []

    async def inspect(
        engine: EngineClient, container_id: str, *, timeout_s: float | None = None
    ) -> Container | None:
        inspected.append(container_id)
        return None  # gone

    feed = EngineFeed(service, inspect=inspect)
    events = feed.follow(client(engine))
    engine.add(cid(1), running=True, labels=labels_for(lease))
    sizes = []
    for n in range(MAX_QUEUED + 10):
        events.on_event(EventKind.CREATED, f"{n:064x}")
        sizes.append(feed._queue.qsize())
    assert max(sizes) <= MAX_QUEUED
    try:
        _start_queue_only(feed)
        await asyncio.wait_for(feed.drained(), 10)
    finally:
        await feed.close()
    assert engine.requests.count("/containers/json?all=1") == 1
    assert len(inspected) < 20  # the events after the drop, not the thousands before
    (warning,) = [r.getMessage() for r in caplog.records if "faster" in r.getMessage()]
    assert warning.startswith(f"Leases: {MAX_QUEUED} container events")
    assert state_of(service, lease) == (LeaseState.RUNNING, cid(1))


async def test_a_relist_that_fails_is_one_line(
    service: LeaseService, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    lease = await granted(service)

    async def inspect(
        engine: EngineClient, container_id: str, *, timeout_s: float | None = None
    ) -> Container | None:
        return None

    gone = FakeEngine(tmp_path / "gone.sock")  # never started: nothing answers
    feed = EngineFeed(service, inspect=inspect)
    events = feed.follow(EngineClient(gone.socket_path, timeout_s=1))
    for n in range(MAX_QUEUED + 1):
        events.on_event(EventKind.DIED, f"{n:064x}")
    try:
        _start_queue_only(feed)
        await asyncio.wait_for(feed.drained(), 10)
    finally:
        await feed.close()
    lines = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert any("not listed" in r.getMessage() for r in lines)
    assert state_of(service, lease) == (LeaseState.PENDING, None)  # nothing ended by it


# -- an engine whose socket refuses the agent -------------------------------------------------


@pytest.fixture
def refused_sockets(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Socket paths whose connect fails with EACCES, as for an agent outside the socket's
    group (root, as the tests run, passes by any file mode)."""
    refused: set[str] = set()
    connect = asyncio.open_unix_connection

    async def open_unix_connection(
        path: str, **kwargs: object
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if str(path) in refused:
            raise PermissionError(13, "Permission denied")
        return await connect(path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncio, "open_unix_connection", open_unix_connection)
    return refused


async def ask_once(service: LeaseService) -> Granted | Refused:
    answer = await service.ask(Ask(count=1))
    if isinstance(answer, Granted):
        service.release(answer.lease.id)
    return answer


@pytest.mark.parametrize(
    ("docker", "podman", "refused_by"),
    [
        ("refused", "absent", "docker"),  # the packaged unit's user outside Docker's group
        ("refused", "followed", "docker"),  # the wrapper, Compose, the engine socket: Docker
        ("followed", "refused", None),  # root Podman's socket: its starts ask the start hook
        ("absent", "refused", "podman"),  # a Podman-only node
        ("absent", "absent", None),  # engines down create nothing: their lists resync
    ],
)
async def test_leases_are_refused_while_the_engine_they_follow_refuses_the_agent(
    tmp_path: Path,
    service: LeaseService,
    feed: EngineFeed,
    refused_sockets: set[str],
    docker: str,
    podman: str,
    refused_by: str | None,
) -> None:
    engines: dict[str, EngineClient] = {}
    fakes: list[FakeEngine] = []
    for name, how in (("docker", docker), ("podman", podman)):
        path = tmp_path / f"{name}.sock"
        if how == "followed":
            fake = FakeEngine(path)
            await fake.start()
            fakes.append(fake)
        elif how == "refused":
            refused_sockets.add(str(path))
        engines[name] = EngineClient(path, timeout_s=5)
    try:
        followed = [feed.follow(engines["docker"]), feed.follow(engines["podman"])]
        feed.start()
        await eventually(
            lambda: (
                all(
                    e.following or e.denied is not None or not e.engine.socket_path.exists()
                    for e in followed
                )
                and (docker != "refused" or followed[0].denied is not None)
                and (podman != "refused" or followed[1].denied is not None)
            ),
            "every engine tried once",
        )
        answer = await ask_once(service)
        if refused_by is None:
            assert isinstance(answer, Granted), answer
        else:
            assert isinstance(answer, Refused), answer
            assert answer.kind.value == "no_engine_access"
            where = engines[refused_by].socket_path
            assert answer.text.startswith("no GPU leases: the agent cannot reach ")
            assert f"unix://{where}: [Errno 13] Permission denied" in answer.text
            assert not service.view().leases  # nothing changed
            refused_sockets.clear()  # the operator mends the group: the engine is down now
            await eventually(lambda: all(e.denied is None for e in followed), "the next attempts")
            assert isinstance(await ask_once(service), Granted)
    finally:
        for fake in fakes:
            await fake.stop()
