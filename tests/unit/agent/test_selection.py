from __future__ import annotations

import pytest

from agent.gpu.simulated import SimulatedBackend
from agent.selection import InvalidParameter, select_devices, select_volumes

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
