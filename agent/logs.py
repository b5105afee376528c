"""The daemon's log: one line per event, ``nvidia-docker-plugin | <date> <time> <message>``.

``NV_DEBUG`` in the environment turns on debug messages (and, elsewhere, tracebacks).
"""

from __future__ import annotations

import logging
import os
import sys

PROG = "nvidia-docker-plugin"


def debug_enabled() -> bool:
    return bool(os.environ.get("NV_DEBUG"))


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"{PROG} | %(asctime)s %(message)s", datefmt="%Y/%m/%d %H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug_enabled() else logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
