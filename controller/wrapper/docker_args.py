"""Find the command and the image in a docker command line, as the docker CLI would.

``scan(args)`` reads the arguments after ``docker`` (Docker 20.10 to 28) and returns a
``DockerCommand``: where the global options end, the command (``run``, ``create``, also
``container run|create``), the index of the command word (GPU arguments go right after it),
the image and its index, and the ``-H``/``--host``, ``-c``/``--context`` and ``--config``
values if any.
Nothing is changed.

Docker's flag parser (pflag) decides what is a value by knowing every flag; we only need to
know the flags that take *no* value, because everything else takes one:

- long options: ``--rm``, ``--name=x``, ``--name x``, ``--rm=false``;
- short options, combined: ``-it``, ``-dit``, ``-itv a:b`` (``-v`` takes ``a:b``),
  ``-itva:b``, ``-e=A=B``;
- ``--`` ends the options; the first argument that is not an option is the command (global
  level) or the image (``run``/``create``), since docker stops parsing options there.

An option missing from the boolean lists is taken to need a value (the safe guess for a flag
added after this list: most docker flags take one). The lists also hold Podman's own options
without a value (``--replace``, ``--rmi``, ``--remote``, ...: ``NV_DOCKER=podman``).
``tests/unit/controller/test_docker_args`` compares the lists with ``docker --help`` and
``docker run --help`` of the installed client, and with Podman's where it is installed.

This module is on the wrapper's fast path (every ``docker ps`` through ``nvidia-docker``): it
imports nothing and uses a plain slotted class rather than a dataclass (``dataclasses``
imports ``inspect``, several milliseconds).
"""

from __future__ import annotations

# `docker --help`, Docker 20.10 to 28: global options that take no value.
GLOBAL_BOOL_LONG = frozenset({"debug", "tls", "tlsverify", "version", "help"})
GLOBAL_BOOL_SHORT = frozenset("Dvh")
# Global options with a value, for reference (anything not boolean takes one):
# --config, -c/--context, -H/--host, -l/--log-level, --tlscacert, --tlscert, --tlskey.

# `docker run --help` / `docker create --help`, Docker 20.10 to 28: options without a value.
RUN_BOOL_LONG = frozenset(
    {
        "detach",  # -d (run only)
        "disable-content-trust",
        "help",
        "init",
        "interactive",  # -i
        "no-healthcheck",
        "oom-kill-disable",
        "privileged",
        "publish-all",  # -P
        "quiet",  # -q (19.03+)
        "read-only",
        "rm",
        "sig-proxy",  # run only
        "tty",  # -t
        "use-api-socket",  # 28.0+
    }
)
RUN_BOOL_SHORT = frozenset("diPqt")  # note: -h is --hostname in run/create and takes a value

# `podman --help` / `podman run --help`, Podman 4.3 and 5.4 (NV_DOCKER=podman): the options
# without a value that docker does not have. Read this way for docker too, which refuses them
# as unknown flags.
PODMAN_GLOBAL_BOOL_LONG = frozenset({"noout", "remote", "syslog", "transient-store"})
PODMAN_GLOBAL_BOOL_SHORT = frozenset("r")  # -r: --remote
PODMAN_RUN_BOOL_LONG = frozenset(
    {
        "env-host",
        "http-proxy",
        "no-hostname",  # 5.0+
        "no-hosts",
        "passwd",
        "read-only-tmpfs",
        "replace",
        "rmi",
        "rootfs",
        "tls-verify",
        "unsetenv-all",
    }
)
_GLOBAL_BOOL_LONG = GLOBAL_BOOL_LONG | PODMAN_GLOBAL_BOOL_LONG
_GLOBAL_BOOL_SHORT = GLOBAL_BOOL_SHORT | PODMAN_GLOBAL_BOOL_SHORT
_RUN_BOOL_LONG = RUN_BOOL_LONG | PODMAN_RUN_BOOL_LONG

GPU_COMMANDS = frozenset({"run", "create"})


class DockerCommand:
    """What ``scan`` found. Indices are into the scanned ``args`` (not counting ``docker``)."""

    __slots__ = (
        "args",
        "command",
        "command_index",
        "docker_config",
        "docker_context",
        "docker_host",
        "global_end",
        "global_help",
        "help",
        "image",
        "image_index",
        "options",
        "spans",
    )

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.global_end = 0  # args[:global_end] are the global options
        self.command: str | None = None  # "run", "create", "ps", ... ("container run" -> "run")
        self.command_index = -1  # index of the command word ("run" of "container run")
        self.image: str | None = None  # run/create only
        self.image_index = -1
        self.docker_host: str | None = None  # last -H/--host value
        self.docker_context: str | None = None  # last -c/--context value
        self.docker_config: str | None = None  # last --config value (docker's settings directory)
        self.options: dict[str, str] = {}  # run/create long options with a value (last wins)
        # run/create long options with a value, each as (name, first index, end index)
        self.spans: list[tuple[str, int, int]] = []
        self.help = False  # --help among the run/create options
        self.global_help = False  # -h/--help among the global options

    @property
    def global_args(self) -> list[str]:
        """The global options, to reuse for the wrapper's own docker calls (inspect, pull)."""
        return self.args[: self.global_end]

    @property
    def wants_gpus_check(self) -> bool:
        """run/create with an image: the image's labels decide."""
        return self.command in GPU_COMMANDS and self.image is not None and not self.help

    @property
    def wants_docker_help(self) -> bool:
        """docker's own help: ``--help``/``-h`` with no command, ``help`` alone, or nothing."""
        if self.command is None:
            return self.global_help or not self.args
        return self.command == "help" and self.command_index == len(self.args) - 1

    def with_inserted(self, extra: list[str], drop: tuple[str, ...] = ()) -> list[str]:
        """The arguments with ``extra`` right after the command word, without the run/create
        long options named in ``drop`` (``gpus``: the wrapper gives the GPUs itself)."""
        at = self.command_index + 1
        args = self.args
        if drop:
            gone = {i for name, start, end in self.spans if name in drop for i in range(start, end)}
            kept = [arg for i, arg in enumerate(args) if i not in gone]
            at -= sum(1 for i in gone if i < at)
            args = kept
        return [*args[:at], *extra, *args[at:]]

    def given(self, name: str) -> int:
        """How many times the run/create long option ``name`` (with a value) is given."""
        return sum(1 for span in self.spans if span[0] == name)

    def __repr__(self) -> str:
        return (
            f"DockerCommand(command={self.command!r}, command_index={self.command_index}, "
            f"image={self.image!r}, image_index={self.image_index}, "
            f"docker_host={self.docker_host!r})"
        )


_SHORT_ALIASES = {"H": "host", "c": "context", "l": "log-level"}
_RUN_SHORT_ALIASES = {
    "a": "attach",
    "c": "cpu-shares",
    "e": "env",
    "h": "hostname",
    "l": "label",
    "m": "memory",
    "p": "publish",
    "u": "user",
    "v": "volume",
    "w": "workdir",
}


def _skip_options(
    args: list[str],
    start: int,
    bool_long: frozenset[str],
    bool_short: frozenset[str],
    short_names: dict[str, str],
    seen: dict[str, str],
    spans: list[tuple[str, int, int]] | None = None,
) -> tuple[int, bool]:
    """Index of the first positional argument at or after ``start``, and whether --help was
    among the options. Options with a value are recorded in ``seen`` (long name -> value),
    and, given ``spans``, the long ones' places (name, first index, end index)."""
    i, n, wants_help = start, len(args), False
    while i < n:
        arg = args[i]
        if arg == "--":
            return i + 1, wants_help
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if name == "help":
                wants_help = True
            first = i
            if not eq and name not in bool_long:
                i += 1
                value = args[i] if i < n else ""
            if name not in bool_long:
                seen[name] = value
                if spans is not None:
                    spans.append((name, first, min(i, n - 1) + 1))
        elif arg.startswith("-") and len(arg) > 1:
            for at in range(1, len(arg)):
                letter = arg[at]
                if letter in bool_short:
                    if letter == "h" and bool_short is _GLOBAL_BOOL_SHORT:
                        wants_help = True
                    continue
                rest = arg[at + 1 :]
                if rest:
                    value = rest[1:] if rest.startswith("=") else rest
                else:
                    i += 1
                    value = args[i] if i < n else ""
                seen[short_names.get(letter, letter)] = value
                break
        else:
            return i, wants_help
        i += 1
    return n, wants_help


def scan(args: list[str]) -> DockerCommand:
    """Read ``args`` (without the program name); see the module docstring."""
    found = DockerCommand(args)
    global_options: dict[str, str] = {}
    at, found.global_help = _skip_options(
        args, 0, _GLOBAL_BOOL_LONG, _GLOBAL_BOOL_SHORT, _SHORT_ALIASES, global_options
    )
    found.global_end = at
    found.docker_host = global_options.get("host")
    found.docker_context = global_options.get("context")
    found.docker_config = global_options.get("config")
    if at >= len(args):
        return found
    command, command_index = args[at], at
    if command == "container" and at + 1 < len(args) and args[at + 1] in GPU_COMMANDS:
        command, command_index = args[at + 1], at + 1
    found.command, found.command_index = command, command_index
    if command not in GPU_COMMANDS:
        return found
    image_at, found.help = _skip_options(
        args,
        command_index + 1,
        _RUN_BOOL_LONG,
        RUN_BOOL_SHORT,
        _RUN_SHORT_ALIASES,
        found.options,
        found.spans,
    )
    if image_at < len(args):
        found.image, found.image_index = args[image_at], image_at
    return found
