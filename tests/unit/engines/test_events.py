"""Container events followed: the parser (real lines of dockerd and Podman), the backoff,
and ``EngineEvents`` against a fake engine that goes away, comes back and misbehaves."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import pytest

from agent.engines.events import (
    EVENTS_PATH,
    Backoff,
    EngineEvent,
    EngineEvents,
    EventKind,
    event_of,
)
from agent.engines.http import MAX_LINE_BYTES, BadAnswer, EngineClient, parse_answer
from agent.leases.containers import Container
from tests.support.fake_engine import FakeEngine, chunk, event_line, eventually
from tests.support.fixture_files import ENGINES

CREATED, STARTED, DIED, DESTROYED = (
    EventKind.CREATED,
    EventKind.STARTED,
    EventKind.DIED,
    EventKind.DESTROYED,
)


def cid(n: int) -> str:
    return f"{n:064x}"


# -- the parser ------------------------------------------------------------------------------


def events_in(name: str) -> list[EngineEvent | None]:
    lines = (ENGINES / name).read_bytes().splitlines()
    return [event_of(parse_answer(line)) for line in lines]


def test_real_streams() -> None:
    """dockerd 20.10: create, start, kill, die, destroy; Podman 4.3 (its compatible API):
    create, init, start, kill, die, cleanup, remove."""
    docker = events_in("docker-20.10-events.jsonl")
    (docker_id,) = {e.container_id for e in docker if e is not None}
    assert docker == [
        EngineEvent(CREATED, docker_id),
        EngineEvent(STARTED, docker_id),
        None,  # kill
        EngineEvent(DIED, docker_id),
        EngineEvent(DESTROYED, docker_id),
    ]
    podman = events_in("podman-4.3-events.jsonl")
    (podman_id,) = {e.container_id for e in podman if e is not None}
    assert podman == [
        EngineEvent(CREATED, podman_id),
        None,  # init
        EngineEvent(STARTED, podman_id),
        None,  # kill
        EngineEvent(DIED, podman_id),
        None,  # cleanup
        EngineEvent(DESTROYED, podman_id),
    ]


@pytest.mark.parametrize(
    ("event", "read"),
    [
        ({"Type": "container", "Action": "start", "Actor": {"ID": cid(1)}}, (STARTED, cid(1))),
        ({"status": "die", "id": cid(2)}, (DIED, cid(2))),  # old engines: no Type, no Action
        ({"Type": "container", "status": "died", "id": cid(3)}, (DIED, cid(3))),
        ({"Action": "remove", "Actor": {"ID": cid(4)}, "id": cid(5)}, (DESTROYED, cid(4))),
        ({"Action": "destroy", "Actor": {"ID": 5}, "id": cid(5)}, (DESTROYED, cid(5))),
        ({"Type": "network", "Action": "create", "Actor": {"ID": cid(1)}}, None),
        ({"Type": "container", "Action": "exec_start: sh -c x", "id": cid(1)}, None),
        ({"Type": "container", "Action": "health_status: healthy", "id": cid(1)}, None),
        ({"Type": "container", "Action": "rename", "id": cid(1)}, None),
        ({"Type": "container", "Action": 5, "status": "stop", "id": cid(1)}, None),
        ({"Type": "container"}, None),
    ],
)
def test_each_event(event: dict[str, object], read: tuple[EventKind, str] | None) -> None:
    assert event_of(event) == (None if read is None else EngineEvent(*read))


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ([1], "a line of it is not a JSON object (an event)"),
        ("start", "a line of it is not a JSON object (an event)"),
        ({"Action": "start"}, "one of its start events has no 64-hex container id"),
        ({"Action": "die", "id": "../../x"}, "one of its die events has no 64-hex container id"),
        (
            {"Action": "create", "id": "AB" * 32},
            "one of its create events has no 64-hex container id",
        ),
    ],
)
def test_what_is_no_event(value: object, why: str) -> None:
    with pytest.raises(BadAnswer) as refused:
        event_of(value, "stream")
    assert str(refused.value).startswith(f"stream: {why}")


def test_the_filter_asks_for_container_events() -> None:
    path, _, query = EVENTS_PATH.partition("?filters=")
    assert path == "/events"
    assert json.loads(unquote(query)) == {"type": ["container"]}
    assert query.isalnum() or set(query) <= set("%0123456789ABCDEFabcdefghijklmnopqrstuvwxyz")


def test_backoff() -> None:
    backoff = Backoff()
    assert [backoff.next_s() for _ in range(9)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    backoff.reset()
    assert backoff.next_s() == 0.5
    with pytest.raises(ValueError, match="backoff"):
        Backoff(0, 1)
    with pytest.raises(ValueError, match="backoff"):
        Backoff(2, 1)


# -- following a fake engine -----------------------------------------------------------------


@dataclass
class Calls:
    """What the callbacks got, in order: ("resync", ids) and (kind, id)."""

    seen: list[tuple[str, object]] = field(default_factory=list)
    fail_on: Callable[[str, object], bool] = lambda _kind, _what: False

    def on_event(self, kind: EventKind, container_id: str) -> None:
        self.seen.append((kind.value, container_id))
        if self.fail_on(kind.value, container_id):
            raise RuntimeError("table said\nno")

    def on_resync(self, containers: list[Container]) -> None:
        ids = tuple(c.id for c in containers)
        self.seen.append(("resync", ids))
        if self.fail_on("resync", ids):
            raise KeyError("resync")

    def resyncs(self) -> list[object]:
        return [what for kind, what in self.seen if kind == "resync"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Following:
    engine: FakeEngine
    events: EngineEvents
    calls: Calls
    pauses: list[float]
    clock: Clock


@pytest.fixture
async def following(tmp_path: Path) -> AsyncIterator[Following]:
    """An EngineEvents of a fake engine (started), whose pauses are recorded, not waited."""
    engine = FakeEngine(tmp_path / "engine.sock")
    await engine.start()
    calls = Calls()
    pauses: list[float] = []
    clock = Clock()

    async def pause(seconds: float) -> None:
        pauses.append(seconds)
        await asyncio.sleep(0.001)

    events = EngineEvents(
        EngineClient(engine.socket_path, timeout_s=5),
        calls.on_event,
        calls.on_resync,
        clock=clock,
        sleep=pause,
    )
    try:
        yield Following(engine, events, calls, pauses, clock)
    finally:
        await events.close()
        await engine.stop()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def infos(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]


async def test_resync_first_then_the_events_in_order(following: Following) -> None:
    engine, calls = following.engine, following.calls
    engine.add(cid(1), running=True)
    following.events.start()
    await eventually(lambda: following.events.following, "the stream open")
    for action in ("create", "start", "kill", "die", "destroy"):
        await engine.send(event_line(action, cid(2)))
    await engine.send(event_line("create", cid(3)) + event_line("start", cid(3)))  # one chunk
    await eventually(lambda: len(calls.seen) == 7, "every followed event")
    assert calls.seen == [
        ("resync", (cid(1),)),
        ("created", cid(2)),
        ("started", cid(2)),
        ("died", cid(2)),
        ("destroyed", cid(2)),
        ("created", cid(3)),
        ("started", cid(3)),
    ]
    assert engine.requests[:2] == [EVENTS_PATH, "/containers/json?all=1"]


async def test_an_event_while_the_list_is_read_comes_after_the_resync(
    following: Following,
) -> None:
    """The stream is open before the list is asked: what happens meanwhile is not lost."""
    engine, calls = following.engine, following.calls
    line = event_line("create", cid(9))
    engine.on_stream = lambda writer: writer.write(chunk(line))
    following.events.start()
    await eventually(lambda: len(calls.seen) == 2, "the resync and the event")
    assert calls.seen == [("resync", ()), ("created", cid(9))]


async def test_an_engine_down_at_start_and_back(
    following: Following, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    engine, calls, pauses = following.engine, following.calls, following.pauses
    await engine.stop()
    following.events.start()
    await eventually(lambda: len(pauses) >= 9, "nine attempts")
    assert pauses[:9] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert calls.seen == []
    engine.add(cid(1))
    await engine.start()
    await eventually(lambda: following.events.following, "the stream open")
    assert calls.resyncs() == [(cid(1),)]
    assert warnings(caplog) == [
        f"Cannot follow container events: cannot reach the Docker engine at "
        f"unix://{engine.socket_path}: [Errno 2] No such file or directory; trying again "
        "every 0.5 s, up to every 30 s (the containers are resynced when the events follow "
        "again)"
    ]
    assert infos(caplog) == [
        f"The Docker engine at unix://{engine.socket_path} answers again: following its "
        "container events (resynced with 1 container)"
    ]
    assert all(r.exc_info is None for r in caplog.records)


async def test_a_restart_is_two_lines_and_a_resync(
    following: Following, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine stops (its stream ends), is away a while, comes back with the containers:
    one line when the events stop, one when they follow again, a resync; the backoff starts
    from the first pause again after a stream that stayed open long enough."""
    caplog.set_level(logging.INFO)
    engine, calls, pauses, clock = (
        following.engine,
        following.calls,
        following.pauses,
        following.clock,
    )
    engine.add(cid(1), running=True)
    following.events.start()
    await eventually(lambda: following.events.following, "the stream open")
    assert infos(caplog) == [
        f"Following the container events of the Docker engine at unix://{engine.socket_path} "
        "(1 container)"
    ]
    clock.now += 5  # a short-lived stream: its end counts as a failure
    await engine.end_streams()
    await eventually(lambda: engine.streams_opened == 2, "the stream reopened")
    await eventually(lambda: following.events.following, "the stream open again")
    await engine.stop()  # away: attempts fail, doubling
    await eventually(lambda: len(pauses) >= 4, "three more attempts")
    engine.add(cid(2))
    await engine.start()
    await eventually(lambda: engine.streams_opened == 3, "the stream reopened")
    await eventually(lambda: following.events.following, "the stream open again")
    clock.now += 30  # this one stays open long enough: the backoff starts again
    await engine.end_streams()
    await eventually(lambda: engine.streams_opened == 4, "the stream reopened")
    await eventually(lambda: following.events.following, "the stream open again")
    assert pauses[:2] == [0.5, 1]
    assert pauses[-1] == 0.5
    assert calls.resyncs() == [(cid(1),), (cid(1),), (cid(1), cid(2)), (cid(1), cid(2))]
    lines = warnings(caplog)
    where = f"the Docker engine at unix://{engine.socket_path}"
    assert lines[0].startswith(f"Container events stopped: {where} ended its event stream; ")
    assert len(lines) == 3  # one per outage (the second one failed many times, said once)
    assert len(infos(caplog)) == 4  # following, then back three times
    assert all(r.exc_info is None for r in caplog.records)


async def test_a_line_it_may_not_send_reopens_the_stream(
    following: Following, caplog: pytest.LogCaptureFixture
) -> None:
    engine, calls = following.engine, following.calls
    following.events.start()
    await eventually(lambda: following.events.following, "the stream open")
    for n, bad in enumerate(
        [
            b"x" * (MAX_LINE_BYTES + 1) + b"\n",
            b"[" * 40 + b"]" * 40 + b"\n",
            b"not json\n",
            json.dumps({"Action": "start", "id": "x"}).encode() + b"\n",
        ],
        start=2,
    ):
        await engine.send(bad)
        await eventually(lambda: engine.streams_opened == n, f"stream {n}")  # noqa: B023
        await eventually(lambda: following.events.following, "the stream open again")
    await engine.send(event_line("start", cid(1)))
    await eventually(lambda: calls.seen[-1] == ("started", cid(1)), "the next event")
    assert len(calls.resyncs()) == 5
    whys = [line.partition("event stream: ")[2].partition(";")[0] for line in warnings(caplog)]
    assert whys == [
        "a line of it is longer than 64 KiB",
        "its JSON nests deeper than 32 levels",
        "it is not valid JSON (line 1, column 1)",
        "one of its start events has no 64-hex container id",
    ]


async def test_a_failing_callback_is_one_line_and_the_stream_goes_on(
    following: Following, caplog: pytest.LogCaptureFixture
) -> None:
    engine, calls = following.engine, following.calls
    calls.fail_on = lambda kind, what: kind in ("created", "resync")
    following.events.start()
    await eventually(lambda: following.events.following, "the stream open")
    for n in range(3):
        await engine.send(event_line("create", cid(n)))
    await engine.send(event_line("start", cid(0)))
    await eventually(lambda: len(calls.seen) == 5, "every event")
    kinds = [kind for kind, _ in calls.seen]
    assert kinds == ["resync", "created", "created", "created", "started"]
    assert engine.streams_opened == 1  # the stream went on
    where = f"the Docker engine at unix://{engine.socket_path}"
    assert (
        warnings(caplog)
        == [  # one line per kind of callback and interval
            f"Handling the resync with 0 containers of {where} failed (KeyError: 'resync'); "
            "following the next events",
            f"Handling the created event of container {cid(0)[:12]} of {where} failed "
            r"(RuntimeError: table said\x0ano); following the next events",
        ]
    )
    assert all(r.exc_info is None for r in caplog.records if r.levelno >= logging.WARNING)


async def test_a_list_that_fails_is_an_outage(
    following: Following, caplog: pytest.LogCaptureFixture
) -> None:
    """No resync, no events: the stream is closed and opened again until the list works."""
    engine, calls = following.engine, following.calls
    engine.add(cid(1))
    engine.answers["/containers/json"] = b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n"
    following.events.start()
    await eventually(lambda: engine.streams_opened >= 3, "three attempts")
    assert calls.seen == []
    assert not following.events.following
    del engine.answers["/containers/json"]
    await eventually(lambda: following.events.following, "the stream open")
    assert calls.resyncs() == [(cid(1),)]
    (line,) = warnings(caplog)
    assert "answered HTTP 500; trying again" in line


async def test_close_ends_the_stream_and_the_callbacks(following: Following) -> None:
    engine, calls = following.engine, following.calls
    following.events.start()
    following.events.start()  # once only
    await eventually(lambda: following.events.following, "the stream open")
    assert engine.streams_opened == 1
    await following.events.close()
    await eventually(lambda: not engine.streams, "the engine sees the stream closed")
    await engine.send(event_line("create", cid(1)))  # to no stream: none is open
    assert calls.seen == [("resync", ())]
    assert not following.events.following
    await following.events.close()  # twice: nothing more
