"""Small JSON files the wrapper keeps for its user, to skip questions whose answer is known.

``cache_file(environment, name)`` is ``$XDG_CACHE_HOME/nvidia-docker/<name>`` (``~/.cache/
...`` where ``XDG_CACHE_HOME`` is not set: the user's own, as the wrapper runs as them).
``read(path)`` gives its entries, only when the file is this user's (another's is not
believed); ``write(path, entries)`` replaces it in one step (a new file renamed over it, so
a reader sees the old entries or the new ones, never half a file), and only where the
directory is this user's, so that ``sudo`` with the caller's ``HOME`` neither trusts nor
leaves a file there. Nothing here fails a run: a file that cannot be read or parsed reads as
no entries; ``write`` raises ``OSError`` for its caller to ignore.

``identity(stat)`` is how both tell that a file is still the one they saw. Used by
``cli_versions`` (what a CLI's ``--version`` says) and ``podman_labels`` (a Podman image's
labels while its store is unchanged).
"""

from __future__ import annotations

import os

from controller import json_codec

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

MAX_BYTES = 256 * 1024  # read at most this much (a file of a few entries is far smaller)


def cache_file(environment: Mapping[str, str], name: str) -> str | None:
    """Where the file ``name`` is kept for the user of ``environment`` (None: no home)."""
    base = environment.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        home = environment.get("HOME", "")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "nvidia-docker", name)


def identity(found: os.stat_result) -> list[int]:
    """A file's identity as the memories keep it: device, inode, size, modification and
    change times (a file replaced, rewritten or touched has another)."""
    return [found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns]


def read(path: str) -> dict[str, object]:
    """The entries of ``path``: only from a file of this user's, else none."""
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_uid != os.geteuid():
                return {}
            entries = json_codec.loads(file.read(MAX_BYTES))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def owned(directory: str) -> bool:
    """Whether the nearest existing of ``directory`` and its parents is this user's: not
    so under ``sudo`` that keeps the caller's ``HOME``, where root would otherwise leave a
    directory of its own in the caller's home."""
    while not os.path.lexists(directory):
        parent = os.path.dirname(directory)
        if parent == directory:
            return False
        directory = parent
    return os.stat(directory).st_uid == os.geteuid()


def write(path: str, entries: Mapping[str, object]) -> None:
    """Replace ``path`` with ``entries`` in one step, where its directory is this user's."""
    directory = os.path.dirname(path)
    if not owned(directory):
        return
    os.makedirs(directory, mode=0o700, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(json_codec.dumps(dict(entries)))
        os.replace(temporary, path)
    except BaseException:
        try:  # noqa: SIM105 - contextlib is not imported on the run path
            os.unlink(temporary)
        except OSError:
            pass
        raise
