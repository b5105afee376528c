"""The daemon's own failure: a start-up step that cannot be done, said in one line."""

from __future__ import annotations


class StartupError(Exception):
    """A start-up step failed; the message is the one line the operator reads."""
