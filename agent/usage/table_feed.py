"""What each usage-ledger tick tells the lease table of a sweep (docs/leases.md).

The engines' events show the containers that were given GPUs; they do not show a process
started on a GPU by other means: a program on the host, a Mesos containerizer task, a
container of another runtime. Each tick's sweep lists every GPU's compute processes and the
attribution places them (``agent.attribution``), so the table learns at every tick
(``processes_seen``) each process's holder, its container (a Docker or Podman container,
whose id the table knows) or ``pid N`` (anything else). A holder that holds nothing on the
process's GPU becomes a foreign holder of that GPU until a tick no longer sees it. A process
the attribution cannot place (it ended, or lives in another PID namespace, which is also
what a simulated node's made-up processes are) tells nothing and is left out.

Each GPU's utilization is not given to the table yet (``set_load``): ties between equally
connected GPUs are broken by index, so that a pick does not depend on whether a tick came
before it.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.attribution.cgroup import OwnerKind
from agent.attribution.owners import ProcessOwner
from agent.leases.containers import GpuUser
from agent.leases.holders import CONTAINER_ID
from agent.node.status import Sweep

ENGINE_KINDS = (OwnerKind.DOCKER, OwnerKind.PODMAN)  # whose container ids the table follows


def gpu_users(sweep: Sweep, owners: Mapping[int, ProcessOwner]) -> list[GpuUser]:
    """The sweep's GPU processes that the attribution placed, each with its holder."""
    users: list[GpuUser] = []
    for device, status in zip(sweep.node.devices, sweep.statuses, strict=False):
        for process in status.processes:
            owner = owners.get(process.pid)
            if owner is None or owner.kind is OwnerKind.UNKNOWN:
                continue
            container = owner.container_id if owner.kind in ENGINE_KINDS else None
            if container is not None and not CONTAINER_ID.fullmatch(container):
                container = None
            users.append(GpuUser(device.index, container, process.pid))
    return users
