"""A doc's sample output against what a command printed (tests/e2e/test_docs_examples.py,
tests/e2e/test_api_examples.py).

What may differ from the sample: ``...`` alone on a line stands for any lines (none too),
``...`` within a line for any text; dates, times, TCP ports of 4 and 5 digits, ``elapsed_s``
and SSH key fingerprints are normalised on both sides, and line ends (``\\r\\n`` of HTTP
headers) too.
"""

from __future__ import annotations

import re


def normal(text: str) -> str:
    """What may differ between runs, made the same (see the module docstring)."""
    text = text.replace("\r\n", "\n")
    text = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d", "<date>", text)
    text = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", "<time>", text)
    text = re.sub(r"(?<=[:\s])\d{4,5}\b(?![./])", "<port>", text)
    text = re.sub(r'"elapsed_s":\s*[0-9.]+', '"elapsed_s":<s>', text)
    text = re.sub(r"SHA256:[A-Za-z0-9+/]{43}", "SHA256:<key>", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def matches(expected: str, actual: str) -> bool:
    """``actual`` is the sample, ``...`` standing for any lines or any text in a line."""
    parts = []
    for line in normal(expected).splitlines():
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            text = r"[^\n]*?".join(re.escape(piece) for piece in line.split("..."))
            parts.append(text + r"\n")
    return re.fullmatch("".join(parts), normal(actual) + "\n" if actual.strip() else "") is not None
