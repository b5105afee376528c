"""Text bodies of the REST API: the same facts as the JSON, aligned, ``N/A`` when missing."""

from __future__ import annotations

from collections.abc import Sequence

from agent.gpu.model import DeviceInfo, DeviceStatus, NodeInfo, PcieThroughput


def _v(value: object, unit: str = "") -> str:
    """A value with its unit, or N/A."""
    if value is None:
        return "N/A"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value} {unit}" if unit else str(value)


def _of(used: object, total: object, unit: str) -> str:
    """``used / total unit``, N/A for a missing side."""
    return f"{_v(used)} / {_v(total)} {unit}"


def _rows(indent: int, rows: Sequence[tuple[str, str]], min_width: int = 0) -> list[str]:
    """Label/value rows, values aligned two spaces after the longest label."""
    width = max(min_width, *(len(label) + 1 for label, _ in rows)) + 2
    pad = " " * indent
    return [f"{pad}{(label + ':').ljust(width)}{value}" for label, value in rows]


def _device_info(dev: DeviceInfo) -> list[str]:
    affinity = "N/A" if dev.cpu_affinity is None else f"NUMA node{dev.cpu_affinity}"
    lines = [f"Device #{dev.index}"]
    lines += _rows(
        2,
        [
            ("Model", _v(dev.model)),
            ("UUID", _v(dev.uuid)),
            ("Path", _v(dev.path)),
            ("Family", _v(dev.family)),
            ("Arch", _v(dev.arch)),
            ("Cores", _v(dev.cores)),
            ("Power", _v(dev.power_w, "W")),
            ("CPU Affinity", affinity),
        ],
    )
    lines.append("  PCI")
    lines += _rows(
        4,
        [
            ("Bus ID", dev.pci.bus_id),
            ("BAR1", _v(dev.pci.bar1_mib, "MiB")),
            ("Bandwidth", _v(dev.pci.bandwidth_mbps, "MB/s")),
        ],
    )
    lines.append("  Memory")
    lines += _rows(
        4,
        [
            ("ECC", _v(dev.memory.ecc)),
            ("Global", _v(dev.memory.global_mib, "MiB")),
            ("Constant", _v(dev.memory.constant_kib, "KiB")),
            ("Shared", _v(dev.memory.shared_kib, "KiB")),
            ("L2 Cache", _v(dev.memory.l2_cache_kib, "KiB")),
            ("Bandwidth", _v(dev.memory.bandwidth_mbps, "MB/s")),
        ],
    )
    lines.append("  Clocks")
    lines += _rows(
        4,
        [("Cores", _v(dev.clocks.cores_mhz, "MHz")), ("Memory", _v(dev.clocks.memory_mhz, "MHz"))],
        min_width=12,
    )
    if not dev.topology:
        lines.append("  P2P Available:  None")
    else:
        lines.append("  P2P Available")
        for peer in dev.topology:
            nvlinks = f", {peer.nvlinks} NVLinks" if peer.nvlinks else ""
            lines.append(f"    {peer.bus_id} - {peer.link.label}{nvlinks}")
    if dev.mig_enabled:  # only GPUs in MIG mode: the old tool's text stays as it was
        lines += _mig_devices(dev)
    return lines


def _mig_devices(dev: DeviceInfo) -> list[str]:
    if not dev.mig_devices:
        return ["  MIG Devices:  None"]
    lines = ["  MIG Devices"]
    for mig in dev.mig_devices:
        instances = f"GI {_v(mig.gpu_instance_id)}, CI {_v(mig.compute_instance_id)}"
        lines.append(
            f"    {dev.index}:{mig.index}  {_v(mig.profile):<10} {_v(mig.memory_mib, 'MiB'):>10}"
            f"  {_v(mig.uuid)}  ({instances})"
        )
    return lines


def mig_summary(node: NodeInfo) -> str:
    """One line for the log: which GPUs are in MIG mode (``on for GPU 0 (4 MIG devices);
    off for GPU 1``), or that none can be."""
    on = [d for d in node.devices if d.mig_enabled]
    off = [d.index for d in node.devices if d.mig_enabled is False]
    unknown = [d.index for d in node.devices if d.mig_enabled is None]
    parts = [f"on for GPU {d.index} ({len(d.mig_devices)} MIG devices)" for d in on]
    if off:
        parts.append("off for " + ("every GPU" if len(off) == len(node.devices) else _gpus(off)))
    if unknown:
        what = "every GPU" if len(unknown) == len(node.devices) else _gpus(unknown)
        parts.append(f"not supported or not read for {what}")
    return "; ".join(parts) or "no GPU"


def _gpus(indices: Sequence[int]) -> str:
    return ("GPU " if len(indices) == 1 else "GPUs ") + ", ".join(map(str, indices))


def info(node: NodeInfo) -> str:
    """The ``/gpu/info`` body."""
    lines = ["", f"Driver version:          {node.driver_version}"]
    lines.append(f"Supported CUDA version:  {node.cuda_version}")
    for dev in node.devices:
        lines.append("")
        lines += _device_info(dev)
    return "\n".join(lines) + "\n\n"


def _device_status(dev: DeviceInfo, st: DeviceStatus, tp: PcieThroughput) -> list[str]:
    lines = [f"Device #{dev.index}"]
    lines += _rows(
        2,
        [("Power", _of(st.power_w, dev.power_w, "W")), ("Temperature", _v(st.temperature_c, "°C"))],
    )
    lines.append("  Utilization")
    util = st.utilization
    lines += _rows(
        4,
        [
            ("GPU", _v(util.gpu_pct, "%")),
            ("Memory", _v(util.memory_pct, "%")),
            ("Encoder", _v(util.encoder_pct, "%")),
            ("Decoder", _v(util.decoder_pct, "%")),
        ],
        min_width=7,
    )
    lines.append("  Memory")
    lines += _rows(4, [("Global", _of(st.memory_used_mib, dev.memory.global_mib, "MiB"))])
    lines.append("    ECC Errors")
    ecc = st.ecc_errors
    lines += _rows(
        6,
        [
            ("L1 Cache", _v(ecc.l1_cache)),
            ("L2 Cache", _v(ecc.l2_cache)),
            ("Global", _v(ecc.global_)),
        ],
    )
    lines.append("  PCI")
    lines += _rows(4, [("BAR1", _of(st.bar1_used_mib, dev.pci.bar1_mib, "MiB"))])
    lines.append("    Throughput")
    lines += _rows(6, [("RX", _v(tp.rx_mbps, "MB/s")), ("TX", _v(tp.tx_mbps, "MB/s"))])
    lines.append("  Clocks")
    lines += _rows(
        4,
        [("Cores", _v(st.clocks.cores_mhz, "MHz")), ("Memory", _v(st.clocks.memory_mhz, "MHz"))],
        min_width=8,
    )
    if not st.processes:
        lines.append("  Processes:  None")
    else:
        lines.append("  Processes")
        for proc in st.processes:
            lines.append(f"    {proc.pid:<8}{_v(proc.memory_used_mib, 'MiB'):>12}  {_v(proc.name)}")
    return lines


def status(
    devices: Sequence[DeviceInfo],
    statuses: Sequence[DeviceStatus],
    throughputs: Sequence[PcieThroughput],
) -> str:
    """The ``/gpu/status`` body for the given devices."""
    lines: list[str] = []
    for dev, st, tp in zip(devices, statuses, throughputs, strict=True):
        lines.append("")
        lines += _device_status(dev, st, tp)
    return "\n".join(lines) + "\n\n"
