"""A plugin request's JSON body, parsed within bounds, with one line a person can act on.

dockerd's bodies are small flat objects (``{"Name": ..., "Opts": {...}}``). Anything may
write to the socket, though, and Python's JSON parser recurses once per nesting level: a
body of 2,000 ``[`` raises ``RecursionError``. So the nesting depth is checked first, by a
linear scan that never recurses, and only bodies within ``MAX_DEPTH`` levels are parsed.
The size is bounded before this (``protocol.MAX_BODY_BYTES``, enforced by aiohttp while
reading; an AuthZ or start hook body by ``authz.MAX_AUTHZ_BODY_BYTES`` or
``authz.MAX_HOOK_BODY_BYTES``, enforced by ``protocol._read``). Errors say what is wrong
with the body and where, never Python's own message.
"""

from __future__ import annotations

import json
import re

MAX_DEPTH = 32

# A JSON string, escapes included; an unterminated one runs to the end of the body.
# Possessive, so that no body makes it backtrack: the scan stays linear in the body's size
# (the plain pattern took 8 s on a 40 KB body of escaped quotes after an open one).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


class BodyError(ValueError):
    """The body is not what the protocol sends; the message says what to fix."""


def parse_json(raw: bytes) -> object:
    """The JSON value of ``raw``; ``BodyError`` for a body that is not JSON, or nests too deep."""
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH:
        _check_depth(raw)
    try:
        return json.loads(raw)
    except UnicodeDecodeError as err:
        raise BodyError(f"the body is not valid JSON (not UTF-8 at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise BodyError(
            f"the body is not valid JSON (line {err.lineno}, column {err.colno})"
        ) from None
    except (ValueError, RecursionError):  # a number of more than 4,300 digits, ...
        raise BodyError("the body is not valid JSON (a value is too large)") from None


def _check_depth(raw: bytes) -> None:
    """Refuse a body whose arrays and objects nest deeper than ``MAX_DEPTH``, counting
    brackets outside strings (an unterminated string runs to the end, as for the parser,
    which then refuses the body without recursing)."""
    depth = 0
    for match in _BRACKET.finditer(_STRING.sub(b"", raw)):
        if match[0] in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                raise BodyError(f"the body nests deeper than {MAX_DEPTH} levels")
        else:
            depth -= 1
