"""The REST API through aiohttp's test client, on the simulated backend."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import zlib
from typing import TYPE_CHECKING

import pytest

from agent.node.facts import NodeFacts
from tests.unit.agent.conftest import CountingBackend

if TYPE_CHECKING:
    from tests.unit.agent.conftest import MakeClient

ROUTES = [
    ("/gpu/info", "text/plain"),
    ("/gpu/info/json", "application/json"),
    ("/gpu/status", "text/plain"),
    ("/gpu/status/json", "application/json"),
    ("/docker/cli", "text/plain"),
    ("/docker/cli/json", "application/json"),
]


@pytest.mark.parametrize(("path", "content_type"), ROUTES)
@pytest.mark.parametrize("prefix", ["", "/v1.0"])
async def test_every_route_answers_versioned_and_unversioned(
    make_client: MakeClient, prefix: str, path: str, content_type: str
) -> None:
    client = await make_client(CountingBackend("hgx-h200-8"))
    resp = await client.get(prefix + path)
    assert resp.status == 200
    assert resp.content_type == content_type
    body = await resp.read()
    assert body.endswith(b"\n")
    if content_type == "application/json":
        json.loads(body)


async def test_info_json_fields_and_units(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("hgx-h200-8"))
    doc = await (await client.get("/gpu/info/json")).json()
    assert doc["Version"] == {"Driver": "580.159.04", "CUDA": "13.0"}
    assert len(doc["Devices"]) == 8
    dev = doc["Devices"][0]
    assert list(dev) == [
        "UUID", "Path", "Model", "Power", "CPUAffinity", "PCI", "Clocks", "Topology",
        "Family", "Arch", "Cores", "Memory",
    ]  # fmt: skip
    assert dev["PCI"] == {"BusID": "00000000:18:00.0", "BAR1": 262144, "Bandwidth": 63008}
    assert dev["Memory"]["Bandwidth"] == 2 * 3201 * 6016 // 8
    assert len(dev["Topology"]) == 7
    assert {"BusID": "00000000:9A:00.0", "Link": 1, "NVLinks": 18} in dev["Topology"]
    assert {"BusID": "00000000:2A:00.0", "Link": 2, "NVLinks": 18} in dev["Topology"]


async def test_status_json_fields(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("hgx-h200-8"))
    doc = await (await client.get("/gpu/status/json")).json()
    busy = doc["Devices"][2]
    assert busy["Utilization"]["GPU"] == 97
    assert busy["Processes"] == [{"PID": 41232, "Name": "python3", "MemoryUsed": 120412}]
    assert busy["PCI"]["Throughput"] == {"RX": 2310, "TX": 1875}
    assert doc["Devices"][0]["Processes"] is None


async def test_docker_cli_default_and_selection(make_client: MakeClient) -> None:
    backend = CountingBackend("hgx-h200-8")
    client = await make_client(backend)
    text = await (await client.get("/docker/cli")).text()
    assert text.startswith(
        "--volume-driver=nvidia-docker --volume=nvidia_driver_580.159.04:/usr/local/nvidia:ro "
        "--device=/dev/nvidiactl --device=/dev/nvidia-uvm --device=/dev/nvidia0 "
    )
    assert text.endswith("--device=/dev/nvidia7\n")
    uuid6 = backend.node_info().devices[6].uuid
    assert uuid6 is not None
    resp = await client.get("/docker/cli/json", params={"dev": f"{uuid6[:12]} 1", "vol": "*"})
    assert await resp.json() == {
        "VolumeDriver": "nvidia-docker",
        "Volumes": ["nvidia_driver_580.159.04:/usr/local/nvidia:ro"],
        "Devices": ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia1", "/dev/nvidia6"],
    }


async def test_plus_in_the_url_separates_entries(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("hgx-h200-8"))
    text = await (await client.get("/docker/cli?dev=0+3&vol=nvidia_driver")).text()
    assert text.endswith("--device=/dev/nvidia0 --device=/dev/nvidia3\n")


@pytest.mark.parametrize("path", ["/docker/cli", "/docker/cli/json", "/gpu/status/json"])
async def test_unknown_device_is_a_400_naming_it(make_client: MakeClient, path: str) -> None:
    client = await make_client(CountingBackend("h200"))
    resp = await client.get(path, params={"dev": "0 7"})
    assert resp.status == 400
    assert await resp.text() == "invalid device: 7\n"


async def test_unknown_volume_is_a_400(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("h200"))
    resp = await client.get("/docker/cli", params={"vol": "nvidia_gl"})
    assert resp.status == 400
    assert await resp.text() == "invalid volume: nvidia_gl\n"
    assert resp.headers["X-Invalid-Parameter"] == "vol"
    assert resp.headers["X-Invalid-Value"] == "nvidia_gl"


@pytest.mark.parametrize(
    ("query", "parameter", "value"),
    [
        ({"dev": "0 GPU-zz é"}, "dev", "GPU-zz"),
        ({"dev": "é"}, "dev", "%C3%A9"),
        ({"format": "yaml"}, "format", "yaml"),
    ],
)
async def test_a_400_names_the_parameter_and_entry_in_headers(
    make_client: MakeClient, query: dict[str, str], parameter: str, value: str
) -> None:
    """Programs read which entry was refused from the headers, never from the text."""
    client = await make_client(CountingBackend("h200"))
    path = "/mesos/cli" if "format" in query else "/docker/cli"
    resp = await client.get(path, params=query)
    assert resp.status == 400
    assert (resp.headers["X-Invalid-Parameter"], resp.headers["X-Invalid-Value"]) == (
        parameter,
        value,
    )


async def test_unknown_routes_404_and_wrong_methods_405(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("h200"))
    assert (await client.get("/gpu/nothing")).status == 404
    assert (await client.get("/v2.0/gpu/info")).status == 404
    for method in ("POST", "PUT", "DELETE"):
        assert (await client.request(method, "/gpu/info/json")).status == 405
    assert (await client.get("/gpu/info")).status == 200  # still serving


async def test_a_lost_gpu_shows_nulls_not_a_500(make_client: MakeClient) -> None:
    backend = CountingBackend("hgx-h200-8")
    backend.failing.add(3)
    client = await make_client(backend)
    resp = await client.get("/gpu/status/json")
    assert resp.status == 200
    devices = (await resp.json())["Devices"]
    assert devices[3]["Power"] is None
    assert devices[3]["Utilization"] == {
        "GPU": None,
        "Memory": None,
        "Encoder": None,
        "Decoder": None,
    }
    assert devices[3]["PCI"]["Throughput"] == {"RX": None, "TX": None}
    assert devices[2]["Power"] == 512
    text = await (await client.get("/gpu/status")).text()
    assert "Device #3\n  Power:        N/A / 700 W\n" in text


async def test_concurrent_requests_share_one_sweep(make_client: MakeClient) -> None:
    backend = CountingBackend("hgx-h200-8", status_delay_s=0.2)
    client = await make_client(backend)
    responses = await asyncio.gather(*(client.get("/gpu/status/json") for _ in range(20)))
    assert all(r.status == 200 for r in responses)
    bodies = {await r.read() for r in responses}
    assert len(bodies) == 1
    # 20 requests, each of 8 GPUs: far fewer than 160 device reads; typically one sweep.
    assert backend.status_calls <= 8 * 4
    assert backend.status_calls % 8 == 0


async def test_status_never_waits_for_the_pcie_counters(make_client: MakeClient) -> None:
    backend = CountingBackend("hgx-h200-8")
    client = await make_client(backend)
    pcie_before = backend.pcie_calls
    for _ in range(5):
        resp = await client.get("/gpu/status/json")
        assert "X-PCIe-Throughput-Age-Ms" in resp.headers
    assert backend.pcie_calls == pcie_before  # served from the sampler's last sample


async def test_info_dev_selection(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("hgx-h200-8"))
    doc = await (await client.get("/gpu/info/json?dev=4")).json()
    assert [d["Path"] for d in doc["Devices"]] == ["/dev/nvidia4"]


async def test_mesos_cli_blob_is_the_info_json_body(make_client: MakeClient) -> None:
    backend = CountingBackend("hgx-h200-8")
    client = await make_client(backend)
    info = await (await client.get("/gpu/info/json")).read()
    for prefix in ("", "/v1.0"):
        resp = await client.get(prefix + "/mesos/cli")
        assert resp.status == 200
        line = await resp.text()
        attributes, resources = line.split(" ")
        blob = attributes.removeprefix("--attributes=gpus:")
        padded = blob + "=" * (-len(blob) % 4)
        assert zlib.decompress(base64.urlsafe_b64decode(padded)) == info
        uuids = [d.uuid for d in backend.node_info().devices]
        assert resources == "--resources=gpus:{" + ",".join(str(u) for u in uuids) + "}"


async def test_mesos_cli_native_format_and_selection(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("hgx-h200-8"))
    line = await (await client.get("/mesos/cli?format=native&dev=1+6")).text()
    assert line.split(" ")[1:] == ["--resources=gpus:2", "--nvidia_gpu_devices=1,6"]
    bad = await client.get("/mesos/cli?dev=9")
    assert (bad.status, await bad.text()) == (400, "invalid device: 9\n")
    assert (await client.get("/mesos/cli?format=yaml")).status == 400


def test_mesos_cli_leaves_out_a_gpu_without_uuid() -> None:
    node = CountingBackend("hgx-h200-8").node_info()
    lost = dataclasses.replace(node.devices[1], uuid=None)
    node = dataclasses.replace(node, devices=(node.devices[0], lost, *node.devices[2:]))
    facts = NodeFacts(node, ("/dev/nvidiactl",))
    legacy = facts.mesos.answer(None, None).decode()
    assert legacy.count("GPU-") == 7
    native = facts.mesos.answer("native", "0 1 2").decode()
    assert native.endswith("--resources=gpus:2 --nvidia_gpu_devices=0,2")
