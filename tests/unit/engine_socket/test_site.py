"""The engine socket's own bounds: its connection limit, and its rights when the agent runs
as an unprivileged user (as the packaged unit does)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.engine_socket.site import serve_engine_socket
from tests.support.unix_server import serving

NOBODY = 65534
ENGINE_GID = 4321  # the engine socket's group (docker's, on a real node)


async def _answer_every_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A stand-in engine: every request head answered ``200 OK``."""
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass


async def _ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(b"GET /_ping HTTP/1.1\r\nHost: docker\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    return head + await asyncio.wait_for(reader.readexactly(length), 5)


async def test_a_client_beyond_the_bound_gets_one_503_and_the_others_keep_going(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving(tmp_path / "engine.sock", _answer_every_head):
        site = await serve_engine_socket(
            tmp_path / "ours.sock",
            tmp_path / "engine.sock",
            None,
            head_timeout_s=5.0,
            max_connections=2,
        )
        held = [await asyncio.open_unix_connection(str(site.path)) for _ in range(2)]
        try:
            for reader, writer in held:  # both served: their requests answered by the engine
                assert (await _ping(reader, writer)).endswith(b"OK")
            reader, writer = await asyncio.open_unix_connection(str(site.path))
            answer = await _ping(reader, writer)
            assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
            message = json.loads(answer.partition(b"\r\n\r\n")[2])["message"]
            assert "has its 2 connections open (--engine-connections)" in message
            assert await asyncio.wait_for(reader.read(), 5) == b""  # and closed
            writer.close()
            assert "a client refused (1 so far)" in caplog.text
            for reader, writer in held:  # the held ones are still served
                assert (await _ping(reader, writer)).endswith(b"OK")
            held[0][1].close()
            await held[0][1].wait_closed()
            for _ in range(100):  # its slot frees once the agent sees the end of it
                if site.open_connections < 2:
                    break
                await asyncio.sleep(0.02)
            reader, writer = await asyncio.open_unix_connection(str(site.path))
            assert (await _ping(reader, writer)).endswith(b"OK")
            writer.close()
        finally:
            for _, writer in held:
                writer.close()
            await site.close()


def _bind_as_nobody(tmp_path: Path, groups: list[int]) -> tuple[int, str]:
    """The engine socket bound by a child process running as nobody in ``groups``: its exit
    status (3: refused) and what it printed (the log's rights, then owner, group, mode)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 0
        try:
            os.close(read_end)
            os.setgroups(groups)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            text = asyncio.run(_bind_once(tmp_path))
        except OSError as err:
            text, status = str(err), 3
        except BaseException as err:  # reported to the parent, not raised
            text, status = repr(err), 4
        os.write(write_end, text.encode())
        os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        printed = pipe.read().decode()
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status), printed


async def _bind_once(tmp_path: Path) -> str:
    site = await serve_engine_socket(
        tmp_path / "run" / "docker.sock",
        tmp_path / "engine.sock",
        None,
        head_timeout_s=1.0,
        max_connections=4,
    )
    found = site.path.stat()
    await site.close()
    return f"{site.rights}\n{found.st_uid} {found.st_gid} {oct(found.st_mode & 0o777)}"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory nobody may reach (pytest's own are root's alone): a bind directory open
    to all, beside an engine socket of root and group ``ENGINE_GID``, mode 0660."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the agent's bind as another user")
    top = Path(tempfile.mkdtemp(prefix="nvd-engine-rights-"))
    try:
        top.chmod(0o755)
        (top / "run").mkdir()
        (top / "run").chmod(0o777)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(top / "engine.sock"))
        listener.close()
        os.chown(top / "engine.sock", 0, ENGINE_GID)
        os.chmod(top / "engine.sock", 0o660)
        yield top
    finally:
        shutil.rmtree(top)


def test_an_unprivileged_agent_in_the_engines_group_takes_its_group_and_mode(
    shared_dir: Path,
) -> None:
    status, printed = _bind_as_nobody(shared_dir, [ENGINE_GID])
    assert status == 0, printed
    rights, owner = printed.splitlines()
    assert owner == f"{NOBODY} {ENGINE_GID} 0o660"
    assert f"group {ENGINE_GID}" in rights
    assert "may not give it to 0" in rights


def test_an_unprivileged_agent_outside_the_engines_group_says_what_to_do(
    shared_dir: Path,
) -> None:
    status, printed = _bind_as_nobody(shared_dir, [])
    assert status == 3, printed
    assert printed == (
        f"cannot give the engine socket the group of {shared_dir / 'engine.sock'} "
        f"(gid {ENGINE_GID}): the agent's user is not in it; add it to that group (the "
        "Ansible role: nvidia_docker_agent_user_groups), or run the agent as root"
    )
    assert not any(p.name.startswith(".docker.sock") for p in (shared_dir / "run").iterdir())
    assert stat.S_ISDIR((shared_dir / "run").stat().st_mode)
