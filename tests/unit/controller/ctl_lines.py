"""What ``nvidia-docker-ctl`` writes on stderr, read as a person reads it."""

from __future__ import annotations

import re

ERROR_LINE = re.compile(r"^nvidia-docker-ctl \| \d{4}/\d\d/\d\d \d\d:\d\d:\d\d Error: (.+)$")
WARNING_LINE = re.compile(r"^nvidia-docker-ctl \| \d{4}/\d\d/\d\d \d\d:\d\d:\d\d Warning: (.+)$")


def error_of(stderr: str) -> str:
    """The message of the one error line ``stderr`` holds (and nothing else)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    match = ERROR_LINE.match(lines[0])
    assert match, lines[0]
    return match.group(1)
