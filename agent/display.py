"""How untrusted text (a query entry, a peer's bytes) is shown in answers and log lines.

Whatever a client sends may end up in a 400 body or a log line. Shown here, it is bounded
(a long value is cut and its length said) and has no control characters (they are written
as escapes), so that one refusal stays one line and nobody can forge log lines.
"""

from __future__ import annotations

SHOWN_CHARS = 80


def shown(text: str, limit_chars: int = SHOWN_CHARS) -> str:
    """``text`` as it may appear in an answer or a log line: at most ``limit_chars``
    characters of it, non-printable ones escaped (``\\x0a``, ``\\u200b``)."""
    head = text[:limit_chars]
    if not head.isprintable():
        head = "".join(_escaped(char) for char in head)
    if len(text) > limit_chars:
        head += f"... ({len(text)} characters)"
    return head


def _escaped(char: str) -> str:
    if char.isprintable():
        return char
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
