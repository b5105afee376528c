"""The operator's options: every setting of ``nvidia-docker`` and ``nvidia-docker-ctl``, once.

Each field of ``Options`` carries its default and, with it, a ``Setting``: the
environment variable that sets it, the ``nvidia-docker-ctl`` flags that set it (none: the
environment only), the help, and how text becomes the value. ``Options.build(environ,
given)`` is called once, at each command's edge (``controller.ctl.main``'s click group,
``controller.wrapper.cli.main``): it reads the declared variables of ``environ``, then the
flags ``given`` on the command line win. Below the edge nothing reads the environment:
each part gets what it needs from this one frozen object, or a value taken from it, when it
is built (``tests/unit/controller/test_edge.py`` checks it).

The ctl's click options (``controller.ctl.flags``) and the variables listed in both
commands' help are made from the same declarations, so a setting's name, default, help,
type and variable are written here and nowhere else. A value that cannot be used raises
``OptionsError``: one line naming the variable or flag and what a good value is.

``Options`` is a ``controller.record`` (a frozen value class like a frozen dataclass, made
without importing ``dataclasses``: ``nvidia-docker run`` builds it, docs/nvidia-docker.md,
"Speed"), its fields declared with ``option(default, help, ...)``; the ctl's requests
(``FleetNodes``, ...) are dataclasses whose fields are declared with ``setting``, the same
arguments. ``declarations(cls)`` reads either.
"""

from __future__ import annotations

import os
from types import MappingProxyType

from controller import env_text
from controller.errors import UsageError
from controller.record import field, fields, is_record, record

TYPE_CHECKING = False  # typing, dataclasses, re: not imported on the wrapper's run path
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence
    from typing import Any

DEFAULT_KNOWN_HOSTS = ("~/.ssh/known_hosts", "/etc/ssh/ssh_known_hosts")
DEFAULT_SSH_CONFIG = "~/.ssh/config"
OUTPUTS = ("table", "json", "jsonl")
MESOS_PREFIX = "MESOS_"  # the Mesos agent's own flags in its environment (mesos exec)


class OptionsError(UsageError):
    """A variable or flag whose value cannot be used; the message names it."""


@record
class Setting:
    """How one option is given.

    ``env``: the variable; ``flags``: the ctl's flags (empty: the environment only);
    ``kind``: ``text``, ``path`` (``~`` is the edge's ``HOME``), ``paths`` (colon
    separated), ``int`` / ``float`` (within ``minimum`` and ``maximum``), ``yes_no``,
    ``switch`` (set and not ``0``/``no``: on), ``words``, ``choice`` (one of ``choices``),
    ``flag`` (a ctl flag without a value), ``output`` (``--json`` / ``--jsonl``).
    ``parse`` replaces the kind's own conversion. ``wrapper`` / ``ctl``: which commands
    read it (their help lists it). ``shown``: the default as help shows it.
    """

    help: str
    env: str | None = None
    flags: tuple[str, ...] = ()
    kind: str = "text"
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    wrapper: bool = False
    ctl: bool = True
    shown: str | None = None
    multiple: bool = False  # a ctl flag given several times (a tuple of values)
    choice_help: tuple[str, ...] = ()  # kind output: the help of each choice's flag


def setting(default: Any, help: str, **how: Any) -> Any:
    """A dataclass field with its ``Setting`` (the ctl's requests: ``FleetNodes``, ...)."""
    from dataclasses import field as dataclass_field  # noqa: PLC0415 (the ctl's classes)

    if isinstance(default, list | dict | set):
        raise TypeError("use a tuple: options are frozen")
    return dataclass_field(default=default, metadata={"setting": Setting(help, **how)})


def option(default: Any, help: str, **how: Any) -> Any:
    """A field of ``Options`` (a ``record``) with its ``Setting``: ``setting``'s twin for a
    class that is not a dataclass (``Options`` is on the wrapper's run path, which does not
    import ``dataclasses``: docs/nvidia-docker.md, "Speed")."""
    if isinstance(default, list | dict | set):
        raise TypeError("use a tuple: options are frozen")
    return field(default=default, meta=Setting(help, **how))


def declarations(cls: type) -> Iterator[tuple[str, Setting, Any]]:
    """``(field name, Setting, default)`` of each declared field of a dataclass or a
    ``record`` (``Options``), in order."""
    if is_record(cls):
        for name, default, declared in fields(cls):
            if isinstance(declared, Setting):
                yield name, declared, default
        return
    from dataclasses import fields as dataclass_fields  # noqa: PLC0415 (the ctl's classes)

    for item in dataclass_fields(cls):
        declared = item.metadata.get("setting")
        if isinstance(declared, Setting):
            yield item.name, declared, item.default


def _cdi(text: str) -> str:
    value = text.strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in env_text.ON:
        return "yes"
    if value in env_text.OFF:
        return "no"
    raise ValueError("give yes, no or auto (or unset it to ask the engine)")


def _number(setting: Setting, text: str) -> float:
    kind = "a whole number" if setting.kind == "int" else "a number"
    low, high = setting.minimum, setting.maximum
    span = f" from {low:g} to {high:g}" if low is not None and high is not None else ""
    try:
        value = int(text) if setting.kind == "int" else float(text)
    except ValueError:
        raise ValueError(f"give {kind}{span}") from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"give {kind}{span}")
    return value


def convert(setting: Setting, text: str, where: str, home: str) -> Any:
    """The value of ``text`` given as ``where`` (a variable or a flag); ``OptionsError``."""
    try:
        if setting.parse is not None:
            return setting.parse(text)
        kind = setting.kind
        if kind in ("int", "float"):
            return _number(setting, text.strip())
        if kind == "path":
            return env_text.expand_home(text.strip(), home)
        if kind == "paths":
            return tuple(env_text.expand_home(p, home) for p in env_text.paths(text))
        if kind == "yes_no":
            return env_text.yes_no(text)
        if kind == "switch":
            return env_text.switch(text)
        if kind == "words":
            return env_text.words(text)
        if kind == "choice":
            if text.strip().lower() not in setting.choices:
                raise ValueError("give " + " or ".join(setting.choices))
            return text.strip().lower()
        return text.strip()
    except ValueError as err:
        given = f"{where} {text!r}" if where.startswith("-") else f"{where}={text!r}"
        raise OptionsError(f"{given} cannot be used: {err}") from None


@record
class AutoGpus:
    """``NV_GPU=auto[:N]`` or ``auto:mig:PROFILE[:N]``: ask the node's agent for a lease of
    ``count`` free GPUs (or MIG devices of ``mig_profile``) instead of naming them."""

    count: int = 1
    mig_profile: str | None = None

    @property
    def text(self) -> str:
        """As ``NV_GPU`` writes it: ``auto:2``, ``auto:mig:1g.18gb:2``."""
        mig = f":mig:{self.mig_profile}" if self.mig_profile is not None else ""
        return f"{AUTO}{mig}:{self.count}"


AUTO = "auto"
MAX_AUTO_COUNT = 64  # no node has more GPUs (the agent's bound too)
_MIG_PROFILE = r"[0-9]+(?:c\.[0-9]+)?g\.[0-9]+gb(?:\+[a-z0-9]+)*"  # 1g.18gb, 1c.2g.35gb
_AUTO_GRAMMAR = (
    "auto, auto:N, auto:mig:PROFILE or auto:mig:PROFILE:N (e.g. auto:2, auto:mig:1g.18gb)"
)


def _gpus(text: str) -> str | AutoGpus:
    """``NV_GPU``: a ``dev`` list (``env_text.gpu_list``: no lease, as nvidia-docker 1.0 has it)
    or an ``auto`` form (a lease)."""
    listed = env_text.gpu_list(text)
    words = listed.lower().split()
    if not any(word.split(":", 1)[0] == AUTO for word in words):
        return listed
    if len(words) > 1:
        raise ValueError(f"auto asks for a lease alone, without GPU names: give {_AUTO_GRAMMAR}")
    parts = words[0].split(":")[1:]
    profile = None
    if parts and parts[0] == "mig":
        import re  # noqa: PLC0415 (compiled for a MIG profile only)

        if len(parts) < 2 or not re.fullmatch(_MIG_PROFILE, parts[1]):
            raise ValueError(f"name a MIG profile as nvidia-smi mig -lgip does: {_AUTO_GRAMMAR}")
        profile, parts = parts[1], parts[2:]
    if len(parts) > 1 or (parts and not parts[0].isdigit()):
        raise ValueError(f"give {_AUTO_GRAMMAR}")
    count = int(parts[0]) if parts else 1
    if not 1 <= count <= MAX_AUTO_COUNT:
        raise ValueError(f"the count of auto:N is 1 to {MAX_AUTO_COUNT}: give {_AUTO_GRAMMAR}")
    return AutoGpus(count, profile)


_NO_ENVIRONMENT: Mapping[str, str] = MappingProxyType({})  # an Options built by no edge


def _ssh_config(text: str) -> str | None:
    value = text.strip()
    return None if value.lower() == "none" else value


@record
class Options:
    """What the operator set, for one run of ``nvidia-docker`` or ``nvidia-docker-ctl``."""

    nv_host: str | None = option(
        None,
        "The node whose agent is asked when a command names none, in the NV_HOST grammar "
        "(nvidia-docker: it wins over docker's address; nvidia-docker-ctl: else the local "
        "agent).",
        env="NV_HOST",
        wrapper=True,
    )
    docker: tuple[str, ...] = option(
        ("docker",),
        "The docker command, split on white space (NV_DOCKER='sudo docker', NV_DOCKER=podman).",
        env=env_text.DOCKER_VAR,
        kind="words",
        wrapper=True,
        ctl=False,
        shown="docker",
    )
    gpus: str | AutoGpus = option(
        "",
        "GPUs to give: indices, UUID prefixes (GPU-..., MIG-...) or MIG devices (<gpu>:<mig>), "
        "commas or spaces between them, with no lease, or auto[:N], auto:mig:PROFILE[:N] for "
        "a lease of N free GPUs (MIG devices of PROFILE) from the node's agent.",
        env="NV_GPU",
        parse=_gpus,
        wrapper=True,
        ctl=False,
        shown="all",
    )
    gpu_wait_s: float = option(
        0.0,
        "Seconds a lease ask (NV_GPU=auto..., --gpus) may wait in the node's queue for GPUs "
        "to free; 0: refused at once when not enough are free.",
        env="NV_GPU_WAIT",
        kind="float",
        minimum=0,
        maximum=600,
        wrapper=True,
        ctl=False,
        shown="0",
    )
    gpu_shared: bool = option(
        False,
        "yes: a lease ask takes shared GPUs (as many leases at once as a GPU's sharing count "
        "on the node allows).",
        env="NV_GPU_SHARED",
        kind="yes_no",
        wrapper=True,
        ctl=False,
        shown="no",
    )
    cpuset: bool = option(
        True,
        "no: a leased container gets no --cpuset-cpus/--cpuset-mems of its GPUs' NUMA nodes "
        "(it never does when the command line gives either).",
        env="NV_CPUSET",
        kind="yes_no",
        wrapper=True,
        ctl=False,
        shown="yes",
    )
    cdi: str = option(
        "auto",
        "The GPU arguments' form: auto asks the engine whether it reads CDI (Podman 4+, "
        "Docker 25+ with CDI on); yes: --device=nvidia.com/gpu=UUID without asking; no: the "
        "volume form.",
        env="NV_CDI",
        parse=_cdi,
        wrapper=True,
        ctl=False,
    )
    docker_host: str | None = option(
        None,
        "docker's daemon address; the node when NV_HOST is not set.",
        env="DOCKER_HOST",
        wrapper=True,
        ctl=True,
    )
    docker_context: str | None = option(
        None, "docker's context (docker context ls).", env="DOCKER_CONTEXT", wrapper=True
    )
    docker_config: str | None = option(
        None,
        "docker's configuration directory (its contexts).",
        env="DOCKER_CONFIG",
        kind="path",
        wrapper=True,
        shown="~/.docker",
    )
    tls_ca: str | None = option(
        None,
        "CA certificate(s) that signed the agents' TLS certificates (https:// nodes); "
        "default: the system's CAs.",
        env="NV_TLS_CA",
        flags=("--ca",),
        kind="path",
        metavar="FILE",
        wrapper=True,
    )
    tls_cert: str | None = option(
        None,
        "Client certificate, for agents with mutual TLS.",
        env="NV_TLS_CERT",
        flags=("--cert",),
        kind="path",
        metavar="FILE",
        wrapper=True,
    )
    tls_key: str | None = option(
        None,
        "The key of --cert (default: in the --cert file).",
        env="NV_TLS_KEY",
        flags=("--key",),
        kind="path",
        metavar="FILE",
        wrapper=True,
    )
    token_file: str | None = option(
        None,
        "Bearer token for agents with --token-file (the first token in the file).",
        env="NV_TOKEN_FILE",
        flags=("--token-file",),
        kind="path",
        metavar="FILE",
        wrapper=True,
    )
    ssh_strict_host_key_checking: bool = option(
        True,
        "no: accept any SSH host key and write none (throw-away test nodes only).",
        env="NV_SSH_STRICT_HOST_KEY_CHECKING",
        kind="yes_no",
        wrapper=True,
        shown="yes",
    )
    ssh_known_hosts: tuple[str, ...] = option(
        DEFAULT_KNOWN_HOSTS,
        "known_hosts files, colon separated.",
        env="NV_SSH_KNOWN_HOSTS",
        kind="paths",
        wrapper=True,
        shown=":".join(DEFAULT_KNOWN_HOSTS),
    )
    ssh_identity: tuple[str, ...] = option(
        (),
        "SSH private key files to try, colon separated, before ~/.ssh/id_*.",
        env="NV_SSH_IDENTITY",
        kind="paths",
        wrapper=True,
    )
    ssh_config: str | None = option(
        DEFAULT_SSH_CONFIG,
        "The OpenSSH client configuration to honour (Host aliases, HostName, User, Port, "
        "IdentityFile, ProxyJump, ProxyCommand); none: read none.",
        env="NV_SSH_CONFIG",
        parse=_ssh_config,
        wrapper=True,
    )
    ssh_max_handshakes: int = option(
        32,
        "SSH logins in progress at once (key exchanges are CPU work on both ends).",
        env="NV_SSH_MAX_HANDSHAKES",
        kind="int",
        minimum=1,
        maximum=4096,
        wrapper=True,
    )
    parallel: int = option(
        64,
        "Nodes asked at the same time.",
        env="NV_FLEET_PARALLEL",
        flags=("-p", "--parallel"),
        kind="int",
        minimum=1,
        maximum=4096,
        metavar="N",
    )
    timeout_s: float = option(
        10.0,
        "Seconds for each node as a whole (connect, SSH login, requests).",
        env="NV_FLEET_TIMEOUT",
        flags=("-t", "--timeout"),
        kind="float",
        minimum=0.1,
        maximum=3600,
        metavar="S",
        shown="10",
    )
    output: str = option(
        "table",
        "How the answers are printed: a table (or text), or JSON.",
        flags=("--json", "--jsonl"),
        kind="output",
        choices=OUTPUTS,
        choice_help=(
            "",
            "One JSON document (nodes by name) instead of the table.",
            "One JSON line per node, as they answer.",
        ),
    )
    debug: bool = option(
        False,
        "Print tracebacks with errors, and the libraries' warnings (SSH).",
        env=env_text.DEBUG_VAR,
        kind="switch",
        wrapper=True,
        shown="off",
    )
    # Facts of this run, set by the edge (no variable of ours; HOME and USER as the system).
    home: str = "/"
    user: str = "root"
    table_width: int | None = None  # stdout is a terminal this wide; None: full values
    progress: bool = False  # stderr is a terminal: a progress line may be drawn there
    password_prompt: bool = False  # stdin is a terminal: an SSH login may ask for one
    mesos_environment: tuple[tuple[str, str], ...] = ()  # MESOS_* variables (mesos exec)
    # The edge's whole environment, for the commands the wrapper runs (docker image inspect,
    # ...: they get it, as they would from subprocess) and their search path (PATH); read
    # no setting of ours from it (those are the fields above).
    environment: Mapping[str, str] = field(default=_NO_ENVIRONMENT, compare=False)

    @classmethod
    def build(
        cls,
        environ: Mapping[str, str],
        given: Mapping[str, str] | None = None,
        *,
        table_width: int | None = None,
        progress: bool = False,
        password_prompt: bool = False,
        command: str = "ctl",
    ) -> Options:
        """The options from ``environ``'s variables, the flags ``given`` (field name ->
        text as typed) winning; raises ``OptionsError`` for a value that cannot be used.

        ``command`` (``ctl`` or ``wrapper``): only the variables that command reads are read
        (a bad ``NV_FLEET_TIMEOUT`` is no reason to refuse ``nvidia-docker run``)."""
        flags = given or {}
        home = environ.get("HOME") or _account().pw_dir
        user = environ.get("USER") or environ.get("LOGNAME") or _account().pw_name
        values: dict[str, Any] = {}
        for name, declared, default in declarations(cls):
            if name in flags:
                where = next((f for f in declared.flags if f.startswith("--")), name)
                values[name] = convert(declared, flags[name], where, home)
            elif (
                declared.env is not None
                and (declared.wrapper if command == "wrapper" else declared.ctl)
                and environ.get(declared.env, "").strip()
            ):
                values[name] = convert(declared, environ[declared.env], declared.env, home)
            elif declared.kind == "paths":
                values[name] = tuple(env_text.expand_home(p, home) for p in default)
            elif declared.kind == "path" and isinstance(default, str):
                values[name] = env_text.expand_home(default, home)
        config = values.get("ssh_config", DEFAULT_SSH_CONFIG)
        values["ssh_config"] = None if config is None else env_text.expand_home(config, home)
        mesos = tuple(sorted((k, v) for k, v in environ.items() if k.startswith(MESOS_PREFIX)))
        return cls(
            **values,
            home=home,
            user=user,
            table_width=table_width,
            progress=progress,
            password_prompt=password_prompt,
            mesos_environment=mesos,
            environment=environ,
        )

    @property
    def docker_config_dir(self) -> str:
        """docker's configuration directory: ``DOCKER_CONFIG``, else ``~/.docker``."""
        return self.docker_config or env_text.expand_home("~/.docker", self.home)


def _account() -> Any:
    import pwd  # noqa: PLC0415 (only without HOME or USER)

    return pwd.getpwuid(os.getuid())


def environment_help(*, wrapper: bool) -> list[tuple[str, str]]:
    """``(variable, help with its default)`` of the settings a command reads from the
    environment only (the ctl's flags list their own variables)."""
    rows = []
    for _name, declared, default in declarations(Options):
        if declared.env is None or (declared.flags and not wrapper):
            continue
        if not (declared.wrapper if wrapper else declared.ctl):
            continue
        rows.append((declared.env, declared.help + shown_default(declared, default)))
    return rows


def shown_default(declared: Setting, default: Any) -> str:
    """`` [default: X]`` for help, or nothing."""
    if declared.shown is not None:
        return f" [default: {declared.shown}]"
    if default in (None, "", ()) or isinstance(default, bool):
        return ""
    return f" [default: {default:g}]" if isinstance(default, float) else f" [default: {default}]"


def help_rows(rows: Sequence[tuple[str, str]], indent: int, width: int = 88) -> list[str]:
    """``name  text`` lines, the text wrapped beside the names (a long name on its own)."""
    import textwrap  # noqa: PLC0415 (help only)

    column = indent + max((len(n) for n, _ in rows), default=0) + 2
    lines = []
    for name, text in rows:
        wrapped = textwrap.wrap(text, max(width - column, 30)) or [""]
        lines.append(f"{' ' * indent}{name:<{column - indent}}{wrapped[0]}")
        lines += [" " * column + more for more in wrapped[1:]]
    return lines


def brief(text: str) -> str:
    """A setting's help up to its first sentence or clause (outside parentheses), with its
    default: for one line of a list."""
    import re  # noqa: PLC0415 (help only)

    default = re.search(r" \[default: [^]]*\]$", text)
    body = text[: default.start()] if default else text
    depth = 0
    for at, char in enumerate(body):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char in ".;" and depth == 0 and body[at + 1 : at + 2] == " ":
            body = body[:at]
            break
    return body.rstrip(".") + (default.group(0) if default else "")
