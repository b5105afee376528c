"""The Docker engine's facts the agent keeps for the wrapper (agent.engines.facts), read by
the events follower as its stream opens and at each ``daemon reload``, and served by
``GET /engines/json``: against a fake engine on a unix socket."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from agent.api.engines import boot_id, engines_answer
from agent.engines.events import EVENTS_PATH, EVENTS_PATH_WITH_DAEMON, EngineEvents
from agent.engines.facts import EngineFacts, dockerd_version, is_reload, read_facts
from agent.engines.http import BadAnswer, EngineClient
from tests.support.fake_engine import FakeEngine, eventually, json_answer

VERSION = json_answer(
    {
        "Version": "26.1.5+dfsg1",
        "ApiVersion": "1.45",
        "Components": [{"Name": "Engine", "Version": "26.1.5+dfsg1"}],
    }
)
PODMAN_VERSION = json_answer(
    {"Version": "4.3.1", "Components": [{"Name": "Podman Engine", "Version": "4.3.1"}]}
)


ENGINE_ID = "5b0f3a4e-9d2c-4c1e-8f7a-2d6b1e0c9a37"


def info(dirs: object = ("/etc/cdi", "/var/run/cdi"), engine_id: object = ENGINE_ID) -> bytes:
    body: dict[str, object] = {"ServerVersion": "26.1.5+dfsg1", "Driver": "overlay2"}
    if engine_id is not ...:
        body["ID"] = engine_id
    if dirs is not ...:
        body["CDISpecDirs"] = list(dirs) if isinstance(dirs, tuple) else dirs
    return json_answer(body)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(tmp_path / "engine.sock")
    fake.answers["/version"] = VERSION
    fake.answers["/info"] = info()
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()


async def facts_of(engine: FakeEngine) -> EngineFacts:
    client = EngineClient(engine.socket_path)
    version = await dockerd_version(client)
    assert version is not None
    return await read_facts(client, version, clock=lambda: 1234.5)


async def test_the_version_and_the_cdi_spec_dirs(engine: FakeEngine) -> None:
    facts = await facts_of(engine)
    assert facts == EngineFacts("26.1.5+dfsg1", ("/etc/cdi", "/var/run/cdi"), 1234.5, ENGINE_ID)
    assert engine.requests == ["/version", "/info"]


@pytest.mark.parametrize("engine_id", [..., None, "", 7, "x" * 257])
async def test_an_id_dockerd_does_not_give_is_none(engine: FakeEngine, engine_id: object) -> None:
    engine.answers["/info"] = info(engine_id=engine_id)
    assert (await facts_of(engine)).engine_id is None


async def test_podman_s_service_is_no_dockerd(engine: FakeEngine) -> None:
    engine.answers["/version"] = PODMAN_VERSION
    assert await dockerd_version(EngineClient(engine.socket_path)) is None


@pytest.mark.parametrize(
    "dirs",
    [[], None, ...],
    ids=["empty: CDI off", "null: CDI off", "absent: before Docker 25"],
)
async def test_no_cdi_is_no_dirs(engine: FakeEngine, dirs: object) -> None:
    engine.answers["/info"] = info(dirs)
    assert (await facts_of(engine)).cdi_spec_dirs == ()


@pytest.mark.parametrize(
    ("path", "answer", "why"),
    [
        ("/version", json_answer({"ApiVersion": "1.45"}), "to GET /version: it names no Version"),
        ("/version", json_answer(["26.1.5"]), "to GET /version: it is not a JSON object"),
        ("/info", info("/etc/cdi"), "to GET /info: its CDISpecDirs is not a list of paths"),
        ("/info", info(("etc/cdi",)), "to GET /info: its CDISpecDirs is not a list of paths"),
        ("/info", info((7,)), "to GET /info: its CDISpecDirs is not a list of paths"),
    ],
)
async def test_an_answer_dockerd_does_not_give_is_one_line(
    engine: FakeEngine, path: str, answer: bytes, why: str
) -> None:
    engine.answers[path] = answer
    with pytest.raises(BadAnswer) as bad:
        await facts_of(engine)
    assert str(bad.value) == (
        f"the Docker engine at unix://{engine.socket_path} gave no usable answer {why}"
    )


def test_only_a_daemon_reload_is_a_reload() -> None:
    assert is_reload({"Type": "daemon", "Action": "reload", "Actor": {"ID": "X"}})
    assert is_reload({"Type": "daemon", "status": "reload"})
    assert not is_reload({"Type": "container", "Action": "reload"})
    assert not is_reload({"Type": "daemon", "Action": "start"})
    assert not is_reload(["daemon", "reload"])


def test_the_stream_with_facts_asks_for_daemon_events_too() -> None:
    path, _, query = EVENTS_PATH_WITH_DAEMON.partition("?filters=")
    assert path == "/events"
    assert json.loads(unquote(query)) == {"type": ["container", "daemon"]}


def reload_line() -> bytes:
    event = {"Type": "daemon", "Action": "reload", "Actor": {"ID": "D", "Attributes": {}}}
    return json.dumps(event).encode() + b"\n"


async def follow(engine: FakeEngine) -> EngineEvents:
    async def pause(_seconds: float) -> None:
        await asyncio.sleep(0.001)

    events = EngineEvents(
        EngineClient(engine.socket_path, timeout_s=5),
        lambda _kind, _id: None,
        lambda _containers: None,
        with_facts=True,
        sleep=pause,
    )
    events.start()
    return events


async def test_read_as_the_stream_opens_again_at_a_reload_and_gone_when_it_ends(
    engine: FakeEngine,
) -> None:
    events = await follow(engine)
    try:
        await eventually(lambda: events.following, "the stream open")
        assert events.facts is not None
        assert events.facts.cdi_spec_dirs == ("/etc/cdi", "/var/run/cdi")
        assert engine.requests[:3] == ["/version", EVENTS_PATH_WITH_DAEMON, "/info"]
        engine.answers["/info"] = info([])  # CDI turned off, then dockerd told to reload
        await engine.send(reload_line())
        await eventually(
            lambda: events.facts is not None and events.facts.cdi_spec_dirs == (),
            "the facts read again",
        )
        engine.answers["/info"] = info(("/srv/cdi",))
        await engine.stop()  # dockerd stopped: nothing is said until it is back
        await eventually(lambda: not events.following, "the stream ended")
        assert events.facts is None
        await engine.start()
        await eventually(lambda: events.following, "the stream open again")
        assert events.facts is not None
        assert events.facts.cdi_spec_dirs == ("/srv/cdi",)
    finally:
        await events.close()


async def test_podman_behind_the_docker_socket_is_followed_without_facts(
    engine: FakeEngine,
) -> None:
    engine.answers["/version"] = PODMAN_VERSION
    events = await follow(engine)
    try:
        await eventually(lambda: events.following, "the stream open")
        assert events.facts is None
        assert engine.requests[:2] == ["/version", EVENTS_PATH]  # no daemon events asked
        assert "/info" not in engine.requests
    finally:
        await events.close()


async def test_facts_it_cannot_read_are_none_and_the_events_go_on(
    engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    engine.answers["/info"] = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
    events = await follow(engine)
    try:
        await eventually(lambda: events.following, "the stream open")
        assert events.facts is None
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert warned == [
            f"the Docker engine at unix://{engine.socket_path} answered HTTP 500; the wrapper "
            "asks the engine itself whether it reads CDI"
        ]
    finally:
        await events.close()


async def test_the_route_says_them_only_while_the_engine_is_followed(
    engine: FakeEngine, tmp_path: Path
) -> None:
    events = await follow(engine)
    podman = EngineEvents(
        EngineClient(tmp_path / "no-podman.sock"), lambda _k, _i: None, lambda _c: None
    )
    try:
        await eventually(lambda: events.following, "the stream open")
        answer = engines_answer([events, podman], tmp_path / "gpu-docker.sock")
        assert answer["BootId"] == boot_id()
        assert answer["EngineSocket"] == str(tmp_path / "gpu-docker.sock")
        assert boot_id()
        assert answer["Engines"] == [
            {
                "Socket": str(engine.socket_path),
                "Following": True,
                "Version": "26.1.5+dfsg1",
                "CDISpecDirs": ["/etc/cdi", "/var/run/cdi"],
                "ReadAt": round(events.facts.read_s, 3) if events.facts else None,
                "ID": ENGINE_ID,
            },
            {
                "Socket": str(tmp_path / "no-podman.sock"),
                "Following": False,
                "Version": None,
                "CDISpecDirs": None,
                "ReadAt": None,
                "ID": None,
            },
        ]
    finally:
        await events.close()
    assert engines_answer([events])["EngineSocket"] is None
    assert engines_answer([events])["Engines"] == [
        {
            "Socket": str(engine.socket_path),
            "Following": False,
            "Version": None,
            "CDISpecDirs": None,
            "ReadAt": None,
            "ID": None,
        }
    ]
