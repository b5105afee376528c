"""MIG through the REST API, on the simulated h200x2-mig node (GPU 0 in MIG mode with four
MIG devices, GPU 1 whole)."""

from __future__ import annotations

import base64
import json
import zlib
from typing import TYPE_CHECKING

from agent.gpu import nodefile
from tests.unit.agent.conftest import CountingBackend

if TYPE_CHECKING:
    from tests.unit.agent.conftest import MakeClient

NODE = nodefile.load("h200x2-mig").info
GPU0, GPU1 = NODE.devices
MIGS = GPU0.mig_devices


async def test_info_json_lists_the_mig_devices_of_a_gpu_in_mig_mode(
    make_client: MakeClient,
) -> None:
    client = await make_client(CountingBackend("h200x2-mig"))
    doc = await (await client.get("/gpu/info/json")).json()
    gpu0, gpu1 = doc["Devices"]
    assert list(gpu0)[-1] == "MIG"  # additive: after every field of the old tool
    assert "MIG" not in gpu1  # a GPU not in MIG mode: the body it always had
    assert gpu0["MIG"]["Enabled"] is True
    assert gpu0["MIG"]["Devices"][1] == {
        "Index": 1,
        "UUID": MIGS[1].uuid,
        "Profile": "2g.35gb",
        "Memory": 35584,
        "GPUInstance": 5,
        "ComputeInstance": 0,
        "Paths": ["/dev/nvidia-caps/nvidia-cap48", "/dev/nvidia-caps/nvidia-cap49"],
    }
    text = await (await client.get("/gpu/info")).text()
    assert f"    0:1  2g.35gb     35584 MiB  {MIGS[1].uuid}  (GI 5, CI 0)\n" in text


async def test_info_of_a_mig_device_is_its_gpu(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("h200x2-mig"))
    doc = await (await client.get("/gpu/info/json", params={"dev": f"{MIGS[2].uuid}"})).json()
    assert [d["UUID"] for d in doc["Devices"]] == [GPU0.uuid]
    status = await (await client.get("/gpu/status/json", params={"dev": "0:3"})).json()
    assert len(status["Devices"]) == 1


async def test_docker_cli_gives_the_gpu_node_and_the_mig_capability_nodes(
    make_client: MakeClient,
) -> None:
    client = await make_client(CountingBackend("h200x2-mig"))
    body = await (await client.get("/docker/cli/json", params={"dev": "0:1"})).json()
    assert body["Devices"] == [
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap48",
        "/dev/nvidia-caps/nvidia-cap49",
    ]
    whole = await (await client.get("/docker/cli/json", params={"dev": "0"})).json()
    assert whole["Devices"][2:] == ["/dev/nvidia0", *(c for m in MIGS for c in m.capabilities)]
    prefix = str(MIGS[3].uuid)[:12]
    text = await (await client.get("/docker/cli", params={"dev": f"{prefix} 1"})).text()
    assert text.endswith(
        "--device=/dev/nvidia0 --device=/dev/nvidia-caps/nvidia-cap129 "
        "--device=/dev/nvidia-caps/nvidia-cap130 --device=/dev/nvidia1\n"
    )
    resp = await client.get("/docker/cli", params={"dev": "1:0"})
    assert resp.status == 400
    assert await resp.text() == "invalid device: 1:0 (GPU 1 is not in MIG mode)\n"
    assert resp.headers["X-Invalid-Value"] == "1%3A0"


def _blob_of(line: str) -> dict[str, object]:
    blob = line.split("--attributes=gpus:", 1)[1].split(maxsplit=1)[0]
    decoded: dict[str, object] = json.loads(
        zlib.decompress(base64.urlsafe_b64decode(blob + "=" * (-len(blob) % 4)))
    )
    return decoded


async def test_the_legacy_mesos_set_offers_mig_devices_by_uuid(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("h200x2-mig"))
    resp = await client.get("/mesos/cli")
    line = await resp.text()
    mig_uuids = ",".join(str(m.uuid) for m in MIGS)
    assert line.endswith(f" --resources=gpus:{{{mig_uuids},{GPU1.uuid}}}")
    assert "X-Left-Out" not in resp.headers
    assert "MIG" in _blob_of(line)["Devices"][0]  # type: ignore[index]
    one = await (await client.get("/mesos/cli", params={"dev": "0:2"})).text()
    assert MIGS[2].uuid is not None
    assert one.endswith(f" --resources=gpus:{{{MIGS[2].uuid}}}")


async def test_the_native_mesos_line_leaves_mig_gpus_out_and_says_so(
    make_client: MakeClient,
) -> None:
    client = await make_client(CountingBackend("h200x2-mig"))
    resp = await client.get("/mesos/cli", params={"format": "native"})
    assert resp.status == 200
    assert (await resp.text()).endswith(" --resources=gpus:1 --nvidia_gpu_devices=1")
    assert resp.headers["X-Left-Out"].startswith("GPU 0 is in MIG mode (Mesos's gpu/nvidia")


async def test_the_native_mesos_line_refuses_mig_entries(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("h200x2-mig"))
    for entry in ("0:1", "0", str(MIGS[0].uuid)):
        resp = await client.get("/mesos/cli", params={"format": "native", "dev": f"1 {entry}"})
        assert resp.status == 400, entry
        assert resp.headers["X-Invalid-Parameter"] == "dev"
        text = await resp.text()
        assert text.startswith(f"invalid device: {entry} (")
        assert "use format=legacy" in text


async def test_a_node_without_mig_answers_mesos_as_before(make_client: MakeClient) -> None:
    client = await make_client(CountingBackend("h200x2"))
    resp = await client.get("/mesos/cli", params={"format": "native"})
    assert (await resp.text()).endswith(" --resources=gpus:2 --nvidia_gpu_devices=0,1")
    assert "X-Left-Out" not in resp.headers
