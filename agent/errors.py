"""The daemon's own failure (a start-up step that cannot be done, said in one line) and its
exit codes (docs/agent.md, "Stopping, failures and exit codes")."""

from __future__ import annotations


class StartupError(Exception):
    """A start-up step failed; the message is the one line the operator reads."""


EXIT_OK = 0
EXIT_STARTUP_FAILED = 1  # driver absent, bad node file, address in use, ...
EXIT_USAGE = 2  # bad flags (click's own code)
EXIT_SERVER_STOPPED = 3  # the plugin socket file was removed while serving
EXIT_FORCED = 130  # a second signal during shutdown
