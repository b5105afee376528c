"""Our renderings against what nvidia-docker-plugin 1.0.1 answered on a real H200.

Fed the same values the old tool had (it knew no Hopper family, no PCIe gen 5, used CUDA's
memory total), the text and JSON bodies must match its answers byte for byte: scripts that
parse them keep working.
"""

from __future__ import annotations

import dataclasses
import json

from agent.api import render_json, render_text
from agent.api.docker_cli import docker_cli
from agent.gpu.model import (
    Clocks,
    DeviceInfo,
    DeviceMemory,
    DeviceStatus,
    EccErrors,
    NodeInfo,
    PcieThroughput,
    PciInfo,
    Utilization,
)
from plugin.volume_specs import VOLUMES
from tests.support.fixture_files import REFERENCE_V101


def _reference(name: str) -> str:
    """One of the old tool's answers (tests/fixtures/README.md); missing is a failure."""
    return (REFERENCE_V101 / name).read_text(encoding="utf-8")


def _old_node() -> NodeInfo:
    """The node as the old tool saw it, from its own info.json."""
    ref = json.loads(_reference("info.json"))
    dev = ref["Devices"][0]
    info = DeviceInfo(
        index=0,
        uuid=dev["UUID"],
        path=dev["Path"],
        model=dev["Model"],
        power_w=dev["Power"],
        cpu_affinity=dev["CPUAffinity"],
        pci=PciInfo(dev["PCI"]["BusID"], dev["PCI"]["BAR1"], dev["PCI"]["Bandwidth"]),
        clocks=Clocks(dev["Clocks"]["Cores"], dev["Clocks"]["Memory"]),
        topology=(),
        family=dev["Family"],
        arch=dev["Arch"],
        cores=dev["Cores"],
        memory=DeviceMemory(
            ecc=dev["Memory"]["ECC"],
            global_mib=dev["Memory"]["Global"],
            shared_kib=dev["Memory"]["Shared"],
            constant_kib=dev["Memory"]["Constant"],
            l2_cache_kib=dev["Memory"]["L2Cache"],
            bandwidth_mbps=dev["Memory"]["Bandwidth"],
        ),
    )
    return NodeInfo(ref["Version"]["Driver"], ref["Version"]["CUDA"], (info,))


def _old_status() -> tuple[DeviceStatus, PcieThroughput]:
    dev = json.loads(_reference("status.json"))["Devices"][0]
    util = dev["Utilization"]
    ecc = dev["Memory"]["ECCErrors"]
    status = DeviceStatus(
        power_w=dev["Power"],
        temperature_c=dev["Temperature"],
        utilization=Utilization(util["GPU"], util["Memory"], util["Encoder"], util["Decoder"]),
        memory_used_mib=dev["Memory"]["GlobalUsed"],
        ecc_errors=EccErrors(ecc["L1Cache"], ecc["L2Cache"], ecc["Global"]),
        clocks=Clocks(dev["Clocks"]["Cores"], dev["Clocks"]["Memory"]),
        bar1_used_mib=dev["PCI"]["BAR1Used"],
        processes=(),
    )
    tput = dev["PCI"]["Throughput"]
    return status, PcieThroughput(tput["RX"], tput["TX"])


def test_info_text_matches_the_old_tool() -> None:
    assert render_text.info(_old_node()) == _reference("info.txt")


def test_info_json_matches_the_old_tool() -> None:
    ours = render_json.info(_old_node())
    assert ours == _reference("info.json").encode()
    assert ours.endswith(b"}\n")


def test_status_text_matches_the_old_tool() -> None:
    status, tput = _old_status()
    node = _old_node()
    assert render_text.status(node.devices, [status], [tput]) == _reference("status.txt")


def test_status_json_matches_the_old_tool() -> None:
    status, tput = _old_status()
    assert render_json.status([status], [tput]) == _reference("status.json").encode()


def test_docker_cli_matches_the_old_tool() -> None:
    node = _old_node()
    control = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
    cli = docker_cli(node.driver_version, control, node.devices, VOLUMES)
    assert cli.text() == _reference("docker-cli.txt")


def test_missing_values_are_null_in_json_and_na_in_text() -> None:
    node = _old_node()
    blank = dataclasses.replace(
        node.devices[0],
        model=None,
        power_w=None,
        cpu_affinity=None,
        clocks=Clocks(None, None),
        memory=DeviceMemory(None, None, None, None, None, None),
    )
    node = NodeInfo(node.driver_version, node.cuda_version, (blank,))
    doc = json.loads(render_json.info(node))
    assert doc["Devices"][0]["Model"] is None
    assert doc["Devices"][0]["Memory"]["ECC"] is None
    assert b"NaN" not in render_json.info(node)
    text = render_text.info(node)
    assert "  Power:         N/A\n" in text
    assert "  CPU Affinity:  N/A\n" in text
    assert "    Global:     N/A\n" in text
