"""The Docker engine's API on its unix socket, for one question: a container's name and image.

``GET /containers/<id>/json`` (``docker inspect``), unversioned so that any engine answers
in its own current API version; the fields read (``Name``, ``Config.Image``) have been there
since the first API versions. Podman's API service (``podman system service``, the
``podman.socket`` unit) answers the same request the same way on its Docker-compatible
endpoints, so one client serves both (``what`` names the engine in messages).

Whatever listens on the socket may answer anything, so everything read from it is bounded
before it can cost memory, time or a log line (docs/metrics.md, "What the agent reads from
an engine"):

- the exchange: one connection per request (``Connection: close``; a lookup is rare, its
  answer cached), connect to last byte within ``timeout_s`` (an answer that trickles in
  times out), at most ``MAX_CONCURRENT`` requests per engine at a time;
- the answer: status line and headers within ``MAX_HEAD_BYTES``; the body within
  ``MAX_ANSWER_BYTES``: a larger ``Content-Length`` is refused before a byte of the body is
  read, and a chunked or close-delimited body is read in pieces and refused one byte past
  the bound, so that an answer that never ends costs no more than one that is too large;
- the JSON: UTF-8, at most ``MAX_DEPTH`` levels of arrays and objects and ``MAX_ITEMS``
  items, checked by a linear scan before it is parsed (Python's parser recurses once per
  level and builds one object per value: 4 MiB of ``[[]]`` would be 134 MB);
- the fields: a name longer than ``MAX_NAME_CHARS`` or an image longer than
  ``MAX_IMAGE_CHARS`` is cut to that length, its last character ``…``; a non-printable
  character is written as its escape (``\\x1b``, ``\\u2028``), so that none reaches a
  Prometheus label, a JSON answer or a log line as it is; a field that is not a string is
  left out.

An answer that breaks a bound is a ``BadAnswer``, one line saying which bound; no message
here repeats what the engine sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from urllib.parse import quote

from agent.config import default
from agent.display import shown

DEFAULT_DOCKER_SOCKET: Path = default("docker_socket")

KIB = 1024
MIB = 1024 * KIB
MAX_HEAD_BYTES = 64 * KIB  # status line and headers; dockerd's are under 1 KiB
# The body: a real inspect answer is a few KB to a few hundred KB (its Env and Labels are
# most of it); 4 MiB holds the largest environment Linux lets a process start with (2 MiB
# with the default 8 MiB stack) with room for labels and mounts.
MAX_ANSWER_BYTES = 4 * MIB
MAX_DEPTH = 32  # levels of arrays and objects, as the plugin's bodies; dockerd's go to 5
# Values in arrays and objects (counted as the commas and brackets outside strings): a real
# answer has a few hundred; the bound keeps what the parser builds to about 10 MB.
MAX_ITEMS = 65_536
MAX_NAME_CHARS = 256  # Docker's names are [a-zA-Z0-9][a-zA-Z0-9_.-]*, in practice < 100
# An image reference: a name of at most 255 characters (the distribution spec), a tag of at
# most 128 and a digest ("@sha256:" and 64 hex digits) fit in 512.
MAX_IMAGE_CHARS = 512
MAX_CONCURRENT = 4  # requests in flight to one engine
CUT = "…"  # the last character of a value that was cut

_READ_BYTES = 64 * KIB
_STATUS_LINE = re.compile(r"HTTP/1\.[01] ([0-9]{3})(?: .*)?")
_DECIMAL = re.compile(r"[0-9]+")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# A JSON string, escapes included; an unterminated one runs to the end. Possessive, so that
# no input makes it backtrack (the scan stays linear in the answer's size).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


@dataclass(frozen=True, slots=True)
class ContainerFacts:
    id: str  # the full 64-hex id
    name: str | None  # without Docker's leading "/"; bounded and printable (see above)
    image: str | None  # as the container was created from: "pytorch/pytorch:2.3.1-cuda12.1"


class DockerEngineError(Exception):
    """The engine cannot be asked (no socket, refused, timeout, not Docker): one line."""


class BadAnswer(DockerEngineError):
    """The engine answered, but not with a container this agent may use (too large, too
    deep, not JSON, not HTTP): one line that says which bound it broke."""


class DockerEngine:
    """A client of one Docker engine (or Podman's API service); ``close()`` it when done."""

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
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)

    @property
    def where(self) -> str:
        """The engine and its socket, as messages name them."""
        return f"{self.what} at unix://{self.socket_path}"

    async def inspect(self, container_id: str) -> ContainerFacts | None:
        """The container's name and image; ``None`` when the engine has no such container.

        ``DockerEngineError`` when the engine cannot be asked, ``BadAnswer`` (a
        ``DockerEngineError`` too) when its answer breaks a bound. Waiting for a free
        request slot counts in ``timeout_s``: a slow engine holds a scrape up by
        ``timeout_s`` at most.
        """
        path = f"/containers/{quote(container_id, safe='')}/json"
        try:
            async with asyncio.timeout(self.timeout_s), self._slots:
                body = await self._get(path, container_id)
        except TimeoutError:
            raise DockerEngineError(
                f"{self.where} did not answer within {self.timeout_s:g} s"
            ) from None
        if body is None:
            return None
        bad = self._bad_answer(container_id)
        return _facts(container_id, parse_answer(body, bad), bad)

    def _bad_answer(self, container_id: str) -> str:
        return f"{self.where} gave no usable answer about container {container_id[:12]}"

    async def _get(self, path: str, container_id: str) -> bytearray | None:
        """The body of a 200 answer to ``GET path``; None for a 404."""
        try:
            reader, writer = await asyncio.open_unix_connection(
                str(self.socket_path), limit=MAX_HEAD_BYTES
            )
        except OSError as err:
            hint = ""
            if err.errno == errno.EACCES:
                hint = (
                    " (this user may not use the socket: give it the socket's group, "
                    "see docs/metrics.md, 'Container names')"
                )
            raise DockerEngineError(f"cannot reach {self.where}: {err}{hint}") from None
        bad = self._bad_answer(container_id)
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: docker\r\nUser-Agent: nvidia-docker-plugin\r\n"
                "Accept: application/json\r\nConnection: close\r\n\r\n".encode("ascii")
            )
            status, headers = await _read_head(reader, bad)
            if status == 404:
                return None
            if status != 200:
                raise DockerEngineError(f"{self.where} answered HTTP {status}")
            return await _read_body(reader, headers, bad)
        except asyncio.IncompleteReadError:
            raise BadAnswer(f"{bad}: it ended early") from None
        except OSError as err:
            raise BadAnswer(f"{bad}: the connection failed while reading ({err})") from None
        finally:
            writer.close()  # nothing of ours is left to send: closes at once
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def close(self) -> None:
        """Nothing to release: every request has its own connection, closed with it."""


async def _read_head(reader: asyncio.StreamReader, bad: str) -> tuple[int, dict[str, str]]:
    """The status code and headers (names lowercased) of an answer, within MAX_HEAD_BYTES."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise BadAnswer(f"{bad}: its headers are larger than {_size(MAX_HEAD_BYTES)}") from None
    lines = head[:-4].decode("latin-1").split("\r\n")
    status = _STATUS_LINE.fullmatch(lines[0])
    if status is None:
        raise BadAnswer(f"{bad}: it is not HTTP (is this an engine's API socket?)")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        name = name.lower()
        if not colon or not name or name != name.strip():
            raise BadAnswer(f"{bad}: one of its headers is malformed")
        value = value.strip()
        if name in headers and headers[name] != value:
            if name == "content-length":
                raise BadAnswer(f"{bad}: it has two different Content-Lengths")
            value = f"{headers[name]}, {value}"
        headers[name] = value
    return int(status[1]), headers


async def _read_body(
    reader: asyncio.StreamReader, headers: Mapping[str, str], bad: str
) -> bytearray:
    """The body, by whichever framing the headers say, refused past MAX_ANSWER_BYTES."""
    too_large = f"{bad}: it is larger than {_size(MAX_ANSWER_BYTES)}"
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.rpartition(",")[2].strip().lower() != "chunked":
            raise BadAnswer(f"{bad}: its Transfer-Encoding is not chunked")
        return await _read_chunked(reader, too_large, bad)
    length = headers.get("content-length")
    if length is not None:
        if _DECIMAL.fullmatch(length) is None:
            raise BadAnswer(f"{bad}: its Content-Length is not a number")
        if len(length) > 12 or int(length) > MAX_ANSWER_BYTES:
            raise BadAnswer(f"{too_large} (its Content-Length says {_shown_count(length)})")
        return bytearray(await reader.readexactly(int(length)))
    body = bytearray()  # to the end of the connection
    while chunk := await reader.read(min(_READ_BYTES, MAX_ANSWER_BYTES + 1 - len(body))):
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            raise BadAnswer(too_large)
    return body


async def _read_chunked(reader: asyncio.StreamReader, too_large: str, bad: str) -> bytearray:
    """A chunked body; its framing counts in MAX_ANSWER_BYTES too, so that endless empty
    extensions or one-byte chunks are bounded as data is."""
    body = bytearray()
    received = 0
    while True:
        try:
            line = await reader.readuntil(b"\r\n")
        except asyncio.LimitOverrunError:
            raise BadAnswer(f"{bad}: one of its chunks is malformed") from None
        size_field = line[:-2].partition(b";")[0].strip()
        if _CHUNK_SIZE.fullmatch(size_field) is None:
            raise BadAnswer(f"{bad}: one of its chunks is malformed")
        size = int(size_field, 16)
        if size == 0:
            return body  # the trailers, if any, are left unread: the connection closes
        received += len(line) + size + 2
        if received > MAX_ANSWER_BYTES:
            raise BadAnswer(too_large)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise BadAnswer(f"{bad}: one of its chunks is malformed")


def parse_answer(body: bytearray | bytes, bad: str = "the engine's answer") -> object:
    """The JSON value of ``body``, once it is known to be UTF-8 within MAX_DEPTH and
    MAX_ITEMS; ``BadAnswer`` (``bad``: what is wrong) otherwise.

    The scan removes the strings (an unterminated one runs to the end: what follows it is
    no JSON anyway, the parser stops there), then counts the commas and brackets left: in a
    linear number of steps, without recursion, on at most MAX_ITEMS brackets.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadAnswer(f"{bad}: it is not UTF-8 (at byte {err.start})") from None
    structure = _STRING.sub("", text)
    opens = structure.count("[") + structure.count("{")
    if opens + structure.count(",") > MAX_ITEMS:
        raise BadAnswer(
            f"{bad}: it has more than {MAX_ITEMS} JSON items (values in arrays and objects)"
        )
    brackets = _NOT_BRACKET.sub("", structure)
    del structure
    if len(brackets) > 2 * opens:
        raise BadAnswer(f"{bad}: it is not valid JSON (more brackets close than open)")
    if max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > MAX_DEPTH:
        raise BadAnswer(f"{bad}: its JSON nests deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise BadAnswer(
            f"{bad}: it is not valid JSON (line {err.lineno}, column {err.colno})"
        ) from None
    except (ValueError, RecursionError):  # a number of more than 4,300 digits
        raise BadAnswer(f"{bad}: it is not valid JSON (a value is too large)") from None


def _facts(container_id: str, body: object, bad: str) -> ContainerFacts:
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
    )


def bounded_text(value: str, limit: int) -> str | None:
    """``value`` as a label may carry it: non-printable characters escaped (as
    ``agent.display`` writes them), at most ``limit`` characters, the last ``…`` where it
    was cut (never inside an escape); None for an empty value."""
    if not value:
        return None
    if len(value) <= limit and value.isprintable():
        return value
    pieces = [shown(char, 1) for char in value[: limit + 1]]
    if len(value) <= limit and sum(map(len, pieces)) <= limit:
        return "".join(pieces)
    kept: list[str] = []
    room = limit - len(CUT)
    for piece in pieces:
        if len(piece) > room:
            break
        kept.append(piece)
        room -= len(piece)
    return "".join(kept) + CUT


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // KIB} KiB"


def _shown_count(digits: str) -> str:
    return f"{int(digits)} bytes" if len(digits) <= 24 else f"a {len(digits)}-digit number"
