"""Logging for the controller's commands, configured once, by the edge, never at import.

The controller reports with one-line errors of its own; the libraries below it log too
(paramiko's channel and transport warnings, the agent's NVML warnings when the wrapper
reads NVML itself). ``configure(prog, debug)`` is called once by each command's edge
(``controller.ctl.main``; the wrapper's slow path through ``configure_when_needed``):
without ``NV_DEBUG`` those libraries are quiet, since the error line already says what
failed; with it, their warnings go to stderr as
``<prog> | <date> <time> <level> <logger>: <message>``.

``logging`` costs about 10 ms to import on the development machine, more than the wrapper's
whole plain-HTTP run needs otherwise. So ``configure_when_needed(prog, debug)`` configures at
once only with ``debug``, or when ``logging`` is imported already; else it keeps the
configuration for ``configure_pending()``, which the wrapper calls on the branches that
import a library that logs (SSH: paramiko; HTTPS and tokens: aiohttp; NVML: the agent's
modules). A process that never imports ``logging`` has nothing to configure.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import logging

QUIET = ("paramiko", "agent")  # libraries whose warnings our own error lines replace


_handler: logging.Handler | None = None  # ours on the root logger, replaced by a new run
_pending: str | None = None  # configure_when_needed's prog, until configure_pending


def configure(prog: str, debug: bool) -> None:
    """Set the process's logging for one run of ``prog`` (see the module docstring); a
    second call (tests run several commands in one process) replaces the first's."""
    import logging  # noqa: PLC0415 (see the module docstring)

    global _handler, _pending  # noqa: PLW0603 (one configuration per process)
    _pending = None
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


def configure_when_needed(prog: str, debug: bool) -> None:
    """``configure(prog, debug)`` now when ``debug`` is on or ``logging`` is imported
    already; else when ``configure_pending()`` is called (see the module docstring)."""
    global _pending  # noqa: PLW0603 (one configuration per process)
    if debug or "logging" in sys.modules:
        configure(prog, debug)
    else:
        _pending = prog


def configure_pending() -> None:
    """Apply what ``configure_when_needed`` kept (debug off), before a library that logs is
    imported; nothing when it configured at once, or when nothing is kept."""
    if _pending is not None:
        configure(_pending, debug=False)
