"""The watcher of a leased ``nvidia-docker run|create``: the lease back at once when docker
ends before creating the container.

The wrapper becomes docker (``execvp``: docker keeps the PID, the terminal, the signals and
the exit code), so nothing of the wrapper is left to see docker fail. Just before the exec,
``start`` forks a watcher, twice (the first child forks the watcher and exits at once, and
the wrapper reaps it: the watcher is nobody's child, so it is never a zombie under docker,
which reaps only its own children). The watcher:

- starts a session of its own and ignores the terminal's signals (Ctrl-C, Ctrl-\\, Ctrl-Z,
  a hang-up go to docker), and holds ``/dev/null`` as standard input, output and error and
  no other inherited descriptor, so that a pipeline (``nvidia-docker run ... | cat``,
  ``$(nvidia-docker run -d ...)``) ends when docker ends;
- waits for the wrapper's process (docker, after the exec) to end: on a pidfd opened
  before the fork (``os.pidfd_open``: no PID reuse can fool it), else by asking every
  ``POLL_S`` whether the PID is still there;
- if it ends within the watch time, asks the node's agent ``DELETE /leases/{id}/pending``
  (docs/leases.md): the agent releases the lease only if it is still pending and no
  container of its engines carries its labels (a container docker created binds it
  instead). It cannot know docker's exit code (docker is not its child), so it asks after
  every run; after a run that created its container the answer is 409 and nothing changes;
- exits: by itself when docker outlives the watch time, and in every case within the
  lease's pending time (an alarm of that many seconds ends it, whatever it waits for).

The watch time and the ask's time share the pending time (``budget``). The agent is
reached as the wrapper reached it (``open_agent``: plain HTTP, HTTPS, a token, SSH with
keys or ssh-agent; never a password prompt, as the watcher has no terminal). Only a grant
that says how long it stays pending (``PendingS``) is watched: an agent that says so
serves the conditional release, and an older one would read the same ``DELETE`` as an
unconditional one.

Cost: ``start`` is two forks and a wait for the first child, in the wrapper, before docker
starts; everything else runs in the watcher.
"""

from __future__ import annotations

import os

from controller.record import record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from controller.transport.endpoint import Endpoint
    from controller.wrapper.gpu_args import Reach

ASK_S = 5.0  # the conditional release's time, at most half the pending time
MAX_WATCH_S = 600.0  # a longer pending time is not watched to its end
POLL_S = 0.05  # without pidfds: how often the PID is looked for
TERMINAL_SIGNALS = ("SIGINT", "SIGQUIT", "SIGTSTP", "SIGHUP", "SIGTTIN", "SIGTTOU")
RELEASE_ANSWERS = (200, 404, 409, 503)


@record
class LeaseWatch:
    """What the watcher needs: the agent the lease came from, how to reach it, the lease
    and how long it stays pending (from the grant)."""

    endpoint: Endpoint
    reach: Reach
    lease: str
    pending_s: float

    @property
    def path(self) -> str:
        """The conditional release of the lease (docs/leases.md)."""
        return f"/leases/{self.lease}/pending"


def watchable(lease: str, pending_s: float | None) -> bool:
    """Whether a grant is watched: its agent said how long it stays pending (so it serves
    the conditional release), and its id is one of the agent's (``lease-N``)."""
    number = lease.removeprefix("lease-")
    return (
        pending_s is not None
        and pending_s > 0
        and number != lease
        and number.isascii()
        and number.isdigit()
    )


def budget(pending_s: float) -> tuple[float, float]:
    """(watch, ask): how long the watcher waits for docker to end, then how long its ask
    may take; together at most the pending time (and ``MAX_WATCH_S`` plus ``ASK_S``)."""
    ask_s = min(ASK_S, pending_s / 2)
    return min(pending_s - ask_s, MAX_WATCH_S), ask_s


def start(watch: LeaseWatch) -> None:
    """Fork the watcher of ``watch`` (see the module docstring); returns in the wrapper
    once the first child has exited. Without a fork (out of processes) there is no
    watcher: the lease then ends by itself after its pending time."""
    watched = os.getpid()
    pidfd = _pidfd(watched)
    try:
        child = os.fork()
    except OSError:
        child = -1
    if child == 0:  # the first child: forks the watcher, exits at once
        try:
            if os.fork() == 0:
                _watcher(watch, watched, pidfd)
        finally:
            os._exit(0)
    if pidfd is not None:
        os.close(pidfd)
    if child > 0:
        os.waitpid(child, 0)


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (Linux 5.3+; close-on-exec, so docker does not hold it), else
    None."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
    except OSError:
        return None
    return fd


def _watcher(watch: LeaseWatch, watched: int, pidfd: int | None) -> None:
    """The watcher's whole life: never returns (``os._exit``)."""
    try:
        import signal  # noqa: PLC0415 (the watcher only: it imports enum)

        os.setsid()
        for name in TERMINAL_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(max(1, int(min(watch.pending_s, MAX_WATCH_S + ASK_S))))
        if pidfd is not None and pidfd < 3:  # the wrapper ran with a standard stream closed
            import fcntl  # noqa: PLC0415

            pidfd = fcntl.fcntl(pidfd, fcntl.F_DUPFD_CLOEXEC, 3)
        _detach(pidfd)
        watch_s, ask_s = budget(watch.pending_s)
        if ended(watched, pidfd, watch_s):
            release_unused(watch, ask_s)
    finally:
        os._exit(0)


def _detach(pidfd: int | None) -> None:
    """``/dev/null`` as standard input, output and error; every other descriptor closed
    but ``pidfd``."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        most = max(int(os.sysconf("SC_OPEN_MAX")), 1024)
    except (OSError, ValueError):
        most = 65536
    if pidfd is None:
        os.closerange(3, most)
    else:
        os.closerange(3, pidfd)
        os.closerange(pidfd + 1, most)


def ended(pid: int, pidfd: int | None, within_s: float) -> bool:
    """Whether process ``pid`` ends within ``within_s``: its pidfd turns readable, or
    (without one) the PID is gone."""
    import time  # noqa: PLC0415

    if pidfd is not None:
        import select  # noqa: PLC0415

        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(max(0, int(within_s * 1000))))
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # there, another user's (NV_DOCKER='sudo docker')
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(POLL_S, left))


def release_unused(watch: LeaseWatch, ask_s: float) -> int | None:
    """Ask the agent to release the lease if it is still pending and unused: the answer's
    status (200 released, 404 gone already, 409 bound to a container, 503 an engine could
    not be asked), or None when no answer came."""
    from controller.errors import ControllerError  # noqa: PLC0415
    from controller.wrapper.gpu_args import open_agent  # noqa: PLC0415

    try:
        with open_agent(watch.endpoint, watch.reach, ask_s) as agent:
            status, _body, _headers = agent.request(
                "DELETE", watch.path, answers=RELEASE_ANSWERS, timeout_s=ask_s
            )
    except (ControllerError, OSError):
        return None
    return status
