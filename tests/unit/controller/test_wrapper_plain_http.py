"""``nvidia-docker run`` over plain HTTP imports neither aiohttp nor asyncio
(``controller.transport.plain_http``; docs/nvidia-docker.md, "Speed"), nor anything outside a
short list of the standard library's modules, and its client says what ``AgentClient`` says.

The wrapper runs as a process whose ``os.execvp`` (the moment it becomes docker) reports the
argv and which modules the run imported; docker is a shell script that answers
``image inspect`` with a GPU image's labels; the node's agent is ``tests.support.lease_agent``
on a loopback port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest
from aiohttp import web

from controller.errors import Failure, NodeError
from controller.transport import plain_http
from controller.transport.agent_errors import AgentHttpError
from controller.transport.endpoint import parse_endpoint
from controller.transport.plain_http import PlainAgentClient
from tests.support.lease_agent import LeaseAgent, served_in_thread
from tests.support.services import free_port

REPO = Path(__file__).resolve().parents[3]
HEAVY = ("aiohttp", "asyncio", "paramiko", "yarl", "multidict", "controller.transport.client")
# What the run path over plain HTTP imports besides our own modules, on Python 3.11 to 3.13
# (top-level names, under python -S: nothing before it; os and the modules it imports come
# with site in a normal start): C modules under json, socket and csv, and select, without
# http.client and the email package, urllib, ssl, logging, typing, ipaddress, pathlib,
# hashlib, dataclasses (and inspect, ast, dis, tokenize), subprocess (and signal,
# threading, locale), contextlib, json, re, enum, functools, socket, selectors, csv
# (docs/nvidia-docker.md, "Speed"). A module added to the run path fails this test until it
# is added here, its cost measured.
LEAN = frozenset(
    {
        "__future__", "_collections_abc", "_csv", "_json", "_socket", "_stat", "genericpath",
        "os", "posixpath", "pwd", "select", "stat", "types",
    }
)  # fmt: skip
NOT_ON_THE_RUN_PATH = (
    "http", "email", "urllib", "ssl", "_ssl", "logging", "typing", "ipaddress", "pathlib",
    "hashlib", "encodings.idna", "controller.wrapper.help", "dataclasses", "inspect", "ast",
    "dis", "tokenize", "subprocess", "_posixsubprocess", "signal", "threading", "locale",
    "contextlib", "json", "re", "enum", "functools", "collections", "socket", "selectors",
    "csv",
)  # fmt: skip
DOCKER = """#!/bin/sh
labels='{"com.nvidia.volumes.needed": "nvidia_driver", "com.nvidia.cuda.version": "12.4"}'
case "$1 $2" in
  "image inspect") echo "$labels" ;;
  *) echo "$@" ;;
esac
"""
PROBE = (
    "import sys\n"
    "before = set(sys.modules)\n"
    "import os\n"
    "from controller.wrapper import cli\n"
    f"heavy = {HEAVY!r}\n"
    "def execvp(_file, argv):\n"
    "    loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy)\n"
    "    new = sorted(set(sys.modules) - before)\n"
    "    import json\n"
    "    print(json.dumps({'argv': argv, 'loaded': loaded, 'new': new}))\n"
    "    sys.exit(0)\n"
    "os.execvp = execvp\n"
    "sys.exit(cli.main())\n"
)


@pytest.fixture
def agent() -> Iterator[tuple[LeaseAgent, int]]:
    lease_agent = LeaseAgent()
    with served_in_thread(lease_agent) as port:
        yield lease_agent, port


def _run(
    tmp_path: Path, args: list[str], *python: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """The wrapper with ``args`` (``python``: the interpreter's own options)."""
    docker = tmp_path / "docker"
    docker.write_text(DOCKER)
    docker.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NV_", "DOCKER_"))}
    return subprocess.run(
        [sys.executable, *python, "-c", PROBE, *args],
        env={**base, "PYTHONPATH": str(REPO), "NV_DOCKER": str(docker), "NV_CDI": "no", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        ([], {"NV_GPU": "0"}),
        ([], {"NV_GPU": "auto"}),
        (["--gpus", "1"], {}),
        (["--gpus", "all"], {}),
    ],
    ids=["NV_GPU=0", "NV_GPU=auto", "--gpus 1", "--gpus all"],
)
@pytest.mark.parametrize("scheme", ["http", "tcp"])
def test_the_run_path_over_plain_http_imports_no_aiohttp_nor_asyncio(
    tmp_path: Path,
    agent: tuple[LeaseAgent, int],
    flags: list[str],
    env: dict[str, str],
    scheme: str,
) -> None:
    lease_agent, port = agent
    args = ["run", *flags, "--rm", "nvidia/cuda:12.4", "nvidia-smi"]
    done = _run(tmp_path, args, "-S", NV_HOST=f"{scheme}://127.0.0.1:{port}", **env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["loaded"] == []
    new = [m for m in report["new"] if m.split(".")[0] not in ("controller", "agent")]
    assert sorted(m for m in new if m not in LEAN and m.split(".")[0] not in LEAN) == []
    assert [
        m for m in new if m in NOT_ON_THE_RUN_PATH or m.split(".")[0] in NOT_ON_THE_RUN_PATH
    ] == []
    assert "--device=/dev/nvidia0" in report["argv"]
    leased = any(arg.startswith("--label=nvidia-docker.lease=") for arg in report["argv"])
    assert leased is ("NV_GPU" not in env or env["NV_GPU"] == "auto")
    assert ("POST /leases" in lease_agent.requests) is leased


def test_a_refused_ask_is_one_line_without_aiohttp(
    tmp_path: Path, agent: tuple[LeaseAgent, int]
) -> None:
    lease_agent, port = agent
    lease_agent.hold("0", "1", "2")
    args = ["run", "--gpus", "1", "nvidia/cuda:12.4"]
    done = _run(tmp_path, args, "-X", "importtime", NV_HOST=f"http://127.0.0.1:{port}")
    assert done.returncode == 1
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()}
    assert not imported & {"aiohttp", "asyncio"}
    errors = [line for line in done.stderr.splitlines() if "Error:" in line]
    assert len(errors) == 1
    assert f"--gpus 1: http://127.0.0.1:{port} has no lease for 1 GPU now: " in errors[0]


def test_a_failed_step_after_the_grant_gives_the_lease_back(
    tmp_path: Path, agent: tuple[LeaseAgent, int]
) -> None:
    lease_agent, port = agent
    lease_agent.cli_status = 500
    done = _run(tmp_path, ["run", "nvidia/cuda:12.4"], NV_GPU="auto", NV_HOST=f"127.0.0.1:{port}")
    assert done.returncode == 1
    assert "the agent answered 500 to GET /docker/cli: the agent broke" in done.stderr
    assert [r for r in lease_agent.requests if "/leases" in r][-1].startswith("DELETE /leases/")


# --- the client itself: AgentClient's answers and lines ------------------------------------


async def _slow(_: web.Request) -> web.Response:
    import asyncio  # noqa: PLC0415

    await asyncio.sleep(5)
    return web.Response(text="late")


async def _refuse(_: web.Request) -> web.Response:
    return web.Response(
        status=400,
        text="invalid device: 9\n",
        headers={"X-Invalid-Parameter": "dev", "X-Invalid-Value": "9"},
    )


async def _echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(
        {"query": request.raw_path, "body": body.decode(), "type": request.content_type},
        status=201,
    )


@pytest.fixture
def plain_port() -> Iterator[int]:
    class Routes(LeaseAgent):
        def application(self) -> web.Application:
            app = web.Application()
            app.router.add_get("/slow", _slow)
            app.router.add_get("/refuse", _refuse)
            app.router.add_post("/echo", _echo)
            app.router.add_get("/html", _html)
            return app

    with served_in_thread(Routes()) as port:
        yield port


async def _html(_: web.Request) -> web.Response:
    return web.Response(text="<html>")


def test_requests_keep_one_connection_and_send_json(plain_port: int) -> None:
    with PlainAgentClient(parse_endpoint(f"http://127.0.0.1:{plain_port}")) as agent:
        first = agent.request("POST", "/echo", payload={"count": 2}, answers=(201,))
        sock = agent._connection.sock
        status, body, headers = agent.request(
            "POST", "/echo", params={"dev": "0 GPU-1a"}, payload=[], answers=(201,)
        )
        assert agent._connection.sock is sock
    assert first[0] == status == 201
    assert json.loads(first[1]) == {
        "query": "/echo",
        "body": '{"count": 2}',
        "type": "application/json",
    }
    assert json.loads(body)["query"] == "/echo?dev=0+GPU-1a"
    assert headers["content-type"].startswith("application/json")


def test_a_refusal_carries_status_and_the_named_entry(plain_port: int) -> None:
    with (
        PlainAgentClient(parse_endpoint(f"127.0.0.1:{plain_port}")) as agent,
        pytest.raises(AgentHttpError) as info,
    ):
        agent.get("/refuse")
    assert str(info.value) == (
        f"http://127.0.0.1:{plain_port}: the agent answered 400 to GET /refuse: invalid device: 9"
    )
    assert (info.value.invalid_parameter, info.value.invalid_value) == ("dev", "9")


def test_the_timeout_bounds_the_request(plain_port: int) -> None:
    started = time.monotonic()
    endpoint = parse_endpoint(f"http://127.0.0.1:{plain_port}")
    with (
        PlainAgentClient(endpoint, timeout_s=0.3) as agent,
        pytest.raises(NodeError, match=r"no answer to GET /slow within 0\.3 s") as info,
    ):
        agent.get("/slow")
    assert info.value.failure is Failure.TIMEOUT
    assert time.monotonic() - started < 3


def test_not_json_and_no_agent(plain_port: int) -> None:
    with (
        PlainAgentClient(parse_endpoint(f"http://127.0.0.1:{plain_port}")) as agent,
        pytest.raises(NodeError, match="GET /html is not JSON: is this an nvidia-docker agent"),
    ):
        agent.get_json("/html")
    port = free_port()
    with (
        PlainAgentClient(parse_endpoint(f"http://127.0.0.1:{port}")) as agent,
        pytest.raises(NodeError) as info,
    ):
        agent.get("/gpu/info/json")
    assert info.value.failure is Failure.REFUSED
    assert str(info.value) == (
        f"http://127.0.0.1:{port}: cannot connect to the agent at http://127.0.0.1:{port} "
        "(connection refused): is nvidia-docker-plugin running there, listening on that "
        "address (-l HOST:PORT)?"
    )


def test_https_is_not_its_business() -> None:
    with pytest.raises(ValueError, match="plain HTTP only"):
        PlainAgentClient(parse_endpoint("https://node3:3476"))


# --- HTTP/1.1 as http.client speaks it: the request, chunks, closes, broken answers -------


def test_urlencode_is_urllibs() -> None:
    params = {"dev": "0 GPU-1a", "vol": "nvidia_driver", "x": "a+b&c=d/é~_.-", "format": "cdi"}
    assert plain_http.urlencode(params) == urlencode(params)


def _one_answer(answer: bytes) -> tuple[int, list[bytes], threading.Thread]:
    """A server on loopback that reads one request and writes ``answer`` (then closes)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    seen: list[bytes] = []

    def serve() -> None:
        with server, server.accept()[0] as conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            seen.append(data)
            conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, seen, thread


def _ask(port: int, call: Callable[[PlainAgentClient], object]) -> object:
    with PlainAgentClient(parse_endpoint(f"http://127.0.0.1:{port}"), timeout_s=5) as agent:
        return call(agent)


def test_the_request_is_http_clients() -> None:
    port, seen, thread = _one_answer(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
    status = _ask(port, lambda a: a.request("POST", "/leases", payload={"n": 1}, answers=(201,)))
    thread.join(5)
    assert status == (201, b"{}", {"content-length": "2"})
    assert seen[0].split(b"\r\n\r\n")[0].split(b"\r\n") == [
        b"POST /leases HTTP/1.1",
        f"Host: 127.0.0.1:{port}".encode(),
        b"Accept-Encoding: identity",
        b"Content-Length: 8",
        b"Accept: */*",
        b"Content-Type: application/json",
    ]


def test_chunked_to_the_close_and_short_answers() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    port, _seen, thread = _one_answer(chunked)
    assert _ask(port, lambda a: a.get("/x")) == b"abcde"
    thread.join(5)
    port, _seen, thread = _one_answer(b"HTTP/1.0 200 OK\r\nX-A: 1\r\n\r\nto the end")
    assert _ask(port, lambda a: a.get("/x")) == b"to the end"
    thread.join(5)


def test_a_body_cut_off_says_how_much_came_without_a_tls_hint() -> None:
    cases = [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc", "after 3 of 9 bytes"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", "after 3 bytes"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab", "after 2 bytes"),
    ]  # fmt: skip
    for answer, said in cases:
        port, _seen, thread = _one_answer(answer)
        with pytest.raises(NodeError) as info:
            _ask(port, lambda a: a.get("/x"))
        thread.join(5)
        assert f"GET /x failed: the answer was cut off {said} (" in str(info.value)
        assert "https://?" not in str(info.value)
        assert info.value.failure is Failure.DISCONNECTED


def test_a_closing_agent_gets_a_new_connection(plain_port: int) -> None:
    port, _seen, thread = _one_answer(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx"
    )
    with PlainAgentClient(parse_endpoint(f"http://127.0.0.1:{port}")) as agent:
        assert agent.get("/x") == b"x"
        assert agent._connection.sock is None
    thread.join(5)


def test_broken_answers_say_what_http_client_said() -> None:
    node = "http://127.0.0.1:{port}"
    cases = [
        (b"", "GET /x failed: Server disconnected (an agent serving TLS closes plain HTTP "
         "connections: https://?)"),
        (b"SSH-2.0-OpenSSH_9.2\r\n", "GET /x failed: SSH-2.0-OpenSSH_9.2\r\n"),
        (b"HTTP/2 200\r\n\r\n", "GET /x failed: HTTP/2"),
        (b"HTTP/1.1 abc OK\r\n\r\n", "GET /x failed: HTTP/1.1 abc OK\r\n"),
    ]  # fmt: skip
    for answer, line in cases:
        port, _seen, thread = _one_answer(answer)
        with pytest.raises(NodeError) as info:
            _ask(port, lambda a: a.get("/x"))
        thread.join(5)
        assert str(info.value) == f"{node.format(port=port)}: {line}"


def test_logging_is_configured_only_where_a_library_may_log() -> None:
    probe = (
        "import sys\n"
        "from controller import logs\n"
        "logs.configure_when_needed('nvidia-docker', False)\n"
        "assert 'logging' not in sys.modules\n"
        "logs.configure_pending()\n"
        "import logging\n"
        "assert [logging.getLogger(n).propagate for n in logs.QUIET] == [False, False]\n"
        "logs.configure_when_needed('nvidia-docker', True)\n"
        "assert [logging.getLogger(n).propagate for n in logs.QUIET] == [True, True]\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
