"""The GPUs a container was given, read off its inspect answer: real answers of dockerd 20.10,
dockerd 26 and Podman 4.3 (tests/fixtures/engines), and constructed ones for the forms and
bounds those engines did not show here."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent.engines.containers import (
    MAX_DEVICE_CHARS,
    MAX_DEVICES,
    MAX_HOW_CHARS,
    GivenDevices,
    container_of,
    given_devices,
)
from agent.gpu import nodefile
from agent.leases.containers import Container
from agent.leases.labels import LeaseLabel
from agent.leases.units import NodeUnits
from tests.support.fixture_files import ENGINES

LEASE = LeaseLabel(
    "lease-3", ("GPU-8f6a2c1e-0b7d-4e39-a1c2-3d4e5f607182",), True, (("user", "alice"),)
)


def captured(name: str) -> dict[str, Any]:
    value = json.loads((ENGINES / f"{name}.json").read_text())
    assert isinstance(value, dict)
    return value


@pytest.mark.parametrize(
    ("name", "given"),
    [
        # --device /dev/nvidia9 --device /dev/nvidiactl --device /dev/nvidia-uvm
        ("docker-20.10-device", GivenDevices(("/dev/nvidia9",), "--device /dev/nvidia9")),
        ("docker-20.10-gpus-all", GivenDevices(("all",), "--gpus all")),
        ("docker-20.10-gpus-count", GivenDevices(("0", "1"), "--gpus 2")),
        (
            "docker-20.10-gpus-device",
            GivenDevices(("1", "GPU-8f6a2c1e"), "--gpus device=1,GPU-8f6a2c1e"),
        ),
        ("docker-20.10-gpus-driver", GivenDevices(("0",), "--gpus 1")),
        # --runtime nvidia -e NVIDIA_VISIBLE_DEVICES=0,2 (a runtime named nvidia: runc)
        (
            "docker-20.10-runtime-env",
            GivenDevices(("0", "2"), "NVIDIA_VISIBLE_DEVICES=0,2"),
        ),
        # -e NVIDIA_VISIBLE_DEVICES=all with runc, as every CUDA image has it: no GPU
        ("docker-20.10-plain", GivenDevices()),
        ("docker-26-gpus-all", GivenDevices(("all",), "--gpus all")),
        ("docker-26-gpus-count", GivenDevices(("0", "1"), "--gpus 2")),
        (
            "docker-26-gpus-device",
            GivenDevices(("1", "GPU-8f6a2c1e"), "--gpus device=1,GPU-8f6a2c1e"),
        ),
        ("docker-26-gpus-driver", GivenDevices(("0",), "--gpus 1")),
        (
            "docker-26-cdi",  # --device nvidia.com/gpu=0 --device nvidia.com/gpu=GPU-8f6a2c1e:1
            GivenDevices(
                ("nvidia.com/gpu=0", "nvidia.com/gpu=GPU-8f6a2c1e:1"),
                "--device nvidia.com/gpu=0 --device nvidia.com/gpu=GPU-8f6a2c1e:1",
            ),
        ),
        ("podman-4.3-device", GivenDevices(("/dev/nvidia9",), "--device /dev/nvidia9")),
        # Podman 4.3 does not show a CDI device in its inspect answer (module docstring)
        ("podman-4.3-cdi", GivenDevices()),
    ],
)
def test_real_answers(name: str, given: GivenDevices) -> None:
    assert given_devices(captured(name)) == given


def test_real_answers_as_containers() -> None:
    answer = captured("docker-20.10-device")
    container = container_of("x", answer)
    assert container == Container(
        answer["Id"], False, LEASE, ("/dev/nvidia9",), "--device /dev/nvidia9"
    )
    podman = captured("podman-4.3-device")
    assert container_of("x", podman) == Container(
        podman["Id"], False, LEASE, ("/dev/nvidia9",), "--device /dev/nvidia9"
    )
    plain = container_of("x", captured("podman-4.3-cdi"))
    assert (plain.lease, plain.devices, plain.how) == (None, (), "its devices")


def test_what_the_table_makes_of_them() -> None:
    """Every form given here names the GPUs it should on a node (the table's reading)."""
    units = NodeUnits(nodefile.load("hgx-h200-8").info)
    gpu1 = units.all()[1]
    for devices, gpus in [
        (given_devices(captured("docker-20.10-gpus-count")).devices, [0, 1]),
        (given_devices(captured("docker-20.10-gpus-all")).devices, list(range(8))),
        (given_devices(captured("docker-26-cdi")).devices, [0]),
        (("/dev/nvidia3", "nvidia.com/gpu=5", gpu1.uuid or ""), [1, 3, 5]),
        # the agent's own kind (--cdi-kind nvidia-docker.com/gpu) names GPUs too
        (("nvidia-docker.com/gpu=2", "nvidia-docker.com/gpu=6"), [2, 6]),
        (("vendor.com/fpga=4",), []),
    ]:
        assert [u.gpu for u in units.given(devices)] == gpus


def test_a_device_of_the_agents_own_cdi_kind_is_a_gpu_the_container_holds() -> None:
    found = given_devices(
        inspect(devices=[device("nvidia-docker.com/gpu=3"), device("vendor.com/fpga=0")])
    )
    assert found.devices == ("nvidia-docker.com/gpu=3",)
    requested = given_devices(
        inspect(requests=[{"Driver": "cdi", "DeviceIDs": ["nvidia-docker.com/gpu=GPU-8f6a"]}])
    )
    assert requested.devices == ("nvidia-docker.com/gpu=GPU-8f6a",)


def inspect(
    *,
    devices: list[object] | None = None,
    requests: object = None,
    env: list[object] | None = None,
    runtime: object = "runc",
) -> dict[str, object]:
    return {
        "Id": "c" * 64,
        "HostConfig": {"Devices": devices or [], "DeviceRequests": requests, "Runtime": runtime},
        "Config": {"Env": env or [], "Labels": {}},
    }


def device(path: object) -> dict[str, object]:
    return {"PathOnHost": path, "PathInContainer": "/dev/nvidia0", "CgroupPermissions": "rwm"}


def gpus(count: object = 0, ids: object = None, driver: object = "", caps: object = None) -> object:
    return {"Driver": driver, "Count": count, "DeviceIDs": ids, "Capabilities": caps}


GPU = [["gpu"]]


@pytest.mark.parametrize(
    ("answer", "given"),
    [
        # device files: GPUs and MIG capabilities, not the files every GPU container has
        (
            inspect(
                devices=[
                    device(p)
                    for p in (
                        "/dev/nvidia0",
                        "/dev/nvidiactl",
                        "/dev/nvidia-uvm",
                        "/dev/nvidia-uvm-tools",
                        "/dev/nvidia-modeset",
                        "/dev/nvidia-caps/nvidia-cap1",
                        "/dev/nvidia-caps/nvidia-cap12",
                        "/dev/nvidia0",  # twice: once
                        "/tmp/nvidia1",
                        "/dev/nvidia1x",
                        "/dev/dri/card0",
                    )
                ]
            ),
            GivenDevices(
                ("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap12"),
                "--device /dev/nvidia0 --device /dev/nvidia-caps/nvidia-cap1 "
                "--device /dev/nvidia-caps/nvidia-cap12",
            ),
        ),
        # a CDI name among the devices, for an engine that shows CDI devices there
        (
            inspect(devices=[device("nvidia.com/gpu=all"), device("vendor.com/fpga=0")]),
            GivenDevices(("nvidia.com/gpu=all",), "--device nvidia.com/gpu=all"),
        ),
        # the cdi driver: NVIDIA's names only
        (
            inspect(requests=[gpus(ids=["vendor.com/fpga=0", "nvidia.com/gpu=1:0"], driver="cdi")]),
            GivenDevices(("nvidia.com/gpu=1:0",), "--device nvidia.com/gpu=1:0"),
        ),
        # --gpus: a MIG device, and IDs given as one comma-separated entry
        (
            inspect(requests=[gpus(ids=["0:1"], caps=GPU), gpus(ids=["2,3"], caps=GPU)]),
            GivenDevices(("0:1", "2", "3"), "--gpus device=0:1 --gpus device=2,3"),
        ),
        # no driver and one of NVIDIA's capabilities; another vendor's driver
        (
            inspect(requests=[gpus(-1, caps=[["compute", "utility"]])]),
            GivenDevices(("all",), "--gpus all"),
        ),
        (inspect(requests=[gpus(-1, caps=[["fpga"]])]), GivenDevices()),
        (inspect(requests=[gpus(-1, caps=[["gpu", "fpga"], []])]), GivenDevices()),
        (inspect(requests=[gpus(-1, driver="amd", caps=GPU)]), GivenDevices()),
        (inspect(requests=[gpus(0, caps=GPU)]), GivenDevices()),  # asks for none
        # NVIDIA_VISIBLE_DEVICES under NVIDIA's runtime: its last value; none, void, empty
        (
            inspect(
                env=["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=1, 3"], runtime="nvidia"
            ),
            GivenDevices(("1", "3"), "NVIDIA_VISIBLE_DEVICES=1, 3"),
        ),
        (
            inspect(env=["NVIDIA_VISIBLE_DEVICES=all"], runtime="nvidia-container-runtime"),
            GivenDevices(("all",), "NVIDIA_VISIBLE_DEVICES=all"),
        ),
        (inspect(env=["NVIDIA_VISIBLE_DEVICES=void"], runtime="nvidia"), GivenDevices()),
        (inspect(env=["NVIDIA_VISIBLE_DEVICES=none"], runtime="nvidia"), GivenDevices()),
        (inspect(env=["NVIDIA_VISIBLE_DEVICES="], runtime="nvidia"), GivenDevices()),
        (inspect(env=["NVIDIA_VISIBLE_DEVICESX=1"], runtime="nvidia"), GivenDevices()),
        # ... but not when --gpus set it (dockerd's value comes after the image's)
        (
            inspect(
                env=["NVIDIA_VISIBLE_DEVICES=all"],
                requests=[gpus(ids=["1"], caps=GPU)],
                runtime="nvidia",
            ),
            GivenDevices(("1",), "--gpus device=1"),
        ),
        # every source at once, in order, each device once
        (
            inspect(
                devices=[device("/dev/nvidia1")],
                requests=[gpus(ids=["1", "2"], caps=GPU)],
                env=["NVIDIA_VISIBLE_DEVICES=2"],
                runtime="nvidia",
            ),
            GivenDevices(("/dev/nvidia1", "1", "2"), "--device /dev/nvidia1 --gpus device=1,2"),
        ),
    ],
    ids=[
        "device-files",
        "podman-cdi",
        "cdi-driver",
        "gpus-ids",
        "capabilities",
        "other-capabilities",
        "mixed-capabilities",
        "other-driver",
        "count-0",
        "env-last",
        "env-all",
        "void",
        "none",
        "empty",
        "other-variable",
        "gpus-over-env",
        "all-sources",
    ],
)
def test_each_form(answer: dict[str, object], given: GivenDevices) -> None:
    assert given_devices(answer) == given


def test_the_environment_when_the_engine_says_so() -> None:
    """An engine that runs NVIDIA's hook for every runtime: the caller says the variable
    counts (or never does)."""
    answer = inspect(env=["NVIDIA_VISIBLE_DEVICES=0"], runtime="crun")
    assert given_devices(answer) == GivenDevices()
    assert given_devices(answer, visible_devices_env=True) == GivenDevices(
        ("0",), "NVIDIA_VISIBLE_DEVICES=0"
    )
    nvidia = inspect(env=["NVIDIA_VISIBLE_DEVICES=0"], runtime="nvidia")
    assert given_devices(nvidia, visible_devices_env=False) == GivenDevices()


@pytest.mark.parametrize(
    "answer",
    [
        {},
        {"HostConfig": None, "Config": None},
        {"HostConfig": [], "Config": "x"},
        inspect(devices=[None, 1, "x", {"PathOnHost": 5}, {"PathOnHost": ["/dev/nvidia0"]}]),
        inspect(requests={"Driver": ""}),
        inspect(requests=[None, {"Driver": 1}, gpus("all", caps=GPU), gpus(True, caps=GPU)]),
        inspect(requests=[gpus(1.5, caps=GPU), gpus(ids="0", caps=GPU), gpus(-1, caps="gpu")]),
        inspect(requests=[gpus(ids=[1, None], caps=GPU)]),
        inspect(env="NVIDIA_VISIBLE_DEVICES=0", runtime="nvidia"),  # type: ignore[arg-type]
        inspect(env=[0, None], runtime=["nvidia"]),
    ],
)
def test_fields_of_other_types_are_absent(answer: dict[str, object]) -> None:
    assert given_devices(answer) == GivenDevices()


def test_bounded_and_failing_safe() -> None:
    """More entries than the bound: all GPUs (held rather than free); an entry too long or
    not printable names nothing; ``how`` is cut and printable."""
    many = [f"GPU-{i:036d}" for i in range(MAX_DEVICES + 1)]
    given = given_devices(inspect(requests=[gpus(ids=many, caps=GPU)]))
    assert given.devices == ("all",)
    assert len(given.how) <= MAX_HOW_CHARS
    assert given.how.endswith("…")
    assert given_devices(inspect(requests=[gpus(10**9, caps=GPU)])).devices == ("all",)
    assert len(given_devices(inspect(requests=[gpus(MAX_DEVICES, caps=GPU)])).devices) == 512
    odd = ["x" * (MAX_DEVICE_CHARS + 1), "GPU-\x1b[31m", "", "1"]
    given = given_devices(inspect(requests=[gpus(ids=odd, caps=GPU)]))
    assert given.devices == ("1",)
    assert given.how.startswith("--gpus device=xxx")
    assert len(given.how) <= MAX_HOW_CHARS
    assert given.how.isprintable()
    hostile = given_devices(
        inspect(env=["NVIDIA_VISIBLE_DEVICES=1,2\n# forged line"], runtime="nvidia")
    )
    assert hostile.devices == ("1",)  # the other entry is not printable: it names nothing
    assert hostile.how == r"NVIDIA_VISIBLE_DEVICES=1,2\x0a# forged line"
    assert hostile.how.isprintable()


@pytest.mark.parametrize(
    ("state", "running"),
    [
        ({"Status": "running", "Running": True}, True),
        ({"Status": "paused", "Running": True, "Paused": True}, True),
        ({"Status": "restarting", "Running": True, "Restarting": True}, True),
        ({"Status": "exited", "Running": False}, False),
        ({"Status": "created", "Running": False}, False),
        ({"Status": "running"}, True),  # an engine that says only one of them
        ({"Running": "yes"}, False),
        (None, False),
    ],
)
def test_running(state: object, running: bool) -> None:
    assert container_of("c" * 64, {"State": state}).running is running


def test_labels_and_ids() -> None:
    answer = captured("docker-20.10-gpus-all")
    assert container_of("x", answer).lease == LEASE
    answer["Config"]["Labels"]["nvidia-docker.lease"] = "not-a-lease"
    assert container_of("x", answer).lease is None
    answer["Config"]["Labels"] = {"nvidia-docker.lease": 3}
    assert container_of("x", answer).lease is None
    answer["Id"] = "not a 64-hex id"
    assert container_of("ab" * 32, answer).id == "ab" * 32
