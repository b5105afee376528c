"""How the text of an environment variable or a flag becomes a setting's value.

The parsers behind ``controller.options``' declarations. This module imports nothing, so
that the wrapper's pass-through path (``nvidia-docker ps``, which reads only ``NV_DOCKER``
and ``NV_DEBUG``) parses those two exactly as the declarations say without importing
``dataclasses``. A parser raises ``ValueError`` whose message says what a good value is;
the caller names the variable or flag.
"""

from __future__ import annotations

DOCKER_VAR = "NV_DOCKER"
DEBUG_VAR = "NV_DEBUG"
OFF = frozenset({"0", "no", "false", "off"})
ON = frozenset({"1", "yes", "true", "on"})


def words(text: str) -> tuple[str, ...]:
    """A command split on white space (``NV_DOCKER='sudo docker -D'``)."""
    return tuple(text.split())


def switch(text: str) -> bool:
    """Set and not ``0``/``no``/``false``/``off``: on (``NV_DEBUG=1``)."""
    return bool(text.strip()) and text.strip().lower() not in OFF


def yes_no(text: str) -> bool:
    """``yes``/``no`` (also ``1``/``0``, ``true``/``false``, ``on``/``off``)."""
    value = text.strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError("give yes or no")


def paths(text: str) -> tuple[str, ...]:
    """A colon-separated list of files (``NV_SSH_KNOWN_HOSTS=a:b``)."""
    return tuple(part for part in text.split(":") if part)


def gpu_list(text: str) -> str:
    """``NV_GPU`` as the agent's ``dev`` parameter: entries separated by one space."""
    return " ".join(text.replace(",", " ").split())


def expand_home(path: str, home: str) -> str:
    """``~`` and ``~/x`` under ``home`` (the edge's ``HOME``); other paths as they are."""
    if path == "~" or path.startswith("~/"):
        return home + path[1:]
    return path
