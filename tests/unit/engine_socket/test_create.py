"""The create rewrite: which device requests ask for GPUs, and what the body becomes."""

from __future__ import annotations

from typing import Any

import pytest

from agent.engine_socket.create import (
    Addition,
    CreateError,
    GpuRequest,
    Mount,
    container_name,
    gpu_request,
    is_create,
    read_body,
    rewrite,
)

CLI_GPUS_2 = {"Driver": "", "Count": 2, "DeviceIDs": None, "Capabilities": [["gpu"]]}
ADDITION = Addition(
    devices=("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia3", "/dev/nvidia5"),
    mounts=(Mount("nvidia_driver_580.1", "/usr/local/nvidia", True, "nvidia-docker"),),
    labels={"nvidia-docker.lease": "lease-7"},
    visible="GPU-3,GPU-5",
    cpuset_cpus="0-15",
    cpuset_mems="0",
)


def body(*requests: dict[str, Any], **host: Any) -> dict[str, Any]:
    return {"Image": "busybox", "HostConfig": {"DeviceRequests": list(requests), **host}}


@pytest.mark.parametrize(
    ("target", "create"),
    [
        (b"/containers/create", True),
        (b"/v1.41/containers/create?name=x", True),
        (b"/v1.41/containers/create/", False),
        (b"/v1.41/containers/json", False),
        (b"/x/containers/create", False),
    ],
)
def test_is_create(target: bytes, create: bool) -> None:
    assert is_create(b"POST", target) is create
    assert not is_create(b"GET", target)


def test_the_container_name() -> None:
    assert container_name(b"/v1.41/containers/create?name=web-1") == "web-1"
    assert container_name(b"/containers/create") is None


@pytest.mark.parametrize(
    ("requests", "wanted"),
    [
        ([CLI_GPUS_2], GpuRequest(2)),
        ([{**CLI_GPUS_2, "Count": -1}], GpuRequest(-1)),
        ([{"Driver": "nvidia", "Count": 1}], GpuRequest(1)),  # Compose: driver nvidia
        ([{"Capabilities": [["gpu"]], "DeviceIDs": ["3", "GPU-5"]}], GpuRequest(0, ("3", "GPU-5"))),
        ([CLI_GPUS_2, {"Driver": "nvidia", "Count": 1}], GpuRequest(3)),
        ([{"Driver": "other", "Count": 1, "Capabilities": [["fpga"]]}], None),
        ([{"Count": 1, "Capabilities": [["nvidia"]]}], GpuRequest(1)),  # dockerd: NVIDIA's
        (
            [{"Driver": "", "Count": 2, "Capabilities": [["fpga"], ["compute", "utility"]]}],
            GpuRequest(2),
        ),
        ([{"Count": 1, "Capabilities": [["compute", "fpga"]]}], None),
        ([{"Driver": "fpga", "Count": 1, "Capabilities": [["compute"]]}], None),
        (  # docker run --gpus 'count=2,options=mig-profile=1g.18gb'
            [{**CLI_GPUS_2, "Options": {"mig-profile": "1g.18gb"}}],
            GpuRequest(2, mig_profile="1g.18gb"),
        ),
        (  # Compose: the same option on two requests
            [{"Driver": "nvidia", "Count": 1, "Options": {"mig-profile": "1g.18gb"}}] * 2,
            GpuRequest(2, mig_profile="1g.18gb"),
        ),
        ([], None),
    ],
)
def test_what_a_create_asks(requests: list[dict[str, Any]], wanted: GpuRequest | None) -> None:
    assert gpu_request(body(*requests)) == wanted


def test_no_host_config_asks_for_nothing() -> None:
    assert gpu_request({"Image": "busybox"}) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"HostConfig": []},
        {"HostConfig": {"DeviceRequests": {"Count": 1}}},
        body({**CLI_GPUS_2, "Count": "2"}),
        body({**CLI_GPUS_2, "Count": True}),
        body({**CLI_GPUS_2, "Count": 0}),
        body({"Driver": "nvidia", "Count": 2, "DeviceIDs": ["0"]}),
        body({"Driver": "nvidia", "DeviceIDs": ["0 1"]}),
        body({"Driver": "nvidia", "DeviceIDs": [3]}),
        body(CLI_GPUS_2, {"Driver": "nvidia", "DeviceIDs": ["0"]}),
        {**body(CLI_GPUS_2), "Env": "A=1"},
        {**body(CLI_GPUS_2), "Env": [1]},
        {**body(CLI_GPUS_2), "Labels": ["a"]},
        body(CLI_GPUS_2, Devices="/dev/fuse"),
        body(CLI_GPUS_2, Mounts=["/data:/data"]),
        body(CLI_GPUS_2, CpusetCpus=3),
        body({**CLI_GPUS_2, "Options": ["mig-profile=1g.18gb"]}),
        body({**CLI_GPUS_2, "Options": {"mig-profile": ""}}),
        body({**CLI_GPUS_2, "Options": {"mig-profile": 1}}),
        body({**CLI_GPUS_2, "Count": -1, "Options": {"mig-profile": "1g.18gb"}}),
        body({"Driver": "nvidia", "DeviceIDs": ["0"], "Options": {"mig-profile": "1g.18gb"}}),
        body(
            {**CLI_GPUS_2, "Options": {"mig-profile": "1g.18gb"}},
            {**CLI_GPUS_2, "Options": {"mig-profile": "2g.35gb"}},
        ),
    ],
)
def test_malformed_gpu_requests_are_400(bad: dict[str, Any]) -> None:
    with pytest.raises(CreateError) as caught:
        gpu_request(bad)
    assert caught.value.status == 400
    assert str(caught.value).startswith("nvidia-docker: "), caught.value  # who refused it


@pytest.mark.parametrize("raw", [b"{nope", b"[1]", b'"x"', b"[" * 100 + b"]" * 100, b"\xff"])
def test_bodies_that_are_not_objects_are_400(raw: bytes) -> None:
    with pytest.raises(CreateError) as caught:
        read_body(raw)
    assert caught.value.status == 400
    assert str(caught.value).startswith("nvidia-docker: the container's create body"), caught.value


GPU = b'[{"Driver":"nvidia","Count":1,"Capabilities":[["gpu"]]}]'


@pytest.mark.parametrize(
    ("raw", "said"),
    [  # each of these asks dockerd 20.10 for a GPU (checked against it), unleased
        (b'{"Image":"x","hostConfig":{"DeviceRequests":' + GPU + b"}}", "spell it 'HostConfig'"),
        (
            b'{"Image":"x","HostConfig":{"deviceRequests":' + GPU + b"}}",
            "key HostConfig.'deviceRequests' is read by the engine as HostConfig.DeviceRequests",
        ),
        ('{"Ho\u017ftConfig":{"DeviceRequests":'.encode() + GPU + b"}}", "'Ho\\u017ftConfig'"),
        (b'{"DeviceRequests":' + GPU + b"}", "put them in its HostConfig"),
        (
            b'{"HostConfig":{"DeviceRequests":' + GPU + b'},"HostConfig":{"Memory":0}}',
            "gives HostConfig twice",
        ),
        (
            b'{"HostConfig":{"DeviceRequests":[{"driver":"nvidia","Count":1}]}}',
            "HostConfig.DeviceRequests[].'driver'",
        ),
        (  # a GPU create whose Env dockerd would take from "env", after the rewritten one
            b'{"Env":[],"env":["NVIDIA_VISIBLE_DEVICES=all"],"HostConfig":{"DeviceRequests":'
            + GPU
            + b"}}",
            "spell it 'Env'",
        ),
        (
            b'{"HostConfig":{"cpusetCpus":"0","DeviceRequests":' + GPU + b"}}",
            "spell it 'CpusetCpus'",
        ),
    ],
)
def test_keys_dockerd_would_read_otherwise_are_400(raw: bytes, said: str) -> None:
    with pytest.raises(CreateError) as caught:
        gpu_request(read_body(raw))
    assert caught.value.status == 400
    assert said in str(caught.value), caught.value
    assert str(caught.value).startswith("nvidia-docker: ")


def test_keys_off_the_gpu_path_and_label_names_are_free() -> None:
    raw = b'{"image":"x","Labels":{"a":"1","A":"2"},"HostConfig":{"memory":1}}'
    assert gpu_request(read_body(raw)) is None
    with_env = b'{"env":["A=1"],"HostConfig":{"Memory":1}}'  # no GPU: nothing is rewritten
    assert gpu_request(read_body(with_env)) is None


def test_the_rewrite() -> None:
    other = {"Driver": "fpga", "Count": 1, "Capabilities": [["fpga"]]}
    original = {
        **body(
            CLI_GPUS_2, other, Devices=[{"PathOnHost": "/dev/fuse", "PathInContainer": "/dev/fuse"}]
        ),
        "Env": ["A=1", "NVIDIA_VISIBLE_DEVICES=all"],
        "Labels": {"app": "x", "nvidia-docker.lease": "forged"},
    }
    new = rewrite(original, ADDITION)
    host = new["HostConfig"]
    assert host["DeviceRequests"] == [other]
    assert [d["PathOnHost"] for d in host["Devices"]] == ["/dev/fuse", *ADDITION.devices]
    assert host["Devices"][1] == {
        "PathOnHost": "/dev/nvidiactl",
        "PathInContainer": "/dev/nvidiactl",
        "CgroupPermissions": "rwm",
    }
    assert host["Mounts"] == [
        {
            "Type": "volume",
            "Source": "nvidia_driver_580.1",
            "Target": "/usr/local/nvidia",
            "ReadOnly": True,
            "VolumeOptions": {"DriverConfig": {"Name": "nvidia-docker"}},
        }
    ]
    assert (host["CpusetCpus"], host["CpusetMems"]) == ("0-15", "0")
    assert new["Env"] == ["A=1", "NVIDIA_VISIBLE_DEVICES=GPU-3,GPU-5"]
    assert new["Labels"] == {"app": "x", "nvidia-docker.lease": "lease-7"}
    assert original["HostConfig"]["DeviceRequests"] == [CLI_GPUS_2, other]  # not changed


def test_the_users_cpuset_and_mounts_are_kept() -> None:
    mine = {"Type": "bind", "Source": "/data", "Target": "/data"}
    new = rewrite(body(CLI_GPUS_2, CpusetCpus="3", Mounts=[mine]), ADDITION)
    assert new["HostConfig"]["CpusetCpus"] == "3"
    assert "CpusetMems" not in new["HostConfig"]
    assert new["HostConfig"]["Mounts"][0] == mine
    assert new["HostConfig"]["DeviceRequests"] is None


def test_the_cdi_form_is_one_cdi_request_and_no_nodes_or_volume() -> None:
    other = {"Driver": "fpga", "Count": 1, "Capabilities": [["fpga"]]}
    mine = {"PathOnHost": "/dev/fuse", "PathInContainer": "/dev/fuse"}
    cdi = Addition(
        devices=(),
        cdi_devices=("nvidia.com/gpu=GPU-3", "nvidia.com/gpu=MIG-5"),
        labels={"nvidia-docker.lease": "lease-8"},
        visible="GPU-3,MIG-5",
    )
    new = rewrite(body(CLI_GPUS_2, other, Devices=[mine]), cdi)
    host = new["HostConfig"]
    assert host["DeviceRequests"] == [
        other,
        {
            "Driver": "cdi",
            "Count": 0,
            "DeviceIDs": ["nvidia.com/gpu=GPU-3", "nvidia.com/gpu=MIG-5"],
            "Capabilities": None,
            "Options": {},
        },
    ]
    assert host["Devices"] == [mine]
    assert "Mounts" not in host
    assert new["Env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-3,MIG-5"]
