"""``nvidia-docker-ctl leases|free``: GPU leases across a fleet (docs/fleet.md, "Leases across
the fleet").

::

    nvidia-docker-ctl leases -i fleet.yml              # who holds what, per unit
    nvidia-docker-ctl free -i fleet.yml --gpus 2       # nodes with 2 free healthy GPUs now
    nvidia-docker-ctl free -i fleet.yml --gpus 3 --mig 1g.18gb

Both are fleet commands (``controller.ctl.fleet``: the same nodes, TLS, tokens, SSH,
timeouts, ``--json``/``--jsonl``, error lines). ``free`` is a query, not a scheduler: it
asks for nothing. Its exit code: 0 when at least one node qualifies, 1 when none does, 3 when
no node's agent could be reached (2 for usage errors, as every command).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from controller.ctl.flags import request_options
from controller.ctl.fleet import FleetNodes, fleet_command, run_fleet_command
from controller.options import Options, setting

_EPILOG = (
    "NODE uses the NV_HOST syntax: node1: | http://10.0.0.1:3476 | ssh://admin@node2:; "
    "no NODE, --nodes or --inventory: NV_HOST, else the local agent. "
    "An agent older than leases gets one line saying so. "
)
LEASES_EPILOG = _EPILOG + (
    "Exit codes: 0 all nodes answered, 1 some failed (or answered an error), 2 usage or "
    "inventory error, 3 no agent could be reached. See docs/fleet.md."
)
FREE_EPILOG = _EPILOG + (
    "Exit codes: 0 at least one node qualifies, 1 none does, 2 usage or inventory error, "
    "3 no agent could be reached. See docs/fleet.md."
)


@dataclass(frozen=True, slots=True)
class FreeRequest:
    gpus: int = setting(
        1,
        "How many free healthy GPUs (with --mig: MIG devices of that profile) a node must have.",
        flags=("--gpus",),
        kind="int",
        minimum=1,
        maximum=1024,
        metavar="N",
    )
    mig: str | None = setting(
        None,
        "MIG devices of this profile instead of whole GPUs (1g.18gb).",
        flags=("--mig",),
        metavar="PROFILE",
    )


@fleet_command("leases", epilog=LEASES_EPILOG)
def leases(node: tuple[str, ...], nodes: FleetNodes, options: Options) -> None:
    """Who holds each GPU and MIG device: state, lease, container, owner, since; queue."""
    from controller.fleet.lease_view import LEASES  # noqa: PLC0415 (keep other commands fast)

    sys.exit(run_fleet_command(LEASES, node, nodes, options))


@fleet_command("free", epilog=FREE_EPILOG)
@request_options(FreeRequest, "request")
def free(node: tuple[str, ...], nodes: FleetNodes, options: Options, request: FreeRequest) -> None:
    """Nodes with N free healthy GPUs now, each with its best-connected set, best first."""
    from controller.fleet.free_view import FreeAsk, free_query  # noqa: PLC0415

    ask = FreeAsk(request.gpus, request.mig.strip() if request.mig else None)
    sys.exit(run_fleet_command(free_query(ask), node, nodes, options, free=ask))
