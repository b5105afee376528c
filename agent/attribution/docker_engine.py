"""The Docker engine's API on its unix socket, for one question: a container's name and image.

``GET /containers/<id>/json`` (``docker inspect``), unversioned so that any engine answers
in its own current API version; the fields read (``Name``, ``Config.Image``) have been there
since the first API versions. Podman's API service (``podman system service``, the
``podman.socket`` unit) answers the same request the same way on its Docker-compatible
endpoints, so one client serves both (``what`` names the engine in messages). One aiohttp
session with a unix connector, opened on first use and kept (keep-alive), each request
bounded by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from agent.config import DEFAULT_DOCKER_SOCKET as _DEFAULT_SOCKET

DEFAULT_DOCKER_SOCKET = Path(_DEFAULT_SOCKET)


@dataclass(frozen=True, slots=True)
class ContainerFacts:
    id: str  # the full 64-hex id
    name: str | None  # without Docker's leading "/"
    image: str | None  # as the container was created from: "pytorch/pytorch:2.3.1-cuda12.1"


class DockerEngineError(Exception):
    """The engine cannot be asked (no socket, refused, timeout, not Docker): one line."""


class DockerEngine:
    """A client of one Docker engine; ``close()`` it when done."""

    def __init__(
        self,
        socket_path: Path = DEFAULT_DOCKER_SOCKET,
        timeout_s: float = 2.0,
        *,
        what: str = "the Docker engine",
    ):
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.what = what
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(self.socket_path)),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    async def inspect(self, container_id: str) -> ContainerFacts | None:
        """The container's name and image; ``None`` when the engine has no such container."""
        where = f"{self.what} at unix://{self.socket_path}"
        try:
            async with self._client().get(f"http://docker/containers/{container_id}/json") as r:
                if r.status == 404:
                    return None
                if r.status != 200:
                    raise DockerEngineError(f"{where} answered HTTP {r.status}")
                body = await r.json(content_type=None)
        except TimeoutError:
            raise DockerEngineError(f"{where} did not answer within {self.timeout_s:g} s") from None
        except aiohttp.ClientConnectorError as err:
            hint = ""
            if err.os_error.errno == errno.EACCES:
                hint = (
                    " (this user may not use the socket: give it the socket's group, "
                    "see docs/metrics.md, 'Container names')"
                )
            raise DockerEngineError(f"cannot reach {where}: {err.os_error}{hint}") from None
        except (aiohttp.ClientError, ValueError) as err:
            raise DockerEngineError(f"{where} gave no usable answer: {err}") from None
        return _facts(container_id, body)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            await asyncio.sleep(0)  # let the connector close its transports


def _facts(container_id: str, body: Any) -> ContainerFacts:
    if not isinstance(body, dict):
        raise DockerEngineError("the engine answered JSON that is not a container")
    name = body.get("Name")
    config = body.get("Config")
    image = config.get("Image") if isinstance(config, dict) else None
    full_id = body.get("Id")
    return ContainerFacts(
        id=full_id if isinstance(full_id, str) and full_id else container_id,
        name=name.removeprefix("/") if isinstance(name, str) and name else None,
        image=image if isinstance(image, str) and image else None,
    )
