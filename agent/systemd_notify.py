"""Telling systemd how the agent is doing: ``READY=1`` once it answers, ``STOPPING=1``, status.

The packaged unit is ``Type=notify``: systemd starts what is ordered after the agent
(``docker.service``, the Mesos agents) only once the agent sends ``READY=1``, which it does
when its plugin socket and REST API answer (``agent.edge.readiness``). The protocol is one
datagram to the unix socket named by ``$NOTIFY_SOCKET`` (a path, or an abstract name
starting with ``@``), as sd_notify(3) describes; no library is needed for that. Without
``$NOTIFY_SOCKET`` (not started by systemd) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("nvidia-docker-plugin")

_failed_logged: set[str] = set()


def notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``message`` (``READY=1``, ``STATUS=...``, lines joined by newlines) to systemd;
    True when sent. A failure is logged once per socket and never raises."""
    address = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        target = "\0" + address[1:]  # an abstract socket name
    elif address.startswith("/"):
        target = address
    else:
        _log_once(address, "only unix socket addresses are supported")
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(target)
            sock.sendall(message.encode())
    except OSError as err:
        _log_once(address, err.strerror or str(err))
        return False
    return True


def status(text: str) -> None:
    """The one line ``systemctl status`` shows for the unit."""
    notify(f"STATUS={text}")


def _log_once(address: str, why: str) -> None:
    if address not in _failed_logged:
        _failed_logged.add(address)
        log.warning("Cannot tell systemd (NOTIFY_SOCKET=%s): %s", address, why)
