"""A fake container engine that answers whatever a test says, and processes it speaks of.

``hostile_engine(socket_path, answer)`` serves ``GET /containers/<id>/json`` on a unix
socket, as dockerd and Podman's API service do, but answers with the byte pieces that
``answer(path)`` yields: a huge or endless body, a header that never ends, a trickle (the
generator may wait between pieces). Each piece is sent as it comes, so a 100 MB answer is
never held whole; a client that hangs up ends the answer, and so does ``ANSWER_DEADLINE_S``.
``requests`` lists the paths asked, so that a test knows its answer was delivered.

``container_process(scope)`` runs a ``sleep`` in a cgroup named ``scope`` (say
``docker-<id>.scope`` or ``libpod-<id>.scope``), the name a container's cgroup has, so that
an agent reading its ``/proc/<pid>/cgroup`` takes it for a process of that container. The
cgroup is made on cgroup v2 (``/sys/fs/cgroup``, or a hybrid machine's ``unified``), else on
cgroup v1's ``pids`` hierarchy, and removed afterwards; it needs root.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import socketserver
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tests.support.memory_cgroup import CGROUP_ROOT
from tests.support.prerequisites import require_root, unavailable

ANSWER_DEADLINE_S = 60.0  # no answer runs longer, whatever it yields
MAX_REQUEST_BYTES = 64 * 1024

Answer = Callable[[str], Iterable[bytes]]  # the request's path -> the pieces to send


class HostileEngine:
    """The server's state, as a test sees it."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.requests: list[str] = []
        self.lock = threading.Lock()

    def asked(self) -> list[str]:
        with self.lock:
            return list(self.requests)


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = False  # server_close() joins the answers in flight
    block_on_close = True

    def __init__(self, path: Path, answer: Answer, engine: HostileEngine) -> None:
        self.answer = answer
        self.engine = engine
        super().__init__(str(path), _Handler)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(ANSWER_DEADLINE_S)
        head = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in head and len(head) < MAX_REQUEST_BYTES:
                piece = sock.recv(4096)
                if not piece:
                    return
                head += piece
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        path = parts[1] if len(parts) == 3 else request_line
        with self.server.engine.lock:
            self.server.engine.requests.append(path)
        deadline = time.monotonic() + ANSWER_DEADLINE_S
        with contextlib.suppress(OSError):  # the client hung up: the answer ends
            for piece in self.server.answer(path):
                if time.monotonic() > deadline:
                    break
                sock.sendall(piece)


@contextlib.contextmanager
def hostile_engine(socket_path: Path, answer: Answer) -> Iterator[HostileEngine]:
    """Serve ``answer`` on ``socket_path`` (bound, so connectable, on entry) until exit."""
    engine = HostileEngine(socket_path)
    server = _Server(socket_path, answer, engine)
    thread = threading.Thread(target=server.serve_forever, name="hostile-engine", daemon=True)
    thread.start()
    try:
        yield engine
    finally:
        server.shutdown()
        server.server_close()  # waits for the answers still being sent
        thread.join()
        with contextlib.suppress(FileNotFoundError):
            socket_path.unlink()


def _cgroup_hierarchy() -> Path:
    for candidate in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        if (candidate / "cgroup.controllers").is_file():
            return candidate  # cgroup v2
    pids = CGROUP_ROOT / "pids"
    if not (pids / "cgroup.procs").is_file():
        unavailable("needs a cgroup hierarchy (cgroup v2, or cgroup v1's pids) for processes")
    return pids


def _remove_when_empty(path: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # its process is still being reaped


@contextlib.contextmanager
def container_process(scope: str) -> Iterator[int]:
    """The PID of a ``sleep`` whose cgroup is ``.../<scope>``: a container's, to the agent."""
    require_root()
    parent = _cgroup_hierarchy() / f"nvidia-docker-test-containers-{secrets.token_hex(4)}"
    leaf = parent / scope
    try:
        leaf.mkdir(parents=True)
    except OSError as err:
        unavailable(f"cannot make a cgroup here: {err}")
    procs = leaf / "cgroup.procs"

    def enter() -> None:
        procs.write_text(f"{os.getpid()}\n")

    try:
        proc = subprocess.Popen(["sleep", "600"], preexec_fn=enter)  # noqa: PLW1509
        try:
            yield proc.pid
        finally:
            proc.kill()
            proc.wait()
    finally:
        _remove_when_empty(leaf)
        _remove_when_empty(parent)
