"""``json.loads`` and ``json.dumps`` for the wrapper's run path, without importing ``json``.

Why: ``import json`` imports ``re`` (its decoder's and encoder's patterns), hence ``enum``
and ``functools``: 5 to 15 ms on the 2-core development machine, more than everything else
``nvidia-docker run`` does over the interpreter's start (docs/nvidia-docker.md, "Speed").
The work itself is done by ``json``'s own C accelerator, ``_json``, which ``json`` uses
too: its scanner (``make_scanner``) reads a document, its ``encode_basestring_ascii``
writes a string. What ``json``'s Python layer adds around them is written here:

- ``loads(text)``: a ``str`` or UTF-8 ``bytes``; white space around the value, nothing
  else after it. Anything this does not take as it stands (another encoding or a byte
  order mark, a document that is not JSON, an interpreter whose ``_json`` differs) is
  handed to ``json.loads``, which then answers or raises exactly as it always did
  (``json.JSONDecodeError``, a ``ValueError``): the same values, the same errors.
- ``dumps(value)``: ``json.dumps(value)`` with its defaults (ASCII only, ``", "`` and
  ``": "``, ``NaN`` and ``Infinity`` allowed) for ``dict``, ``list``, ``tuple``, ``str``,
  ``int``, ``float``, ``bool`` and ``None``; any other value goes to ``json.dumps``.

``tests/unit/controller/test_json_codec.py`` checks both against ``json`` itself.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_WHITESPACE = " \t\n\r"  # JSON's, as json.decoder skips it around the value
_INFINITY = float("inf")
_CONSTANTS = {"-Infinity": -_INFINITY, "Infinity": _INFINITY, "NaN": float("nan")}


class _Settings:
    """What ``_json.make_scanner`` reads from ``json.JSONDecoder()``: its defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    array_hook = None  # read from Python 3.15 on
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__


def _accelerator() -> tuple[Callable[[str, int], tuple[Any, int]], Callable[[str], str]] | None:
    """``_json``'s scanner and string encoder, or None (then ``json`` does it all)."""
    try:
        import _json  # noqa: PLC0415 (a C module: no import of its own)

        return _json.make_scanner(_Settings()), _json.encode_basestring_ascii  # type: ignore[arg-type]
    except (ImportError, AttributeError, TypeError):
        return None


_FAST = _accelerator()


def loads(data: str | bytes) -> Any:
    """``json.loads(data)`` (see the module docstring)."""
    if _FAST is not None:
        text = _utf8(data)
        if text is not None and not text.startswith("\ufeff"):
            start = len(text) - len(text.lstrip(_WHITESPACE))
            try:
                value, end = _FAST[0](text, start)
            except (StopIteration, ValueError):  # not a JSON value: json says why
                pass
            else:
                if not text[end:].strip(_WHITESPACE):
                    return value
    import json  # noqa: PLC0415 (see the module docstring: json answers or says why)

    return json.loads(data)


def _utf8(data: str | bytes) -> str | None:
    """``data`` as text when ``json.loads`` would read it as UTF-8 without a byte order
    mark (a zero byte among the first four, or a first byte of 0xEF 0xFE 0xFF: it may guess
    another encoding)."""
    if isinstance(data, str):
        return data
    if not isinstance(data, bytes | bytearray) or 0 in data[:4] or data[:1] in _BOM_STARTS:
        return None
    return data.decode("utf-8", "surrogatepass")


_BOM_STARTS = (b"\xef", b"\xfe", b"\xff")


def dumps(value: Any) -> str:
    """``json.dumps(value)`` (see the module docstring)."""
    if _FAST is not None:
        try:
            return _encode(value, _FAST[1])
        except _NotPlain:
            pass
    import json  # noqa: PLC0415 (a value of another type: json encodes it, or refuses)

    return json.dumps(value)


class _NotPlain(Exception):
    """A value of a type that ``_encode`` leaves to ``json``."""


def _encode(value: Any, string: Callable[[str], str]) -> str:
    if isinstance(value, str):
        return string(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_encode(item, string) for item in value) + "]"
    if isinstance(value, dict):
        items = (f"{_key(key, string)}: {_encode(item, string)}" for key, item in value.items())
        return "{" + ", ".join(items) + "}"
    raise _NotPlain


def _float(value: float) -> str:
    if value != value:  # noqa: PLR0124 (NaN, as json.encoder tells it without math)
        return "NaN"
    if value == _INFINITY:
        return "Infinity"
    if value == -_INFINITY:
        return "-Infinity"
    return float.__repr__(value)


def _key(key: object, string: Callable[[str], str]) -> str:
    """A key as ``json`` writes it: a string, or a float, int, bool or None made one."""
    if isinstance(key, str):
        return string(key)
    if isinstance(key, float):
        return string(_float(key))
    if key is True:
        return '"true"'
    if key is False:
        return '"false"'
    if key is None:
        return '"null"'
    if isinstance(key, int):
        return string(int.__repr__(key))
    raise _NotPlain
