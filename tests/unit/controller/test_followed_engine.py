"""``followed_engine``: a lease is asked only for a container of a Docker engine that the
node's agent follows (docs/leases.md, "How it fails safe").

The engine behind the wrapper's socket is ``FakeEngine`` (what dockerd answers to
``GET /info``); the agent's word is a ``GET /engines/json`` answer as the agent gives it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controller.wrapper.followed_engine import engine_followed, refusal
from controller.wrapper.leases import LeaseAsk
from tests.support.fake_engine import FakeEngine, json_answer

BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
OTHER_ID = "5b0f3a4e-9d2c-4c1e-8f7a-2d6b1e0c9a37"  # the dockerd the agent follows
USERS_ID = "0e1d2c3b-4a59-4687-9a1b-c2d3e4f5a6b7"  # the user's own dockerd


@pytest.fixture
async def users_engine(tmp_path: Path) -> AsyncIterator[FakeEngine]:
    """The dockerd the user's docker CLI asks (rootless Docker's, say), not the agent's."""
    engine = FakeEngine(tmp_path / "user-docker.sock")
    engine.answers["/info"] = json_answer({"ID": USERS_ID, "ServerVersion": "28.0.1"})
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


PODMAN = "/run/podman/podman.sock"


def agents_answer(
    docker: Path, engine_id: str | None = OTHER_ID, *, boot_id: str = BOOT_ID, **extra: object
) -> dict[str, object]:
    """``GET /engines/json`` of an agent following the dockerd at ``docker``, and Podman's
    service (``PODMAN``), which it does not reach."""
    return {
        "BootId": boot_id,
        "Engines": [
            {"Socket": str(docker), "Following": True, "Version": "26.1.5", "ID": engine_id},
            {"Socket": PODMAN, "Following": False, "Version": None, "ID": None},
        ],
        "EngineSocket": None,
        **extra,
    }


async def followed(answer: object, engine: FakeEngine) -> bool | None:
    return await asyncio.to_thread(engine_followed, answer, str(engine.socket_path))


async def test_another_dockerd_than_the_agents_is_not_followed(
    users_engine: FakeEngine, tmp_path: Path
) -> None:
    agents = tmp_path / "docker.sock"
    agents.touch()
    podman = tmp_path / "podman.sock"
    podman.touch()
    answer = agents_answer(agents)
    answer["Engines"][1]["Socket"] = str(podman)  # type: ignore[index]
    answer["Engines"].append(  # type: ignore[attr-defined]
        {"Socket": str(tmp_path / "no-podman.sock"), "Following": False}  # not there: unsaid
    )
    assert await followed(answer, users_engine) is False
    assert users_engine.requests == ["/info"]
    line = refusal(LeaseAsk("NV_GPU=auto:1"), str(users_engine.socket_path), answer)
    assert line == (
        "NV_GPU=auto:1 asks for a GPU lease, but docker runs its containers on the engine at "
        f"unix://{users_engine.socket_path}, which the node's agent does not follow (it follows "
        f"{agents} and {podman}), so the lease would end as soon as docker "
        "returns and its GPUs would go to the next ask: use the engine the agent follows "
        f"(DOCKER_HOST=unix://{agents}), have the agent follow this one (nvidia-docker-plugin "
        f"--docker-socket {users_engine.socket_path}), or name GPUs without a lease (NV_GPU=0,1, "
        "and no --gpus)"
    )


async def test_the_agents_own_socket_is_followed_through_any_path_to_it(
    users_engine: FakeEngine, tmp_path: Path
) -> None:
    link = tmp_path / "docker.sock"
    link.symlink_to(users_engine.socket_path)  # DOCKER_HOST names the link
    for stream_open in (True, False):  # a stream that dropped comes back
        answer = agents_answer(link, None)
        answer["Engines"][0]["Following"] = stream_open  # type: ignore[index]
        assert await followed(answer, users_engine) is True
    assert users_engine.requests == []  # no question to dockerd


async def test_the_agents_gpu_aware_engine_socket_is_followed(
    users_engine: FakeEngine, tmp_path: Path
) -> None:
    answer = agents_answer(tmp_path / "docker.sock", EngineSocket=str(users_engine.socket_path))
    assert await followed(answer, users_engine) is True
    assert users_engine.requests == []


async def test_the_same_dockerd_behind_a_second_socket_is_followed(
    users_engine: FakeEngine, tmp_path: Path
) -> None:
    """dockerd -H unix:///var/run/docker.sock -H unix:///srv/docker.sock: one daemon."""
    answer = agents_answer(tmp_path / "docker.sock", USERS_ID)
    assert await followed(answer, users_engine) is True
    assert users_engine.requests == ["/info"]


async def test_where_it_cannot_say_the_lease_is_asked(
    users_engine: FakeEngine, tmp_path: Path
) -> None:
    agents = tmp_path / "docker.sock"
    # an agent of another machine (through a tunnel): its sockets are not this machine's
    assert await followed(agents_answer(agents, boot_id="another-boot"), users_engine) is None
    # an agent before the route, or listing no engine
    assert await followed(None, users_engine) is None
    assert await followed({"BootId": BOOT_ID, "Engines": []}, users_engine) is None
    # an agent that follows a dockerd without saying its ID
    assert await followed(agents_answer(agents, None), users_engine) is None
    # an engine that does not answer /info: docker fails on it too
    users_engine.answers["/info"] = (
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
    )
    assert await followed(agents_answer(agents), users_engine) is None


async def test_an_agent_whose_dockerd_is_down_does_not_follow_the_users(
    users_engine: FakeEngine, tmp_path: Path
) -> None:
    """Its dockerd is not the one that answers at the user's socket."""
    answer = agents_answer(tmp_path / "docker.sock", None)
    answer["Engines"][0]["Following"] = False  # type: ignore[index]
    assert await followed(answer, users_engine) is False


def ping_answer(server: str) -> bytes:
    """``GET /_ping``'s answer, with the engine's ``Server`` header."""
    return b"HTTP/1.1 200 OK\r\nServer: %s\r\nContent-Length: 2\r\n\r\nOK" % server.encode()


@pytest.mark.parametrize(
    "row",
    [
        {"Following": False, "Version": None, "ID": None},  # reconnecting after a restart
        {"Following": True, "Version": None, "ID": None},  # its GET /info not read
    ],
)
async def test_the_same_dockerd_is_followed_while_its_row_says_no_id(
    users_engine: FakeEngine, tmp_path: Path, row: dict[str, object]
) -> None:
    """The agent follows the user's dockerd at a first socket, whose row says no ``ID`` just
    now: that socket is asked (``GET /_ping``, then ``GET /info``), and says the same daemon."""
    first = FakeEngine(tmp_path / "docker.sock")
    first.answers["/_ping"] = ping_answer("Docker/26.1.5 (linux)")
    first.answers["/info"] = json_answer({"ID": USERS_ID})
    await first.start()
    try:
        answer = agents_answer(first.socket_path)
        answer["Engines"][0].update(row)  # type: ignore[index]
        assert await followed(answer, users_engine) is True
        assert first.requests == ["/_ping", "/info"]
        first.answers["/info"] = json_answer({"ID": OTHER_ID})  # another daemon after all
        assert await followed(answer, users_engine) is False
    finally:
        await first.stop()


async def test_podmans_service_without_an_id_is_not_asked_its_info(
    users_engine: FakeEngine, tmp_path: Path
) -> None:
    podman = FakeEngine(tmp_path / "podman.sock")
    podman.answers["/_ping"] = ping_answer("Libpod/4.3.1 (linux)")
    await podman.start()
    try:
        answer = agents_answer(tmp_path / "docker.sock")
        answer["Engines"][1] = {  # type: ignore[index]
            "Socket": str(podman.socket_path),
            "Following": True,
            "Version": None,
            "ID": None,
        }
        assert await followed(answer, users_engine) is False
        assert podman.requests == ["/_ping"]
    finally:
        await podman.stop()
