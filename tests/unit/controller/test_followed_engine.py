"""``followed_engine``: a lease is asked only for a container of a Docker engine that the
node's agent follows (docs/leases.md, "How it fails safe").

The engine behind the wrapper's socket is ``FakeEngine`` (what dockerd answers to
``GET /info``); the agent's word is a ``GET /engines/json`` answer as the agent gives it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from controller.wrapper.followed_engine import (
    address_id,
    cli_engine_id,
    engine_followed,
    followed_by_id,
    refusal,
    refusal_by_id,
)
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


# --- engines reached other than by a socket file: tcp://, ssh://, an agent elsewhere --------


@pytest.mark.parametrize("boot_id", [BOOT_ID, "another-boot"])
def test_an_engine_is_matched_by_its_id_wherever_the_agent_runs(
    tmp_path: Path, boot_id: str
) -> None:
    """``DOCKER_HOST=tcp://...`` or ``ssh://...``, or an agent on another machine reached
    through ``NV_HOST``: no socket file to compare, the daemon's ``ID`` is."""
    answer = agents_answer(tmp_path / "docker.sock", OTHER_ID, boot_id=boot_id)
    assert followed_by_id(answer, OTHER_ID) is True
    assert followed_by_id(answer, USERS_ID) is False
    # unknown: the engine said no ID, or the agent follows a dockerd without saying its own
    assert followed_by_id(answer, None) is None
    assert followed_by_id(agents_answer(tmp_path / "docker.sock", None), USERS_ID) is None
    assert followed_by_id(None, USERS_ID) is None  # an agent before the route
    assert followed_by_id({"BootId": boot_id, "Engines": []}, USERS_ID) is None
    # a dockerd whose stream dropped, its ID still said, is the same daemon
    answer["Engines"][0]["Following"] = False  # type: ignore[index]
    assert followed_by_id(answer, OTHER_ID) is True
    # an agent that follows Podman's service, which says no ID of its own (its compatible
    # GET /info makes one up each time): docker's engine may be that service, over tcp
    podman = {"Socket": PODMAN, "Following": True, "Version": None, "ID": None}
    answer["Engines"][1] = podman  # type: ignore[index]
    assert followed_by_id(answer, USERS_ID) is None
    podman["Following"] = False  # its socket is not there: it follows no dockerd
    assert followed_by_id(answer, USERS_ID) is False


def test_the_refusal_by_id_names_both_daemons_and_the_agents_node(tmp_path: Path) -> None:
    agents = tmp_path / "docker.sock"
    answer = agents_answer(agents, OTHER_ID, boot_id="another-boot")
    line = refusal_by_id(
        LeaseAsk("--gpus 2"), "tcp://10.0.0.7:2376", USERS_ID, answer, "gpu-node-3:3476"
    )
    assert line == (
        "--gpus 2 asks for a GPU lease, but docker runs its containers on the engine at "
        f"tcp://10.0.0.7:2376 (ID {USERS_ID}), which the agent of gpu-node-3:3476 does not "
        f"follow (it follows {agents} (ID {OTHER_ID})), so the lease would end as soon as "
        "docker returns and its GPUs would go to the next ask: point docker at the engine that "
        "agent follows (DOCKER_HOST, -H or --context), ask the agent of the node that engine "
        "runs on (NV_HOST), or name GPUs without a lease (NV_GPU=0,1, and no --gpus)"
    )
    podman_only = {"Engines": [{"Socket": PODMAN, "Following": True}]}
    line = refusal_by_id(LeaseAsk("--gpus 2"), "ssh://n", USERS_ID, podman_only, "n:3476")
    assert "does not follow (it follows no dockerd)" in line


DOCKER_SCRIPT = """#!/bin/sh
printf '%s\\n' "$*" > "{record}"
printf '%s' "$ANSWER"
exit "${{CODE:-0}}"
"""


@pytest.mark.parametrize(
    ("answer", "code", "expected"),
    [
        (f"{USERS_ID}\n", "0", USERS_ID),
        ("", "0", None),  # an engine that says none
        (f"{USERS_ID}\n", "1", None),  # docker failed: it fails on the run too
        (f"{USERS_ID}\n{OTHER_ID}\n", "0", None),  # not one ID
    ],
)
def test_the_docker_cli_is_asked_the_id_with_the_commands_global_options(
    tmp_path: Path, answer: str, code: str, expected: str | None
) -> None:
    """TLS settings, contexts and SSH are the docker CLI's: it is asked ``docker info``
    with the run's own global options, in the run's environment."""
    record = tmp_path / "argv"
    docker = tmp_path / "docker"
    docker.write_text(DOCKER_SCRIPT.format(record=record))
    docker.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "ANSWER": answer, "CODE": code}
    said = cli_engine_id(["docker"], ["-H", "tcp://10.0.0.7:2376", "--tlsverify"], env)
    assert said == expected
    assert record.read_text() == "-H tcp://10.0.0.7:2376 --tlsverify info --format {{.ID}}\n"


def test_no_docker_cli_says_nothing(tmp_path: Path) -> None:
    assert cli_engine_id(["docker"], [], {"PATH": str(tmp_path)}) is None


def test_a_plain_tcp_engine_is_asked_over_http_and_tls_is_left_to_the_cli(
    tmp_path: Path,
) -> None:
    """``tcp://`` without docker's TLS settings: ``GET /info`` over plain HTTP (no docker
    CLI to start). With them, or where the plain question gets no answer (a context's TLS),
    the docker CLI says it."""
    record = tmp_path / "argv"
    docker = tmp_path / "docker"
    docker.write_text(DOCKER_SCRIPT.format(record=record))
    docker.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "ANSWER": "FROM:THE:CLI"}
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        answer = json.dumps({"ID": USERS_ID}).encode()
        served = threading.Thread(target=_serve_info, args=(listener, answer), daemon=True)
        served.start()
        assert address_id(address, ["docker"], [], env) == USERS_ID
        served.join(timeout=10)
        assert not record.exists()  # the CLI was not started
        for global_args, extra in [(["--tlsverify"], {}), ([], {"DOCKER_TLS_VERIFY": "1"})]:
            said = address_id(address, ["docker"], global_args, {**env, **extra})
            assert said == "FROM:THE:CLI"  # no plain question: nothing accepted it
            record.unlink()
    # nothing answers there: the CLI is asked (it fails too, or knows better)
    assert address_id(address, ["docker"], [], env) == "FROM:THE:CLI"
    assert address_id("ssh://ops@gpu-7", ["docker"], [], env) == "FROM:THE:CLI"
    assert record.read_text() == "info --format {{.ID}}\n"


def _serve_info(listener: socket.socket, body: bytes) -> None:
    """One ``GET /info`` answered with ``body``."""
    connection, _ = listener.accept()
    with connection:
        data = b""
        while b"\r\n\r\n" not in data:
            data += connection.recv(65536)
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
        connection.sendall(head + body)
