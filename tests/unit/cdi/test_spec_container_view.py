"""The spec's edits besides the GPUs: the environment, the host files, DRM nodes, another
kind, the hook's driver version; still the lowest CDI version, still valid."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from cdi import spec
from cdi.host_files import Access, HostMount
from cdi.spec import DeviceNode, Gpu, LinkerCacheHook, MigInstance, SpecInputs
from tests.support.cdi_schema import schema_errors

UUID0 = "GPU-b74d99e5-c300-e2af-9177-cff8b32143df"
MIG0 = "MIG-5c3c9cfb-1a2d-5e1b-8f1e-2b6f0d1e7a01"
VOLUME = "/var/lib/nvidia-docker/volumes/nvidia_driver/580.159.04"
HOOK = LinkerCacheHook("/usr/local/bin/nvidia-docker-cdi-hook", "/sbin/ldconfig")
DRM = (DeviceNode("/dev/dri/card1"), DeviceNode("/dev/dri/renderD128"))
FILES = (
    HostMount(f"{VOLUME}/bin/nvidia-smi", "/usr/bin/nvidia-smi"),
    HostMount("/usr/share/vulkan/icd.d/nvidia_icd.json", "/etc/vulkan/icd.d/nvidia_icd.json"),
    HostMount("/run/nvidia-persistenced/socket", "/run/nvidia-persistenced/socket", Access.TALK),
    HostMount("/elsewhere/nvidia-smi", "/usr/bin/nvidia-smi"),  # a second one: the first wins
)


def inputs(**changes: Any) -> SpecInputs:
    base = SpecInputs(
        gpus=(Gpu(0, UUID0, DeviceNode("/dev/nvidia0"), drm=DRM, mig=(MigInstance(1, MIG0, ()),)),),
        control_nodes=(DeviceNode("/dev/nvidiactl"), DeviceNode("/dev/nvidia-modeset")),
        driver_volume=VOLUME,
        hook=HOOK,
        env=(spec.VOID_VISIBLE_DEVICES,),
        host_files=FILES,
        driver_version="580.159.04",
    )
    return dataclasses.replace(base, **changes)


def nodes_of(document: dict[str, Any], name: str) -> list[str]:
    (device,) = [d for d in document["devices"] if d["name"] == name]
    return [node["path"] for node in device["containerEdits"]["deviceNodes"]]


def test_every_container_gets_void_visible_devices_and_the_host_files_after_the_volume() -> None:
    document = spec.build_spec(inputs()).document
    edits = document["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert [(m["containerPath"], m["hostPath"], m["options"]) for m in edits["mounts"]] == [
        ("/usr/local/nvidia", VOLUME, ["ro", "nosuid", "nodev", "bind"]),
        ("/usr/bin/nvidia-smi", f"{VOLUME}/bin/nvidia-smi", ["ro", "nosuid", "nodev", "bind"]),
        (
            "/etc/vulkan/icd.d/nvidia_icd.json",
            "/usr/share/vulkan/icd.d/nvidia_icd.json",
            ["ro", "nosuid", "nodev", "bind"],
        ),
        (
            "/run/nvidia-persistenced/socket",
            "/run/nvidia-persistenced/socket",
            ["nosuid", "nodev", "noexec", "bind"],
        ),
    ]
    assert schema_errors(document) == []
    assert document["cdiVersion"] == "0.5.0"  # env and mounts are older than 0.5.0


def test_a_gpus_drm_nodes_come_with_it_and_with_all_not_with_its_mig_devices() -> None:
    migs = (MigInstance(1, MIG0, (DeviceNode("/dev/nvidia-caps/nvidia-cap12"),)),)
    gpu = Gpu(0, UUID0, DeviceNode("/dev/nvidia0"), drm=DRM, mig=migs)
    document = spec.build_spec(inputs(gpus=(gpu,))).document
    drm = ["/dev/dri/card1", "/dev/dri/renderD128"]
    assert nodes_of(document, "0")[-2:] == drm
    assert nodes_of(document, "all")[-2:] == drm
    assert nodes_of(document, "0:1") == ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap12"]


def test_the_hook_is_told_the_host_drivers_version() -> None:
    (hook,) = spec.build_spec(inputs()).document["containerEdits"]["hooks"]
    assert hook["args"][-2:] == ["--host-driver-version", "580.159.04"]
    (plain,) = spec.build_spec(inputs(driver_version=None)).document["containerEdits"]["hooks"]
    assert "--host-driver-version" not in plain["args"]


def test_another_kind_names_the_same_devices() -> None:
    built = spec.build_spec(inputs(kind="nvidia-docker.com/gpu"))
    assert built.document["kind"] == "nvidia-docker.com/gpu"
    assert built.device_names == ("0", UUID0, "all")
    assert spec.qualified("0", "nvidia-docker.com/gpu") == "nvidia-docker.com/gpu=0"
    assert schema_errors(built.document) == []


@pytest.mark.parametrize(
    ("kind", "valid"),
    [
        ("nvidia.com/gpu", True),
        ("nvidia-docker.com/gpu", True),
        ("example.com/gpu_2", True),
        ("nvidia.com", False),
        ("nvidia.com/", False),
        ("/gpu", False),
        ("9vendor.com/gpu", False),  # a vendor starts with a letter
        ("nvidia.com/gpu-", False),
        ("nvidia.com/g/pu", False),
        ("nvidia.com/gpu=0", False),
    ],
)
def test_cdi_kinds(kind: str, valid: bool) -> None:
    assert spec.valid_kind(kind) is valid
