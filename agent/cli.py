"""The command line of ``nvidia-docker-plugin``: flags (each with an env var) -> ``Config``.

A thin click command, as uvicorn's: its options are made from ``agent.config``'s
declarations (one per ``Config`` field), it only builds the ``Config`` and hands it to
``agent.server.run``; ``--dump-node`` and ``-v`` answer and exit. Every option also reads
an ``NVIDIA_DOCKER_PLUGIN_*`` environment variable (the flag wins); docs/agent.md lists them.
``main`` first rewrites 1.0's Go forms of ``-l``, ``-d`` and ``-s`` (``-l=ADDR``) as click
reads them (``go_flag_forms``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from agent import __version__
from agent.config import Config, Option, options
from agent.errors import EXIT_OK, EXIT_STARTUP_FAILED, StartupError
from agent.logs import PROG, debug_enabled, setup_logging
from agent.process import loop_factory

log = logging.getLogger(PROG)

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _param_type(option: Option) -> click.ParamType | None:  # type: ignore[type-arg]
    if option.kind == "dir":
        return click.Path(file_okay=False, path_type=Path)
    if option.kind == "file":
        return click.Path(dir_okay=False, path_type=Path)
    if option.kind == "float":
        return click.FloatRange(min=option.minimum)
    if option.kind == "int":
        return click.IntRange(min=None if option.minimum is None else int(option.minimum))
    if option.kind == "choice":
        return click.Choice(option.choices)
    return None


def _callback(option: Option) -> Callable[[click.Context, click.Parameter, Any], Any] | None:
    """Text to value (``option.parse``), and an empty value as ``None`` where it turns the
    setting off: click takes an empty environment variable for an unset one (and would use
    the default), so that case is read here."""
    if option.parse is None and not option.empty_is_none:
        return None

    def convert(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        from_default = param.name is not None and (
            ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT
        )
        if option.empty_is_none and (
            value in ("", None) or (from_default and os.environ.get(option.env_var) == "")
        ):
            return None
        if option.parse is None or value is None:
            return value
        try:
            return option.parse(str(value))
        except ValueError as err:
            raise click.BadParameter(str(err)) from None

    return convert


def _option(name: str, option: Option, default: Any) -> Decorator:
    """The click option of one ``Config`` field."""
    return click.option(
        *option.flags,
        name,
        default=default,
        show_default=default is not None,
        envvar=option.env_var,
        show_envvar=True,
        type=_param_type(option),
        callback=_callback(option),
        metavar=option.metavar,
        help=option.help,
    )


def _settings(command: Callable[..., Any]) -> Callable[..., Any]:
    for name, option, default in reversed(options()):  # click applies the last one first
        command = _option(name, option, default)(command)
    return command


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"NVIDIA Docker plugin: {__version__}")
        ctx.exit(EXIT_OK)


@click.command(name=PROG, context_settings={"help_option_names": ["-h", "--help"]})
@_settings
@click.option(
    "--dump-node",
    "dump_target",
    metavar="FILE",
    help="Write this node's GPU facts as a node file (- for stdout) and exit.",
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
def command(dump_target: str | None, **settings: Any) -> None:
    """The NVIDIA Docker node agent: GPU discovery, REST API and Docker volume plugin."""
    setup_logging()
    if dump_target is not None:
        sys.exit(dump_node(settings["simulate"], dump_target))
    private = _keep_simulation_private(click.get_current_context(), settings)
    try:
        _serve(Config(**settings))
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


# What a simulated node must not share with the machine unless asked: Docker finds a plugin
# socket in /run/docker/plugins, Podman and Docker 25+ read /var/run/cdi, a real agent keeps
# its volumes in the volume directory, and the host's linker cache names another driver.
MACHINE_WIDE = ("socket_dir", "volume_dir", "cdi_spec_dir", "ldcache", "state_dir")


def _keep_simulation_private(ctx: click.Context, settings: dict[str, Any]) -> Path | None:
    """With ``--simulate``, every machine-wide setting left at its default is made private:
    the plugin socket, the volumes and the state in a new temporary directory (returned,
    removed at exit), no CDI spec, no driver files (the node is fake; so would be what it
    hands out). None when no directory had to be made."""
    if settings["simulate"] is None:
        return None
    variables = {name: option.env_var for name, option, _ in options()}
    defaulted = [
        n
        for n in MACHINE_WIDE
        if ctx.get_parameter_source(n) is ParameterSource.DEFAULT
        and os.environ.get(variables[n]) is None  # set, even empty: the operator's choice
    ]
    if not defaulted:
        return None
    moved = [what for name, what in _PRIVATE_WORDS if name in defaulted]
    # a directory only when something moves into it (a kill -9 would leave it behind)
    private = Path(tempfile.mkdtemp(prefix="nvidia-docker-simulated-")) if moved else None
    replaced = {
        "socket_dir": private / "plugins" if private else None,
        "volume_dir": private / "volumes" if private else None,
        "state_dir": private / "state" if private else None,
        "cdi_spec_dir": None,
        "ldcache": None,
    }
    for name in defaulted:
        settings[name] = replaced[name]
    flags = {"socket_dir": "-s", "volume_dir": "-d", "cdi_spec_dir": "--cdi-spec-dir",
             "ldcache": "--ldcache", "state_dir": "--state-dir"}  # fmt: skip
    said = [f"{_and(moved)} in {private}"] if moved else []
    said += ["no CDI spec"] if "cdi_spec_dir" in defaulted else []
    said += ["no driver files"] if "ldcache" in defaulted else []
    log.info(
        "Simulated node: nothing machine-wide is touched (%s) but the REST port; give %s to "
        "use the machine's",
        "; ".join(said),
        ", ".join(flags[n] for n in defaulted),
    )
    return private


_PRIVATE_WORDS = (
    ("socket_dir", "plugin socket"),
    ("volume_dir", "volumes"),
    ("state_dir", "state"),
)


def _and(words: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _serve(config: Config) -> None:
    _check_tls_options(config.tls_cert, config.tls_key, config.tls_client_ca)
    try:
        factory, loop_name = loop_factory(config.event_loop)
    except StartupError as err:
        log.error("Error: %s", err)
        sys.exit(EXIT_STARTUP_FAILED)
    log.info("Event loop: %s", loop_name)
    from agent.server import run  # noqa: PLC0415 - aiohttp and NVML only when serving

    with asyncio.Runner(loop_factory=factory) as runner:
        sys.exit(runner.run(run(config)))


def _check_tls_options(cert: Path | None, key: Path | None, client_ca: Path | None) -> None:
    if (cert is None) != (key is None):
        raise click.UsageError("--tls-cert and --tls-key go together: give both, or neither")
    if client_ca is not None and cert is None:
        raise click.UsageError("--tls-client-ca needs TLS: give --tls-cert and --tls-key too")


# nvidia-docker-plugin 1.0 read its flags with Go's flag package, which also takes them as
# -l=ADDR, --l ADDR and --l=ADDR; click alone would read -l=ADDR as the value "=ADDR" (and
# -d=/dir as the relative directory "=/dir").
_GO_FLAGS = ("l", "d", "s")


def go_flag_forms(args: list[str]) -> list[str]:
    """``args`` with 1.0's Go forms of its flags with a value (``-l=ADDR``, ``--d DIR``,
    ``--s=DIR``) written as click reads them (``-l ADDR``); every other word as it is."""
    read: list[str] = []
    for arg in args:
        dashes = 2 if arg.startswith("--") else 1 if arg.startswith("-") else 0
        name, eq, value = arg[dashes:].partition("=")
        if dashes and name in _GO_FLAGS and (eq or dashes == 2):
            read.append(f"-{name}")
            if eq:
                read.append(value)
        else:
            read.append(arg)
    return read


def main() -> None:
    """Console script ``nvidia-docker-plugin``."""
    try:
        command.main(args=go_flag_forms(sys.argv[1:]), prog_name=PROG)
    except SystemExit:
        raise
    except Exception as err:  # one line, unless NV_DEBUG asks for the traceback
        if debug_enabled():
            traceback.print_exc()
        print(f"{PROG} | Error: {err}", file=sys.stderr)
        sys.exit(EXIT_STARTUP_FAILED)


def dump_node(simulate: str | None, target: str) -> int:
    """``--dump-node FILE``: read the node (NVML, or ``simulate``), write it as a node file
    to ``target`` (``-``: stdout); the exit code (docs/agent.md), with one log line for an
    error or for what was written."""
    from agent.gpu.dump import dump_to  # noqa: PLC0415 - only for this command

    def report(line: str) -> None:
        (log.error if line.startswith("Error") else log.info)("%s", line)

    return dump_to(simulate, target, report)
