"""A node file that describes no possible node is refused with one line naming the field
(duplicate UUIDs, bus ids, MIG indices; MIG devices on a GPU not in MIG mode; topology
that names no other GPU), and what ``--dump-node`` writes always loads back."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from agent.gpu import dump, nodefile
from tests.unit.gpu.conftest import MakeFake, StartBackend
from tests.unit.gpu.fake_nvml import GPU_IS_LOST

Node = dict[str, Any]


def mig_node() -> Node:
    data: Node = json.loads(nodefile.resolve("h200x2-mig").read_text(encoding="utf-8"))
    return data


def _same_gpu_uuid(d: Node) -> None:
    d["devices"][1]["uuid"] = d["devices"][0]["uuid"]


def _same_mig_uuid(d: Node) -> None:
    migs = d["devices"][0]["mig_devices"]
    migs[2]["uuid"] = migs[0]["uuid"]


def _mig_uuid_of_a_gpu(d: Node) -> None:
    d["devices"][0]["mig_devices"][1]["uuid"] = d["devices"][1]["uuid"]


def _same_bus_id(d: Node) -> None:
    d["devices"][1]["pci"]["bus_id"] = d["devices"][0]["pci"]["bus_id"]


def _mig_off(d: Node) -> None:
    d["devices"][0]["mig_enabled"] = False


def _same_mig_index(d: Node) -> None:
    d["devices"][0]["mig_devices"][3]["index"] = 1


def _negative_mig_index(d: Node) -> None:
    d["devices"][0]["mig_devices"][0]["index"] = -1


def _same_instances(d: Node) -> None:
    migs = d["devices"][0]["mig_devices"]
    migs[1]["gpu_instance_id"] = migs[0]["gpu_instance_id"]
    migs[1]["compute_instance_id"] = migs[0]["compute_instance_id"]


def _telemetry_of_no_mig(d: Node) -> None:
    d["devices"][0]["status"]["telemetry"]["mig_devices"][2]["index"] = 9


def _peer_twice(d: Node) -> None:
    d["devices"][0]["topology"].append(dict(d["devices"][0]["topology"][0]))


def _peer_missing(d: Node) -> None:
    d["devices"][1]["topology"][0]["bus_id"] = "00000000:99:00.0"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            _same_gpu_uuid,
            "devices[1].uuid: GPU-b74d99e5-c300-e2af-9177-cff8b32143df is also devices[0]'s: "
            "every GPU and MIG device needs its own UUID",
        ),
        (
            _same_mig_uuid,
            "devices[0].mig_devices[2].uuid: MIG-5c3c9cfb-1a2d-5e1b-8f1e-2b6f0d1e7a01 is also "
            "devices[0].mig_devices[0]'s: every GPU and MIG device needs its own UUID",
        ),
        (
            _mig_uuid_of_a_gpu,
            "devices[1].uuid: GPU-4c5aeaec-c4cb-f650-e322-0d9b49245837 is also "
            "devices[0].mig_devices[1]'s: every GPU and MIG device needs its own UUID",
        ),
        (
            _same_bus_id,
            "devices[1].pci.bus_id: 00000000:00:06.0 is also devices[0]'s: every device needs "
            "its own bus id",
        ),
        (
            _mig_off,
            "devices[0].mig_devices: 4 MIG devices on a GPU whose mig_enabled is not true: "
            "set mig_enabled to true, or remove them",
        ),
        (
            _same_mig_index,
            "devices[0].mig_devices[3].index: 1 is used twice on this GPU: each MIG device "
            "needs its own index >= 0",
        ),
        (
            _negative_mig_index,
            "devices[0].mig_devices[0].index: -1 is negative: each MIG device needs its own "
            "index >= 0",
        ),
        (
            _same_instances,
            "devices[0].mig_devices[1]: GPU instance 1 with compute instance 0 is another MIG "
            "device of this GPU too",
        ),
        (
            _telemetry_of_no_mig,
            "devices[0].status.telemetry.mig_devices[2].index: 9 is not the index of one of "
            "this GPU's mig_devices",
        ),
        (_peer_twice, "devices[0].topology[1].bus_id: 00000000:00:07.0 is listed twice"),
        (_peer_missing, "devices[1].topology[0].bus_id: 00000000:99:00.0 is not another device"),
    ],
)
def test_an_impossible_layout_is_one_line_naming_the_field(
    mutate: Callable[[Node], None], message: str
) -> None:
    data = mig_node()
    nodefile.parse(copy.deepcopy(data))  # the built-in node itself is fine
    mutate(data)
    with pytest.raises(nodefile.NodeFileError) as caught:
        nodefile.parse(data)
    assert str(caught.value) == message


def test_a_dump_with_two_gpus_nvml_cannot_open_loads_back(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    fake.fail("nvmlDeviceGetHandleByIndex", GPU_IS_LOST)
    backend = start_backend(fake)
    data = json.loads(json.dumps(dump.dump_node(backend)))
    assert [d["pci"]["bus_id"] for d in data["devices"]] == ["", ""]
    parsed = nodefile.parse(data)
    assert parsed.info == backend.node_info()
    assert [d.uuid for d in parsed.info.devices] == [None, None]


@pytest.mark.parametrize("seconds", ["1e999", "-0.5"])
def test_a_timing_that_cannot_be_slept_is_refused(seconds: str) -> None:
    text = json.dumps({**mig_node(), "timing": {"status_call_s": 0}})
    raw = text.replace('"status_call_s": 0', f'"status_call_s": {seconds}')
    with pytest.raises(nodefile.NodeFileError) as caught:
        nodefile.parse(nodefile.decode_json(raw.encode()))
    assert str(caught.value) == "timing.status_call_s: expected a finite number >= 0"
