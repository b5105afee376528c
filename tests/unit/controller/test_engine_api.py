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
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from controller.options import Options
from controller.wrapper.docker_args import scan
from controller.wrapper.engine_api import (
    DEFAULT_SOCKET,
    NO_SUCH_IMAGE,
    engine_socket,
    image_labels,
    server_version,
)
from controller.wrapper.engine_cdi import ask_engine

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
        ({"NV_DOCKER": "/usr/bin/docker"}, RUN),
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
    listener.listen(1)

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _json(status: str, body: object) -> bytes:
    text = json.dumps(body).encode()
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status.encode(), len(text), text)


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


@pytest.mark.parametrize(
    ("server", "reads_cdi", "cli_calls"),
    [
        ("20.10.24+dfsg1", False, []),  # older than CDI: the socket's answer is enough
        ("28.2.2", True, ["info --format {{json .CDISpecDirs}}"]),  # then the CLI's info
    ],
)
def test_the_cdi_question_asks_the_socket_first(
    tmp_path: Path, server: str, reads_cdi: bool, cli_calls: list[str]
) -> None:
    calls = tmp_path / "calls"
    docker = tmp_path / "docker"
    docker.write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        'case "$1" in info) echo \'["/etc/cdi"]\' ;; *) echo \'{"Client": {}}\' ;; esac\n'
    )
    docker.chmod(0o755)
    path = tmp_path / "engine.sock"
    thread = _answering(path, _json("200 OK", {"Version": server, "ApiVersion": "1.41"}))
    found = ask_engine([str(docker)], scan(RUN), {"PATH": "/usr/bin:/bin"}, str(path))
    thread.join(5)
    assert (found.engine, found.reads_cdi) == (f"Docker {server}", reads_cdi)
    assert (calls.read_text().splitlines() if calls.exists() else []) == cli_calls
