"""HTTP/1.1 message heads and body framing, as far as a forwarding proxy must read them.

``parse_request_head`` and ``parse_response_head`` take one head (the bytes up to and
including the empty line) and return its start line, its headers (as sent, in order) and
how its body is framed (``Framing``): none, ``Content-Length`` bytes, chunked, or (a
response only) until the connection closes. Everything hostile is a ``HeadError`` with the
status and one line to answer: a head over ``MAX_HEAD_BYTES``, a line that is not HTTP, two
different ``Content-Length`` values, a ``Transfer-Encoding`` other than ``chunked``, a
chunk-size line that is not hex. Nothing here does I/O; ``agent.engine_socket.proxy`` reads.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 256
MAX_CHUNK_LINE = 1024  # "hex size[;extensions]\r\n"
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_VERSION = re.compile(rb"HTTP/1\.[01]")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")


class HeadError(ValueError):
    """A message the proxy refuses: ``status`` to answer, ``str()`` the one line."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


class Body(enum.Enum):
    NONE = "none"
    LENGTH = "length"
    CHUNKED = "chunked"
    UNTIL_CLOSE = "until close"  # a response without a length: the rest of the stream


@dataclass(frozen=True, slots=True)
class Framing:
    body: Body
    length: int = 0  # Body.LENGTH: how many bytes


@dataclass(frozen=True, slots=True)
class Head:
    """One request or response head. ``start``: the request line's method, target and
    version, or the status line's version, status and reason."""

    start: tuple[bytes, bytes, bytes]
    headers: tuple[tuple[bytes, bytes], ...]  # (name as sent, value stripped)
    framing: Framing

    def get(self, name: bytes) -> bytes | None:
        """The last value of header ``name`` (case-insensitive); None when absent."""
        lowered = name.lower()
        found = None
        for key, value in self.headers:
            if key.lower() == lowered:
                found = value
        return found

    def has_token(self, name: bytes, token: bytes) -> bool:
        """Whether a comma-separated header (``Connection``) lists ``token``."""
        lowered = name.lower()
        return any(
            part.strip().lower() == token
            for key, value in self.headers
            if key.lower() == lowered
            for part in value.split(b",")
        )

    @property
    def method(self) -> bytes:
        return self.start[0]

    @property
    def target(self) -> bytes:
        return self.start[1]

    @property
    def status(self) -> int:
        """A response's status code."""
        return int(self.start[1])

    def with_body_length(self, length: int, dropped: tuple[bytes, ...] = ()) -> bytes:
        """The request head again, as bytes, with its body framed as ``length`` bytes (a
        chunked body that the proxy read whole, or a body it rewrote), without the headers
        named in ``dropped`` (lower case)."""
        lines = [b" ".join(self.start)]
        for key, value in self.headers:
            if key.lower() not in (b"content-length", b"transfer-encoding", *dropped):
                lines.append(key + b": " + value)
        lines.append(b"Content-Length: " + str(length).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n"


def _lines(raw: bytes) -> list[bytes]:
    if len(raw) > MAX_HEAD_BYTES:
        raise HeadError(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")
    if not raw.endswith(b"\r\n\r\n"):
        raise HeadError(400, "the request head is not complete (no empty line at its end)")
    lines = raw[:-4].split(b"\r\n")
    if len(lines) > MAX_HEADERS + 1:
        raise HeadError(431, f"more than {MAX_HEADERS} header lines")
    return lines


def _headers(lines: list[bytes]) -> tuple[tuple[bytes, bytes], ...]:
    headers = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise HeadError(400, "a header line is not NAME: VALUE")
        if b"\r" in value or b"\n" in value or b"\0" in value:
            raise HeadError(400, "a header value has a control character")
        headers.append((name, value.strip(b" \t")))
    return tuple(headers)


def _length(headers: tuple[tuple[bytes, bytes], ...]) -> int | None:
    values = {v for k, v in headers if k.lower() == b"content-length"}
    if not values:
        return None
    if len(values) > 1:
        raise HeadError(400, "two different Content-Length headers")
    (value,) = values
    if not (value.isdigit() and len(value) <= 18):
        raise HeadError(400, "the Content-Length is not a number of bytes")
    return int(value)


def _framing(headers: tuple[tuple[bytes, bytes], ...], *, response: bool) -> Framing:
    codings = [
        part.strip().lower()
        for k, v in headers
        if k.lower() == b"transfer-encoding"
        for part in v.split(b",")
    ]
    length = _length(headers)
    if codings:
        if codings != [b"chunked"]:
            raise HeadError(501, "only Transfer-Encoding: chunked is understood")
        if length is not None and not response:
            raise HeadError(400, "both Content-Length and Transfer-Encoding")
        return Framing(Body.CHUNKED)
    if length is not None:
        return Framing(Body.LENGTH, length) if length else Framing(Body.NONE)
    return Framing(Body.UNTIL_CLOSE) if response else Framing(Body.NONE)


def parse_request_head(raw: bytes) -> Head:
    """A request head (``raw`` ends with the empty line); ``HeadError`` for anything else."""
    lines = _lines(raw)
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise HeadError(400, "the request line is not METHOD TARGET HTTP/1.1")
    if not _VERSION.fullmatch(parts[2]):
        raise HeadError(505, "only HTTP/1.0 and HTTP/1.1 are served")
    headers = _headers(lines[1:])
    return Head((parts[0], parts[1], parts[2]), headers, _framing(headers, response=False))


def parse_response_head(raw: bytes, *, method: bytes) -> Head:
    """A response head to a request of ``method``; ``HeadError`` (502) when it is not one."""
    try:
        lines = _lines(raw)
        version, _, rest = lines[0].partition(b" ")
        code, _, reason = rest.partition(b" ")
        if not _VERSION.fullmatch(version) or not (code.isdigit() and len(code) == 3):
            raise HeadError(502, "the engine's answer is not HTTP/1.1")
        headers = _headers(lines[1:])
        status = int(code)
        if method == b"HEAD" or status in (204, 304) or 100 <= status < 200:
            framing = Framing(Body.NONE)
        else:
            framing = _framing(headers, response=True)
    except HeadError as err:
        raise HeadError(502, f"the engine's answer cannot be read: {err}") from None
    return Head((version, code, reason), headers, framing)


def chunk_size(line: bytes) -> int:
    """The size of the chunk whose size line is ``line`` (with its CRLF); ``HeadError``."""
    if len(line) > MAX_CHUNK_LINE or not line.endswith(b"\r\n"):
        raise HeadError(400, "a chunk-size line is too long or not complete")
    size = line[:-2].partition(b";")[0].strip(b" \t")
    if not _HEX.fullmatch(size):
        raise HeadError(400, "a chunk size is not a hexadecimal number")
    return int(size, 16)
