"""Port 3476 of this machine, where the nvidia-docker wrapper looks for the node's own agent
when ``NV_HOST`` is unset: one test at a time, machine-wide (other runs of this suite wait
for the lock)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tests.support.prerequisites import unavailable
from tests.support.services import machine_lock, port_open, wait_until

LOCAL_AGENT_PORT = 3476
LOCAL_AGENT_LOCK = "agent-3476"


@contextlib.contextmanager
def local_agent_port() -> Iterator[int]:
    """The port, held for the block; anything else listening there is waited for a while,
    then the test is skipped."""
    with machine_lock(LOCAL_AGENT_LOCK):
        try:
            wait_until(
                lambda: not (port_open(LOCAL_AGENT_PORT) or port_open(LOCAL_AGENT_PORT, "::1")),
                what=f"localhost:{LOCAL_AGENT_PORT} to be free",
                timeout_s=30,
            )
        except TimeoutError:
            unavailable(f"something else listens on localhost:{LOCAL_AGENT_PORT}")
        yield LOCAL_AGENT_PORT
