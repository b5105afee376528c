"""When the wrapper asks the engine's socket itself instead of starting ``docker image inspect``
(``controller.wrapper.engine_api.engine_socket``): only where the docker CLI would ask that
same local socket. Everything else (another docker command, a remote daemon, global options)
keeps the CLI. The answers themselves are checked against a real dockerd in
``tests/e2e/test_wrapper.py``.

``PATH`` holds what a machine may call ``docker``: a copy of a real program (ELF), a script,
a link to a program with another name (Podman's client). Contexts are made with the real
docker CLI, as ``test_docker_context`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from controller.errors import NodeError
from controller.options import Options
from controller.transport.agent_errors import AgentHttpError
from controller.wrapper.docker_args import scan
from controller.wrapper.engine_api import (
    DEFAULT_SOCKET,
    NO_SUCH_IMAGE,
    cli_engine_address,
    docker_version,
    engine_socket,
    image_labels,
    server_version,
    tcp_engine_id,
    unix_path,
)
from controller.wrapper.engine_cdi import AGENT_ENGINES, agent_engine_cdi, ask_engine
from controller.wrapper.gpu_args import CdiChoice
from tests.unit.controller.cli_program import cli_program
from tests.unit.controller.go_program import go_program, ldflags_lines

DOCKER = shutil.which("docker")
PROGRAM = Path("/bin/true")  # any ELF program stands in for the docker CLI's file
RUN = ["run", "--rm", "nvidia/cuda:12.4"]


def _bin(tmp_path: Path, name: str) -> Path:
    found = tmp_path / name
    found.mkdir()
    return found


def _options(search_path: str, **environ: str) -> Options:
    return Options.build(
        {"HOME": "/nonexistent", "USER": "u", "PATH": search_path, **environ}, command="wrapper"
    )


@pytest.fixture
def cli_path(tmp_path: Path) -> str:
    """A PATH whose docker is a program named docker."""
    where = _bin(tmp_path, "cli")
    shutil.copy(PROGRAM, where / "docker")
    return f"{where}:/usr/bin:/bin"


def test_the_local_daemon_is_its_default_socket(cli_path: str) -> None:
    assert engine_socket(_options(cli_path), scan(RUN)) == DEFAULT_SOCKET
    assert engine_socket(_options(cli_path, NV_DOCKER="docker"), scan(RUN)) == DEFAULT_SOCKET
    found = engine_socket(
        _options(cli_path, DOCKER_HOST="unix:///run/user/7/docker.sock"), scan(RUN)
    )
    assert found == "/run/user/7/docker.sock"


@pytest.mark.parametrize(
    ("environ", "args"),
    [
        ({"DOCKER_HOST": "tcp://10.0.0.2:2376"}, RUN),
        ({"DOCKER_HOST": "ssh://ops@gpu-a"}, RUN),
        ({"DOCKER_HOST": "unix://"}, RUN),
        ({"NV_DOCKER": "sudo docker"}, RUN),
        ({"NV_DOCKER": "podman"}, RUN),
        ({"NV_DOCKER": "/nonexistent/docker"}, RUN),
        ({"NV_DOCKER": "/bin/true"}, RUN),  # a program, but not named docker
        ({}, ["-H", "unix:///var/run/docker.sock", *RUN]),
        ({}, ["--context", "default", *RUN]),
        ({}, ["--debug", *RUN]),
        ({}, ["--config", "/elsewhere", *RUN]),
    ],
)
def test_anything_else_keeps_the_cli(
    cli_path: str, environ: dict[str, str], args: list[str]
) -> None:
    assert engine_socket(_options(cli_path, **environ), scan(args)) is None


def test_nv_docker_naming_the_cli_s_file_is_the_cli(tmp_path: Path) -> None:
    """``NV_DOCKER=/usr/bin/docker``, as where ``docker`` on ``PATH`` is the wrapper itself:
    the engine is asked as for ``docker`` (and a lease's check sees it), not a script by
    that name nor a link to podman."""
    program = _bin(tmp_path, "program")
    shutil.copy(PROGRAM, program / "docker")
    wrapper = _bin(tmp_path, "wrapper")  # the first docker on PATH: a script, the wrapper
    (wrapper / "docker").write_text('#!/bin/sh\nexec nvidia-docker "$@"\n')
    (wrapper / "docker").chmod(0o755)
    linked = _bin(tmp_path, "linked")
    shutil.copy(PROGRAM, linked / "podman")
    (linked / "docker").symlink_to(linked / "podman")
    search_path = f"{wrapper}:/usr/bin:/bin"
    assert engine_socket(_options(search_path), scan(RUN)) is None  # PATH's docker: a script
    options = _options(search_path, NV_DOCKER=str(program / "docker"))
    assert engine_socket(options, scan(RUN)) == DEFAULT_SOCKET
    assert cli_engine_address(options, scan(["-H", "tcp://n:2375", *RUN])) == "tcp://n:2375"
    for other in (wrapper / "docker", linked / "docker"):
        assert engine_socket(_options(search_path, NV_DOCKER=str(other)), scan(RUN)) is None


def test_docker_must_be_the_cli_program(tmp_path: Path) -> None:
    script = _bin(tmp_path, "script")  # podman-docker's docker is a shell script
    (script / "docker").write_text('#!/bin/sh\nexec podman "$@"\n')
    (script / "docker").chmod(0o755)
    linked = _bin(tmp_path, "linked")
    shutil.copy(PROGRAM, linked / "podman")
    (linked / "docker").symlink_to(linked / "podman")
    program = _bin(tmp_path, "program")
    shutil.copy(PROGRAM, program / "docker")
    not_executable = _bin(tmp_path, "not-executable")
    shutil.copy(PROGRAM, not_executable / "docker")
    (not_executable / "docker").chmod(0o644)
    empty = _bin(tmp_path, "empty")
    for search_path, expected in [
        (f"{script}:{program}", None),  # the first docker on PATH is the one execvp runs
        (f"{linked}:{program}", None),
        (f"{not_executable}:{program}", DEFAULT_SOCKET),  # skipped, as execvp skips it
        (str(empty), None),  # no docker at all: the CLI path says so
        (f"{empty}:{program}", DEFAULT_SOCKET),
    ]:
        assert engine_socket(_options(search_path), scan(RUN)) == expected, search_path


@pytest.mark.skipif(DOCKER is None, reason="the docker CLI is not installed")
def test_a_context_s_unix_socket_is_asked(cli_path: str, tmp_path: Path) -> None:
    config = tmp_path / "docker-config"
    for name, host in [("rootless", "unix:///run/user/1000/docker.sock"), ("far", "tcp://n:2376")]:
        subprocess.run(
            [str(DOCKER), "context", "create", name, "--docker", f"host={host}"],
            env={"DOCKER_CONFIG": str(config), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            check=True,
            timeout=60,
        )
    rootless = _options(cli_path, DOCKER_CONFIG=str(config), DOCKER_CONTEXT="rootless")
    assert engine_socket(rootless, scan(RUN)) == "/run/user/1000/docker.sock"
    far = _options(cli_path, DOCKER_CONFIG=str(config), DOCKER_CONTEXT="far")
    assert engine_socket(far, scan(RUN)) is None


@pytest.mark.skipif(DOCKER is None, reason="the docker CLI is not installed")
def test_the_lease_check_sees_the_engine_the_global_options_name(
    cli_path: str, tmp_path: Path
) -> None:
    """``-H`` and ``--context`` leave the wrapper's engine questions to the CLI, but the
    followed-engine check of a lease needs to know which engine they name."""
    config = tmp_path / "docker-config"
    subprocess.run(
        [str(DOCKER), "context", "create", "rootless", "--docker", "host=unix:///run/u.sock"],
        env={"DOCKER_CONFIG": str(config), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        check=True,
        timeout=60,
    )
    options = _options(cli_path, DOCKER_CONFIG=str(config), DOCKER_HOST="unix:///run/d.sock")
    for args, expected in [
        (["-H", "unix:///run/other.sock", *RUN], "/run/other.sock"),
        (["--context", "rootless", *RUN], "/run/u.sock"),
        (["-H", "tcp://127.0.0.1:2375", *RUN], None),
        (RUN, "/run/d.sock"),
    ]:
        assert unix_path(cli_engine_address(options, scan(args))) == expected, args
        assert engine_socket(options, scan(args)) == (expected if args == RUN else None)
    # the address whatever it is: the check asks a tcp:// or ssh:// engine its ID by the CLI
    assert cli_engine_address(options, scan(["-H", "tcp://127.0.0.1:2375", *RUN])) == (
        "tcp://127.0.0.1:2375"
    )
    remote = _options(cli_path, DOCKER_CONFIG=str(config), DOCKER_HOST=" ssh://ops@gpu-7 ")
    assert cli_engine_address(remote, scan(RUN)) == "ssh://ops@gpu-7"
    assert cli_engine_address(_options(cli_path), scan(RUN)) == "unix:///var/run/docker.sock"


def test_no_socket_or_an_odd_name_leaves_it_to_the_cli(tmp_path: Path) -> None:
    assert image_labels(str(tmp_path / "no-engine.sock"), "nvidia/cuda:12.4") is None
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(8)
        listener.setblocking(False)
        for name in ("", "/etc/passwd", "a b", "x/../../containers", "a//b", "q?x", "#"):
            assert image_labels(str(path), name) is None
            with pytest.raises(BlockingIOError):  # not asked: no connection came
                listener.accept()


def _answering(path: Path, answer: bytes) -> threading.Thread:
    """A server on ``path`` that reads one request and writes ``answer``, then closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    return _serve_once(listener, answer, [])


def _serve_once(listener: socket.socket, answer: bytes, read: list[bytes]) -> threading.Thread:
    """Serve one request on ``listener`` (bound): read it into ``read``, write ``answer``."""
    listener.listen(1)

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            read.append(data)
            conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _json(status: str, body: object) -> bytes:
    text = json.dumps(body).encode()
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status.encode(), len(text), text)


def _answering_tcp(answer: bytes, family: int = socket.AF_INET) -> tuple[int, list[bytes]]:
    """A server on a loopback port that reads one request and writes ``answer``, then
    closes: its port, and the requests it read."""
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
    read: list[bytes] = []
    _serve_once(listener, answer, read)
    return listener.getsockname()[1], read


def test_a_plain_tcp_dockerd_is_asked_its_id_over_http() -> None:
    """``DOCKER_HOST=tcp://127.0.0.1:PORT``: ``GET /info``, no docker CLI to start."""
    port, read = _answering_tcp(_json("200 OK", {"ID": "52N2:AD6T", "ServerVersion": "20.10"}))
    assert tcp_engine_id(f"tcp://127.0.0.1:{port}") == "52N2:AD6T"
    assert read[0].startswith(b"GET /info HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % port)
    if socket.has_ipv6:
        port, read = _answering_tcp(_json("200 OK", {"ID": "X"}), socket.AF_INET6)
        assert tcp_engine_id(f"tcp://[::1]:{port}/") == "X"
        assert b"Host: [::1]:%d\r\n" % port in read[0]


@pytest.mark.parametrize(
    "answer",
    [
        # Go's TLS server to a plain HTTP request: the CLI, which knows the TLS, is asked
        b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n",
        _json("200 OK", {"ServerVersion": "20.10"}),  # no ID said
        _json("200 OK", ["not", "info"]),
        b"\x15\x03\x01\x00\x02\x02\x46",  # a TLS alert: not HTTP
    ],
)
def test_a_tcp_engine_that_does_not_say_its_id_over_http_says_none(answer: bytes) -> None:
    port, _ = _answering_tcp(answer)
    assert tcp_engine_id(f"tcp://127.0.0.1:{port}") is None


@pytest.mark.parametrize(
    "address",
    [
        "ssh://ops@gpu-7",
        "tcp://",
        "tcp://user@127.0.0.1:2375",
        "tcp://127.0.0.1:2375/v1.41",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:99999",
        "tcp://127.0.0.1:port",
        "tcp://::1:2375",  # IPv6 without brackets: the CLI's business
        "tcp://[::1",
    ],
)
def test_other_addresses_are_left_to_the_cli(address: str) -> None:
    assert tcp_engine_id(address) is None


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (_json("200 OK", {"Config": {"Labels": {"a": "1", "n": 2}}}), {"a": "1", "n": "2"}),
        (_json("200 OK", {"Config": {"Labels": None}}), {}),
        (_json("404 Not Found", {"message": "No such image: x:1"}), NO_SUCH_IMAGE),
        (
            _json("404 Not Found", {"message": "failed to find image x: image not known"}),
            NO_SUCH_IMAGE,
        ),
        # anything else: the CLI is asked, and says it in its words
        (_json("404 Not Found", {"message": "page not found"}), None),
        (_json("400 Bad Request", {"message": "invalid reference format"}), None),
        (_json("500 Internal Server Error", {"message": "boom"}), None),
        (_json("200 OK", {"Config": "odd"}), None),
        (_json("200 OK", {"Config": {"Labels": ["odd"]}}), None),
        (_json("200 OK", ["odd"]), None),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n{x}", None),
        (b"SSH-2.0-OpenSSH_9.2\r\n", None),
        (b"", None),
    ],
)
def test_only_a_clear_answer_is_taken(tmp_path: Path, answer: bytes, expected: object) -> None:
    path = tmp_path / "engine.sock"
    thread = _answering(path, answer)
    assert image_labels(str(path), "x:1") == expected
    thread.join(5)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (_json("200 OK", {"Version": "28.2.2", "ApiVersion": "1.50"}), "28.2.2"),
        (_json("200 OK", {"ApiVersion": "1.50"}), None),  # no Version: the CLI is asked
        (_json("200 OK", ["28.2.2"]), None),
        (_json("500 Internal Server Error", {"message": "boom"}), None),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{", None),
    ],
)
def test_the_engine_s_version(tmp_path: Path, answer: bytes, expected: str | None) -> None:
    path = tmp_path / "engine.sock"
    thread = _answering(path, answer)
    found = server_version(str(path))
    assert (found or {}).get("Version") == expected
    thread.join(5)


def _pinged(status: str, header: str) -> bytes:
    return f"HTTP/1.1 {status}\r\n{header}\r\nContent-Length: 2\r\n\r\nOK".encode()


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (_json("200 OK", "OK"), None),  # no Server header
        (_pinged("200 OK", "Server: Docker/28.2.2 (linux)"), "28.2.2"),
        (_pinged("200 OK", "server: Docker/26.1.5+dfsg1"), "26.1.5+dfsg1"),
        (_pinged("200 OK", "Server: Libpod/4.3.1 (linux)"), None),  # Podman's service
        (_pinged("200 OK", "Server: Docker/"), None),
        (_pinged("500 Internal Server Error", "Server: Docker/28.2.2 (linux)"), None),
        (b"SSH-2.0-OpenSSH_9.2\r\n", None),
    ],
)  # fmt: skip
def test_dockerd_s_version_from_its_ping(
    tmp_path: Path, answer: bytes, expected: str | None
) -> None:
    path = tmp_path / "engine.sock"
    thread = _answering(path, answer)
    assert docker_version(str(path)) == expected
    thread.join(5)


class _Engine:
    """A server on a unix socket that answers each connection's one request from
    ``answers`` (by its target; 404 otherwise) and records the targets asked, in order."""

    def __init__(self, path: Path, answers: dict[str, bytes]) -> None:
        self.path = str(path)
        self.answers = answers
        self.asked: list[str] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(8)
        self._listener.settimeout(0.05)  # how often the loop looks at _stop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with self._listener:
            while not self._stop.is_set():
                try:
                    conn = self._listener.accept()[0]
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(5)
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
                    target = data.split(b" ", 2)[1].decode()
                    self.asked.append(target)
                    conn.sendall(self.answers.get(target, _json("404 Not Found", {})))

    def stop(self) -> list[str]:
        """Stop serving; the targets asked."""
        self._stop.set()
        self._thread.join(5)
        return self.asked


def _ping(server: str | None) -> bytes:
    """dockerd's answer to ``GET /_ping`` (``server``: its Server header; None: none)."""
    headers = "Api-Version: 1.45\r\nOstype: linux\r\nContent-Length: 2\r\n"
    if server is not None:
        headers += f"Server: {server}\r\n"
    return f"HTTP/1.1 200 OK\r\n{headers}\r\nOK".encode()


CDI_INFO = _json("200 OK", {"ServerVersion": "26.1.5+dfsg1", "CDISpecDirs": ["/etc/cdi"]})
DOCKER_26 = {"/_ping": _ping("Docker/26.1.5+dfsg1 (linux)"), "/info": CDI_INFO}
DOCKER_CE_CLI = '"-X \\"github.com/docker/cli/cli/version.Version=28.2.2\\""'
OLD_CLI = "-X github.com/docker/cli/cli/version.Version=24.0.7"
INFO_CALL = "info --format {{json .CDISpecDirs}}"
ON, OFF = "CDI spec dirs /etc/cdi", "CDI is off in the engine (no CDI spec dirs)"


@pytest.mark.parametrize(
    ("answers", "cli", "engine", "reads_cdi", "reason", "asked", "cli_calls"),
    [
        pytest.param(  # older than CDI: /_ping is the whole question (no /version, no CLI)
            {"/_ping": _ping("Docker/20.10.24+dfsg1 (linux)")}, DOCKER_CE_CLI,
            "Docker 20.10.24+dfsg1", False, "Docker reads CDI from 25.0 on", ["/_ping"], [],
            id="docker-20.10",
        ),
        pytest.param(  # 25+: /info, and the CLI's version from its file
            DOCKER_26, DOCKER_CE_CLI,
            "Docker 26.1.5+dfsg1", True, ON, ["/_ping", "/info"], [], id="docker-26-cdi-on",
        ),
        pytest.param(  # a CLI older than 25 cannot pass a CDI device on (its info fails)
            DOCKER_26, OLD_CLI, "Docker 26.1.5+dfsg1", False,
            "the docker CLI 24.0.7 cannot pass CDI devices (25.0 on can)", ["/_ping", "/info"], [],
            id="docker-26-old-cli",
        ),
        pytest.param(  # a CLI that does not record its version (-trimpath): docker info
            DOCKER_26, None,
            "Docker 26.1.5+dfsg1", True, ON, ["/_ping", "/info"], [INFO_CALL], id="trimpath-cli",
        ),
        pytest.param(
            {**DOCKER_26, "/info": _json("200 OK", {"CDISpecDirs": []})}, DOCKER_CE_CLI,
            "Docker 26.1.5+dfsg1", False, OFF, ["/_ping", "/info"], [], id="docker-26-cdi-off",
        ),
        pytest.param(  # no CDISpecDirs at all: the CLI's template prints null, no CDI
            {**DOCKER_26, "/info": _json("200 OK", {"ServerVersion": "26.1.5"})}, DOCKER_CE_CLI,
            "Docker 26.1.5+dfsg1", False, OFF, ["/_ping", "/info"], [], id="no-spec-dirs",
        ),
        pytest.param(  # an unclear /info: docker info says it
            {**DOCKER_26, "/info": _json("500 Internal Server Error", {"message": "boom"})},
            None, "Docker 26.1.5+dfsg1", True, ON, ["/_ping", "/info"], [INFO_CALL],
            id="info-unclear",
        ),
        pytest.param(
            {**DOCKER_26, "/info": _json("200 OK", {"CDISpecDirs": "/etc/cdi"})},
            None, "Docker 26.1.5+dfsg1", True, ON, ["/_ping", "/info"], [INFO_CALL],
            id="info-odd",
        ),
        pytest.param(  # Podman's service is no dockerd: its /version, as before
            {"/_ping": _ping("Libpod/4.3.1 (linux)"),
             "/version": _json("200 OK", {"Version": "4.3.1"})},
            DOCKER_CE_CLI, "Docker 4.3.1", False, "Docker reads CDI from 25.0 on",
            ["/_ping", "/version"], [], id="podman-service",
        ),
        pytest.param(  # no Server header: /version, then (25+) the CLI's info, as before
            {"/_ping": _ping(None), "/version": _json("200 OK", {"Version": "28.2.2"})},
            None, "Docker 28.2.2", True, ON, ["/_ping", "/version"], [INFO_CALL],
            id="no-server-header",
        ),
        pytest.param(  # nothing answers clearly: the CLI's version (its script says 20.10)
            {}, None, "Docker 20.10.24", False, "Docker reads CDI from 25.0 on",
            ["/_ping", "/version"], ["version --format {{json .}}"], id="no-answers",
        ),
    ],
)  # fmt: skip
def test_the_cdi_question_on_the_engine_s_socket(
    tmp_path: Path,
    answers: dict[str, bytes],
    cli: str | None,
    engine: str,
    reads_cdi: bool,
    reason: str,
    asked: list[str],
    cli_calls: list[str],
) -> None:
    """``cli``: the ``-ldflags`` the docker CLI's file records (None: a script, which
    records its calls and answers as docker would)."""
    calls = tmp_path / "calls"
    docker = tmp_path / "docker"
    if cli is None:
        docker.write_text(
            f'#!/bin/sh\necho "$*" >> {calls}\n'
            'case "$1" in info) echo \'["/etc/cdi"]\' ;;'
            ' *) echo \'{"Client": {}, "Server": {"Version": "20.10.24"}}\' ;; esac\n'
        )
        docker.chmod(0o755)
    else:  # the build information of a docker CLI; the file cannot run, so it is never asked
        go_program(docker, ldflags_lines(cli))
    server = _Engine(tmp_path / "engine.sock", answers)
    try:
        found = ask_engine([str(docker)], scan(RUN), {"PATH": "/usr/bin:/bin"}, server.path)
    finally:
        targets = server.stop()
    assert (found.engine, found.reads_cdi, found.reason) == (engine, reads_cdi, reason)
    assert targets == asked
    assert (calls.read_text().splitlines() if calls.exists() else []) == cli_calls
    said = [f"GET {t}" for t in asked] + [f"docker {c.split()[0]}" for c in cli_calls]
    assert [a for a in found.asked if not a.startswith("the docker CLI")] == said


def _agent_row(socket_path: str, **row: object) -> dict[str, object]:
    """The node's agent's ``GET /engines/json`` (this machine's), one engine in it (``row``
    overrides)."""
    engine: dict[str, object] = {
        "Socket": socket_path,
        "Following": True,
        "Version": "26.1.5+dfsg1",
        "CDISpecDirs": ["/etc/cdi"],
        "ReadAt": 1796467200.5,
    }
    return {"BootId": BOOT_ID.read_text().strip(), "Engines": [{**engine, **row}]}


CLI_INFO = "the docker CLI's build information"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@pytest.mark.parametrize(
    ("row", "cli", "expected"),
    [
        pytest.param({}, DOCKER_CE_CLI, (True, ON, (AGENT_ENGINES, CLI_INFO)), id="cdi-on"),
        pytest.param(
            {}, OLD_CLI,
            (False, "the docker CLI 24.0.7 cannot pass CDI devices (25.0 on can)",
             (AGENT_ENGINES, CLI_INFO)),
            id="old-cli",
        ),
        pytest.param(
            {"CDISpecDirs": []}, DOCKER_CE_CLI, (False, OFF, (AGENT_ENGINES,)), id="cdi-off"
        ),
        pytest.param(
            {"Version": "20.10.24+dfsg1", "CDISpecDirs": []}, DOCKER_CE_CLI,
            (False, "Docker reads CDI from 25.0 on", (AGENT_ENGINES,)), id="docker-20.10",
        ),
        pytest.param({"Following": False}, DOCKER_CE_CLI, None, id="not-following"),
        pytest.param({"Version": None, "CDISpecDirs": None}, DOCKER_CE_CLI, None, id="no-facts"),
        pytest.param({"Socket": "/nonexistent/docker.sock"}, DOCKER_CE_CLI, None, id="elsewhere"),
        pytest.param({"CDISpecDirs": "/etc/cdi"}, DOCKER_CE_CLI, None, id="odd-dirs"),
    ],
)  # fmt: skip
def test_the_cdi_question_answered_by_the_node_s_agent(
    tmp_path: Path,
    row: dict[str, object],
    cli: str,
    expected: tuple[bool, str, tuple[str, ...]] | None,
) -> None:
    """The agent's word on the engine of that same socket file (here through a link, as
    ``/var/run`` links to ``/run``): no question to the engine itself (nothing listens)."""
    docker = tmp_path / "docker"
    go_program(docker, ldflags_lines(cli))
    engine = tmp_path / "run" / "docker.sock"
    engine.parent.mkdir()
    engine.touch()
    (tmp_path / "var-run").symlink_to(engine.parent)
    answer = _agent_row(str(tmp_path / "var-run" / "docker.sock"))
    answer["Engines"][0].update(row)  # type: ignore[index]
    found = agent_engine_cdi(answer, str(engine), [str(docker)], scan(RUN), {"PATH": "/bin"})
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert (found.engine, found.reads_cdi, found.reason, found.asked) == (
        f"Docker {row.get('Version', '26.1.5+dfsg1')}",
        *expected,
    )


def test_an_agent_answer_that_is_not_the_route_s_says_nothing(tmp_path: Path) -> None:
    engine = tmp_path / "docker.sock"
    engine.touch()
    row = _agent_row(str(engine))
    answers: list[object] = [
        None,
        [],
        {"Engines": {}},
        {"Engines": ["x"]},
        {"Engines": [{}]},
        {**row, "BootId": "another-node"},  # through a tunnel: another kernel's agent
        {**row, "BootId": None},
        {"Engines": row["Engines"]},
    ]
    for answer in answers:
        assert agent_engine_cdi(answer, str(engine), ["docker"], scan(RUN), {}) is None


class _LocalAgent:
    """The local agent's connection as ``CdiChoice`` uses it: ``GET /engines/json``."""

    node = "localhost"

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.asked: list[str] = []

    def get_json(self, path: str, params: object = None) -> object:
        self.asked.append(path)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _choice_world(tmp_path: Path, **environ: str) -> tuple[CdiChoice, str]:
    """A ``CdiChoice`` of a run whose engine socket is a dockerd 26 with CDI on (answering
    /_ping and /info) and whose docker CLI records version 28.2.2."""
    where = _bin(tmp_path, "cli")
    go_program(where / "docker", ldflags_lines(DOCKER_CE_CLI))
    (where / "docker").chmod(0o755)  # found on PATH as execvp would (it is never run)
    options = _options(f"{where}:/usr/bin:/bin", **environ)
    socket_path = str(tmp_path / "engine.sock")
    return CdiChoice(options, scan(RUN), socket_path), socket_path


def test_the_local_agent_s_word_spares_the_engine_its_questions(tmp_path: Path) -> None:
    choice, socket_path = _choice_world(tmp_path)
    server = _Engine(Path(socket_path), DOCKER_26)
    agent = _LocalAgent(_agent_row(socket_path))
    try:
        assert choice(agent) is True  # type: ignore[arg-type]
        assert choice(agent) is True  # type: ignore[arg-type]  # decided once
    finally:
        assert server.stop() == []  # dockerd was asked nothing
    assert agent.asked == ["/engines/json"]
    assert choice.engine is not None
    assert choice.engine.asked == (AGENT_ENGINES, CLI_INFO)


@pytest.mark.parametrize(
    "agent",
    [
        pytest.param(None, id="no local agent (a remote node's, or none)"),
        pytest.param(
            _LocalAgent(AgentHttpError("localhost", "/engines/json", 404, "404: Not Found")),
            id="an agent before the route",
        ),
        pytest.param(_LocalAgent({"Engines": []}), id="an agent that follows no engine"),
    ],
)
def test_without_the_agent_s_word_the_engine_is_asked(
    tmp_path: Path, agent: _LocalAgent | None
) -> None:
    choice, socket_path = _choice_world(tmp_path)
    server = _Engine(Path(socket_path), DOCKER_26)
    try:
        assert choice(agent) is True  # type: ignore[arg-type]
    finally:
        assert server.stop() == ["/_ping", "/info"]
    assert choice.engine is not None
    assert choice.engine.asked == ("GET /_ping", "GET /info", CLI_INFO)


def test_an_agent_that_did_not_answer_before_a_pull_is_asked_again(tmp_path: Path) -> None:
    """The agent asked before a pull (``_refuse_before_pull``) did not answer: its word is
    not remembered as none, so the check that a lease holds asks it again after the pull
    (else the run would take its lease on an engine the agent does not follow)."""
    choice, _ = _choice_world(tmp_path)
    silent = _LocalAgent(NodeError("localhost", "connection refused"))
    assert choice.engines(silent) is None  # type: ignore[arg-type]
    answer = {"BootId": "b", "Engines": []}
    agent = _LocalAgent(answer)
    assert choice.engines(agent) is answer  # type: ignore[arg-type]
    assert choice.engines(agent) is answer  # type: ignore[arg-type]  # then remembered
    assert agent.asked == ["/engines/json"]
    old = _LocalAgent(AgentHttpError("localhost", "/engines/json", 404, "404: Not Found"))
    (tmp_path / "old").mkdir()
    choice, _ = _choice_world(tmp_path / "old")
    assert choice.engines(old) is None  # type: ignore[arg-type]
    assert choice.engines(agent) is None  # type: ignore[arg-type]  # an agent before it
    assert agent.asked == ["/engines/json"]


def test_nv_cdi_decides_without_the_agent(tmp_path: Path) -> None:
    choice, socket_path = _choice_world(tmp_path, NV_CDI="no")
    agent = _LocalAgent(_agent_row(socket_path))
    assert choice(agent) is False  # type: ignore[arg-type]
    assert agent.asked == []


@pytest.mark.parametrize(
    ("printed", "reads_cdi", "reason"),
    [
        ("Docker version 26.1.5+dfsg1, build a72d7cd", True, ON),
        (
            "Docker version 20.10.24+dfsg1, build 297e128",
            False,
            "the docker CLI 20.10.24+dfsg1 cannot pass CDI devices (25.0 on can)",
        ),
    ],
)
def test_a_cli_that_does_not_record_its_version_is_asked_it_once(
    tmp_path: Path, printed: str, reads_cdi: bool, reason: str
) -> None:
    """Debian's and Ubuntu's docker CLI (``-trimpath``): ``docker --version`` once, then
    remembered, where ``docker info`` ran at every run."""
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli_program(bin_dir / "docker", printed, calls)
    environment = {"PATH": f"{bin_dir}:/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    found = []
    for _ in range(2):
        server = _Engine(tmp_path / "engine.sock", DOCKER_26)
        try:
            found.append(ask_engine(["docker"], scan(RUN), environment, server.path))
        finally:
            assert server.stop() == ["/_ping", "/info"]
        (tmp_path / "engine.sock").unlink()
    for each in found:
        assert (each.engine, each.reads_cdi, each.reason) == (
            "Docker 26.1.5+dfsg1",
            reads_cdi,
            reason,
        )
    assert found[0].asked[2:] == (CLI_INFO, "docker --version")
    assert found[1].asked[2:] == (CLI_INFO, "docker --version, remembered")
    assert calls.read_text().splitlines() == ["--version"]


def test_a_tcp_engine_whose_id_a_lease_asked_takes_the_agent_s_word(tmp_path: Path) -> None:
    """``DOCKER_HOST=tcp://...`` with a lease: the check asked the agent's rows and the
    engine's ``ID`` (``GET /info`` over plain HTTP); the row of that ``ID`` (the agent of
    another machine, here) says whether it reads CDI: no ``docker version`` to run."""
    where = _bin(tmp_path, "cli")
    go_program(where / "docker", ldflags_lines(DOCKER_CE_CLI))
    (where / "docker").chmod(0o755)
    port, read = _answering_tcp(_json("200 OK", {"ID": "52N2:AD6T"}))
    options = _options(f"{where}:/usr/bin:/bin", DOCKER_HOST=f"tcp://127.0.0.1:{port}")
    answer = _agent_row("/var/run/docker.sock")
    answer["BootId"] = "another-machine"
    answer["Engines"][0]["ID"] = "52N2:AD6T"  # type: ignore[index]
    choice = CdiChoice(options, scan(RUN), None, lease_address=f"tcp://127.0.0.1:{port}")
    agent = _LocalAgent(answer)
    assert choice.engines(agent) == answer  # type: ignore[arg-type]
    assert choice.lease_engine_id() == "52N2:AD6T"
    assert choice(None) is True
    assert choice.engine is not None
    assert choice.engine.asked == (AGENT_ENGINES, CLI_INFO)
    assert [request.split(b" ", 2)[1] for request in read] == [b"/info"]
    # another daemon's ID: the agent says nothing of it (the engine is asked)
    docker = [str(where / "docker")]
    assert agent_engine_cdi(answer, "", docker, scan(RUN), {}, engine_id="ANOTHER") is None


def test_a_docker_command_of_several_words_is_seen_through_for_the_lease_check(
    cli_path: str, tmp_path: Path
) -> None:
    """``NV_DOCKER='sudo docker -D'`` (nvidia-docker 1.0's own example), ``env VAR=...
    docker``, ``docker -H ...``: the engine docker's CLI gets past the prefixes, in the
    environment each gives it, with ``NV_DOCKER``'s global options before the command
    line's. The engine questions themselves stay the CLI's (``engine_socket``)."""
    config = tmp_path / "docker-config"  # no config.json: no current context
    users = "unix:///run/user/7/docker.sock"
    base = {"DOCKER_HOST": users, "DOCKER_CONFIG": str(config)}
    for nv_docker, args, expected in [
        ("sudo -E docker", RUN, users),  # the caller's environment
        ("sudo --preserve-env=DOCKER_CONFIG docker -D", RUN, "unix:///var/run/docker.sock"),
        ("docker -H unix:///srv/d.sock", RUN, "unix:///srv/d.sock"),
        ("docker -H unix:///srv/d.sock", ["-H", "unix:///srv/e.sock", *RUN], "unix:///srv/e.sock"),
        ("env DOCKER_HOST=tcp://127.0.0.1:2375 docker", RUN, "tcp://127.0.0.1:2375"),
        ("env -u DOCKER_HOST docker", RUN, "unix:///var/run/docker.sock"),
        ("sudo podman", RUN, None),
        ("nice docker", RUN, None),  # a prefix not seen through
        ("sudo -h docker", RUN, None),
    ]:
        options = _options(cli_path, NV_DOCKER=nv_docker, **base)
        assert cli_engine_address(options, scan(args)) == expected, nv_docker
        assert engine_socket(options, scan(args)) is None, nv_docker
    # settings it cannot read (a config.json that is not a file): it cannot say
    config.mkdir()
    (config / "config.json").mkdir()
    options = _options(cli_path, NV_DOCKER="sudo -E docker", DOCKER_CONFIG=str(config))
    assert cli_engine_address(options, scan(RUN)) is None


def test_a_service_socket_the_wrapper_may_not_look_at_is_its_path_s_user_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``sudo -u alice podman`` run by bob: the agent follows alice's service at
    ``/run/user/<alice>/podman/podman.sock``, which bob may not stat (alice's runtime
    directory is hers alone): its path says whose it is."""
    from controller.wrapper import engine_cdi  # noqa: PLC0415

    service = "/run/user/4321/podman/podman.sock"
    real_stat = os.stat

    def stat(path: str, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith("/run/user/4321/"):
            raise PermissionError(13, "Permission denied", path)
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)
    answer = {
        "BootId": BOOT_ID.read_text().strip(),
        "Engines": [{"Socket": service, "Following": True, "Version": None, "ID": None}],
    }
    assert engine_cdi.follows_own_engine(answer, 4321) is True
    assert engine_cdi.follows_own_engine(answer, 4322) is False
    answer["Engines"][0]["Following"] = False  # type: ignore[index]
    assert engine_cdi.follows_own_engine(answer, 4321) is False
