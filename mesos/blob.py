"""The ``gpus`` attribute blob: a node's ``/gpu/info/json`` body, zlib-compressed, base64url.

Encoding (what ``/mesos/cli`` puts after ``--attributes=gpus:``): the exact JSON bytes,
trailing newline included, compressed with zlib-ng into a standard zlib stream (RFC 1950),
then base64 with the URL-safe alphabet (``-`` and ``_``, RFC 4648 section 5) and the ``=``
padding removed, as RFC 6920 does. The result only uses ``[A-Za-z0-9_-]``, which Mesos keeps
as a TEXT attribute, and any zlib implementation inflates it.

Decoding accepts the bare blob (padded or not), ``gpus:BLOB``, ``--attributes=...`` or a whole
``/mesos/cli`` line, and gives back the JSON bytes exactly. Anything else raises
``BlobError`` whose message says what is wrong and where.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import cast

from zlib_ng import zlib_ng

ATTRIBUTE_NAME = "gpus"
"""Name of the Mesos attribute (and of the legacy resource) that carries the GPUs."""

COMPRESSION_LEVEL = 9
"""zlib level of the blob. The agent encodes it once per ``/mesos/cli`` query form and serves
it from a cache (``agent.api.mesos_cli``), so the best ratio is worth its (sub-millisecond)
cost: every offer of the node carries it."""

MAX_INFLATED_BYTES = 16 * 1024 * 1024
"""Refuse blobs that inflate beyond this: a GPU info document is a few KiB per GPU."""

_ZLIB_ERROR = cast("type[Exception]", zlib_ng.error)  # its stub declares an instance
_BASE64URL = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_FLAG_PREFIX = "--attributes="
_BLOB_IN_TEXT = re.compile(r"(?:^|;)\s*" + ATTRIBUTE_NAME + r":([^;]*)")


class BlobError(ValueError):
    """The text is not a valid ``gpus`` blob; the message says what is wrong."""


def encode(info_json: bytes) -> str:
    """The blob for ``info_json`` (bytes as served by ``/gpu/info/json``)."""
    compressed = zlib_ng.compress(info_json, COMPRESSION_LEVEL)
    return base64.urlsafe_b64encode(compressed).rstrip(b"=").decode("ascii")


def decode(text: str) -> bytes:
    """The exact JSON bytes inside a blob; raises ``BlobError`` on anything else."""
    blob = extract_blob(text)
    compressed = _base64url_bytes(blob)
    inflated = _inflate(compressed)
    _check_json(inflated)
    return inflated


def extract_blob(text: str) -> str:
    """The blob out of ``BLOB``, ``gpus:BLOB``, ``--attributes=...`` or a ``/mesos/cli`` line."""
    stripped = text.strip()
    if not stripped:
        raise BlobError("empty input: expected a gpus blob (the text after 'gpus:')")
    words = stripped.split()
    if len(words) > 1:
        attributes = [w for w in words if w.startswith(_FLAG_PREFIX)]
        if not attributes:
            raise BlobError(
                f"found {len(words)} words but no {_FLAG_PREFIX} flag: "
                "pass the blob, gpus:BLOB, or the whole /mesos/cli line"
            )
        stripped = attributes[0]
    value = stripped.removeprefix(_FLAG_PREFIX)
    if value != stripped or value.startswith(ATTRIBUTE_NAME + ":") or ";" in value:
        match = _BLOB_IN_TEXT.search(value)
        if match is None:
            raise BlobError(f"no '{ATTRIBUTE_NAME}:' attribute in {_shorten(value)!r}")
        value = match.group(1).strip()
        if not value:
            raise BlobError(f"the '{ATTRIBUTE_NAME}:' attribute is empty")
    return value


def _base64url_bytes(blob: str) -> bytes:
    unpadded = blob.rstrip("=")
    for position, char in enumerate(unpadded, start=1):
        if char in _BASE64URL:
            continue
        if char in "+/":
            raise BlobError(
                f"character {char!r} at position {position} is from the standard base64 "
                "alphabet; the blob uses the URL-safe one ('-' and '_')"
            )
        if char == "=":
            raise BlobError(f"padding '=' at position {position} is not at the end")
        raise BlobError(f"character {char!r} at position {position} is not base64url")
    if len(blob) - len(unpadded) > 2:
        raise BlobError(f"{len(blob) - len(unpadded)} padding characters: at most 2 are valid")
    if len(unpadded) % 4 == 1:
        raise BlobError(
            f"length {len(unpadded)} is not a base64 length (one character too many or "
            "missing): the blob is cut or has extra characters"
        )
    padding = "=" * (-len(unpadded) % 4)
    try:
        return base64.urlsafe_b64decode(unpadded + padding)
    except binascii.Error as error:  # pragma: no cover - the checks above cover every case
        raise BlobError(f"not base64url: {error}") from None


def _inflate(compressed: bytes) -> bytes:
    if len(compressed) < 2:
        raise BlobError(f"{len(compressed)} byte(s) after base64: too short for a zlib stream")
    cmf, flg = compressed[0], compressed[1]
    if cmf & 0x0F != 8 or cmf >> 4 > 7 or ((cmf << 8) | flg) % 31 != 0:
        raise BlobError(
            f"not a zlib stream: header bytes {compressed[:2].hex()} (a zlib stream starts "
            "78 01, 78 5e, 78 9c or 78 da)"
        )
    inflater = zlib_ng.decompressobj()
    try:
        inflated = inflater.decompress(compressed, MAX_INFLATED_BYTES)
    except _ZLIB_ERROR as error:
        raise BlobError(f"corrupt zlib stream: {error}") from None
    if inflater.unconsumed_tail:
        raise BlobError(f"inflates to more than {MAX_INFLATED_BYTES} bytes: not GPU info")
    if not inflater.eof:
        raise BlobError(
            f"truncated zlib stream: {len(compressed)} compressed bytes end before the "
            f"stream does ({len(inflated)} bytes inflated so far)"
        )
    if inflater.unused_data:
        raise BlobError(
            f"{len(inflater.unused_data)} byte(s) of trailing data after the zlib stream"
        )
    return inflated


def _check_json(inflated: bytes) -> None:
    try:
        text = inflated.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BlobError(
            f"inflated data is not UTF-8 text: {error.reason} at byte {error.start}"
        ) from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise BlobError(
            f"inflated data ({len(inflated)} bytes) is not JSON: {error.msg} at line "
            f"{error.lineno} column {error.colno}"
        ) from None
    except (ValueError, RecursionError):  # nested too deep, a number of 4,300+ digits
        raise BlobError(
            f"inflated data ({len(inflated)} bytes) is not the GPU info JSON: it nests too "
            "deep or holds a number too large to read"
        ) from None
    if not isinstance(document, dict):
        raise BlobError(f"inflated JSON is a {type(document).__name__}, not the GPU info object")


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
