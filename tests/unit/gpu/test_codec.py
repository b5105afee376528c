"""The model's JSON codec: node files and the CUDA child's answers, read off the declarations."""

from __future__ import annotations

import copy
import enum
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from agent.gpu import codec, nodefile
from agent.gpu.codec import CodecError
from agent.gpu.model import (
    DeviceInfo,
    DeviceStatus,
    EccErrors,
    PcieThroughput,
    PciLink,
    PeerLink,
)


class Color(enum.IntEnum):
    RED = 1
    GREEN = 2


@dataclass(frozen=True, slots=True)
class Inner:
    size_mib: int | None
    color: Color = Color.RED


@dataclass(frozen=True, slots=True)
class Outer:
    """A model type as a later version might declare it: an added field with a default."""

    index: int = field(metadata={"json": None})
    name: str
    inner: Inner
    items: tuple[Inner, ...]
    renamed_: bool | None = field(metadata={"json": "renamed"})
    added_later: int = 7


def test_round_trip_and_names() -> None:
    value = Outer(3, "x", Inner(5, Color.GREEN), (Inner(None),), True, 9)
    data = codec.to_json(value)
    assert data == {
        "name": "x",
        "inner": {"size_mib": 5, "color": 2},
        "items": [{"size_mib": None, "color": 1}],
        "renamed": True,
        "added_later": 9,
    }
    assert codec.from_json(Outer, json.loads(json.dumps(data)), given={"index": 3}) == value
    assert list(data) == ["name", "inner", "items", "renamed", "added_later"]  # declared order


def test_a_file_written_before_a_field_existed_still_loads() -> None:
    old = {"name": "x", "inner": {"size_mib": 1}, "comment": "unknown keys are ignored"}
    value = codec.from_json(Outer, old, given={"index": 0})
    assert value == Outer(0, "x", Inner(1, Color.RED), (), None, 7)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "top.name: missing"),
        ({"name": None}, "top.name: must not be null"),
        ({"name": 5}, "top.name: expected a string, got 5"),
        ({"name": "x", "inner": {"size_mib": True}}, "top.inner.size_mib: expected an integer"),
        ({"name": "x", "inner": {"color": 9}}, "top.inner.color: expected one of 1, 2, got 9"),
        ({"name": "x", "items": {}}, "top.items: expected a list"),
        ({"name": "x", "items": [None, 3]}, "top.items[1]: expected an object, got 3"),
        ({"name": "x", "renamed": "yes"}, "top.renamed: expected true or false"),
        ([], "top: expected an object"),
    ],
)
def test_errors_name_the_field(data: Any, message: str) -> None:
    with pytest.raises(CodecError) as caught:
        codec.from_json(Outer, data, "top", given={"index": 0})
    assert str(caught.value).startswith(message)


def test_lenient_reading_nulls_what_is_wrong_and_keeps_the_rest() -> None:
    value = codec.from_json(Inner, {"size_mib": "x", "color": 2}, lenient=True)
    assert value == Inner(None, Color.GREEN)


def test_model_json_names() -> None:
    assert codec.to_json(EccErrors(1, 2, 3)) == {"l1_cache": 1, "l2_cache": 2, "global": 3}
    assert codec.to_json(PeerLink("00000000:01:00.0", PciLink.SAME_BOARD, 18)) == {
        "bus_id": "00000000:01:00.0",
        "link": 6,
        "nvlinks": 18,
    }
    assert "index" not in codec.to_json(nodefile.load("h200").info.devices[0])


@pytest.mark.parametrize("name", nodefile.BUILTIN_NODES)
def test_every_model_field_is_in_a_dumped_node_file(name: str) -> None:
    """A dump carries every field of the model, so a new field reaches node files by itself."""
    loaded = nodefile.load(name)
    data = nodefile.dump(
        loaded.info,
        [d.status for d in loaded.devices],
        [d.throughput for d in loaded.devices],
    )
    device = data["devices"][0]
    assert set(codec.to_json(loaded.info.devices[0])) <= set(device)  # to_json: every field
    assert set(codec.to_json(loaded.devices[0].status)) <= set(device["status"])
    assert nodefile.parse(data).info == loaded.info


def test_node_file_errors_name_the_field() -> None:
    raw = json.loads(nodefile.resolve("h200x2").read_text())
    broken = copy.deepcopy(raw)
    del broken["devices"][1]["pci"]["bus_id"]
    with pytest.raises(nodefile.NodeFileError, match=r"^devices\[1\]\.pci\.bus_id: missing$"):
        nodefile.parse(broken)
    broken = copy.deepcopy(raw)
    broken["devices"][0]["status"]["processes"] = [{"pid": "12", "name": "x"}]
    with pytest.raises(
        nodefile.NodeFileError, match=r"^devices\[0\]\.status\.processes\[0\]\.pid: expected an"
    ):
        nodefile.parse(broken)
    broken = copy.deepcopy(raw)
    broken["devices"][0]["topology"][0]["link"] = 9
    with pytest.raises(nodefile.NodeFileError, match=r"topology\[0\]\.link: expected one of 0, 1"):
        nodefile.parse(broken)


@pytest.mark.parametrize("name", nodefile.BUILTIN_NODES)
def test_the_compiled_codec_writes_what_to_json_writes_and_reads_it_back(name: str) -> None:
    """The GPU worker's hot path (encoder/decoder) agrees with the checked walk."""
    node = nodefile.load(name)
    for device in node.devices:
        for cls, value in ((DeviceStatus, device.status), (PcieThroughput, device.throughput)):
            written = codec.encoder(cls)(value)
            assert written == codec.to_json(value)
            assert codec.decoder(cls)(json.loads(json.dumps(written))) == value
            assert codec.decoder(cls)(written) == codec.from_json(cls, written)


def test_the_compiled_decoder_fills_what_is_missing_as_from_json_does() -> None:
    assert codec.decoder(DeviceStatus)({}) == codec.from_json(DeviceStatus, {})
    with pytest.raises(TypeError, match="not in JSON"):
        codec.decoder(DeviceInfo)
