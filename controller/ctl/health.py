"""``nvidia-docker-ctl health NODE...``: only what is wrong across a fleet, for scripts and cron.

Lists each unhealthy GPU (node, GPU, reason with its XID, since when) and each node that did
not answer (or is in a driver upgrade); prints nothing on stdout when all is well. Exit
codes as the other fleet commands (docs/fleet.md), plus: 1 when there is any problem.
"""

from __future__ import annotations

import sys

from controller.ctl.fleet import FleetNodes, fleet_command, run_fleet_command
from controller.options import Options

_EPILOG = (
    "NODE uses the NV_HOST syntax: node1: | http://10.0.0.1:3476 | ssh://admin@node2:; "
    "no NODE, --nodes or --inventory: NV_HOST, else the local agent. "
    "Exit codes: 0 no problem, 1 a problem (an unhealthy GPU, a node that failed), 2 usage "
    "or inventory error, 3 no agent could be reached. See docs/fleet.md."
)


@fleet_command("health", epilog=_EPILOG)
def health(node: tuple[str, ...], nodes: FleetNodes, options: Options) -> None:
    """Only the problems: unhealthy GPUs (reason, XID, since) and nodes that do not answer."""
    from controller.fleet.query import HEALTH  # noqa: PLC0415 (keep other commands fast)

    sys.exit(run_fleet_command(HEALTH, node, nodes, options))
