"""Merging the node's flags into a mesos-agent command line: one flag each, nothing lost."""

from __future__ import annotations

import pytest

from mesos.agent_args import MergeError, merge_agent_args
from mesos.flags import legacy_flags, native_flags
from tests.unit.mesos import mesos_rules

INFO = b'{"Version":{"Driver":"580.159.04","CUDA":"13.0"},"Devices":[]}\n'
UUIDS = ["GPU-aaaa", "GPU-bbbb"]
LEGACY = legacy_flags(INFO, UUIDS)
NATIVE = native_flags(INFO, UUIDS, [0, 1])
BLOB_ATTRIBUTE = LEGACY.split()[0].removeprefix("--attributes=")
GPU_ISOLATION = "cgroups/devices,filesystem/linux,gpu/nvidia"


def _mesos_reads(args: list[str], environ: dict[str, str] | None = None) -> dict[str, str | None]:
    return mesos_rules.load_flags(["mesos-agent", *args], environ)


def test_flags_are_added_when_the_operator_gave_none() -> None:
    merged = merge_agent_args(["--master=zk://zk1:2181/mesos", "--work_dir=/var/lib/mesos"], LEGACY)
    assert merged == ["--master=zk://zk1:2181/mesos", "--work_dir=/var/lib/mesos", *LEGACY.split()]


def test_attributes_and_resources_are_joined_in_place() -> None:
    args = ["--attributes=rack:r1;os:ubuntu", "--master=m:5050", "--resources=cpus:8;mem:1024"]
    merged = merge_agent_args(args, LEGACY)
    assert merged == [
        f"--attributes=rack:r1;os:ubuntu;{BLOB_ATTRIBUTE}",
        "--master=m:5050",
        "--resources=cpus:8;mem:1024;gpus:{GPU-aaaa,GPU-bbbb}",
    ]
    flags = _mesos_reads(merged)
    attributes = mesos_rules.parse_attributes(flags["attributes"] or "")
    assert [(k, v.type) for k, v in attributes.items()] == [
        ("rack", "TEXT"),
        ("os", "TEXT"),
        ("gpus", "TEXT"),
    ]
    resources = mesos_rules.parse_resources(flags["resources"] or "")
    assert [name for name, _ in resources] == ["cpus", "mem", "gpus"]


def test_two_word_form_becomes_one_word() -> None:
    merged = merge_agent_args(["--attributes", "rack:r1", "--isolation", "posix/cpu"], LEGACY)
    assert merged[:2] == [f"--attributes=rack:r1;{BLOB_ATTRIBUTE}", "--isolation=posix/cpu"]
    _mesos_reads(merged)  # Mesos itself would refuse the two-word form


def test_repeated_operator_flags_become_one() -> None:
    merged = merge_agent_args(
        ["--attributes=a:1", "--isolation=posix/cpu", "--ATTRIBUTES=b:2", "--isolation=posix/mem"],
        LEGACY,
    )
    assert merged == [
        f"--attributes=a:1;b:2;{BLOB_ATTRIBUTE}",
        "--isolation=posix/cpu,posix/mem",
        "--resources=gpus:{GPU-aaaa,GPU-bbbb}",
    ]
    _mesos_reads(merged)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (LEGACY, mesos_rules.Value("SET", items=tuple(UUIDS))),
        (NATIVE, mesos_rules.Value("SCALAR", scalar=2)),
    ],
    ids=["legacy", "native"],
)
def test_json_resources_get_the_gpus_as_json(line: str, expected: mesos_rules.Value) -> None:
    given = '[{"name":"cpus","type":"SCALAR","scalar":{"value":8}}]'
    merged = merge_agent_args([f"--resources={given}"], line)
    resources = mesos_rules.parse_resources(_mesos_reads(merged)["resources"] or "")
    assert resources == [("cpus", mesos_rules.Value("SCALAR", scalar=8)), ("gpus", expected)]


def test_native_adds_the_gpu_isolators_in_an_order_every_version_accepts() -> None:
    merged = merge_agent_args(["--isolation=gpu/nvidia,docker/runtime"], NATIVE)
    flags = _mesos_reads(merged)
    assert flags["isolation"] == "docker/runtime,cgroups/devices,filesystem/linux,gpu/nvidia"
    for version in [(1, 0), (1, 1), (1, 2), (1, 6), (1, 7), (1, 11)]:
        assert mesos_rules.native_gpus_offered(flags, version) == 2


def test_native_without_isolation_keeps_mesos_default_isolators() -> None:
    flags = _mesos_reads(merge_agent_args(["--master=m"], NATIVE))
    assert flags["isolation"] == "posix/cpu,posix/mem," + GPU_ISOLATION
    assert flags["nvidia_gpu_devices"] == "0,1"
    assert flags["resources"] == "gpus:2"


def test_environment_values_are_kept_not_hidden() -> None:
    environ = {
        "MESOS_ATTRIBUTES": "zone:eu1",
        "MESOS_RESOURCES": "cpus:4",
        "MESOS_ISOLATION": "cgroups/cpu,cgroups/mem",
        "HOME": "/root",
    }
    merged = merge_agent_args(["--master=m"], NATIVE, environ=environ)
    flags = _mesos_reads(merged, environ)
    assert flags["attributes"] == f"zone:eu1;{BLOB_ATTRIBUTE}"
    assert flags["resources"] == "cpus:4;gpus:2"
    assert flags["isolation"] == "cgroups/cpu,cgroups/mem," + GPU_ISOLATION


def test_arguments_after_double_dash_are_left_alone() -> None:
    merged = merge_agent_args(["--master=m", "--", "--attributes=x:y"], LEGACY)
    assert merged == ["--master=m", *LEGACY.split(), "--", "--attributes=x:y"]


def test_other_arguments_keep_their_order_and_spelling() -> None:
    args = ["--no-systemd_enable_support", "--strict", "positional", " --port=5051 "]
    assert merge_agent_args(args, LEGACY)[:4] == args


@pytest.mark.parametrize(
    ("args", "line", "expected"),
    [
        (["--attributes=gpus:old"], LEGACY, "already has a 'gpus' attribute"),
        (["--resources=cpus:1;gpus:2"], NATIVE, "already names 'gpus'"),
        (["--resources=gpus(ml):{x}"], LEGACY, "already names 'gpus'"),
        (
            ['--resources=[{"name":"gpus","type":"SCALAR","scalar":{"value":1}}]'],
            NATIVE,
            "already names 'gpus'",
        ),
        (["--nvidia_gpu_devices=0"], NATIVE, "comes from the node's GPU flags"),
        (["--no-attributes"], LEGACY, "Mesos refuses --no-attributes"),
        (["--no-isolation"], NATIVE, "Mesos refuses --no-isolation"),
        (["--master=m", "--attributes"], LEGACY, "--attributes has no value"),
        (["--resources", "--master=m"], LEGACY, "--resources has no value"),
        (["--resources=file:///etc/mesos/resources"], LEGACY, "reads a file"),
        (["--isolation=cgroups/devices,gpu/nvidia"], LEGACY, "use the native format"),
        (["--master=m"], "--attributes=a:b --attributes=c:d", "node's flags are not valid"),
    ],
)
def test_conflicts_are_refused_with_the_reason(args: list[str], line: str, expected: str) -> None:
    with pytest.raises(MergeError, match=expected):
        merge_agent_args(args, line)
