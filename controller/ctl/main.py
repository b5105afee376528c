"""``nvidia-docker-ctl``: operator commands that run off the node (fleet, Mesos flags, endpoints).

This module is the tool's edge, the only one of the ctl that reads the environment:

- the click group: ``--version``, and help that lists the variables the commands read;
- ``Edge``: the environment and the terminal, taken once per run, from which each command's
  ``Options`` are built (``controller.ctl.flags``: the command's flags win); logging is
  configured here, once (``controller.logs``);
- the error and exit-code scheme of every command: a failure is one line on stderr,
  ``nvidia-docker-ctl | <date> <time> Error: <message>`` (the shape of ``nvidia-docker``'s
  own errors, docs/fleet.md), and the exit code says what kind it was (``controller.errors``,
  docs/fleet.md "Errors and exit codes"): 1 failed, 2 usage (click's own errors included:
  never "internal error" for a user's mistake), 3 no agent reached, 4 a bug (``NV_DEBUG=1``
  for the traceback), 130 interrupted.

Each command group lives in its own module and is added here with one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import click

from agent import __version__
from controller.ctl.endpoint import endpoint
from controller.ctl.fleet import docker_cli, info, status
from controller.ctl.health import health
from controller.ctl.leases import free, leases
from controller.ctl.mesos import mesos
from controller.ctl.usage import idle, usage
from controller.env_text import DEBUG_VAR, switch
from controller.errors import (
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NO_ANSWER,
    EXIT_OK,
    EXIT_USAGE,
    ControllerError,
    NodeError,
    UsageError,
)
from controller.options import Options, brief, environment_help, help_rows

PROG = "nvidia-docker-ctl"


def say(level: str, message: str) -> None:
    """One line on stderr: ``nvidia-docker-ctl | <date> <time> <level>: <message>``."""
    stamp = time.strftime("%Y/%m/%d %H:%M:%S")
    click.echo(f"{PROG} | {stamp} {level}: {message}", err=True)


class Edge:
    """The environment and the terminal of this run; builds the commands' ``Options``."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = dict(environ)
        self.debug = switch(self.environ.get(DEBUG_VAR, ""))
        self.home = self.environ.get("HOME") or Options.build(self.environ).home

    def options(self, given: Mapping[str, Any]) -> Options:
        """The options of this run: the environment's, the command's flags ``given`` winning."""
        width = shutil.get_terminal_size((80, 24)).columns if _terminal(sys.stdout) else None
        return Options.build(
            self.environ,
            given,
            table_width=width,
            progress=_terminal(sys.stderr),
            password_prompt=_terminal(sys.stdin),
        )


def edge() -> Edge:
    """This run's edge (made by the group; a command invoked on its own makes one)."""
    ctx = click.get_current_context(silent=True)
    found = ctx.find_object(Edge) if ctx is not None else None
    if found is None:
        found = Edge(os.environ)
        if ctx is not None:
            ctx.obj = found
    return found


def _terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _environment_epilog() -> str:
    """The variables the commands read besides their flags' own (click keeps ``\\b``
    paragraphs as written)."""
    rows = environment_help(wrapper=False)
    docker = ", ".join(name for name, _ in rows if name.startswith("DOCKER_"))
    own = [(name, brief(text)) for name, text in rows if not name.startswith("DOCKER_")]
    return "\n".join(
        [
            "\b",
            "Environment (each flag names its own variable):",
            *help_rows(own, 2),
            f"  {docker}: docker's address (endpoint without VALUE, as nvidia-docker)",
            "",
            "\b",
            "Errors: one line on stderr, 'nvidia-docker-ctl | <date> <time> Error: <message>'.",
            "Exit codes: 0 done, 1 failed (a node failed or refused, a problem found), 2 usage,",
            "3 no node's agent could be reached, 4 a bug (NV_DEBUG=1), 130 interrupted.",
            "Docs: docs/fleet.md, docs/mesos.md, docs/nvidia-docker.md.",
        ]
    )


class CtlGroup(click.Group):
    """The group whose ``main`` applies the tool's error and exit-code scheme."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        debug = switch(os.environ.get(DEBUG_VAR, ""))
        try:
            code = super().main(args, prog_name or PROG, complete_var, False, **extra)
        except SystemExit:
            raise
        except BaseException as exc:  # every failure becomes one line
            code = _report(exc, debug)
        sys.exit(code if isinstance(code, int) else EXIT_OK)


def _report(exc: BaseException, debug: bool) -> int:
    """Print ``exc`` as the tool's one line; its exit code."""
    from controller.transport.agent_errors import AgentHttpError  # noqa: PLC0415

    if isinstance(exc, KeyboardInterrupt | click.Abort):
        click.echo(f"{PROG}: interrupted", err=True)
        return EXIT_INTERRUPTED
    if isinstance(exc, BrokenPipeError):  # the reader went away (| head): say nothing more
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    if debug:
        import traceback  # noqa: PLC0415

        traceback.print_exception(exc)
    if isinstance(exc, click.UsageError):
        where = exc.ctx.command_path if exc.ctx is not None else PROG
        say("Error", f"{exc.format_message().rstrip('.')}: see {where} --help")
        return EXIT_USAGE
    if isinstance(exc, click.ClickException):
        say("Error", exc.format_message())
        return EXIT_FAILED
    if isinstance(exc, UsageError):
        say("Error", str(exc))
        return EXIT_USAGE
    if isinstance(exc, ControllerError):
        say("Error", str(exc))
        if isinstance(exc, NodeError) and not isinstance(exc, AgentHttpError):
            return EXIT_NO_ANSWER
        return EXIT_FAILED
    say(
        "Error",
        f"internal error: {type(exc).__name__}: {exc} "
        f"({'' if debug else 'set NV_DEBUG=1 for the traceback, and '}report it)",
    )
    return EXIT_INTERNAL


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"{PROG} {__version__}")
        ctx.exit(EXIT_OK)


@click.group(
    cls=CtlGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=_environment_epilog(),
)
@click.option(
    "-v",
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Print the version and exit.",
)
@click.pass_context
def main(ctx: click.Context) -> None:
    """Operate NVIDIA Docker GPU nodes: fleet status and health, Mesos agent flags, endpoints."""
    from controller.logs import configure  # noqa: PLC0415

    ctx.obj = Edge(os.environ)
    configure(PROG, ctx.obj.debug)


main.add_command(mesos)
main.add_command(endpoint)
main.add_command(info)
main.add_command(status)
main.add_command(docker_cli)
main.add_command(health)
main.add_command(leases)
main.add_command(free)
main.add_command(usage)
main.add_command(idle)

if __name__ == "__main__":
    main()
