"""``nvidia-docker``: docker, with GPUs for the containers of images that ask for them.

Usage: ``nvidia-docker [docker arguments]`` (docs/nvidia-docker.md). This module is the
wrapper's edge: the only one of the wrapper that reads the environment. Its settings are
``controller.options``' declarations (``NV_GPU``, ``NV_GPU_WAIT``, ``NV_CPUSET``, ``NV_HOST``,
``NV_CDI``, TLS, SSH, ...), built into one ``Options`` for ``run``/``create``; the pass-through
path reads only ``NV_DOCKER`` and ``NV_DEBUG``, with the same parsers (``controller.env_text``).

Only ``run`` and ``create`` (also ``container run|create``) change: the GPU arguments go right
after the command word (for a lease, ``NV_GPU=auto...`` or docker's ``--gpus``, also its
labels and cpuset, and ``--gpus`` itself is dropped), then docker replaces this process
(``execvp``: same pid, so signals and the exit code are docker's); with a lease, a watcher
forked just before gives the lease back if docker ends without creating the container
(``lease_watch``). Everything else is handed
to docker untouched; ``version`` (without ``--format``) first prints ``NVIDIA Docker:
<version>`` and a blank line;
``--help`` (and ``help``, or no argument) first prints what the wrapper adds and its
variables, then docker's help. Errors are one line,
``nvidia-docker | <date> <time> Error: <message>``, exit code 1.

Speed: Mesos runs ``docker ps``, ``inspect``, ``logs``, ``stop``, ``rm``, ``version``
through this wrapper many times per task. That path imports only this module,
``docker_args``, ``errors`` and ``env_text`` (none imports anything) and execs docker: it
never asks the daemon anything, so it also works while the daemon is down. run/create import
the GPU step; it asks a node's agent over plain HTTP with the standard library
(``controller.transport.plain_http``: a ``socket``, no aiohttp, asyncio or ``http.client``),
and imports aiohttp and ssl only for HTTPS or a token, paramiko only for SSH, NVML only when
no local agent answers, ``logging`` only where one of those may log or ``NV_DEBUG`` is on
(``controller.logs.configure_when_needed``).
"""

from __future__ import annotations

import os
import sys

from controller.errors import ControllerError
from controller.wrapper import docker_args

PROG = "nvidia-docker"
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from controller.wrapper import lease_watch


def _log(level: str, message: str) -> None:
    import time  # noqa: PLC0415 (error path only)

    stamp = time.strftime("%Y/%m/%d %H:%M:%S")
    sys.stderr.write(f"{PROG} | {stamp} {level}: {message}\n")
    sys.stderr.flush()


def docker_command(environ: Mapping[str, str]) -> list[str]:
    """``NV_DOCKER`` split on white space, or ``docker`` (``Options.docker``'s parser)."""
    from controller.env_text import DOCKER_VAR, words  # noqa: PLC0415 (import-free)

    return list(words(environ.get(DOCKER_VAR, ""))) or ["docker"]


def debug_enabled(environ: Mapping[str, str]) -> bool:
    """``NV_DEBUG`` as ``Options.debug`` reads it."""
    from controller.env_text import DEBUG_VAR, switch  # noqa: PLC0415 (import-free)

    return switch(environ.get(DEBUG_VAR, ""))


def plan(
    args: list[str], environ: Mapping[str, str]
) -> tuple[list[str], lease_watch.LeaseWatch | None]:
    """The docker argv to exec for ``nvidia-docker args`` (may print, may raise), and the
    lease its watcher gives back if docker creates no container (``lease_watch``)."""
    docker = docker_command(environ)
    command = docker_args.scan(args)
    if command.wants_gpus_check:
        from controller.logs import configure_when_needed  # noqa: PLC0415 (slow path only)
        from controller.options import Options  # noqa: PLC0415
        from controller.wrapper.gpu_args import gpu_arguments  # noqa: PLC0415

        options = Options.build(
            environ,
            password_prompt=_terminal(sys.stdin),
            progress=_terminal(sys.stderr),
            command="wrapper",
        )
        configure_when_needed(PROG, options.debug)
        changes = gpu_arguments(command, options)
        for warning in changes.warnings:
            _log("Warning", warning)
        argv = [*options.docker, *command.with_inserted(changes.insert, changes.drop)]
        return argv, changes.watch
    if (
        command.command == "version"
        and command.command_index == command.global_end
        and not _formatted(args[command.command_index + 1 :])
    ):
        from agent import __version__  # noqa: PLC0415

        sys.stdout.write(f"NVIDIA Docker: {__version__}\n\n")
        sys.stdout.flush()
    elif command.wants_docker_help:
        from controller.wrapper.help import wrapper_help  # noqa: PLC0415 (help only)

        sys.stdout.write(wrapper_help())
        sys.stdout.flush()
    return [*docker, *args], None


def _formatted(version_args: list[str]) -> bool:
    """``docker version --format``/``-f``: a script reads the output, which stays docker's."""
    return any(
        arg in ("--format", "-f") or arg.startswith(("--format=", "-f")) for arg in version_args
    )


def _terminal(stream: object) -> bool:
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False


def exec_docker(argv: Sequence[str]) -> None:
    """Replace this process with docker (only returns by raising), with ``SIGPIPE`` and
    ``SIGXFSZ`` back at their defaults: Python ignores both at start, and an ignored signal
    stays ignored across ``exec``, so docker would otherwise get ``EPIPE`` where a docker
    started by the shell dies of ``SIGPIPE`` (``nvidia-docker logs -f c | head -1``)."""
    import _signal  # type: ignore[import-not-found]  # noqa: PLC0415 (loaded at start; signal imports enum)

    for name in ("SIGPIPE", "SIGXFSZ"):
        _signal.signal(getattr(_signal, name), _signal.SIG_DFL)
    try:
        os.execvp(argv[0], list(argv))  # noqa: S606 (exec in place: same pid)
    except FileNotFoundError:
        raise ControllerError(
            f"the docker command {argv[0]!r} was not found: install docker, or name it in "
            "NV_DOCKER (e.g. NV_DOCKER='sudo docker')"
        ) from None
    except OSError as err:
        raise ControllerError(f"cannot run {argv[0]!r}: {err.strerror or err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``nvidia-docker``; returns only on error (exit code 1)."""
    args = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ  # the edge: nothing below reads the environment
    try:
        argv, watch = plan(args, environ)
        if watch is not None:
            from controller.wrapper.lease_watch import start  # noqa: PLC0415 (a lease only)

            start(watch)
        exec_docker(argv)
    except ControllerError as err:
        if debug_enabled(environ):
            import traceback  # noqa: PLC0415

            traceback.print_exc()
        _log("Error", str(err))
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # a bug or an unforeseen failure: still one line
        if debug_enabled(environ):
            raise
        _log("Error", f"{type(err).__name__}: {err} (set NV_DEBUG=1 for the traceback)")
        return 1
    return 1  # not reached: exec_docker returns only by raising


if __name__ == "__main__":
    sys.exit(main())
