"""Run the docker CLI for one question and read its answer, without ``subprocess``.

``ask(argv, environment, timeout_s=None)`` runs ``argv`` (``<docker> image inspect ...``,
``volume inspect``, ``version``, ``info``) in ``environment`` (the edge's: ``Options``),
found on its ``PATH``, with standard input from ``/dev/null`` and its standard output and
error captured, and returns an ``Answer`` (exit code, both outputs as text), as
``subprocess.run(argv, capture_output=True, text=True, stdin=DEVNULL)`` would: a command
that is not found raises ``FileNotFoundError``; a timeout kills the command and raises
``TimeoutError``; an exit by a signal is a negative code.

Why not ``subprocess``: it imports ``signal``, ``threading``, ``selectors``, ``locale`` and
``contextlib``, 4 to 10 ms on the 2-core development machine, more than the rest of the
wrapper's questions (docs/nvidia-docker.md, "Speed"). This is ``os.posix_spawn`` with two
pipes read by ``select.poll``. Unlike ``subprocess`` it leaves the command the signals that
Python ignores (``SIGPIPE``, ``SIGXFSZ``) ignored, as the docker the wrapper finally becomes
has them; nothing here closes a pipe early, so no question notices.
"""

from __future__ import annotations

import os
import select
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

_READ_BYTES = 64 * 1024
_KILL = 9  # SIGKILL on Linux (the signal module costs milliseconds to import)


class Answer:
    """What a docker command said: its exit code and its two outputs (UTF-8 text)."""

    __slots__ = ("returncode", "stderr", "stdout")

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


def found(command: str, environment: Mapping[str, str]) -> str:
    """``command``'s file, looked up on ``environment``'s ``PATH`` as ``subprocess`` looks
    (``posix_spawnp`` would use this process's own); ``FileNotFoundError`` if none."""
    if "/" in command:
        return command
    for directory in environment.get("PATH", os.defpath).split(os.pathsep):
        candidate = os.path.join(directory or ".", command)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(2, "No such file or directory", command)


def ask(
    argv: Sequence[str], environment: Mapping[str, str], timeout_s: float | None = None
) -> Answer:
    """Run ``argv`` and read its answer (see the module docstring)."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        pid = os.posix_spawn(
            found(argv[0], environment),
            list(argv),
            environment,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, out_write, 1),
                (os.POSIX_SPAWN_DUP2, err_write, 2),
            ],
        )
    except BaseException:
        for fd in (out_read, err_read):
            os.close(fd)
        raise
    finally:
        for fd in (out_write, err_write):
            os.close(fd)
    try:
        out, err = _read_both(out_read, err_read, timeout_s)
    except BaseException:  # a timeout, Ctrl-C: the command goes too
        os.kill(pid, _KILL)
        os.waitpid(pid, 0)
        raise
    finally:
        for fd in (out_read, err_read):
            os.close(fd)
    _, status = os.waitpid(pid, 0)
    return Answer(os.waitstatus_to_exitcode(status), _text(out), _text(err))


def _read_both(out_fd: int, err_fd: int, timeout_s: float | None) -> tuple[bytes, bytes]:
    """Both pipes to their end (``TimeoutError`` past ``timeout_s``)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    poller = select.poll()
    for fd in chunks:
        poller.register(fd, select.POLLIN)
    open_fds = len(chunks)
    while open_fds:
        wait_ms = None
        if deadline is not None:
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
        ready = poller.poll(wait_ms)
        if not ready and deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"no answer within {timeout_s:g} s")
        for fd, _event in ready:
            data = os.read(fd, _READ_BYTES)
            if data:
                chunks[fd].append(data)
            else:
                poller.unregister(fd)
                open_fds -= 1
    return b"".join(chunks[out_fd]), b"".join(chunks[err_fd])


def _text(data: bytes) -> str:
    """As ``subprocess``'s text mode reads it: UTF-8, universal newlines."""
    return data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
