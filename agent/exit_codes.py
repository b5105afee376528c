"""The daemon's exit codes (docs/agent.md, "Stopping, failures and exit codes")."""

from __future__ import annotations

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1  # driver absent, bad node file, address in use, ...
EXIT_USAGE = 2  # bad flags (click's own code)
EXIT_SERVER_STOPPED = 3  # one of the two servers stopped on its own
EXIT_FORCED = 130  # a second signal during shutdown
