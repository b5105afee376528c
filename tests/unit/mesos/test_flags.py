"""The /mesos/cli lines, judged by Mesos's own parsing rules (``mesos_rules``)."""

from __future__ import annotations

import pytest

from mesos.blob import decode
from mesos.flags import (
    FlagsError,
    check_attribute_text,
    check_set_items,
    legacy_flags,
    native_flags,
    parse_flag_line,
)
from tests.unit.mesos import mesos_rules

UUIDS = ["GPU-825bd660-d5ca-57d3-b40a-8a8f99e88dc9", "GPU-1f0c3e2a-0000-4000-8000-000000000001"]


def test_legacy_line_has_the_old_tools_shape(
    reference_info_json: bytes, reference_mesos_cli: str
) -> None:
    uuid = "GPU-87f188b6-25f1-39ad-ceb7-643fc637f1b2"
    line = legacy_flags(reference_info_json, [uuid])
    old_attribute, old_resources = reference_mesos_cli.split(" ")
    attribute, resources = line.split(" ")
    assert resources == old_resources  # byte for byte
    assert attribute.startswith("--attributes=gpus:")
    assert old_attribute.startswith("--attributes=gpus:")
    assert decode(attribute) == decode(old_attribute) == reference_info_json


def test_legacy_line_is_exactly_two_name_value_words_without_newline(
    reference_info_json: bytes,
) -> None:
    line = legacy_flags(reference_info_json, UUIDS)
    assert not line.endswith("\n")
    words = line.split(" ")
    assert len(words) == 2
    assert all(w.startswith("--") and "=" in w for w in words)
    assert list(parse_flag_line(line)) == ["attributes", "resources"]


def test_legacy_line_is_read_by_mesos_as_a_text_attribute_and_a_set(
    reference_info_json: bytes,
) -> None:
    flags = mesos_rules.load_flags(
        ["mesos-agent", *legacy_flags(reference_info_json, UUIDS).split()]
    )
    attributes = mesos_rules.parse_attributes(flags["attributes"] or "")
    assert list(attributes) == ["gpus"]
    assert attributes["gpus"].type == "TEXT"
    assert decode(attributes["gpus"].text) == reference_info_json  # Mesos keeps it unchanged
    resources = mesos_rules.parse_resources(flags["resources"] or "")
    assert resources == [("gpus", mesos_rules.Value("SET", items=tuple(UUIDS)))]


def test_native_line_gives_mesos_a_count_and_the_device_indices(
    reference_info_json: bytes,
) -> None:
    line = native_flags(reference_info_json, UUIDS, [0, 3])
    assert not line.endswith("\n")
    words = line.split(" ")
    assert [w.split("=", 1)[0] for w in words] == [
        "--attributes",
        "--resources",
        "--nvidia_gpu_devices",
    ]
    assert words[1:] == ["--resources=gpus:2", "--nvidia_gpu_devices=0,3"]
    flags = mesos_rules.load_flags(
        ["mesos-agent", *words, "--isolation=cgroups/devices,filesystem/linux,gpu/nvidia"]
    )
    assert mesos_rules.parse_attributes(flags["attributes"] or "")["gpus"].type == "TEXT"
    for version in [(1, 0), (1, 4), (1, 11)]:
        assert mesos_rules.native_gpus_offered(flags, version) == 2


def test_the_legacy_set_is_dropped_by_the_gpu_isolator(reference_info_json: bytes) -> None:
    """Why the native format exists: Mesos's GPU isolator offers no GPU for the legacy line."""
    words = legacy_flags(reference_info_json, UUIDS).split()
    flags = mesos_rules.load_flags(
        ["mesos-agent", *words, "--isolation=cgroups/devices,filesystem/linux,gpu/nvidia"]
    )
    assert mesos_rules.native_gpus_offered(flags, (1, 11)) == 0


@pytest.mark.parametrize(
    ("uuids", "indices", "expected"),
    [
        (UUIDS, [0], "2 GPU UUIDs but 1 indices"),
        (UUIDS, [1, 1], "duplicate GPU index"),
        (UUIDS, [0, -1], "non-negative integers"),
        ([], [], "no GPU selected"),
        ([UUIDS[0], UUIDS[0]], [0, 1], "listed twice"),
    ],
)
def test_native_flags_refuse_what_mesos_would_refuse(
    uuids: list[str], indices: list[int], expected: str
) -> None:
    with pytest.raises(FlagsError, match=expected):
        native_flags(b"{}\n", uuids, indices)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", "empty"),
        ("a;b", "split the attribute"),
        ("a\nb", "split the attribute"),
        ("[1-2]", "bracket"),
        ("a{b}", "bracket"),
        ("a(b)", "bracket"),
        ("a b", "white space"),
        ("12", "reads as a number"),
        ("1.5e3", "reads as a number"),
        ("0x1F", "reads as a number"),
        ("nan", "reads as a number"),
    ],
)
def test_attribute_text_rules(value: str, expected: str) -> None:
    with pytest.raises(FlagsError, match=expected):
        check_attribute_text(value)


@pytest.mark.parametrize("value", ["eJxLTEoGAAJNASc", "e5", "eNp-_0", "GPU-a_b"])
def test_attribute_text_accepted_is_text_for_mesos(value: str) -> None:
    check_attribute_text(value)
    assert mesos_rules.parse_value(value) == mesos_rules.Value("TEXT", text=value)


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([], "no GPU selected"),
        ([""], "empty GPU UUID"),
        (["GPU-a", "GPU-a"], "listed twice"),
        (["GPU-a,b"], "contains ','"),
        (["GPU-a}"], "contains '}'"),
        (["GPU:a"], "contains ':'"),
        (["GPU a"], "contains ' '"),
        ("GPU-a", "one string"),
    ],
)
def test_set_item_rules(items: list[str], expected: str) -> None:
    with pytest.raises(FlagsError, match=expected):
        check_set_items(items)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("--attributes=a:b --attributes=c:d", "given twice"),
        ("--Attributes=a:b --attributes=c:d", "given twice"),
        ("--attributes a:b", "not a --name=value flag"),
        ("--attributes=a:b  --resources=x:1", "not a --name=value flag"),
        ("--attributes=", "empty name or value"),
    ],
)
def test_parse_flag_line_refuses_what_mesos_refuses(line: str, expected: str) -> None:
    with pytest.raises(FlagsError, match=expected):
        parse_flag_line(line)
