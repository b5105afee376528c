"""Where an SSH node really is: ``~/.ssh/config`` applied to an ``ssh://`` endpoint.

``resolve_route(endpoint, config_file)`` reads the OpenSSH client configuration with
paramiko's own parser (``paramiko.SSHConfig``: ``Host`` patterns, and ``Match`` blocks as
paramiko evaluates them) and returns an ``SshRoute``: the target as a ``SshHop``
(``HostName``, ``Port``, ``User``, ``IdentityFile``) and the jump hosts to go through
(``ProxyJump``, each resolved in the same file), or a ``ProxyCommand``. As with ``ssh``,
what the endpoint writes wins over the file: ``ssh://admin@gpu1:2222`` keeps admin and
2222 whatever ``Host gpu1`` says; a bare ``ssh://gpu1`` takes both from it.
``UserKnownHostsFile`` adds known-hosts files; the host key policy itself stays
``NV_SSH_STRICT_HOST_KEY_CHECKING``'s (a config file cannot turn the check off behind the
operator's back).

The file is the one the edge's options name (``Options.ssh_config``: ``~/.ssh/config``,
``NV_SSH_CONFIG`` another, ``none`` none); ``Include`` lines are replaced by the files they
name (``~/.ssh/`` for relative paths, glob patterns), which paramiko's parser would skip. It
is parsed once per process and version of the named file (included files are read with it).
A file that cannot be read is an ``EndpointError``
naming it. Jump hosts' own ``ProxyJump`` lines are not followed (write the whole chain in
the target's ``ProxyJump``, as ``ssh -J`` does).
"""

from __future__ import annotations

import functools
import glob
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import paramiko

from controller.env_text import expand_home
from controller.errors import EndpointError
from controller.transport.endpoint import DEFAULT_SSH_PORT, Endpoint


@dataclass(frozen=True, slots=True)
class SshHop:
    """One SSH server to log in to: as named (``alias``) and as reached."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...] = ()  # from IdentityFile lines, those that exist

    @property
    def where(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{self.user}@{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class SshRoute:
    """How to reach a node: through ``jumps`` (outermost first), or a ``proxy_command``."""

    target: SshHop
    jumps: tuple[SshHop, ...] = ()
    proxy_command: str | None = None
    known_hosts: tuple[str, ...] = ()  # UserKnownHostsFile of the target's entry
    config_file: str | None = None  # the file that was read, if any

    def describe(self) -> str:
        via = " via " + " -> ".join(h.where for h in self.jumps) if self.jumps else ""
        if self.proxy_command:
            via = f" via ProxyCommand {self.proxy_command!r}"
        return f"{self.target.where}{via}"


def _load(path: str | None, home: str) -> paramiko.SSHConfig | None:
    if path is None:
        return None
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise EndpointError(f"SSH config {path}: cannot read it: {err.strerror}") from None
    return _parse(path, stat.st_mtime_ns, stat.st_size, home)


@functools.lru_cache(maxsize=8)
def _parse(path: str, _mtime_ns: int, _size: int, home: str) -> paramiko.SSHConfig:
    try:
        return paramiko.SSHConfig.from_text(_text_with_includes(path, home, 0))
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        name = getattr(err, "filename", None) or path
        where = path if name == path else f"{path} (Include {name})"
        raise EndpointError(f"SSH config {where}: cannot read it: {why}") from None
    except EndpointError:
        raise
    except Exception as err:  # paramiko raises ConfigParseError and bare exceptions
        raise EndpointError(f"SSH config {path}: cannot parse it: {err}") from None


_MAX_INCLUDE_DEPTH = 16  # OpenSSH's READCONF_MAX_DEPTH


def _text_with_includes(path: str, home: str, depth: int) -> str:
    """The file's text, each ``Include`` line replaced in place by the text of the files it
    names (paramiko's parser ignores ``Include``): as ``ssh`` reads a user's file, ``~`` is
    ``home``, a relative path is under ``~/.ssh``, a glob pattern is its matches in sorted
    order, and a name that matches nothing is skipped. An Include inside a ``Host`` or
    ``Match`` block gives that block the included lines before their first ``Host`` or
    ``Match``, and the block's own lines after the Include stay its own; unlike ``ssh``, the
    included file's ``Host`` and ``Match`` blocks are then evaluated even where the outer
    block does not match. Raises ``OSError``, and ``EndpointError`` for Includes nested more
    than 16 deep."""
    with open(path, encoding="utf-8") as file:
        lines = file.read().splitlines()
    out: list[str] = []
    header: str | None = None  # the Host or Match line of the block being read
    for line in lines:
        keyword, _, value = line.strip().replace("=", " ", 1).partition(" ")
        if keyword.lower() in ("host", "match"):
            header = line
        if keyword.lower() != "include":
            out.append(line)
            continue
        if depth >= _MAX_INCLUDE_DEPTH:
            raise EndpointError(
                f"SSH config {path}: Include nested more than {_MAX_INCLUDE_DEPTH} deep "
                "(does a file include itself?)"
            )
        for name in shlex.split(value):
            pattern = os.path.join(home, ".ssh", expand_home(name, home))
            for included in sorted(glob.glob(pattern)):
                if os.path.isfile(included):
                    out.append(_text_with_includes(included, home, depth + 1))
        if header is not None:  # the lines after the Include belong to its block again
            out.append(header)
    return "\n".join(out) + "\n"


def _port(text: object, where: str) -> int:
    value = str(text).strip()
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise EndpointError(f"{where}: Port {value!r} is not a port number (1 to 65535)")
    return int(value)


def _hop(
    config: paramiko.SSHConfig | None,
    alias: str,
    *,
    user: str | None,
    port: int | None,
    default_user: str,
    where: str,
    home: str,
) -> tuple[SshHop, Mapping[str, object]]:
    entry: Mapping[str, object] = config.lookup(alias) if config is not None else {}
    hostname = str(entry.get("hostname") or alias)
    if port is None:
        port = _port(entry["port"], where) if "port" in entry else DEFAULT_SSH_PORT
    if user is None:
        user = str(entry.get("user") or default_user)
    files = entry.get("identityfile") or []
    named = (expand_home(str(f), home) for f in (files if isinstance(files, list) else [files]))
    identities = tuple(f for f in named if Path(f).is_file())
    return SshHop(alias, hostname, port, user, identities), entry


def _jump_spec(spec: str, where: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` (or an alias) -> (user, host, port)."""
    text = spec.strip().removeprefix("ssh://")
    user, at, rest = text.rpartition("@")
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port_text = tail.removeprefix(":")
    else:
        host, _, port_text = rest.partition(":")
    if not host:
        raise EndpointError(f"{where}: bad ProxyJump entry {spec!r} (write [user@]host[:port])")
    return (user if at else None), host, (_port(port_text, where) if port_text else None)


def resolve_route(
    endpoint: Endpoint, config_file: str | None, default_user: str, home: str
) -> SshRoute:
    """The route to an ``ssh://`` endpoint under ``config_file`` (see the module docstring);
    ``default_user``: the user of jump hosts the file gives none (the edge's ``$USER``);
    ``home``: what ``~`` means in the file's paths."""
    config = _load(config_file, home)
    where = f"SSH config {config_file}, Host {endpoint.host}"
    # a jump host's user is its own (the file's, else this machine's), never the target's
    fallback = default_user
    target, entry = _hop(
        config,
        endpoint.host,
        user=None if "user" in endpoint.ssh_defaults else endpoint.user,
        port=None if "ssh_port" in endpoint.ssh_defaults else endpoint.ssh_port,
        default_user=endpoint.user or fallback,
        where=where,
        home=home,
    )
    jumps: list[SshHop] = []
    jump_text = str(entry.get("proxyjump") or "").strip()
    if jump_text and jump_text.lower() != "none":
        for spec in jump_text.split(","):
            user, host, port = _jump_spec(spec, where)
            hop, _ = _hop(
                config, host, user=user, port=port, default_user=fallback, where=where, home=home
            )
            jumps.append(hop)
    proxy = str(entry.get("proxycommand") or "").strip()
    proxy_command = proxy if proxy and proxy.lower() != "none" and not jumps else None
    known = tuple(
        expand_home(p, home) for p in str(entry.get("userknownhostsfile") or "").split() if p
    )
    return SshRoute(
        target,
        tuple(jumps),
        proxy_command,
        known,
        config_file if config is not None else None,
    )
