from __future__ import annotations

import pytest

from agent.gpu.simulated import SimulatedBackend
from agent.node.selection import (
    InvalidParameter,
    Target,
    select_devices,
    select_targets,
    select_volumes,
)

NODE = SimulatedBackend.from_file("hgx-h200-8").node_info()


def test_empty_and_star_mean_all() -> None:
    for value in (None, "", " ", "*"):
        assert select_devices(NODE.devices, value) == NODE.devices
        assert [v.name for v in select_volumes(value)] == ["nvidia_driver"]


def test_indices_and_uuid_prefixes_in_index_order_once() -> None:
    uuid3 = NODE.devices[3].uuid
    assert uuid3 is not None
    chosen = select_devices(NODE.devices, f"5 {uuid3[:10]} 0 5")
    assert [d.index for d in chosen] == [0, 3, 5]


def test_uuid_prefix_is_case_insensitive() -> None:
    uuid = NODE.devices[1].uuid
    assert uuid is not None
    assert select_devices(NODE.devices, uuid.upper())[0].index == 1


@pytest.mark.parametrize("entry", ["8", "-1", "GPU-", "GPU-zzz", "gpu0", "nvidia0", "1.0"])
def test_unknown_device_names_the_entry(entry: str) -> None:
    with pytest.raises(InvalidParameter, match=f"^invalid device: {entry}$"):
        select_devices(NODE.devices, f"0 {entry}")


def test_ambiguous_uuid_prefix_is_refused() -> None:
    with pytest.raises(InvalidParameter, match="invalid device: GPU-"):
        select_devices(NODE.devices, "GPU-")


def test_unknown_volume() -> None:
    with pytest.raises(InvalidParameter, match=r"^invalid volume: nvidia_foo$"):
        select_volumes("nvidia_driver nvidia_foo")


# --- MIG ------------------------------------------------------------------------------------

MIG_NODE = SimulatedBackend.from_file("h200x2-mig").node_info()
MIGS = MIG_NODE.devices[0].mig_devices


def test_mig_devices_by_index_and_uuid_prefix() -> None:
    uuid2 = MIGS[2].uuid
    assert uuid2 is not None
    targets = select_targets(MIG_NODE.devices, f"0:3 {uuid2[:12]} 1 0:3")
    assert [(t.gpu.index, t.mig.index if t.mig else None) for t in targets] == [
        (0, 2),
        (0, 3),
        (1, None),
    ]
    # /gpu/info and /gpu/status serve whole GPUs: a MIG device stands for its GPU.
    assert [d.index for d in select_devices(MIG_NODE.devices, "0:1")] == [0]


def test_a_whole_gpu_includes_its_mig_devices() -> None:
    targets = select_targets(MIG_NODE.devices, "0:1 0")
    assert [(t.gpu.index, t.mig) for t in targets] == [(0, None)]
    assert select_targets(MIG_NODE.devices, None) == tuple(Target(d) for d in MIG_NODE.devices)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("0:9", r"invalid device: 0:9 \(GPU 0 has MIG devices 0:0, 0:1, 0:2, 0:3\)"),
        ("1:0", r"invalid device: 1:0 \(GPU 1 is not in MIG mode\)"),
        ("2:0", r"invalid device: 2:0$"),
        ("0:x", r"invalid device: 0:x$"),
        ("0:1:2", r"invalid device: 0:1:2$"),
        ("MIG-", r"invalid device: MIG-$"),  # every MIG device: ambiguous
        ("MIG-ffff", r"invalid device: MIG-ffff$"),
    ],
)
def test_unknown_mig_devices_say_what_there_is(entry: str, message: str) -> None:
    with pytest.raises(InvalidParameter, match=message) as caught:
        select_targets(MIG_NODE.devices, entry)
    assert (caught.value.parameter, caught.value.entry) == ("dev", entry)
