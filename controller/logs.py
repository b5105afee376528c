"""Logging for the controller's commands, configured once, by the edge, never at import.

The controller reports with one-line errors of its own; the libraries below it log too
(paramiko's channel and transport warnings, the agent's NVML warnings when the wrapper
reads NVML itself). ``configure(prog, debug)`` is called once by each command's edge
(``controller.ctl.main``, the wrapper's slow path): without ``NV_DEBUG`` those libraries
are quiet, since the error line already says what failed; with it, their warnings go to
stderr as ``<prog> | <date> <time> <level> <logger>: <message>``.
"""

from __future__ import annotations

import logging
import sys

QUIET = ("paramiko", "agent")  # libraries whose warnings our own error lines replace


_handler: logging.Handler | None = None  # ours on the root logger, replaced by a new run


def configure(prog: str, debug: bool) -> None:
    """Set the process's logging for one run of ``prog`` (see the module docstring); a
    second call (tests run several commands in one process) replaces the first's."""
    global _handler  # noqa: PLW0603 (one configuration per process)
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
        _handler = None
    for name in QUIET:
        library = logging.getLogger(name)
        library.propagate = debug
        if not any(isinstance(h, logging.NullHandler) for h in library.handlers):
            library.addHandler(logging.NullHandler())  # not propagated: not lastResort's
    if debug:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(
            logging.Formatter(
                f"{prog} | %(asctime)s %(levelname)s %(name)s: %(message)s",
                datefmt="%Y/%m/%d %H:%M:%S",
            )
        )
        root.addHandler(_handler)
        root.setLevel(logging.WARNING)
