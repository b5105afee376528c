"""Finding the command and the image in docker command lines (Docker 20.10 to 28)."""

from __future__ import annotations

import re
import subprocess

import pytest

from controller.wrapper import cli_versions
from controller.wrapper.docker_args import (
    GLOBAL_BOOL_LONG,
    GLOBAL_BOOL_SHORT,
    PODMAN_GLOBAL_BOOL_LONG,
    PODMAN_GLOBAL_BOOL_SHORT,
    PODMAN_RUN_BOOL_LONG,
    RUN_BOOL_LONG,
    RUN_BOOL_SHORT,
    scan,
)
from tests.support.prerequisites import require_command


def found(line: str) -> tuple[str | None, int, str | None]:
    command = scan(line.split())
    return command.command, command.command_index, command.image


@pytest.mark.parametrize(
    ("line", "command", "command_index", "image"),
    [
        ("run cuda", "run", 0, "cuda"),
        ("create cuda", "create", 0, "cuda"),
        ("container run cuda", "run", 1, "cuda"),
        ("container create --rm cuda", "create", 1, "cuda"),
        ("run -it --rm cuda bash", "run", 0, "cuda"),
        ("run -dit cuda", "run", 0, "cuda"),
        ("run -itv /a:/b cuda", "run", 0, "cuda"),
        ("run -itv/a:/b cuda", "run", 0, "cuda"),
        ("run -e=A=B cuda", "run", 0, "cuda"),
        ("run -e A=B -v x:y -w /w -u 0 -h host -p 80:80 -m 1g cuda", "run", 0, "cuda"),
        ("run --name=x --rm=false cuda", "run", 0, "cuda"),
        ("run --name x --init --privileged --read-only -P -q cuda", "run", 0, "cuda"),
        ("run --sig-proxy --use-api-socket --no-healthcheck cuda", "run", 0, "cuda"),
        ("run --oom-kill-disable --disable-content-trust --publish-all cuda", "run", 0, "cuda"),
        ("run --detach --interactive --tty cuda", "run", 0, "cuda"),
        ("run --gpus all --pull missing --platform linux/amd64 cuda", "run", 0, "cuda"),
        ("run -- cuda", "run", 0, "cuda"),
        ("run --rm -- cuda -c x", "run", 0, "cuda"),
        ("run --future-flag value cuda", "run", 0, "cuda"),  # unknown: takes a value
        # global options, with and without values
        ("-H unix:///x.sock run cuda", "run", 2, "cuda"),
        ("--host=tcp://h:2375 run cuda", "run", 1, "cuda"),
        ("-D -l debug --config /c --context default run cuda", "run", 7, "cuda"),
        ("-c default -Dl debug run cuda", "run", 4, "cuda"),
        ("--tls --tlsverify --tlscacert a --tlscert b --tlskey c run cuda", "run", 8, "cuda"),
        ("--debug --log-level=info container run cuda", "run", 3, "cuda"),
        # everything else passes
        ("ps -a", "ps", 0, None),
        ("inspect run", "inspect", 0, None),
        ("logs -f run", "logs", 0, None),
        ("image inspect cuda", "image", 0, None),
        ("container ls", "container", 0, None),
        ("version", "version", 0, None),
        ("--version", None, -1, None),
        ("-v", None, -1, None),
        ("", None, -1, None),
        ("run", "run", 0, None),
        ("run --rm", "run", 0, None),
        ("run --name", "run", 0, None),
        ("build -t run .", "build", 0, None),
        ("-H run ps", "ps", 2, None),  # -H takes "run" as its value
    ],
)
def test_scan(line: str, command: str | None, command_index: int, image: str | None) -> None:
    assert found(line) == (command, command_index, image)


def test_mesos_command_line() -> None:
    args = [
        "-H",
        "unix:///var/run/docker.sock",
        "run",
        "--cpu-shares",
        "1024",
        "--memory",
        "256m",
        "-e",
        "A=B",
        "-v",
        "x:y",
        "--net",
        "host",
        "--entrypoint",
        "/bin/sh",
        "--name",
        "mesos-abc",
        "nvidia/cuda",
        "-c",
        "cmd",
    ]
    command = scan(args)
    assert (command.command, command.image, command.image_index) == ("run", "nvidia/cuda", 17)
    assert command.docker_host == "unix:///var/run/docker.sock"
    assert command.global_args == ["-H", "unix:///var/run/docker.sock"]
    assert command.with_inserted(["--device=/dev/nvidia0"])[:4] == [
        "-H",
        "unix:///var/run/docker.sock",
        "run",
        "--device=/dev/nvidia0",
    ]
    assert command.with_inserted(["X"])[-4:] == ["mesos-abc", "nvidia/cuda", "-c", "cmd"]


def test_options_with_values_are_recorded() -> None:
    command = scan(["run", "--pull=never", "--platform", "linux/arm64", "-e", "A=B", "cuda"])
    assert command.options["pull"] == "never"
    assert command.options["platform"] == "linux/arm64"
    assert command.options["env"] == "A=B"
    assert scan(["-Htcp://h:1", "ps"]).docker_host == "tcp://h:1"
    assert scan(["-H=tcp://h:2", "ps"]).docker_host == "tcp://h:2"


@pytest.mark.parametrize(
    ("line", "image", "name"),
    [
        ("run --replace --name job -d cuda", "cuda", "job"),
        ("run --rmi --rm --name job cuda", "cuda", "job"),
        ("create --no-hosts --passwd --http-proxy=false --name job cuda", "cuda", "job"),
        ("--remote run --name job cuda", "cuda", "job"),
        ("-r --syslog --noout container run --name job cuda", "cuda", "job"),
    ],
)
def test_podman_s_own_flags_without_a_value(line: str, image: str, name: str) -> None:
    """NV_DOCKER=podman: ``--replace`` takes no value, so ``job`` is the name, not the image."""
    command = scan(line.split())
    assert (command.command, command.image, command.options.get("name")) == (
        "run" if "run" in line else "create",
        image,
        name,
    )


def test_help_is_not_a_run() -> None:
    assert not scan(["run", "--help", "cuda"]).wants_gpus_check
    assert scan(["run", "--rm", "cuda"]).wants_gpus_check
    assert not scan(["ps"]).wants_gpus_check


# --- the boolean lists against the installed docker client --------------------------------

_FLAG = re.compile(r"^\s{1,6}(?:-(\w), )?--([a-z0-9-]+)(?: ([a-z0-9-]+))?\s{2,}\S")
# Boolean flags of run newer than some CLIs the tests meet (Debian 13's docker-cli is 26,
# which test-all brings where the machine's CLI is older than 25): the major version that
# added each.
ADDED_IN = {"use-api-socket": 28}


def _cli_major() -> int:
    """The installed docker CLI's major version (``Docker version 26.1.5+dfsg1, ...``)."""
    docker = require_command("docker", "the Docker CLI: scripts/test-all expects Docker 28")
    text = subprocess.run([docker, "--version"], capture_output=True, text=True, check=True)
    said = cli_versions.parse(text.stdout)
    assert said is not None, text.stdout
    return int(said[1].split(".", 1)[0])


def _help_flags(*args: str, program: str | None = None) -> tuple[set[str], set[str]]:
    """(long boolean flags, short boolean flags) from ``docker ... --help`` (or ``program``'s)."""
    docker = program or require_command(
        "docker", "the Docker CLI: scripts/test-all expects Docker 28"
    )
    text = subprocess.run(
        [docker, *args, "--help"], capture_output=True, text=True, check=True
    ).stdout
    long_bools: set[str] = set()
    short_bools: set[str] = set()
    for line in text.splitlines():
        match = _FLAG.match(line)
        if match and match.group(3) is None:
            long_bools.add(match.group(2))
            if match.group(1):
                short_bools.add(match.group(1))
    return long_bools, short_bools


@pytest.mark.parametrize("command", ["run", "create"])
def test_run_boolean_flags_match_docker_help(command: str) -> None:
    long_bools, short_bools = _help_flags(command)
    assert len(long_bools) > 8  # the parser of the help text works
    # every boolean flag of this docker is known...
    assert long_bools <= RUN_BOOL_LONG, f"add to RUN_BOOL_LONG: {long_bools - RUN_BOOL_LONG}"
    assert short_bools <= RUN_BOOL_SHORT, f"add to RUN_BOOL_SHORT: {short_bools - RUN_BOOL_SHORT}"
    if command == "run":  # ...and run knows no boolean that docker does not (create has fewer)
        major = _cli_major()
        assert long_bools == {f for f in RUN_BOOL_LONG if ADDED_IN.get(f, 0) <= major}
        assert short_bools == RUN_BOOL_SHORT


def test_global_boolean_flags_match_docker_help() -> None:
    long_bools, short_bools = _help_flags()
    assert long_bools == GLOBAL_BOOL_LONG - {"help"}  # --help is not listed at the top level
    assert short_bools == GLOBAL_BOOL_SHORT - {"h"}


def test_podman_s_boolean_flags_are_known() -> None:
    podman = require_command("podman", "Podman: scripts/test-all expects Podman 4.3")
    for args, known_long, known_short in (
        (
            (),
            GLOBAL_BOOL_LONG | PODMAN_GLOBAL_BOOL_LONG,
            GLOBAL_BOOL_SHORT | PODMAN_GLOBAL_BOOL_SHORT,
        ),
        (("run",), RUN_BOOL_LONG | PODMAN_RUN_BOOL_LONG, RUN_BOOL_SHORT),
        (("create",), RUN_BOOL_LONG | PODMAN_RUN_BOOL_LONG, RUN_BOOL_SHORT),
    ):
        long_bools, short_bools = _help_flags(*args, program=podman)
        assert len(long_bools) > 3  # the parser of the help text works
        assert long_bools <= known_long, f"unknown {args}: {long_bools - known_long}"
        assert short_bools <= known_short, f"unknown {args}: {short_bools - known_short}"
