"""Whether the docker command runs rootless Podman, and as which user.

Rootless Podman's containers are its user's own: the node's agent sees them only where it
follows that user's Podman API service, so a lease asked for one is refused unless it does
(``leases.ask_lease``; docs/nvidia-docker.md, "Rootless Podman"). ``rootless_uid(docker,
global_args, environment)`` is the uid of the rootless Podman that ``docker`` (``NV_DOCKER``'s
words) runs with the command's global options, or None: not Podman, root Podman, a service
on another machine, or one not looked at. It runs only when a lease is asked, and reads a few
small files (no subprocess: docs/nvidia-docker.md, "Speed"):

1. Prefixes, seen through (``command_prefixes``): ``env``, ``sudo``, ``runuser -u`` and
   ``doas``, each with the user and the environment it gives podman; one not seen through:
   None.
2. The program: ``podman`` or ``podman-remote`` by name; else the file found as execvp finds
   it (``docker`` on ``PATH``), when its real name is one of those (a link, as some
   ``podman-docker`` packages install) or when it is a small script (``#!``, read up to
   ``SCRIPT_BYTES``) with a line ``exec <dir>/podman ...`` (Debian's and Fedora's
   ``podman-docker``: ``exec /usr/bin/podman "$@"``); the script's literal words before
   ``"$@"`` count as podman's options.
3. Where its containers are made. A local ``podman`` makes them as the user it runs as:
   rootless unless root. A client of a service (``podman-remote``, ``--remote``, ``--url``,
   ``-H``/``--host``, ``--connection``/``-c``, ``--context NAME``, ``CONTAINER_HOST``,
   ``CONTAINER_CONNECTION``, a containers.conf ``remote = true``) talks to the URL Podman
   chooses (``podman_connections``: its options, its variables, a connection's URI from
   ``podman-connections.json`` or containers.conf's ``service_destinations``, a default
   connection, else Podman's default socket, ``$XDG_RUNTIME_DIR/podman/podman.sock`` for a
   user and ``/run/podman/podman.sock`` for root). A ``unix:`` socket there is rootless
   Podman of the socket's owner unless root owns it (one that is not there: podman fails;
   one the wrapper's user may not look at, which ``sudo -u USER`` reaches: the ``<uid>`` of
   its ``/run/user/<uid>/`` path, else USER's); ``ssh://`` and ``tcp://`` are a service on
   another machine; a connection named that is not there: podman fails (None). Where
   Podman 4 and 5 may choose differently (containers.conf's ``remote_uri``), the first of
   their sockets that is a user's counts.
"""

from __future__ import annotations

import os

from controller.wrapper import docker_args, docker_cli, podman_connections, podman_labels
from controller.wrapper.command_prefixes import FLAG, VALUE, read_options, through_prefixes
from controller.wrapper.engine_cdi import runtime_dir_owner

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

SCRIPT_BYTES = 4096  # podman-docker's script is about 200 bytes
PODMAN_NAMES = ("podman", "podman-remote")
_FALSE = ("false", "f", "0")  # how pflag's flags are said false (--remote=false), lowered
# Podman's global options that choose its service; any other takes a value unless it is
# one of docker_args' global flags (Podman's pflag knows them all; only these are read).
_PODMAN_OPTIONS = {
    "-c": ("connection", VALUE), "-H": ("host", VALUE), "-r": ("remote", FLAG),
    **{f"-{letter}": (letter, FLAG) for letter in docker_args.GLOBAL_BOOL_SHORT},
    **{f"--{name}": (name, FLAG) for name in docker_args.GLOBAL_BOOL_LONG},
    **{f"--{name}": (name, FLAG) for name in docker_args.PODMAN_GLOBAL_BOOL_LONG},
}  # fmt: skip


def rootless_uid(
    docker: Sequence[str], global_args: Sequence[str], environment: Mapping[str, str]
) -> int | None:
    """The uid of the rootless Podman that ``docker`` runs with ``global_args`` in
    ``environment`` (the edge's), or None (see the module docstring)."""
    seen = through_prefixes(docker, environment)
    if seen is None or not seen[0]:
        return None
    words, uid, env = seen
    client = _podman_client(words[0], env)
    if client is None:
        return None
    name, script_words = client
    options = _podman_options([*script_words, *words[1:], *global_args])
    if options is None:
        return None
    flagged = name == "podman-remote" or _flagged_remote(options, env)
    if not flagged and uid == 0:  # root's Podman, or a service its settings name: root's
        return None
    conf_files = podman_labels.containers_conf(env, uid)
    settings = podman_connections.engine_settings(conf_files)
    if not flagged and settings.get("remote") != "true":
        return uid  # a local podman of a user other than root
    urls = podman_connections.destinations(options, env, settings, conf_files, uid)
    owners = (_socket_owner(url, uid) for url in urls)
    return next((owner for owner in owners if owner is not None), None)


def runs_podman(docker: Sequence[str], environment: Mapping[str, str]) -> bool:
    """``docker`` (``NV_DOCKER``'s words) runs Podman's client, past any ``env``, ``sudo``,
    ``runuser`` or ``doas`` before it: ``podman`` by name, or a ``docker`` that is
    podman-docker's script or a link to ``podman`` (step 2 of the module docstring)."""
    seen = through_prefixes(docker, environment)
    return seen is not None and bool(seen[0]) and _podman_client(seen[0][0], seen[2]) is not None


def _podman_client(word: str, environment: Mapping[str, str]) -> tuple[str, list[str]] | None:
    """``podman`` or ``podman-remote`` where ``word`` runs Podman's client, with the options
    a script adds (see the module docstring); None for anything else."""
    name = os.path.basename(word)
    if name in PODMAN_NAMES:
        return name, []
    try:
        path = docker_cli.found(word, environment)
    except FileNotFoundError:
        return None
    real = os.path.basename(os.path.realpath(path))
    if real in PODMAN_NAMES:
        return real, []
    return _script_exec(path)


def _script_exec(path: str) -> tuple[str, list[str]] | None:
    """The Podman program a small script at ``path`` ``exec``s, and the literal words it
    gives it before ``"$@"``; None where it is not such a script."""
    try:
        with open(path, "rb") as file:
            head = file.read(SCRIPT_BYTES)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    for line in head.decode("utf-8", "replace").splitlines():
        words = [word.strip("\"'") for word in line.split()]
        if len(words) > 1 and words[0] == "exec" and os.path.basename(words[1]) in PODMAN_NAMES:
            given: list[str] = []
            for word in words[2:]:
                if "$" in word or "`" in word:  # "$@" and anything the shell expands
                    break
                given.append(word)
            return os.path.basename(words[1]), given
    return None


def _podman_options(words: Sequence[str]) -> dict[str, str] | None:
    """Podman's global options among ``words`` (all options): name -> its last value."""
    read = read_options(words, _PODMAN_OPTIONS, unknown=VALUE)
    return dict(read[0]) if read is not None else None


def _flagged_remote(options: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """Podman is a client of a service by its options or variables, as its own ``IsRemote``
    reads them (``--remote=false`` wins over the variables, not over ``--url``)."""
    if any(name in options for name in ("url", "host", "connection", "context")):
        return True
    if "remote" in options:
        return options["remote"].lower() not in _FALSE
    return bool(env.get("CONTAINER_HOST") or env.get("CONTAINER_CONNECTION"))


def _socket_owner(url: str, uid: int) -> int | None:
    """The owner of the socket file a ``unix:`` URL (``unix:///path``, ``unix:/path``) names,
    where it is there and not root's; None for root's, for one not there (podman cannot
    use it), and for any other scheme (a service on another machine). One the wrapper may
    not look at (``EACCES``: in another user's ``/run/user/<uid>``, which ``sudo -u`` that
    user's Podman (``uid``) reaches) is that user's: the ``<uid>`` of its path, else ``uid``
    unless root."""
    if not url.startswith("unix:"):
        return None
    path = "/" + url[len("unix:") :].lstrip("/")
    try:
        owner = os.stat(path).st_uid
    except PermissionError:
        found = runtime_dir_owner(path)
        owner = uid if found is None else found
    except (OSError, ValueError):
        return None
    return owner if owner != 0 else None
