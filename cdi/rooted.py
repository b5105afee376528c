"""Paths inside another root directory, resolved as if that directory were ``/``.

A driver container's root seen from the host (``--cdi-dev-root``) and a container's root
file system (seen by the hook) hold symbolic links written for their own ``/``:
``/usr/local/cuda -> /usr/local/cuda-12.4``, ``10_nvidia.json -> /etc/alternatives/...``.
``resolve`` follows such links one component at a time: an absolute target starts again at
the root, ``..`` stops at the root, so the answer is always a path inside it. It reads links
and nothing else (no file is opened), and gives up after ``MAX_LINKS`` links (a loop).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

MAX_LINKS = 40  # as the kernel's own limit for one path


def _parts(path: str) -> list[str]:
    return [part for part in path.split("/") if part and part != "."]


def resolve(root: Path, path: str) -> str | None:
    """Where ``path`` (absolute, as seen inside ``root``) really is inside ``root``, every
    symbolic link followed there: ``/usr/local/cuda/compat`` -> ``/usr/local/cuda-12.4/compat``.
    None when a component is missing or cannot be read, or the links do not end."""
    pending = _parts(path)[::-1]  # a stack: the next component last
    done: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if done:
                done.pop()
            continue
        try:
            target = os.readlink(os.path.join(root, *done, part))
        except OSError as err:
            if err.errno == errno.EINVAL:  # there, and not a link
                done.append(part)
                continue
            return None
        links += 1
        if links > MAX_LINKS:
            return None
        if target.startswith("/"):
            done = []
        pending.extend(_parts(target)[::-1])
    return "/" + "/".join(done)


def on_host(root: Path, inside: str) -> Path:
    """The host path of ``inside`` (a path as seen inside ``root``)."""
    return root / inside.lstrip("/")
