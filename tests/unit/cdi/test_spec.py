"""The CDI spec builder: device names and edits, the version it declares, the CDI schema."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from cdi import spec
from cdi.spec import DeviceNode, Gpu, LinkerCacheHook, MigInstance, SpecInputs
from tests.support.cdi_schema import schema_errors

UUID0 = "GPU-b74d99e5-c300-e2af-9177-cff8b32143df"
UUID1 = "GPU-4c5aeaec-c4cb-f650-e322-0d9b49245837"
MIG00 = "MIG-5c3c9cfb-1a2d-5e1b-8f1e-2b6f0d1e7a01"
MIG01 = "MIG-8e1f2a3b-4c5d-5e6f-9a0b-1c2d3e4f5a02"
CONTROL = (DeviceNode("/dev/nvidiactl"), DeviceNode("/dev/nvidia-uvm"))
VOLUME = "/var/lib/nvidia-docker/volumes/nvidia_driver/580.159.04"
HOOK = LinkerCacheHook("/usr/local/bin/nvidia-docker-cdi-hook", "/sbin/ldconfig")


def caps(*minors: int) -> tuple[DeviceNode, ...]:
    return tuple(DeviceNode(f"/dev/nvidia-caps/nvidia-cap{m}") for m in minors)


def two_gpus(**gpu1: Any) -> SpecInputs:
    return SpecInputs(
        gpus=(
            Gpu(0, UUID0, DeviceNode("/dev/nvidia0")),
            Gpu(1, UUID1, DeviceNode("/dev/nvidia1"), **gpu1),
        ),
        control_nodes=CONTROL,
        driver_volume=VOLUME,
        hook=HOOK,
    )


def nodes_of(document: dict[str, Any], name: str) -> list[str]:
    (device,) = [d for d in document["devices"] if d["name"] == name]
    return [node["path"] for node in device["containerEdits"]["deviceNodes"]]


def test_one_device_per_index_and_uuid_and_all() -> None:
    built = spec.build_spec(two_gpus())
    doc = built.document
    assert doc["kind"] == "nvidia.com/gpu"
    assert built.device_names == ("0", UUID0, "1", UUID1, "all")
    assert nodes_of(doc, "0") == nodes_of(doc, UUID0) == ["/dev/nvidia0"]
    assert nodes_of(doc, UUID1) == ["/dev/nvidia1"]
    assert nodes_of(doc, "all") == ["/dev/nvidia0", "/dev/nvidia1"]
    assert built.left_out == ()
    assert schema_errors(doc) == []


def test_common_edits_control_nodes_driver_volume_and_the_hook() -> None:
    edits = spec.build_spec(two_gpus()).document["containerEdits"]
    assert edits["deviceNodes"] == [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}]
    assert edits["mounts"] == [
        {
            "hostPath": VOLUME,
            "containerPath": "/usr/local/nvidia",
            "options": ["ro", "nosuid", "nodev", "bind"],
        }
    ]
    (hook,) = edits["hooks"]
    assert hook == {
        "hookName": "createContainer",
        "path": HOOK.program,
        "args": [
            "nvidia-docker-cdi-hook",
            "update-ldcache",
            "--ldconfig",
            "/sbin/ldconfig",
            "--folder",
            "/usr/local/nvidia/lib64",
            "--folder",
            "/usr/local/nvidia/lib",
        ],
        "timeout": 30,
    }


def test_no_driver_volume_means_no_mount_and_no_hook() -> None:
    inputs = SpecInputs(gpus=two_gpus().gpus, control_nodes=CONTROL, driver_volume=None, hook=HOOK)
    edits = spec.build_spec(inputs).document["containerEdits"]
    assert set(edits) == {"deviceNodes"}


def test_the_version_is_the_lowest_that_has_the_features_used() -> None:
    # Device names starting with a digit ("0") came with CDI 0.5.0: our specs need 0.5.0,
    # which Debian 12's Podman 4.3 reads, and nothing newer.
    assert spec.build_spec(two_gpus()).document["cdiVersion"] == "0.5.0"
    base: dict[str, Any] = {"kind": spec.KIND, "devices": []}
    named = {"name": "gpu0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
    assert spec.minimum_version({**base, "devices": [named]}) == "0.3.0"
    typed = {"containerEdits": {"mounts": [{"hostPath": "a", "containerPath": "b", "type": "x"}]}}
    assert spec.minimum_version({**base, "devices": [named], **typed}) == "0.4.0"
    host = {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/x/dev/nvidia0"}]}
    assert spec.minimum_version({**base, "devices": [{**named, "containerEdits": host}]}) == "0.5.0"
    assert spec.minimum_version({**base, "devices": [named], "annotations": {"a": "b"}}) == "0.6.0"


def test_a_kind_whose_class_has_a_dot_declares_cdi_0_6_0() -> None:
    # CDI allows "." in the class (after the "/") only from 0.6.0 on; a reader refuses a
    # spec that declares less ("the spec version must be at least v0.6.0").
    dotted = spec.build_spec(replace(two_gpus(), kind="example.com/gpu.v2")).document
    assert dotted["cdiVersion"] == "0.6.0"
    assert (
        spec.build_spec(replace(two_gpus(), kind="nvidia-docker.com/gpu")).document["cdiVersion"]
        == "0.5.0"
    )
    assert schema_errors(dotted) == []


def test_an_unhealthy_gpu_leaves_all_but_keeps_its_names() -> None:
    built = spec.build_spec(two_gpus(healthy=False))
    assert built.device_names == ("0", UUID0, "1", UUID1, "all")
    assert nodes_of(built.document, "all") == ["/dev/nvidia0"]
    assert nodes_of(built.document, UUID1) == ["/dev/nvidia1"]
    assert built.left_out == ("GPU 1: unhealthy, not in 'all'",)


def test_no_healthy_gpu_means_no_all_device() -> None:
    inputs = SpecInputs(
        gpus=(Gpu(0, UUID0, DeviceNode("/dev/nvidia0"), healthy=False),),
        control_nodes=CONTROL,
        driver_volume=VOLUME,
    )
    built = spec.build_spec(inputs)
    assert built.device_names == ("0", UUID0)  # CDI refuses a device without edits
    assert schema_errors(built.document) == []


def test_devices_that_cannot_be_named_are_left_out_and_said_so() -> None:
    inputs = SpecInputs(
        gpus=(
            Gpu(0, None, None),  # NVML could not open it at start
            Gpu(1, "GPU-1/old format", DeviceNode("/dev/nvidia1")),
        ),
        control_nodes=CONTROL,
        driver_volume=VOLUME,
    )
    built = spec.build_spec(inputs)
    assert built.device_names == ("1", "all")
    assert built.left_out == (
        "GPU 0: its device node is unknown (NVML cannot open it)",
        "GPU 1: UUID 'GPU-1/old format' is not a CDI device name; use '1'",
    )
    assert schema_errors(built.document) == []


def mig_inputs() -> SpecInputs:
    migs = (MigInstance(0, MIG00, caps(12, 13)), MigInstance(2, MIG01, caps(21, 23)))
    return SpecInputs(
        gpus=(
            Gpu(0, UUID0, DeviceNode("/dev/nvidia0"), mig=migs),
            Gpu(1, UUID1, DeviceNode("/dev/nvidia1")),
        ),
        control_nodes=CONTROL,
        driver_volume=VOLUME,
        hook=HOOK,
    )


def test_mig_devices_by_index_and_uuid() -> None:
    built = spec.build_spec(mig_inputs())
    doc = built.document
    assert built.device_names == ("0", UUID0, "0:0", MIG00, "0:2", MIG01, "1", UUID1, "all")
    caps_0 = ["/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13"]
    caps_2 = ["/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap23"]
    assert nodes_of(doc, "0:0") == nodes_of(doc, MIG00) == ["/dev/nvidia0", *caps_0]
    assert nodes_of(doc, MIG01) == ["/dev/nvidia0", *caps_2]
    # The whole GPU, and "all", give every MIG device of it.
    assert nodes_of(doc, UUID0) == ["/dev/nvidia0", *caps_0, *caps_2]
    assert nodes_of(doc, "all") == ["/dev/nvidia0", *caps_0, *caps_2, "/dev/nvidia1"]
    assert schema_errors(doc) == []
    assert doc["cdiVersion"] == "0.5.0"


def test_a_mig_device_withdrawn_on_its_own_leaves_all_but_keeps_its_names() -> None:
    inputs = mig_inputs()
    gpu0 = inputs.gpus[0]
    sick = (gpu0.mig[0], MigInstance(2, MIG01, caps(21, 23), healthy=False))
    built = spec.build_spec(replace(inputs, gpus=(replace(gpu0, mig=sick), inputs.gpus[1])))
    doc = built.document
    caps_0 = ["/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13"]
    assert nodes_of(doc, MIG01) == ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21",
                                    "/dev/nvidia-caps/nvidia-cap23"]  # fmt: skip
    assert nodes_of(doc, "all") == ["/dev/nvidia0", *caps_0, "/dev/nvidia1"]
    assert built.left_out == ("GPU 0 MIG device 2: unhealthy, not in 'all'",)
    assert schema_errors(doc) == []


def test_a_mig_device_without_capability_nodes_is_left_out() -> None:
    inputs = SpecInputs(
        gpus=(Gpu(0, UUID0, DeviceNode("/dev/nvidia0"), mig=(MigInstance(1, MIG00, ()),)),),
        control_nodes=CONTROL,
        driver_volume=None,
    )
    built = spec.build_spec(inputs)
    assert built.device_names == ("0", UUID0, "all")
    assert built.left_out == ("GPU 0 MIG device 1: its capability nodes are unknown",)


def test_host_paths_for_a_driver_container_dev_root() -> None:
    root = "/run/nvidia/driver"
    inputs = SpecInputs(
        gpus=(Gpu(0, UUID0, DeviceNode("/dev/nvidia0", f"{root}/dev/nvidia0")),),
        control_nodes=(DeviceNode("/dev/nvidiactl", f"{root}/dev/nvidiactl"),),
        driver_volume=VOLUME,
    )
    doc = spec.build_spec(inputs).document
    assert doc["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidiactl", "hostPath": f"{root}/dev/nvidiactl"}
    ]
    (device,) = [d for d in doc["devices"] if d["name"] == "0"]
    assert device["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": f"{root}/dev/nvidia0"}
    ]
    assert schema_errors(doc) == []


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("0", True),
        ("0:1", True),
        (UUID0, True),
        (MIG00, True),
        ("all", True),
        ("MIG-GPU-b74d99e5/1/0", False),  # the R450 MIG UUID format
        ("-x", False),
        ("x-", False),
        ("", False),
        ("a b", False),
    ],
)
def test_cdi_device_names(name: str, valid: bool) -> None:
    assert spec.valid_name(name) is valid


def test_preferred_names_for_the_command_line() -> None:
    gpu = Gpu(3, UUID0, DeviceNode("/dev/nvidia3"))
    assert spec.gpu_name(gpu) == UUID0
    assert spec.gpu_name(Gpu(3, None, DeviceNode("/dev/nvidia3"))) == "3"
    assert spec.gpu_name(Gpu(3, UUID0, None)) is None
    assert spec.mig_name(gpu, MigInstance(1, MIG00, caps(1))) == MIG00
    assert spec.mig_name(gpu, MigInstance(1, None, caps(1))) == "3:1"
    assert spec.mig_name(gpu, MigInstance(1, MIG00, ())) is None
    assert spec.qualified("3:1") == "nvidia.com/gpu=3:1"


def test_the_file_is_indented_json_with_a_final_newline() -> None:
    document = spec.build_spec(two_gpus()).document
    text = spec.encode(document)
    assert text.endswith(b"}\n")
    assert json.loads(text) == document
    assert b'\n  "kind": "nvidia.com/gpu",\n' in text
