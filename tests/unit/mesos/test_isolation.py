"""The --isolation values of the gpu/nvidia isolator, per Mesos version."""

from __future__ import annotations

import pytest

from mesos.isolation import with_gpu_isolation
from tests.unit.mesos import mesos_rules

VERSIONS = [(1, minor) for minor in range(12)]


def _accepted(isolation: str, version: tuple[int, int]) -> bool:
    """Whether an agent of ``version`` with this ``--isolation`` offers one GPU (the model)."""
    flags = {"isolation": isolation, "resources": "gpus:1", "nvidia_gpu_devices": "0"}
    try:
        return mesos_rules.native_gpus_offered(flags, version) == 1
    except mesos_rules.MesosRefused:
        return False


@pytest.mark.parametrize(
    ("value", "accepted_from", "accepted_until"),
    [
        ("cgroups/devices,gpu/nvidia", (1, 0), (1, 1)),
        ("gpu/nvidia,cgroups/devices", None, None),
        ("cgroups/devices,filesystem/linux,gpu/nvidia", (1, 0), (1, 11)),
        ("filesystem/linux,gpu/nvidia,cgroups/devices", (1, 7), (1, 11)),
        ("gpu/nvidia,cgroups/devices,filesystem/linux", (1, 7), (1, 11)),
        ("cgroups/all,filesystem/linux,gpu/nvidia", (1, 7), (1, 11)),
        ("posix/cpu,posix/mem", None, None),
    ],
)
def test_the_model_follows_each_versions_rules(
    value: str,
    accepted_from: tuple[int, int] | None,
    accepted_until: tuple[int, int] | None,
) -> None:
    for version in VERSIONS:
        expected_ok = (
            accepted_from is not None
            and accepted_until is not None
            and accepted_from <= version <= accepted_until
        )
        assert _accepted(value, version) == expected_ok, (value, version)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, "posix/cpu,posix/mem,cgroups/devices,filesystem/linux,gpu/nvidia"),
        ("", "cgroups/devices,filesystem/linux,gpu/nvidia"),
        ("gpu/nvidia,cgroups/cpu", "cgroups/cpu,cgroups/devices,filesystem/linux,gpu/nvidia"),
        (
            "docker/runtime,filesystem/linux",
            "docker/runtime,filesystem/linux,cgroups/devices,gpu/nvidia",
        ),
        ("cgroups/all,,gpu/nvidia", "cgroups/all,filesystem/linux,gpu/nvidia"),
    ],
)
def test_with_gpu_isolation(given: str | None, expected: str) -> None:
    assert with_gpu_isolation(given) == expected


@pytest.mark.parametrize(
    "given",
    [None, "", "gpu/nvidia", "posix/cpu,gpu/nvidia,posix/mem", "cgroups/devices,gpu/nvidia"],
)
def test_with_gpu_isolation_is_accepted_by_every_version(given: str | None) -> None:
    value = with_gpu_isolation(given)
    for version in VERSIONS:
        flags = {"isolation": value, "resources": "gpus:1", "nvidia_gpu_devices": "0"}
        assert mesos_rules.native_gpus_offered(flags, version) == 1
