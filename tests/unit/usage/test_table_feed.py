"""What a ledger tick tells the lease table of a sweep: its GPU processes and each GPU's
load."""

from __future__ import annotations

import dataclasses

from agent.attribution.cgroup import OwnerKind
from agent.attribution.owners import ProcessOwner
from agent.gpu import nodefile
from agent.gpu.model import LOST_DEVICE_STATUS, GpuProcess, Utilization
from agent.leases.containers import GpuUser
from agent.leases.loads import GpuLoad
from agent.node.status import Sweep
from agent.usage.table_feed import gpu_loads, gpu_users
from tests.unit.leases.nodes import build_node

NODE = build_node([0, 0, 1, 1])
DOCKER_ID = "a" * 64
PODMAN_ID = "b" * 64


def sweep(processes: dict[int, list[int]]) -> Sweep:
    statuses = tuple(
        dataclasses.replace(
            LOST_DEVICE_STATUS,
            processes=tuple(GpuProcess(pid, "python3", 100) for pid in processes.get(i, [])),
        )
        for i in range(len(NODE.devices))
    )
    return Sweep(NODE, statuses, (), None)


def test_each_placed_process_is_told_with_its_holder() -> None:
    owners = {
        10: ProcessOwner(OwnerKind.DOCKER, DOCKER_ID),
        11: ProcessOwner(OwnerKind.PODMAN, PODMAN_ID),
        12: ProcessOwner(OwnerKind.HOST),
        13: ProcessOwner(OwnerKind.MESOS, mesos_container="task-1"),
        14: ProcessOwner(OwnerKind.CONTAINERD, "c" * 64),  # not an engine the table follows
        15: ProcessOwner(OwnerKind.DOCKER, "/not an id"),
    }
    users = gpu_users(sweep({0: [10], 1: [11, 12], 2: [13, 14], 3: [15]}), owners)
    assert users == [
        GpuUser(0, DOCKER_ID, 10),
        GpuUser(1, PODMAN_ID, 11),
        GpuUser(1, None, 12),
        GpuUser(2, None, 13),
        GpuUser(2, None, 14),
        GpuUser(3, None, 15),
    ]
    assert [u.holder for u in users[2:]] == ["pid 12", "pid 13", "pid 14", "pid 15"]


def test_a_process_that_cannot_be_placed_tells_nothing() -> None:
    owners = {20: ProcessOwner(OwnerKind.UNKNOWN)}  # ended, or another PID namespace's
    assert gpu_users(sweep({0: [20, 21]}), owners) == []  # 21: not attributed at all


def test_each_gpu_load_is_its_utilization_and_memory_used_of_its_total() -> None:
    file = nodefile.load("hgx-h200-8")  # GPUs 2 and 3 train: 97 %, 121,034 of 143,771 MiB
    statuses = tuple(d.status for d in file.devices)
    statuses = (*statuses[:7], LOST_DEVICE_STATUS)  # GPU 7 does not answer
    loads = gpu_loads(Sweep(file.info, statuses, (), None))
    assert loads[0] == GpuLoad(0, 0)  # 615 MiB the driver keeps: 0 %
    assert loads[2] == loads[3] == GpuLoad(97, 84)
    assert loads[7] == GpuLoad(None, None)
    assert [load.level for load in loads] == [0, 0, 9, 9, 0, 0, 0, 0]


def test_a_gpu_whose_total_memory_is_unknown_has_utilization_alone() -> None:
    busy = Utilization(30, None, None, None)
    statuses = tuple(
        dataclasses.replace(LOST_DEVICE_STATUS, utilization=busy, memory_used_mib=500)
        for _ in NODE.devices
    )
    assert gpu_loads(Sweep(NODE, statuses, (), None)) == [GpuLoad(30, None)] * 4
