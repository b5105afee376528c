"""The words before a program that run it as another user or in another environment.

``through_prefixes(words, environment)`` reads ``NV_DOCKER``'s words past the prefixes it
knows, and returns the words from the program on, the uid the program runs as and the
environment it gets; None where a prefix is not seen through. ``read_options`` reads the
options at the head of a command's words, as getopt and Go's pflag read them; the Podman
and docker checks read their own options with it.

The prefixes:

- ``env``: its ``-i``, ``-u NAME`` and ``NAME=VALUE`` words change the environment;
- ``sudo``: the program runs as ``-u USER`` (``--user=USER``, ``#UID``), else as root
  (``-g GROUP`` alone: as the caller), in sudo's default ``env_reset`` environment
  (``PATH``, the user's ``HOME`` and the ``VAR=value`` words; the caller's with ``-E`` or
  ``--preserve-env``, and the variables named with ``--preserve-env=LIST``); sudo's
  ``secure_path`` is not read;
- util-linux's ``runuser -u USER`` (``--user=USER``; a name, or a uid where util-linux
  takes one; with ``-g``, ``-G``, ``-m``/``-p``, ``-P``, ``-T``, ``-w``), run by root only:
  as USER, in the caller's environment with USER's ``HOME`` (and ``USER``, ``LOGNAME``; all
  of the caller's with ``-m``/``-p``);
- OpenDoas's ``doas`` (``-n``, ``-u USER``: a name or a uid): as USER, else root, in the
  environment doas makes without ``keepenv`` or ``setenv`` in doas.conf, which is not
  read: USER's ``HOME``, ``LOGNAME``, ``USER`` and ``SHELL``, the caller's ``TERM`` and
  ``DISPLAY``, and ``PATH`` (the caller's, where doas finds the program).

An option the prefix is not known to take (``env -S``, ``sudo -h``), or a shell it starts
(``runuser USER -c ...``, ``runuser -l``, ``doas -s``), and ``doas -C`` or ``-L``, which run
no command: not seen through (None); so are ``setpriv`` and ``su``.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    import pwd
    from collections.abc import Mapping, Sequence

VALUE, FLAG, OPTIONAL = "value", "flag", "optional"  # how an option takes its value
_ENV_OPTIONS = {  # GNU env's, but -S/--split-string (not seen through)
    "-i": ("ignore-environment", FLAG), "--ignore-environment": ("ignore-environment", FLAG),
    "-u": ("unset", VALUE), "--unset": ("unset", VALUE),
    "-C": ("chdir", VALUE), "--chdir": ("chdir", VALUE),
    "-0": ("null", FLAG), "--null": ("null", FLAG), "-v": ("debug", FLAG),
    "--debug": ("debug", FLAG), "--list-signal-handling": ("list-signal-handling", FLAG),
    "--block-signal": ("block-signal", OPTIONAL),
    "--default-signal": ("default-signal", OPTIONAL),
    "--ignore-signal": ("ignore-signal", OPTIONAL),
}  # fmt: skip
_SUDO_OPTIONS = {  # sudo's that run a command; -h (help or --host), -e, -l, -v: not seen through
    **{spelled: (long, VALUE) for short, long in (
        ("u", "user"), ("g", "group"), ("C", "close-from"), ("D", "chdir"), ("p", "prompt"),
        ("r", "role"), ("t", "type"), ("T", "command-timeout"), ("U", "other-user"),
        ("R", "chroot"),
    ) for spelled in (f"-{short}", f"--{long}")},
    **{spelled: (long, FLAG) for short, long in (
        ("A", "askpass"), ("B", "bell"), ("b", "background"), ("H", "set-home"),
        ("i", "login"), ("K", "remove-timestamp"), ("k", "reset-timestamp"),
        ("n", "non-interactive"), ("N", "no-update"), ("P", "preserve-groups"), ("S", "stdin"),
        ("s", "shell"),
    ) for spelled in (f"-{short}", f"--{long}")},
    "-E": ("preserve-env", OPTIONAL), "--preserve-env": ("preserve-env", OPTIONAL),
}  # fmt: skip
_RUNUSER_OPTIONS = {  # util-linux's with -u; -c, -C, -f, -l, -s (a shell), -h, -V: not seen through
    **{spelled: (long, VALUE) for short, long in (
        ("u", "user"), ("g", "group"), ("G", "supp-group"), ("w", "whitelist-environment"),
    ) for spelled in (f"-{short}", f"--{long}")},
    **{spelled: (long, FLAG) for short, long in (
        ("m", "preserve-environment"), ("p", "preserve-environment"), ("P", "pty"),
        ("T", "no-pty"),
    ) for spelled in (f"-{short}", f"--{long}")},
}  # fmt: skip
_DOAS_OPTIONS = {"-n": ("n", FLAG), "-u": ("user", VALUE)}  # -C, -L, -s: not seen through
_DOAS_KEPT = ("TERM", "DISPLAY", "PATH")  # the caller's, in the environment doas makes


def through_prefixes(
    docker: Sequence[str], environment: Mapping[str, str]
) -> tuple[list[str], int, dict[str, str]] | None:
    """``docker``'s words from its program on, the uid it runs as and its environment,
    past any ``env``, ``sudo``, ``runuser`` and ``doas`` before it; None where a prefix is
    not seen through."""
    words, uid, env = list(docker), os.geteuid(), dict(environment)
    while words and os.path.basename(words[0]) in PREFIXES:
        read = PREFIXES[os.path.basename(words[0])](words[1:], env)
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
    read = read_options(words, _ENV_OPTIONS, unknown=None)
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
    read = read_options(words, _SUDO_OPTIONS, unknown=None)
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
    read = read_options(words, _RUNUSER_OPTIONS, unknown=None)
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
    read = read_options(words, _DOAS_OPTIONS, unknown=None)
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


def read_options(
    words: Sequence[str], known: Mapping[str, tuple[str, str]], *, unknown: str | None
) -> tuple[list[tuple[str, str]], int] | None:
    """The options at the head of ``words`` as (name, value) pairs, read as getopt and pflag
    read them (``--name=value``, ``--name value``, ``-abc``, ``-uNAME``, ``-u NAME``,
    ``-r=false``; ``--`` ends them), and the index of the first word after them. A flag's
    value is ``true`` unless given (``--remote=false``), an optional value not given is
    ``""``; an option not ``known`` takes a value where ``unknown`` is ``VALUE``, else None
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
            if not equals and kind == VALUE:
                at += 1
                if at >= len(words):
                    return None
                value = words[at]
            elif not equals:
                value = "true" if kind == FLAG else ""
            found.append((name, value))
        else:
            for index in range(1, len(word)):
                name, kind = known.get(f"-{word[index]}", (word[index], unknown or ""))
                if not kind:
                    return None
                if kind == FLAG and word[index + 1 : index + 2] == "=":  # pflag's -r=false
                    found.append((name, word[index + 2 :]))
                    break
                if kind != VALUE:
                    found.append((name, "true" if kind == FLAG else ""))
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


PREFIXES = {"env": _env, "sudo": _sudo, "runuser": _runuser, "doas": _doas}
