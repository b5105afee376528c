"""Which labels a GPU's series carry, given who runs on it."""

from __future__ import annotations

import dataclasses

from agent.attribution.cgroup import OwnerKind
from agent.attribution.owners import ProcessOwner
from agent.gpu import nodefile
from agent.gpu.model import (
    LOST_DEVICE_STATUS,
    UNKNOWN_THROUGHPUT,
    DeviceStatus,
    GpuProcess,
)
from agent.metrics.gpu_families import gpu_families
from agent.metrics.service import render
from tests.unit.metrics.conftest import samples

NODE = nodefile.load("hgx-h200-8")
TRAINER = ProcessOwner(OwnerKind.DOCKER, "a" * 64, "trainer", "pytorch/pytorch:2.3.1", None)
OTHER = ProcessOwner(OwnerKind.DOCKER, "b" * 64, "notebook", "jupyter/base:latest", None)
TASK = ProcessOwner(OwnerKind.MESOS, None, None, None, "6b4a3f7e")
HOST = ProcessOwner(OwnerKind.HOST)


def _render(processes: list[GpuProcess], owners: dict[int, ProcessOwner]) -> str:
    statuses = [d.status for d in NODE.devices]
    statuses[0] = dataclasses.replace(statuses[0], processes=tuple(processes))
    families = gpu_families(
        NODE.info.devices, statuses, [d.throughput for d in NODE.devices], owners,
        driver_version="580.159.04", hostname="n1",
    )  # fmt: skip
    return render(families).decode()


def _gpu0_labels(text: str, gpu: str = "0") -> dict[str, str]:
    (sample,) = [
        s for s in samples(text) if s.name == "DCGM_FI_DEV_GPU_UTIL" and s.labels["gpu"] == gpu
    ]
    return sample.labels


def test_one_container_owns_the_gpu() -> None:
    text = _render([GpuProcess(10, "python3", 100), GpuProcess(11, "python3", 50)],
                   {10: TRAINER, 11: TRAINER})  # fmt: skip
    labels = _gpu0_labels(text)
    assert labels["container"] == "trainer"
    assert labels["container_id"] == "a" * 64
    assert labels["image"] == "pytorch/pytorch:2.3.1"
    assert "mesos_container" not in labels
    assert "container" not in _gpu0_labels(text, gpu="1")  # GPU 1 runs nothing


def test_two_containers_or_a_host_process_share_it() -> None:
    for owners in ({10: TRAINER, 11: OTHER}, {10: TRAINER, 11: HOST}):
        text = _render([GpuProcess(10, "a", 1), GpuProcess(11, "b", 1)], owners)
        assert "container" not in _gpu0_labels(text)


def test_a_process_not_attributed_leaves_the_gpu_unlabelled() -> None:
    text = _render([GpuProcess(10, "a", 1), GpuProcess(11, "b", 1)], {10: TRAINER})
    assert "container" not in _gpu0_labels(text)


def test_a_host_only_gpu_has_no_container_labels() -> None:
    assert "container" not in _gpu0_labels(_render([GpuProcess(10, "x", 1)], {10: HOST}))


def test_mesos_task_labels() -> None:
    text = _render([GpuProcess(10, "python3", 100)], {10: TASK})
    labels = _gpu0_labels(text)
    assert labels["mesos_container"] == "6b4a3f7e"
    assert "container" not in labels


def test_per_process_series() -> None:
    text = _render([GpuProcess(10, "python3", 100), GpuProcess(12, None, None)],
                   {10: TRAINER, 12: HOST})  # fmt: skip
    memory = [s for s in samples(text) if s.name == "nvidia_docker_gpu_process_memory_used_bytes"]
    info = [s for s in samples(text) if s.name == "nvidia_docker_gpu_process_info"]
    assert [s.labels["pid"] for s in info if s.labels["gpu"] == "0"] == ["10", "12"]
    (trainer,) = [s for s in memory if s.labels["gpu"] == "0"]  # 12's memory is unknown
    assert trainer.value == 100 * 2**20
    assert trainer.labels == {
        "gpu": "0", "UUID": NODE.info.devices[0].uuid, "device": "nvidia0", "Hostname": "n1",
        "pid": "10", "process_name": "python3", "owner": "docker", "container": "trainer",
        "container_id": "a" * 64, "image": "pytorch/pytorch:2.3.1",
    }  # fmt: skip
    (host,) = [s for s in info if s.labels["pid"] == "12"]
    assert host.labels["owner"] == "host"
    assert "process_name" not in host.labels
    assert "container" not in host.labels


def test_lost_status_gives_nothing_for_that_gpu() -> None:
    statuses: list[DeviceStatus] = [d.status for d in NODE.devices]
    statuses[0] = LOST_DEVICE_STATUS
    throughputs = [d.throughput for d in NODE.devices]
    throughputs[0] = UNKNOWN_THROUGHPUT  # as the sampler reports a lost GPU
    families = gpu_families(
        NODE.info.devices, statuses, throughputs, {},
        driver_version="580.159.04", hostname="n1",
    )  # fmt: skip
    gpus = {s.labels["gpu"] for f in families for s in f.samples}
    assert "0" not in gpus
    assert len(gpus) == 7
