"""Taking over a unix socket's path: remove a socket file nobody listens on, never a live
one or something that is not a socket. The plugin socket and the engine socket both bind a
fixed path that a crashed agent may have left behind."""

from __future__ import annotations

import enum
import logging
import socket
import stat
from pathlib import Path

log = logging.getLogger("nvidia-docker-plugin")

PROBE_TIMEOUT_S = 1.0


class InTheWay(enum.Enum):
    NOT_A_SOCKET = "not a socket"
    LIVE = "served by another process"


def clear_stale_socket(path: Path) -> InTheWay | None:
    """Remove ``path`` if it is a socket nobody accepts on; None when the path is free now,
    else what is in the way (a connection that fails otherwise counts as live: cannot tell)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return InTheWay.NOT_A_SOCKET
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("Removing the stale socket %s", path)
        path.unlink(missing_ok=True)
        return None
    except OSError:
        pass
    finally:
        probe.close()
    return InTheWay.LIVE
