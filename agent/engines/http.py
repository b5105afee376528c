"""The bounded HTTP/1.1 exchange with a container engine's API on its unix socket.

One client (``EngineClient``) per engine: the Docker engine, or Podman's API service
(``podman system service``, the ``podman.socket`` unit) on its Docker-compatible endpoints,
which answer the same requests the same way (``what`` names the engine in messages). Paths
are unversioned, so that any engine answers in its own current API version. Attribution
(``agent.attribution.docker_engine``) asks it about containers, the lease wiring
(``agent.engines.containers``, ``agent.engines.events``) lists them and follows their events.

Whatever listens on the socket may answer anything, so everything read from it is bounded
before it can cost memory, time or a log line (docs/metrics.md, "What the agent reads from
an engine"):

- the exchange: one connection per request (``Connection: close``), connect to last byte
  within ``timeout_s`` (an answer that trickles in times out), at most ``MAX_CONCURRENT``
  requests per engine at a time;
- the answer: status line and headers within ``MAX_HEAD_BYTES``; the body within
  ``MAX_ANSWER_BYTES`` (or the bound the caller gives): a larger ``Content-Length`` is
  refused before a byte of the body is read, and a chunked or close-delimited body is read
  in pieces and refused one byte past the bound, so that an answer that never ends costs no
  more than one that is too large;
- a stream (``GET /events``, which never ends): opened within ``timeout_s``, then read as
  lines, each within ``MAX_LINE_BYTES``; it holds a connection of its own, outside the
  ``MAX_CONCURRENT`` requests, and costs nothing while the engine has nothing to say (a
  blocked read);
- the JSON: UTF-8, at most ``MAX_DEPTH`` levels of arrays and objects and ``MAX_ITEMS``
  items (or the bound the caller gives), checked by a linear scan before it is parsed
  (Python's parser recurses once per level and builds one object per value: 4 MiB of
  ``[[]]`` would be 134 MB);
- text kept from an answer: ``bounded_text`` cuts it and escapes what is not printable.

An answer that breaks a bound is a ``BadAnswer``, one line saying which bound; no message
here repeats what the engine sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import re
from collections import deque
from collections.abc import Callable, Mapping
from itertools import accumulate
from pathlib import Path
from typing import Any
from urllib.parse import quote

from agent.display import shown

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
# One line of a stream: an event of dockerd or Podman is under 1 KiB, its labels included
# (they are the event's attributes); a longer line is refused and the stream reopened.
MAX_LINE_BYTES = 64 * KIB
MAX_CONCURRENT = 4  # requests in flight to one engine
DEFAULT_TIMEOUT_S = 2.0
CUT = "…"  # the last character of a value that was cut

_READ_BYTES = 64 * KIB
_STATUS_LINE = re.compile(r"HTTP/1\.[01] ([0-9]{3})(?: .*)?")
_DECIMAL = re.compile(r"[0-9]+")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
# A JSON string, escapes included; an unterminated one runs to the end. Possessive, so that
# no input makes it backtrack (the scan stays linear in the answer's size).
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}

PairsHook = Callable[[list[tuple[str, Any]]], object]


class EngineError(Exception):
    """The engine cannot be asked (no socket, refused, timeout, not Docker): one line."""


class EngineDenied(EngineError):
    """This process may not use the engine's socket (EACCES: not in the socket's group): one
    line that says so. Not an outage: asking again changes nothing until someone acts."""


class EngineTimeout(EngineError):
    """The engine did not answer within the time given: one line. Not always an engine
    that is gone: dockerd holds a container's lock for as long as that container starts
    or stops, and its inspect waits for it (attribution and the lease feed then ask the
    container list: ``list_entry``)."""


class BadAnswer(EngineError):
    """The engine answered, but not with anything this agent may use (too large, too deep,
    not JSON, not HTTP): one line that says which bound it broke."""


class EngineClient:
    """A client of one engine's API socket, shared by every part that asks it; ``close()``
    it when done (nothing is held between requests: each has its own connection)."""

    # What a refused connect (EACCES) adds to its message.
    access_hint = " (this user may not use the socket: give it the socket's group)"

    def __init__(
        self,
        socket_path: Path,
        timeout_s: float = DEFAULT_TIMEOUT_S,
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

    def bad_answer(self, about: str) -> str:
        """The start of a ``BadAnswer``'s line: ``about`` says which answer (``about
        container 8f3c2b1a8f3c``, ``to its container list``)."""
        return f"{self.where} gave no usable answer {about}"

    async def get(
        self,
        path: str,
        about: str,
        *,
        timeout_s: float | None = None,
        max_bytes: int = MAX_ANSWER_BYTES,
        slot: bool = True,
    ) -> bytearray | None:
        """The body of a 200 answer to ``GET path``; None for a 404.

        ``EngineError`` when the engine cannot be asked or answers another status,
        ``BadAnswer`` (an ``EngineError`` too) when its answer breaks a bound. Waiting for a
        free request slot counts in the timeout (``timeout_s``, else the client's); with
        ``slot=False`` the request takes none (a ping, while the slots may all be held).
        """
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        slots = self._slots if slot else contextlib.nullcontext()
        try:
            async with asyncio.timeout(limit_s), slots:
                reader, writer = await self._connect(path)
                try:
                    status, headers = await self._head(reader, about)
                    if status == 404:
                        return None
                    if status != 200:
                        raise EngineError(f"{self.where} answered HTTP {status}")
                    return await read_body(reader, headers, self.bad_answer(about), max_bytes)
                except asyncio.IncompleteReadError:
                    raise BadAnswer(f"{self.bad_answer(about)}: it ended early") from None
                except OSError as err:
                    raise BadAnswer(
                        f"{self.bad_answer(about)}: the connection failed while reading ({err})"
                    ) from None
                finally:
                    await _close(writer)
        except TimeoutError:
            raise EngineTimeout(f"{self.where} did not answer within {limit_s:g} s") from None

    async def list_entry(
        self, container_id: str, about: str, *, timeout_s: float | None = None
    ) -> dict[str, Any] | None:
        """The container's entry in the engine's list (``GET /containers/json?all=1`` with
        an ``id`` filter: ``docker ps -a --filter id=...``; ``Names``, ``Image``,
        ``Labels``, ``State``); None when the list has no such container. dockerd answers
        its list from a snapshot, while an inspect waits for the container's lock, which
        dockerd holds for as long as the container starts or stops; Podman's list waits as
        its inspect does. Raises as ``get`` does; ``BadAnswer`` for a list that is no array."""
        filters = quote(json.dumps({"id": [container_id]}, separators=(",", ":")), safe="")
        body = await self.get(
            f"/containers/json?all=1&filters={filters}", about, timeout_s=timeout_s
        )
        bad = self.bad_answer(about)
        listed = parse_answer(body, bad) if body is not None else []
        if not isinstance(listed, list):
            raise BadAnswer(f"{bad}: it is not a JSON array (a container list)")
        for item in listed:
            if not isinstance(item, dict):
                continue
            entry: dict[str, Any] = item
            found = entry.get("Id")
            if isinstance(found, str) and found.startswith(container_id):
                return entry  # the filter matches id prefixes: the list may hold others
        return None

    async def answers_ping(self, timeout_s: float | None = None) -> bool:
        """Whether the engine answers ``GET /_ping`` within ``timeout_s`` (else the
        client's): Docker and Podman answer it without taking any container's lock. It
        takes no request slot: it is asked when requests that hold them wait."""
        try:
            body = await self.get("/_ping", "to a ping", timeout_s=timeout_s, slot=False)
            return body is not None
        except EngineError:
            return False

    async def post(self, path: str, about: str, *, timeout_s: float | None = None) -> int:
        """``POST path`` with no body (``/containers/<id>/stop``): the answer's status
        (its body, bounded, is read and dropped). ``EngineError`` when the engine cannot be
        asked or does not answer within ``timeout_s`` (else the client's)."""
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit_s), self._slots:
                reader, writer = await self._connect(path, method="POST")
                try:
                    status, headers = await self._head(reader, about)
                    with contextlib.suppress(EngineError, asyncio.IncompleteReadError, OSError):
                        await read_body(reader, headers, self.bad_answer(about), MAX_HEAD_BYTES)
                    return status
                except (OSError, asyncio.IncompleteReadError) as err:
                    raise BadAnswer(
                        f"{self.bad_answer(about)}: {err or 'it ended early'}"
                    ) from None
                finally:
                    await _close(writer)
        except TimeoutError:
            raise EngineTimeout(f"{self.where} did not answer within {limit_s:g} s") from None

    async def stream(self, path: str, about: str) -> LineStream:
        """``GET path`` opened as a stream of lines (``LineStream``): connected and its head
        read within the client's ``timeout_s``, then read for as long as the engine sends.
        ``EngineError`` when it cannot be opened or answers another status than 200."""
        try:
            async with asyncio.timeout(self.timeout_s):
                reader, writer = await self._connect(path)
                try:
                    status, headers = await self._head(reader, about)
                except (OSError, asyncio.IncompleteReadError) as err:
                    await _close(writer)
                    why = "it ended early" if isinstance(err, EOFError) else str(err)
                    raise BadAnswer(f"{self.bad_answer(about)}: {why}") from None
                except BaseException:
                    await _close(writer)
                    raise
        except TimeoutError:
            raise EngineTimeout(
                f"{self.where} did not answer within {self.timeout_s:g} s"
            ) from None
        if status != 200:
            await _close(writer)
            raise EngineError(f"{self.where} answered HTTP {status}")
        try:
            return LineStream(reader, writer, headers, self.bad_answer(about), self.where)
        except BaseException:
            await _close(writer)
            raise

    async def _connect(
        self, path: str, *, method: str = "GET"
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            reader, writer = await asyncio.open_unix_connection(
                str(self.socket_path), limit=MAX_HEAD_BYTES
            )
        except OSError as err:
            if err.errno == errno.EACCES:
                raise EngineDenied(f"cannot reach {self.where}: {err}{self.access_hint}") from None
            raise EngineError(f"cannot reach {self.where}: {err}") from None
        body_length = "Content-Length: 0\r\n" if method != "GET" else ""
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: docker\r\nUser-Agent: nvidia-docker-plugin\r\n"
            f"Accept: application/json\r\n{body_length}Connection: close\r\n\r\n".encode("ascii")
        )
        return reader, writer

    async def _head(self, reader: asyncio.StreamReader, about: str) -> tuple[int, dict[str, str]]:
        return await read_head(reader, self.bad_answer(about))

    async def close(self) -> None:
        """Nothing to release: every request has its own connection, closed with it."""


class LineStream:
    """The body of an open answer as lines (``async for line in stream``), by whichever
    framing its headers say: each line without its ``\\n`` (and ``\\r``), blank lines left
    out, at most ``MAX_LINE_BYTES`` (a longer one is a ``BadAnswer``). The iteration ends
    when the body ends as its framing says; a connection that ends otherwise is an
    ``EngineError`` (the engine went away). ``close()`` it when done."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        headers: Mapping[str, str],
        bad: str,
        where: str,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._bad = bad
        self._where = where
        self._lines: deque[bytes] = deque()
        self._partial = bytearray()
        self._ended = False
        self._chunked = False
        self._left: int | None = None  # bytes of the body (or chunk) still to read
        coding = headers.get("transfer-encoding")
        length = headers.get("content-length")
        if coding is not None:
            if coding.rpartition(",")[2].strip().lower() != "chunked":
                raise BadAnswer(f"{bad}: its Transfer-Encoding is not chunked")
            self._chunked = True
            self._left = 0
        elif length is not None:
            if _DECIMAL.fullmatch(length) is None or len(length) > 18:
                raise BadAnswer(f"{bad}: its Content-Length is not a number")
            self._left = int(length)

    def __aiter__(self) -> LineStream:
        return self

    async def __anext__(self) -> bytes:
        while not self._lines:
            if self._ended:
                raise StopAsyncIteration
            piece = await self._piece()
            if piece is None:
                self._ended = True
                self._add_line(bytes(self._partial))  # a last line without its newline
                self._partial.clear()
            else:
                self._feed(piece)
        return self._lines.popleft()

    async def close(self) -> None:
        """Hang up (the engine ends its side of the stream when it sees it)."""
        self._ended = True
        await _close(self._writer)

    def _feed(self, piece: bytes) -> None:
        *complete, rest = piece.split(b"\n")
        if complete:
            self._add_line(bytes(self._partial) + complete[0])
            for line in complete[1:]:
                self._add_line(line)
            self._partial = bytearray(rest)
        else:
            self._partial += rest
        if len(self._partial) > MAX_LINE_BYTES:
            raise BadAnswer(f"{self._bad}: a line of it is longer than {_size(MAX_LINE_BYTES)}")

    def _add_line(self, line: bytes) -> None:
        line = line.removesuffix(b"\r")
        if len(line) > MAX_LINE_BYTES:
            raise BadAnswer(f"{self._bad}: a line of it is longer than {_size(MAX_LINE_BYTES)}")
        if line.strip():
            self._lines.append(line)

    async def _piece(self) -> bytes | None:
        """The next bytes of the body; None where it ends as its framing says."""
        try:
            if self._chunked:
                return await self._chunk_piece()
            want = _READ_BYTES if self._left is None else min(_READ_BYTES, self._left)
            if want == 0:
                return None
            piece = await self._reader.read(want)
        except OSError as err:
            raise EngineError(f"{self._where} broke its stream ({err})") from None
        except asyncio.IncompleteReadError:
            raise EngineError(f"{self._where} closed its stream") from None
        if not piece:
            if self._left is None:
                return None  # a close-delimited body ends with its connection
            raise EngineError(f"{self._where} closed its stream")
        if self._left is not None:
            self._left -= len(piece)
        return piece

    async def _chunk_piece(self) -> bytes | None:
        assert self._left is not None
        while self._left == 0:
            try:
                line = await self._reader.readuntil(b"\r\n")
            except asyncio.LimitOverrunError:
                raise BadAnswer(f"{self._bad}: one of its chunks is malformed") from None
            size_field = line[:-2].partition(b";")[0].strip()
            if _CHUNK_SIZE.fullmatch(size_field) is None:
                raise BadAnswer(f"{self._bad}: one of its chunks is malformed")
            size = int(size_field, 16)
            if size == 0:
                return None  # the trailers, if any, are left unread: the connection closes
            self._left = size
        piece = await self._reader.read(min(_READ_BYTES, self._left))
        if not piece:
            raise asyncio.IncompleteReadError(b"", self._left)
        self._left -= len(piece)
        if self._left == 0 and await self._reader.readexactly(2) != b"\r\n":
            raise BadAnswer(f"{self._bad}: one of its chunks is malformed")
        return piece


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()  # nothing of ours is left to send: closes at once
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def read_head(reader: asyncio.StreamReader, bad: str) -> tuple[int, dict[str, str]]:
    """The status code and headers (names lowercased) of an answer, within MAX_HEAD_BYTES
    (the reader's limit); ``BadAnswer`` (``bad``: which answer) otherwise."""
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


async def read_body(
    reader: asyncio.StreamReader,
    headers: Mapping[str, str],
    bad: str,
    max_bytes: int = MAX_ANSWER_BYTES,
) -> bytearray:
    """The body, by whichever framing the headers say, refused past ``max_bytes``."""
    too_large = f"{bad}: it is larger than {_size(max_bytes)}"
    coding = headers.get("transfer-encoding")
    if coding is not None:
        if coding.rpartition(",")[2].strip().lower() != "chunked":
            raise BadAnswer(f"{bad}: its Transfer-Encoding is not chunked")
        return await _read_chunked(reader, too_large, bad, max_bytes)
    length = headers.get("content-length")
    if length is not None:
        if _DECIMAL.fullmatch(length) is None:
            raise BadAnswer(f"{bad}: its Content-Length is not a number")
        if len(length) > 12 or int(length) > max_bytes:
            raise BadAnswer(f"{too_large} (its Content-Length says {_shown_count(length)})")
        return bytearray(await reader.readexactly(int(length)))
    body = bytearray()  # to the end of the connection
    while chunk := await reader.read(min(_READ_BYTES, max_bytes + 1 - len(body))):
        body += chunk
        if len(body) > max_bytes:
            raise BadAnswer(too_large)
    return body


async def _read_chunked(
    reader: asyncio.StreamReader, too_large: str, bad: str, max_bytes: int
) -> bytearray:
    """A chunked body; its framing counts in ``max_bytes`` too, so that endless empty
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
        if received > max_bytes:
            raise BadAnswer(too_large)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise BadAnswer(f"{bad}: one of its chunks is malformed")


def parse_answer(
    body: bytearray | bytes,
    bad: str = "the engine's answer",
    *,
    max_items: int = MAX_ITEMS,
    object_pairs_hook: PairsHook | None = None,
) -> object:
    """The JSON value of ``body``, once it is known to be UTF-8 within MAX_DEPTH and
    ``max_items``; ``BadAnswer`` (``bad``: what is wrong) otherwise. ``object_pairs_hook``
    is the parser's (it may keep only the fields the caller reads, so that a large answer
    does not become as many objects).

    The scan removes the strings (an unterminated one runs to the end: what follows it is
    no JSON anyway, the parser stops there), then counts the commas and brackets left: in a
    linear number of steps, without recursion, on at most twice ``max_items`` brackets.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadAnswer(f"{bad}: it is not UTF-8 (at byte {err.start})") from None
    structure = _STRING.sub("", text)
    opens = structure.count("[") + structure.count("{")
    if opens + structure.count(",") > max_items:
        raise BadAnswer(
            f"{bad}: it has more than {max_items} JSON items (values in arrays and objects)"
        )
    brackets = _NOT_BRACKET.sub("", structure)
    del structure
    if len(brackets) > 2 * opens:
        raise BadAnswer(f"{bad}: it is not valid JSON (more brackets close than open)")
    if max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > MAX_DEPTH:
        raise BadAnswer(f"{bad}: its JSON nests deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as err:
        raise BadAnswer(
            f"{bad}: it is not valid JSON (line {err.lineno}, column {err.colno})"
        ) from None
    except (ValueError, RecursionError):  # a number of more than 4,300 digits
        raise BadAnswer(f"{bad}: it is not valid JSON (a value is too large)") from None


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
