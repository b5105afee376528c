"""``nvidia-docker``: docker, with GPUs for the containers of images that ask for them.

Usage: ``nvidia-docker [docker arguments]`` (docs/nvidia-docker.md).

- ``NV_DOCKER``: the docker command, split on white space (default ``docker``);
- ``NV_GPU``: GPUs by index or UUID prefix, commas or spaces (default all);
- ``NV_HOST`` / ``-H`` / ``DOCKER_HOST``: the node whose agent gives the GPU facts;
- ``NV_DEBUG``: tracebacks on errors.

Only ``run`` and ``create`` (also ``container run|create``) change: the GPU arguments go right
after the command word, then docker replaces this process (``execvp``: same pid, so signals
and the exit code are docker's). Everything else is handed to docker untouched; ``version``
first prints ``NVIDIA Docker: <version>`` and a blank line.

Speed: Mesos runs ``docker ps``, ``inspect``, ``logs``, ``stop``, ``rm``, ``version`` through
this wrapper many times per task. That path imports only this module, ``docker_args`` and
``errors`` (all stdlib-free) and execs docker: it never asks the daemon anything, so it also
works while the daemon is down. aiohttp, paramiko and NVML are imported for run/create only.
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


def _log(level: str, message: str) -> None:
    import time  # noqa: PLC0415 (error path only)

    stamp = time.strftime("%Y/%m/%d %H:%M:%S")
    sys.stderr.write(f"{PROG} | {stamp} {level}: {message}\n")
    sys.stderr.flush()


def docker_command(environ: Mapping[str, str]) -> list[str]:
    """``NV_DOCKER`` split on white space, or ``docker``."""
    return environ.get("NV_DOCKER", "").split() or ["docker"]


def plan(args: list[str], environ: Mapping[str, str]) -> list[str]:
    """The docker argv to exec for ``nvidia-docker args`` (may print, may raise)."""
    docker = docker_command(environ)
    command = docker_args.scan(args)
    if command.wants_gpus_check:
        from controller.wrapper.gpu_args import gpu_arguments  # noqa: PLC0415 (slow path only)

        extra, warnings = gpu_arguments(command, docker, environ)
        for warning in warnings:
            _log("Warning", warning)
        return [*docker, *command.with_inserted(extra)]
    if command.command == "version" and command.command_index == command.global_end:
        from agent import __version__  # noqa: PLC0415

        sys.stdout.write(f"NVIDIA Docker: {__version__}\n\n")
        sys.stdout.flush()
    return [*docker, *args]


def exec_docker(argv: Sequence[str]) -> None:
    """Replace this process with docker (only returns by raising)."""
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
    environ = os.environ
    try:
        exec_docker(plan(args, environ))
    except ControllerError as err:
        if environ.get("NV_DEBUG"):
            import traceback  # noqa: PLC0415

            traceback.print_exc()
        _log("Error", str(err))
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # a bug or an unforeseen failure: still one line
        if environ.get("NV_DEBUG"):
            raise
        _log("Error", f"{type(err).__name__}: {err} (set NV_DEBUG=1 for the traceback)")
        return 1
    return 1  # not reached: exec_docker returns only by raising


if __name__ == "__main__":
    sys.exit(main())
