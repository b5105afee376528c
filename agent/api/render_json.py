"""JSON bodies of the REST API. Field names and units are a contract (docs/api.md).

Bodies are compact JSON ending with a newline, as the old tool wrote them; ``None`` is
``null``. Key order follows the old tool's answers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agent.gpu.model import DeviceInfo, DeviceStatus, NodeInfo, PcieThroughput


def encode(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def device_info(dev: DeviceInfo) -> dict[str, Any]:
    topology = [
        {"BusID": peer.bus_id, "Link": int(peer.link), "NVLinks": peer.nvlinks}
        for peer in dev.topology
    ]
    body = {
        "UUID": dev.uuid,
        "Path": dev.path,
        "Model": dev.model,
        "Power": dev.power_w,
        "CPUAffinity": dev.cpu_affinity,
        "PCI": {
            "BusID": dev.pci.bus_id,
            "BAR1": dev.pci.bar1_mib,
            "Bandwidth": dev.pci.bandwidth_mbps,
        },
        "Clocks": {"Cores": dev.clocks.cores_mhz, "Memory": dev.clocks.memory_mhz},
        "Topology": topology or None,
        "Family": dev.family,
        "Arch": dev.arch,
        "Cores": dev.cores,
        "Memory": {
            "ECC": dev.memory.ecc,
            "Global": dev.memory.global_mib,
            "Shared": dev.memory.shared_kib,
            "Constant": dev.memory.constant_kib,
            "L2Cache": dev.memory.l2_cache_kib,
            "Bandwidth": dev.memory.bandwidth_mbps,
        },
    }
    if dev.mig_enabled:  # additive, and only for GPUs in MIG mode: other bodies stay as they were
        body["MIG"] = mig(dev)
    return body


def mig(dev: DeviceInfo) -> dict[str, Any]:
    """``Devices[].MIG`` of ``/gpu/info/json``: the MIG devices of a GPU in MIG mode."""
    devices = [
        {
            "Index": m.index,
            "UUID": m.uuid,
            "Profile": m.profile,
            "Memory": m.memory_mib,
            "GPUInstance": m.gpu_instance_id,
            "ComputeInstance": m.compute_instance_id,
            "Paths": list(m.capabilities) or None,
        }
        for m in dev.mig_devices
    ]
    return {"Enabled": True, "Devices": devices or None}


def info(node: NodeInfo) -> bytes:
    """The ``/gpu/info/json`` body (also the Mesos blob's plain text)."""
    return encode(
        {
            "Version": {"Driver": node.driver_version, "CUDA": node.cuda_version},
            "Devices": [device_info(dev) for dev in node.devices],
        }
    )


def device_status(status: DeviceStatus, throughput: PcieThroughput) -> dict[str, Any]:
    processes = [
        {"PID": p.pid, "Name": p.name, "MemoryUsed": p.memory_used_mib} for p in status.processes
    ]
    return {
        "Power": status.power_w,
        "Temperature": status.temperature_c,
        "Utilization": {
            "GPU": status.utilization.gpu_pct,
            "Memory": status.utilization.memory_pct,
            "Encoder": status.utilization.encoder_pct,
            "Decoder": status.utilization.decoder_pct,
        },
        "Memory": {
            "GlobalUsed": status.memory_used_mib,
            "ECCErrors": {
                "L1Cache": status.ecc_errors.l1_cache,
                "L2Cache": status.ecc_errors.l2_cache,
                "Global": status.ecc_errors.global_,
            },
        },
        "Clocks": {"Cores": status.clocks.cores_mhz, "Memory": status.clocks.memory_mhz},
        "PCI": {
            "BAR1Used": status.bar1_used_mib,
            "Throughput": {"RX": throughput.rx_mbps, "TX": throughput.tx_mbps},
        },
        "Processes": processes or None,
    }


def status(statuses: Sequence[DeviceStatus], throughputs: Sequence[PcieThroughput]) -> bytes:
    """The ``/gpu/status/json`` body for the given devices."""
    return encode(
        {"Devices": [device_status(st, tp) for st, tp in zip(statuses, throughputs, strict=True)]}
    )
