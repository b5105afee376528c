"""The version a container CLI's program prints, asked once per file and remembered.

``cli_version(program, environment)`` is what ``<program> --version`` says, as ``(name,
version)``: ``("Docker", "26.1.5+dfsg1")`` for ``Docker version 26.1.5+dfsg1, build
a72d7cd``, ``("podman", "4.3.1")`` for ``podman version 4.3.1`` (``podman-remote`` too).
The CDI question (``engine_cdi``) needs it where the program's file does not record its
version for ``go_build_info`` to read: Debian's and Ubuntu's docker CLI (built with
``-trimpath``), which costs a ``docker info`` (about 40 ms) at every run without it, and
Podman, whose ``version`` costs 20 to 100 ms at every run.

A program's answer is remembered in a small JSON file, ``$XDG_CACHE_HOME/nvidia-docker/
cli-versions.json`` (``controller.wrapper.user_cache``: the user's own, believed and written
only where it is theirs), keyed by the program's real path and the identity of its file
(device, inode, size, modification and change times): an upgrade writes a new file or
changes those, and the next run asks again. Only ELF programs are asked and remembered
(None for a script: its answer is whatever it runs now, and the caller asks as it did
before). Reading costs about 0.1 ms.
Nothing here fails a run: a file that cannot be read, written or parsed, or a program that
does not answer, means "ask" (None where the program does not say).
"""

from __future__ import annotations

import os

from controller.wrapper import user_cache

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

ASK_TIMEOUT_S = 10.0
MAX_PROGRAMS = 16  # entries kept (a machine has a docker or two, a podman)
CACHE_NAME = "cli-versions.json"
_ELF = b"\x7fELF"
_NAMES = frozenset(("Docker", "podman", "podman-remote"))
_VERSION_CHARACTERS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.+-_~"
)


def cache_file(environment: Mapping[str, str]) -> str | None:
    """Where the answers are kept for the user of ``environment`` (None: no home)."""
    return user_cache.cache_file(environment, CACHE_NAME)


def parse(printed: str) -> tuple[str, str] | None:
    """``(name, version)`` of a ``--version`` line; None for anything else."""
    words = printed.strip().split()
    if len(words) < 3 or words[1] != "version":
        return None
    return _said(words[0], words[2].rstrip(","))


def _said(name: object, version: object) -> tuple[str, str] | None:
    """``(name, version)`` when both are what a CLI prints (a remembered entry too)."""
    if name not in _NAMES or not isinstance(name, str) or not isinstance(version, str):
        return None
    if not version or not set(version) <= _VERSION_CHARACTERS:
        return None
    return name, version


def cli_version(
    program: str, environment: Mapping[str, str], asked: list[str] | None = None
) -> tuple[str, str] | None:
    """What ``program`` (a path) prints for ``--version`` (see the module docstring),
    remembered; ``asked`` gets ``"<name> --version"`` where the program was run, ``"<name>
    --version, remembered"`` where the answer was known."""
    try:
        real = os.path.realpath(program)
        identity = program_identity(real)
    except OSError:
        return None
    if identity is None:  # a script: its answer is whatever it runs now
        return None
    store = cache_file(environment)
    entries = user_cache.read(store) if store is not None else {}
    known = entries.get(real)
    name = os.path.basename(program)
    if isinstance(known, dict) and known.get("file") == identity:
        said = _said(known.get("name"), known.get("version"))
        if said is not None:
            if asked is not None:
                asked.append(f"{name} --version, remembered")
            return said
    if asked is not None:
        asked.append(f"{name} --version")
    from controller.wrapper import docker_cli  # noqa: PLC0415 (only when asking)

    try:
        answer = docker_cli.ask([real, "--version"], environment, timeout_s=ASK_TIMEOUT_S)
    except OSError:
        return None
    said = parse(answer.stdout) if answer.returncode == 0 else None
    if said is None or store is None:
        return said
    try:
        if program_identity(real) == identity:  # not replaced while it answered
            entries.pop(real, None)
            entries[real] = {"file": identity, "name": said[0], "version": said[1]}
            user_cache.write(store, dict(list(entries.items())[-MAX_PROGRAMS:]))
    except OSError:
        pass
    return said


def program_identity(path: str) -> list[int] | None:
    """The file's identity, or None where ``path`` is not an ELF program."""
    with open(path, "rb") as file:
        if file.read(4) != _ELF:
            return None
        return user_cache.identity(os.fstat(file.fileno()))
