"""Whether the docker command runs rootless Podman, and as which user.

Rootless Podman's containers are its user's own: the node's agent sees them only where it
follows that user's Podman API service, so a lease asked for one is refused unless it does
(``leases.ask_lease``; docs/nvidia-docker.md, "Rootless Podman"). ``rootless_uid(docker,
global_args, environment)`` is the uid of the rootless Podman that ``docker`` (``NV_DOCKER``'s
words) runs with the command's global options, or None: not Podman, root Podman, a service
on another machine, or one not looked at. It runs only when a lease is asked, and reads a few
small files (no subprocess: docs/nvidia-docker.md, "Speed"):

1. Prefixes, seen through: ``env`` (its ``-i``, ``-u NAME`` and ``NAME=VALUE`` words change
   the environment podman gets); ``sudo``, whose podman runs as ``-u USER``
   (``--user=USER``, ``#UID``), else as root (``-g GROUP`` alone: as the caller), in sudo's
   default ``env_reset`` environment (``PATH``, the user's ``HOME`` and the ``VAR=value``
   words; the caller's with ``-E`` or ``--preserve-env``, and the variables named with
   ``--preserve-env=LIST``); util-linux's ``runuser -u USER`` (``--user=USER``; a name, or
   a uid where util-linux takes one; with ``-g``, ``-G``, ``-m``/``-p``, ``-P``, ``-T``,
   ``-w``), run by root only, whose podman runs as USER in the caller's environment with
   USER's ``HOME`` (and ``USER``, ``LOGNAME``; all of the caller's with ``-m``/``-p``); and
   OpenDoas's ``doas`` (``-n``, ``-u USER``: a name or a uid), whose podman runs as USER,
   else root, in the environment doas makes without ``keepenv`` or ``setenv`` in
   doas.conf, which is not read: USER's ``HOME``, ``LOGNAME``, ``USER`` and ``SHELL``, the
   caller's ``TERM`` and ``DISPLAY``, and ``PATH`` (the caller's, where doas finds the
   program). An option the prefix is not known to take (``env -S``, ``sudo -h``), or a
   shell it starts (``runuser USER -c ...``, ``runuser -l``, ``doas -s``), and ``doas -C``
   or ``-L``, which run no command: not seen through (None); so are ``setpriv`` and ``su``.
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

TYPE_CHECKING = False
if TYPE_CHECKING:
    import pwd
    from collections.abc import Mapping, Sequence

SCRIPT_BYTES = 4096  # podman-docker's script is about 200 bytes
PODMAN_NAMES = ("podman", "podman-remote")
_VALUE, _FLAG, _OPTIONAL = "value", "flag", "optional"  # how an option takes its value
_FALSE = ("false", "f", "0")  # how pflag's flags are said false (--remote=false), lowered
# Podman's global options that choose its service; any other takes a value unless it is
# one of docker_args' global flags (Podman's pflag knows them all; only these are read).
_PODMAN_OPTIONS = {
    "-c": ("connection", _VALUE), "-H": ("host", _VALUE), "-r": ("remote", _FLAG),
    **{f"-{letter}": (letter, _FLAG) for letter in docker_args.GLOBAL_BOOL_SHORT},
    **{f"--{name}": (name, _FLAG) for name in docker_args.GLOBAL_BOOL_LONG},
    **{f"--{name}": (name, _FLAG) for name in docker_args.PODMAN_GLOBAL_BOOL_LONG},
}  # fmt: skip
_ENV_OPTIONS = {  # GNU env's, but -S/--split-string (not seen through)
    "-i": ("ignore-environment", _FLAG), "--ignore-environment": ("ignore-environment", _FLAG),
    "-u": ("unset", _VALUE), "--unset": ("unset", _VALUE),
    "-C": ("chdir", _VALUE), "--chdir": ("chdir", _VALUE),
    "-0": ("null", _FLAG), "--null": ("null", _FLAG), "-v": ("debug", _FLAG),
    "--debug": ("debug", _FLAG), "--list-signal-handling": ("list-signal-handling", _FLAG),
    "--block-signal": ("block-signal", _OPTIONAL),
    "--default-signal": ("default-signal", _OPTIONAL),
    "--ignore-signal": ("ignore-signal", _OPTIONAL),
}  # fmt: skip
_SUDO_OPTIONS = {  # sudo's that run a command; -h (help or --host), -e, -l, -v: not seen through
    **{spelled: (long, _VALUE) for short, long in (
        ("u", "user"), ("g", "group"), ("C", "close-from"), ("D", "chdir"), ("p", "prompt"),
        ("r", "role"), ("t", "type"), ("T", "command-timeout"), ("U", "other-user"),
        ("R", "chroot"),
    ) for spelled in (f"-{short}", f"--{long}")},
    **{spelled: (long, _FLAG) for short, long in (
        ("A", "askpass"), ("B", "bell"), ("b", "background"), ("H", "set-home"),
        ("i", "login"), ("K", "remove-timestamp"), ("k", "reset-timestamp"),
        ("n", "non-interactive"), ("N", "no-update"), ("P", "preserve-groups"), ("S", "stdin"),
        ("s", "shell"),
    ) for spelled in (f"-{short}", f"--{long}")},
    "-E": ("preserve-env", _OPTIONAL), "--preserve-env": ("preserve-env", _OPTIONAL),
}  # fmt: skip
_RUNUSER_OPTIONS = {  # util-linux's with -u; -c, -C, -f, -l, -s (a shell), -h, -V: not seen through
    **{spelled: (long, _VALUE) for short, long in (
        ("u", "user"), ("g", "group"), ("G", "supp-group"), ("w", "whitelist-environment"),
    ) for spelled in (f"-{short}", f"--{long}")},
    **{spelled: (long, _FLAG) for short, long in (
        ("m", "preserve-environment"), ("p", "preserve-environment"), ("P", "pty"),
        ("T", "no-pty"),
    ) for spelled in (f"-{short}", f"--{long}")},
}  # fmt: skip
_DOAS_OPTIONS = {"-n": ("n", _FLAG), "-u": ("user", _VALUE)}  # -C, -L, -s: not seen through
_DOAS_KEPT = ("TERM", "DISPLAY", "PATH")  # the caller's, in the environment doas makes


def rootless_uid(
    docker: Sequence[str], global_args: Sequence[str], environment: Mapping[str, str]
) -> int | None:
    """The uid of the rootless Podman that ``docker`` runs with ``global_args`` in
    ``environment`` (the edge's), or None (see the module docstring)."""
    seen = _through_prefixes(docker, environment)
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
    seen = _through_prefixes(docker, environment)
    return seen is not None and bool(seen[0]) and _podman_client(seen[0][0], seen[2]) is not None


def _through_prefixes(
    docker: Sequence[str], environment: Mapping[str, str]
) -> tuple[list[str], int, dict[str, str]] | None:
    """``docker``'s words from its program on, the uid it runs as and its environment,
    past any ``env``, ``sudo``, ``runuser`` and ``doas`` before it; None where a prefix is
    not seen through."""
    words, uid, env = list(docker), os.geteuid(), dict(environment)
    while words and os.path.basename(words[0]) in _PREFIXES:
        read = _PREFIXES[os.path.basename(words[0])](words[1:], env)
        if read is None:
            return None
        words, env, run_as = read
        uid = uid if run_as is None else run_as
    return words, uid, env


def _env(
    words: list[str], environment: Mapping[str, str]
) -> tuple[list[str], dict[str, str], int | None] | None:
    """GNU ``env``'s words (after ``env``): the command's words, its environment, and no
    other user (None)."""
    read = _options(words, _ENV_OPTIONS, unknown=None)
    if read is None:
        return None
    options, at = read
    lone = words[at : at + 1] == ["-"]  # after the options, a lone "-" is -i
    ignore = lone or any(name == "ignore-environment" for name, _ in options)
    env = {} if ignore else dict(environment)
    for name, value in options:
        if name == "unset":
            env.pop(value, None)
    return _assign(words[at + lone :], env), env, None


def _sudo(
    words: list[str], environment: Mapping[str, str]
) -> tuple[list[str], dict[str, str], int | None] | None:
    """sudo's words (after ``sudo``): the command's words, its environment (sudo's default
    ``env_reset``: ``PATH``, the user's ``HOME``, what ``--preserve-env=LIST`` names, the
    ``VAR=value`` words; ``-E``: the caller's), and the uid it runs as (``-u``, else root;
    ``-g`` alone: the invoking user's)."""
    read = _options(words, _SUDO_OPTIONS, unknown=None)
    if read is None:
        return None
    options, at = read
    given = dict(options)
    # -g GROUP alone runs the command as the invoking user, with that group
    invoking = f"#{os.geteuid()}" if "group" in given else "root"
    user = _user(given.get("user", invoking))
    if user is None:
        return None
    uid, home = user
    kept = given.get("preserve-env")  # "": all of them (-E, --preserve-env)
    if kept == "":
        env = dict(environment)
    else:
        env = {"HOME": home} if home else {}
        names = ("PATH", *(kept.split(",") if kept else ()))
        env.update((name, environment[name]) for name in names if name in environment)
    if home and ("set-home" in given or "login" in given):
        env["HOME"] = home
    return _assign(words[at:], env), env, uid


def _runuser(
    words: list[str], environment: Mapping[str, str]
) -> tuple[list[str], dict[str, str], int | None] | None:
    """util-linux runuser's words (after ``runuser``): with ``-u USER``, the command's words,
    its environment (the caller's, with USER's ``HOME``, and ``USER`` and ``LOGNAME`` unless
    USER is root; ``-m``/``-p``: the caller's) and USER's uid. None for its other forms (a
    shell), a user not there, and a caller other than root (runuser refuses). Its options
    end at the command, as if ``--`` came before it (GNU getopt reads on, and runuser fails
    on podman's own options after the command, leasing nothing)."""
    read = _options(words, _RUNUSER_OPTIONS, unknown=None)
    if read is None or os.geteuid() != 0:
        return None
    options, at = read
    given = dict(options)
    if "user" not in given or words[at : at + 1] == ["-"]:  # su's forms; -u with a login
        return None
    entry = _account(given["user"])
    if entry is None:
        return None
    env = dict(environment)
    if "preserve-environment" not in given:
        env["HOME"] = entry.pw_dir
        if entry.pw_uid != 0:
            env.update(USER=entry.pw_name, LOGNAME=entry.pw_name)
    return words[at:], env, entry.pw_uid


def _doas(
    words: list[str], environment: Mapping[str, str]
) -> tuple[list[str], dict[str, str], int | None] | None:
    """OpenDoas's words (after ``doas``): the command's words, the environment doas makes
    (without ``keepenv`` or ``setenv`` in doas.conf: the user's ``HOME``, ``LOGNAME``,
    ``USER`` and ``SHELL``, the caller's ``TERM``, ``DISPLAY`` and ``PATH``, in which doas
    finds the program), and the uid it runs as (``-u USER``, else root)."""
    read = _options(words, _DOAS_OPTIONS, unknown=None)
    if read is None:
        return None
    options, at = read
    entry = _account(dict(options).get("user", "root"))
    if entry is None:
        return None
    env = {name: environment[name] for name in _DOAS_KEPT if name in environment}
    env.update(HOME=entry.pw_dir, LOGNAME=entry.pw_name, USER=entry.pw_name)
    env["SHELL"] = entry.pw_shell
    return words[at:], env, entry.pw_uid


def _account(name: str) -> pwd.struct_passwd | None:
    """The passwd entry of runuser's or doas's user: by name, else by uid; None: none."""
    import pwd  # noqa: PLC0415 (runuser and doas only)

    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    try:
        return pwd.getpwuid(int(name)) if name.isascii() and name.isdigit() else None
    except (KeyError, OverflowError):
        return None


def _user(name: str) -> tuple[int, str] | None:
    """sudo's ``-u`` user (a name or ``#UID``): its uid and home (``""``: unknown); None:
    no such user (sudo refuses it)."""
    import pwd  # noqa: PLC0415 (sudo only)

    number = name[1:] if name.startswith("#") else None
    try:
        entry = pwd.getpwnam(name) if number is None else pwd.getpwuid(int(number))
    except (KeyError, ValueError):
        return (int(number), "") if number is not None and number.isdigit() else None
    return entry.pw_uid, entry.pw_dir


def _assign(words: list[str], env: dict[str, str]) -> list[str]:
    """The words after the leading ``NAME=VALUE`` ones, which are set in ``env``."""
    at = 0
    while at < len(words) and "=" in words[at] and not words[at].startswith("="):
        name, _, value = words[at].partition("=")
        env[name] = value
        at += 1
    return words[at:]


def _options(
    words: Sequence[str], known: Mapping[str, tuple[str, str]], *, unknown: str | None
) -> tuple[list[tuple[str, str]], int] | None:
    """The options at the head of ``words`` as (name, value) pairs, read as getopt and pflag
    read them (``--name=value``, ``--name value``, ``-abc``, ``-uNAME``, ``-u NAME``,
    ``-r=false``; ``--`` ends them), and the index of the first word after them. A flag's
    value is ``true`` unless given (``--remote=false``), an optional value not given is
    ``""``; an option not ``known`` takes a value where ``unknown`` is ``_VALUE``, else None
    (not read)."""
    found: list[tuple[str, str]] = []
    at = 0
    while at < len(words) and words[at].startswith("-") and words[at] != "-":
        word = words[at]
        if word == "--":
            return found, at + 1
        if word.startswith("--"):
            spelled, equals, value = word.partition("=")
            name, kind = known.get(spelled, (spelled[2:], unknown or ""))
            if not kind:
                return None
            if not equals and kind == _VALUE:
                at += 1
                if at >= len(words):
                    return None
                value = words[at]
            elif not equals:
                value = "true" if kind == _FLAG else ""
            found.append((name, value))
        else:
            for index in range(1, len(word)):
                name, kind = known.get(f"-{word[index]}", (word[index], unknown or ""))
                if not kind:
                    return None
                if kind == _FLAG and word[index + 1 : index + 2] == "=":  # pflag's -r=false
                    found.append((name, word[index + 2 :]))
                    break
                if kind != _VALUE:
                    found.append((name, "true" if kind == _FLAG else ""))
                    continue
                value = word[index + 1 :].removeprefix("=")  # -uNAME; pflag's -H=URL
                if not value:
                    at += 1
                    if at >= len(words):
                        return None
                    value = words[at]
                found.append((name, value))
                break
        at += 1
    return found, at


_PREFIXES = {"env": _env, "sudo": _sudo, "runuser": _runuser, "doas": _doas}


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
    read = _options(words, _PODMAN_OPTIONS, unknown=_VALUE)
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
        found = _runtime_dir_owner(path)
        owner = uid if found is None else found
    except (OSError, ValueError):
        return None
    return owner if owner != 0 else None


def _runtime_dir_owner(path: str) -> int | None:
    """The ``<uid>`` of a ``path`` in ``/run/user/<uid>/`` (``/var/run`` too), else None."""
    for runtime in ("/run/user/", "/var/run/user/"):
        number, slash, _ = path.removeprefix(runtime).partition("/")
        if path.startswith(runtime) and slash and number.isascii() and number.isdigit():
            return int(number)
    return None
