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

Each tick also gives the table every GPU's load in that sweep (``gpu_loads``, for
``set_load``): its utilization and the share of its memory used, which picks weigh among
equally connected GPUs (``agent.leases.loads``). The table keeps the latest tick's until the
next one, so a pick depends on the last sweep before it, as it does on the leases then.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.attribution.cgroup import OwnerKind
from agent.attribution.owners import ProcessOwner
from agent.leases.containers import GpuUser
from agent.leases.holders import CONTAINER_ID
from agent.leases.loads import GpuLoad, memory_used_pct
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


def gpu_loads(sweep: Sweep) -> list[GpuLoad]:
    """Each GPU's load in the sweep, in index order: its utilization and memory used (of
    its total, ``DeviceInfo.memory.global_mib``); unknown values (a lost GPU) stay None."""
    return [
        GpuLoad(
            status.utilization.gpu_pct,
            memory_used_pct(status.memory_used_mib, device.memory.global_mib),
        )
        for device, status in zip(sweep.node.devices, sweep.statuses, strict=False)
    ]
