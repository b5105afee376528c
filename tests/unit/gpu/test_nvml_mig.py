"""MIG through NVML: the fake pynvml answers as a driver with MIG devices would."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agent.gpu import nodefile, nvml_mig
from agent.gpu.model import MigDevice
from tests.unit.gpu.conftest import MakeFake, StartBackend
from tests.unit.gpu.fake_nvml import NOT_SUPPORTED, FakeMig

UUIDS = (
    "MIG-3f0e0a3c-64a6-5b4d-9b9e-4b8c8a0d0a01",
    "MIG-3f0e0a3c-64a6-5b4d-9b9e-4b8c8a0d0a02",
    "MIG-3f0e0a3c-64a6-5b4d-9b9e-4b8c8a0d0a03",
)
# What the driver writes for GPU minor 0 (abridged: two GPU instances of eight).
MIG_MINORS = """config 1
monitor 2
gpu0/gi0/access 3
gpu0/gi0/ci0/access 4
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu0/gi2/access 21
gpu0/gi2/ci0/access 22
gpu0/gi2/ci1/access 23
gpu1/gi1/access 147
gpu1/gi1/ci0/access 148
garbage line here
gpu1/gi2/access notanumber
"""


def _proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    (proc / "driver" / "nvidia-caps").mkdir(parents=True)
    (proc / "driver" / "nvidia-caps" / "mig-minors").write_text(MIG_MINORS)
    return proc


def test_the_mig_minors_file_maps_capabilities_to_minors(tmp_path: Path) -> None:
    minors = nvml_mig.read_mig_minors(_proc(tmp_path))
    assert minors["config"] == 1
    assert minors["gpu0/gi1/access"] == 12
    assert minors["gpu1/gi1/ci0/access"] == 148
    assert "gpu1/gi2/access" not in minors  # a malformed line is left out
    assert nvml_mig.read_mig_minors(tmp_path / "nowhere") == {}


def test_capability_nodes_are_the_gi_then_the_ci_node() -> None:
    minors = {"gpu1/gi1/access": 147, "gpu1/gi1/ci0/access": 148}
    assert nvml_mig.capability_nodes(1, 1, 0, minors) == (
        "/dev/nvidia-caps/nvidia-cap147",
        "/dev/nvidia-caps/nvidia-cap148",
    )
    assert nvml_mig.capability_nodes(0, 1, 0, minors) == ()  # another GPU's minor
    assert nvml_mig.capability_nodes(None, 1, 0, minors) == ()


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("NVIDIA H200 MIG 1g.18gb", "1g.18gb"),
        ("NVIDIA H200 MIG 1c.2g.35gb", "1c.2g.35gb"),
        ("NVIDIA H200", None),
        (None, None),
    ],
)
def test_profile_from_the_mig_device_name(name: str | None, profile: str | None) -> None:
    assert nvml_mig.profile_of(name) == profile


def test_mig_mode_off_on_the_real_h200_capture(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    info = start_backend(fake).node_info()
    assert [d.mig_enabled for d in info.devices] == [False, False]
    assert [d.mig_devices for d in info.devices] == [(), ()]
    assert "nvmlDeviceGetMigDeviceHandleByIndex" not in fake.calls


def test_mig_devices_of_a_gpu_in_mig_mode(
    make_fake: MakeFake, start_backend: StartBackend, tmp_path: Path
) -> None:
    fake = make_fake("h200x2")
    # Slots 0 and 2 hold MIG devices, slot 1 is empty (a destroyed instance).
    fake.enable_mig(
        0,
        [
            FakeMig(0, UUIDS[0], "3g.71gb", 71424, gpu_instance=1, compute_instance=0),
            FakeMig(2, UUIDS[1], "1c.2g.35gb", 35584, gpu_instance=2, compute_instance=1),
        ],
    )
    info = start_backend(fake, proc=_proc(tmp_path)).node_info()
    gpu0, gpu1 = info.devices
    assert gpu0.mig_enabled is True
    assert gpu0.mig_devices == (
        MigDevice(
            index=0,
            uuid=UUIDS[0],
            profile="3g.71gb",
            memory_mib=71424,
            gpu_instance_id=1,
            compute_instance_id=0,
            capabilities=("/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13"),
        ),
        MigDevice(
            index=2,
            uuid=UUIDS[1],
            profile="1c.2g.35gb",
            memory_mib=35584,
            gpu_instance_id=2,
            compute_instance_id=1,
            capabilities=("/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap23"),
        ),
    )
    assert (gpu1.mig_enabled, gpu1.mig_devices) == (False, ())


def test_unknown_capability_minors_are_warned_about(
    make_fake: MakeFake,
    start_backend: StartBackend,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = make_fake("h200x2")
    fake.enable_mig(1, [FakeMig(0, UUIDS[2], "7g.141gb", 143104, 0, 0)])
    (tmp_path / "proc").mkdir()  # no mig-minors file: the nvidia-caps module is not loaded
    with caplog.at_level(logging.WARNING):
        info = start_backend(fake, proc=tmp_path / "proc").node_info()
    (mig,) = info.devices[1].mig_devices
    assert mig.uuid == UUIDS[2]
    assert mig.capabilities == ()
    assert any("GPU 1, MIG device 0" in r.getMessage() for r in caplog.records)


def test_a_gpu_without_mig_support_reports_none(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    fake.fail("nvmlDeviceGetMigMode", NOT_SUPPORTED)
    info = start_backend(fake).node_info()
    assert [d.mig_enabled for d in info.devices] == [None, None]
    assert "nvmlDeviceGetMaxMigDeviceCount" not in fake.calls


def test_a_mig_value_nvml_cannot_read_is_none(
    make_fake: MakeFake, start_backend: StartBackend, tmp_path: Path
) -> None:
    fake = make_fake("h200x2")
    fake.enable_mig(0, [FakeMig(0, UUIDS[0], "1g.18gb", 16384, 3, 0)])
    fake.fail("nvmlDeviceGetComputeInstanceId", NOT_SUPPORTED)
    info = start_backend(fake, proc=_proc(tmp_path)).node_info()
    (mig,) = info.devices[0].mig_devices
    assert (mig.gpu_instance_id, mig.compute_instance_id) == (3, None)
    assert mig.capabilities == ()  # the compute instance's node cannot be known
    assert (mig.uuid, mig.profile, mig.memory_mib) == (UUIDS[0], "1g.18gb", 16384)


def test_mig_devices_survive_a_node_file_round_trip(
    make_fake: MakeFake, start_backend: StartBackend, tmp_path: Path
) -> None:
    """--dump-node of a MIG node gives a node file that serves the same MIG devices."""
    fake = make_fake("h200x2")
    fake.enable_mig(0, [FakeMig(0, UUIDS[0], "3g.71gb", 71424, 1, 0)])
    backend = start_backend(fake, proc=_proc(tmp_path))
    info = backend.node_info()
    count = len(info.devices)
    dumped = nodefile.dump(
        info,
        [backend.device_status(i) for i in range(count)],
        [backend.pcie_throughput(i) for i in range(count)],
    )
    assert dumped["devices"][0]["mig_enabled"] is True
    assert dumped["devices"][0]["mig_devices"][0]["capabilities"] == [
        "/dev/nvidia-caps/nvidia-cap12",
        "/dev/nvidia-caps/nvidia-cap13",
    ]
    assert nodefile.parse(json.loads(json.dumps(dumped))).info == info
