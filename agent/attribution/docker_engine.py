"""The Docker engine's API on its unix socket, for one question: a container's name and image
(and the labels asked for: ``wanted_labels``).

``GET /containers/<id>/json`` (``docker inspect``), asked through the engine's client
(``agent.engines.http``, whose ``EngineClient`` this is: every answer bounded, each refusal
one line); the fields read are ``Name`` and ``Config.Image``, there since the first API
versions, and ``Config.Labels``. Podman's API service (``podman system service``, the
``podman.socket`` unit) answers the same request the same way on its Docker-compatible
endpoints, so one client serves both (``what`` names the engine in messages).

``listed`` asks the container list for one id instead (``GET /containers/json?all=1`` with
an ``id`` filter: ``docker ps -a --filter id=...``; ``Names``, ``Image``, ``Labels``): dockerd
answers its list from a snapshot, while an inspect waits for the container's lock, which
dockerd holds for as long as the container starts or stops (seconds, where a runtime hook or
a large image is slow: Docker 20.10 and 26 alike). The list's ``Image`` is the image as the
container was created from, or the image's id once that name points to another image.

What is read is bounded as ``agent.engines.http`` says (docs/metrics.md, "What the agent
reads from an engine"); here, the fields: a name longer than ``MAX_NAME_CHARS`` or an image
longer than ``MAX_IMAGE_CHARS`` is cut to that length, its last character ``…``; a
non-printable character is written as its escape (``\\x1b``, ``\\u2028``), so that none
reaches a Prometheus label, a JSON answer or a log line as it is; a field that is not a
string is left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from agent.config import default
from agent.engines.http import (
    CUT,
    DEFAULT_TIMEOUT_S,
    MAX_ANSWER_BYTES,
    MAX_CONCURRENT,
    MAX_DEPTH,
    MAX_HEAD_BYTES,
    MAX_ITEMS,
    BadAnswer,
    EngineClient,
    EngineError,
    EngineTimeout,
    bounded_text,
    parse_answer,
)

# What attribution and its tests have always imported from here: the bounds and the
# parsers are the engine client's (agent.engines.http), named here too.
__all__ = [
    "CUT",
    "DEFAULT_DOCKER_SOCKET",
    "MAX_ANSWER_BYTES",
    "MAX_CONCURRENT",
    "MAX_DEPTH",
    "MAX_HEAD_BYTES",
    "MAX_IMAGE_CHARS",
    "MAX_ITEMS",
    "MAX_NAME_CHARS",
    "BadAnswer",
    "ContainerFacts",
    "DockerEngine",
    "DockerEngineError",
    "EngineTimeout",
    "bounded_text",
    "parse_answer",
]

DEFAULT_DOCKER_SOCKET: Path = default("docker_socket")

MAX_NAME_CHARS = 256  # Docker's names are [a-zA-Z0-9][a-zA-Z0-9_.-]*, in practice < 100
# An image reference: a name of at most 255 characters (the distribution spec), a tag of at
# most 128 and a digest ("@sha256:" and 64 hex digits) fit in 512.
MAX_IMAGE_CHARS = 512
MAX_LABEL_CHARS = 256  # a label value kept (Compose's project and service names are short)

_HEX64 = re.compile(r"[0-9a-f]{64}")

# The engine's errors, by the names attribution has always used: one class for both.
DockerEngineError = EngineError


@dataclass(frozen=True, slots=True)
class ContainerFacts:
    id: str  # the full 64-hex id
    name: str | None  # without Docker's leading "/"; bounded and printable (see above)
    image: str | None  # as the container was created from: "pytorch/pytorch:2.3.1-cuda12.1"
    # The labels the client was asked to keep (``DockerEngine.wanted_labels``), sorted by key;
    # each value bounded and printable as the name is.
    labels: tuple[tuple[str, str], ...] = ()


class DockerEngine(EngineClient):
    """A client of one Docker engine (or Podman's API service); ``close()`` it when done."""

    access_hint = (
        " (this user may not use the socket: give it the socket's group, "
        "see docs/metrics.md, 'Container names: who may ask the engine')"
    )

    def __init__(
        self,
        socket_path: Path = DEFAULT_DOCKER_SOCKET,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        what: str = "the Docker engine",
    ):
        super().__init__(socket_path, timeout_s, what=what)
        # The label keys whose values the facts keep (the usage ledger's owner labels, its
        # idle policy label); every other label is dropped as it is read.
        self.wanted_labels: frozenset[str] = frozenset()

    async def inspect(self, container_id: str) -> ContainerFacts | None:
        """The container's name, image and wanted labels; ``None`` when the engine has no such
        container.

        ``DockerEngineError`` when the engine cannot be asked, ``BadAnswer`` (a
        ``DockerEngineError`` too) when its answer breaks a bound. Waiting for a free
        request slot counts in ``timeout_s``: a slow engine holds a scrape up by
        ``timeout_s`` at most.
        """
        about = f"about container {container_id[:12]}"
        path = f"/containers/{quote(container_id, safe='')}/json"
        body = await self.get(path, about)
        if body is None:
            return None
        bad = self.bad_answer(about)
        return _facts(container_id, parse_answer(body, bad), bad, self.wanted_labels)

    async def listed(self, container_id: str) -> ContainerFacts | None:
        """The container's name, image and labels from the engine's container list (which
        does not wait for a starting container, as ``inspect`` does); ``None`` when the
        list has no such container. Raises as ``inspect`` does."""
        about = f"about container {container_id[:12]} (its list)"
        item = await self.list_entry(container_id, about)
        if item is None:
            return None
        names = item.get("Names")
        names = names if isinstance(names, list) else []
        # its own name first; a legacy link adds "/other/alias"
        own = [n for n in names if isinstance(n, str) and "/" not in n.removeprefix("/")]
        as_inspected = {
            "Id": item.get("Id"),
            "Name": own[0] if own else (names[0] if names else None),
            "Config": {"Image": item.get("Image"), "Labels": item.get("Labels")},
        }
        return _facts(container_id, as_inspected, self.bad_answer(about), self.wanted_labels)


def _facts(
    container_id: str, body: object, bad: str, wanted: frozenset[str] = frozenset()
) -> ContainerFacts:
    """The facts of a parsed answer: its fields, bounded; ``BadAnswer`` for no object."""
    if not isinstance(body, dict):
        raise BadAnswer(f"{bad}: it is not a JSON object (a container)")
    name = body.get("Name")
    config = body.get("Config")
    image = config.get("Image") if isinstance(config, dict) else None
    full_id = body.get("Id")
    return ContainerFacts(
        id=full_id if isinstance(full_id, str) and _HEX64.fullmatch(full_id) else container_id,
        name=bounded_text(name.removeprefix("/"), MAX_NAME_CHARS)
        if isinstance(name, str)
        else None,
        image=bounded_text(image, MAX_IMAGE_CHARS) if isinstance(image, str) else None,
        labels=_labels(config.get("Labels") if isinstance(config, dict) else None, wanted),
    )


def _labels(labels: object, wanted: frozenset[str]) -> tuple[tuple[str, str], ...]:
    """The wanted labels of ``Config.Labels`` whose values are strings, sorted by key."""
    if not wanted or not isinstance(labels, dict):
        return ()
    kept = [
        (key, bounded_text(value, MAX_LABEL_CHARS) or "")
        for key, value in labels.items()
        if isinstance(key, str) and key in wanted and isinstance(value, str)
    ]
    return tuple(sorted(kept))
