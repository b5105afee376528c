"""The GPU metric families of one sweep, under dcgm-exporter's default names and labels.

Names, units, types and labels are dcgm-exporter's (its ``etc/default-counters.csv`` and
its renderer), so that the dashboards and alert rules written for it work unchanged;
docs/metrics.md lists each with its source. The monotonic fields (energy, PCIe replays,
remapped rows, ECC counts) are ``counter`` under their own names, without ``_total``, as
dcgm-exporter writes them: ``agent.metrics.exposition`` renders these families. One
deliberate difference: ``DCGM_FI_DEV_PCIE_TX_THROUGHPUT``/``RX`` are a throughput (KB/s,
NVML's ~20 ms sample), which a comment of dcgm-exporter's calls a counter; here they are
gauges.

The profiling families (``DCGM_FI_PROF_*``) are NVML's GPM values (``agent.gpu.nvml_gpm``)
in DCGM's units: ratios from 0 to 1 where GPM gives percent, bytes per second where it
gives MiB/s. A GPU in MIG mode also has one series per GPU instance of its MIG devices for
its framebuffer and its profiling values, with dcgm-exporter's ``GPU_I_PROFILE`` and
``GPU_I_ID`` labels, and one ``nvidia_docker_gpu_healthy`` (0 while any of that GPU
instance's MIG devices is unhealthy). The XID family carries
dcgm-exporter's ``err_code`` and ``err_msg`` labels.

A value the GPU does not report has no sample at all: never NaN, never -1.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.core import Metric

from agent.attribution.owners import ProcessOwner
from agent.gpu.model import DeviceInfo, DeviceStatus, MigDevice, PcieThroughput, Profiling
from agent.health.rule import DeviceHealth
from agent.health.xid_catalog import xid_message

GAUGE = "gauge"
COUNTER = "counter"  # rendered under its own name (agent.metrics.exposition)
MIB = 1024 * 1024

Value = float | int | None
Reader = Callable[[DeviceStatus, PcieThroughput], Value]


@dataclass(frozen=True, slots=True)
class GpuMetric:
    name: str
    kind: str  # GAUGE or COUNTER
    help: str
    read: Reader


def _power_w(status: DeviceStatus, _tput: PcieThroughput) -> Value:
    if status.telemetry.power_mw is not None:
        return status.telemetry.power_mw / 1000
    return status.power_w


def _kbps(mbps: int | None) -> Value:
    return None if mbps is None else mbps * 1000


def _flag(value: bool | None) -> Value:
    return None if value is None else int(value)


GPU_METRICS: tuple[GpuMetric, ...] = (
    GpuMetric("DCGM_FI_DEV_SM_CLOCK", GAUGE, "SM clock frequency (in MHz).",
              lambda s, _t: s.clocks.cores_mhz),
    GpuMetric("DCGM_FI_DEV_MEM_CLOCK", GAUGE, "Memory clock frequency (in MHz).",
              lambda s, _t: s.clocks.memory_mhz),
    GpuMetric("DCGM_FI_DEV_MEMORY_TEMP", GAUGE, "Memory temperature (in C).",
              lambda s, _t: s.telemetry.memory_temperature_c),
    GpuMetric("DCGM_FI_DEV_GPU_TEMP", GAUGE, "GPU temperature (in C).",
              lambda s, _t: s.temperature_c),
    GpuMetric("DCGM_FI_DEV_POWER_USAGE", GAUGE, "Power draw (in W).", _power_w),
    GpuMetric("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", COUNTER,
              "Total energy consumption since the driver was loaded (in mJ).",
              lambda s, _t: s.telemetry.total_energy_mj),
    GpuMetric("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", GAUGE,
              "PCIe transmit throughput (in KB/s), the agent's latest PCIe sample.",
              lambda _s, t: _kbps(t.tx_mbps)),
    GpuMetric("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", GAUGE,
              "PCIe receive throughput (in KB/s), the agent's latest PCIe sample.",
              lambda _s, t: _kbps(t.rx_mbps)),
    GpuMetric("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", COUNTER,
              "Total number of PCIe retries.",
              lambda s, _t: s.telemetry.pcie_replay_count),
    GpuMetric("DCGM_FI_DEV_GPU_UTIL", GAUGE, "GPU utilization (in %).",
              lambda s, _t: s.utilization.gpu_pct),
    GpuMetric("DCGM_FI_DEV_MEM_COPY_UTIL", GAUGE, "Memory utilization (in %).",
              lambda s, _t: s.utilization.memory_pct),
    GpuMetric("DCGM_FI_DEV_ENC_UTIL", GAUGE, "Encoder utilization (in %).",
              lambda s, _t: s.utilization.encoder_pct),
    GpuMetric("DCGM_FI_DEV_DEC_UTIL", GAUGE, "Decoder utilization (in %).",
              lambda s, _t: s.utilization.decoder_pct),
    GpuMetric("DCGM_FI_DEV_FB_FREE", GAUGE, "Framebuffer memory free (in MiB).",
              lambda s, _t: s.telemetry.framebuffer.free_mib),
    GpuMetric("DCGM_FI_DEV_FB_USED", GAUGE, "Framebuffer memory used (in MiB).",
              lambda s, _t: s.telemetry.framebuffer.used_mib),
    GpuMetric("DCGM_FI_DEV_FB_RESERVED", GAUGE,
              "Framebuffer memory reserved by the driver (in MiB).",
              lambda s, _t: s.telemetry.framebuffer.reserved_mib),
    GpuMetric("DCGM_FI_DEV_BAR1_USED", GAUGE, "BAR1 memory used (in MiB).",
              lambda s, _t: s.bar1_used_mib),
    GpuMetric("DCGM_FI_DEV_ECC_DBE_VOL_L1", COUNTER,
              "L1 cache double-bit (uncorrected) volatile ECC errors.",
              lambda s, _t: s.ecc_errors.l1_cache),
    GpuMetric("DCGM_FI_DEV_ECC_DBE_VOL_L2", COUNTER,
              "L2 cache double-bit (uncorrected) volatile ECC errors.",
              lambda s, _t: s.ecc_errors.l2_cache),
    GpuMetric("DCGM_FI_DEV_ECC_DBE_VOL_DEV", COUNTER,
              "Device memory double-bit (uncorrected) volatile ECC errors.",
              lambda s, _t: s.ecc_errors.global_),
    GpuMetric("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", COUNTER,
              "Number of remapped rows for uncorrectable errors.",
              lambda s, _t: s.telemetry.remapped_rows.uncorrectable),
    GpuMetric("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", COUNTER,
              "Number of remapped rows for correctable errors.",
              lambda s, _t: s.telemetry.remapped_rows.correctable),
    GpuMetric("DCGM_FI_DEV_ROW_REMAP_FAILURE", GAUGE, "Whether remapping of rows has failed.",
              lambda s, _t: _flag(s.telemetry.remapped_rows.failed)),
    GpuMetric("DCGM_FI_DEV_ROW_REMAP_PENDING", GAUGE,
              "Whether remapping of rows is pending (until the next GPU reset).",
              lambda s, _t: _flag(s.telemetry.remapped_rows.pending)),
)  # fmt: skip

ProfilingReader = Callable[[Profiling], Value]


@dataclass(frozen=True, slots=True)
class ProfilingMetric:
    """A DCGM profiling field from GPM's values (always a gauge)."""

    name: str
    help: str
    read: ProfilingReader


def _ratio(pct: float | None) -> Value:
    """GPM's percent as DCGM's ratio (0 to 1)."""
    return None if pct is None else pct / 100


def _bytes_per_s(mib_s: float | None) -> Value:
    return None if mib_s is None else mib_s * MIB


PROFILING_METRICS: tuple[ProfilingMetric, ...] = (
    ProfilingMetric("DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                    "Ratio of time any graphics or compute engine was active (0 to 1, GPM).",
                    lambda p: _ratio(p.graphics_pct)),
    ProfilingMetric("DCGM_FI_PROF_SM_ACTIVE",
                    "Ratio of cycles an SM had at least one warp assigned (0 to 1, GPM).",
                    lambda p: _ratio(p.sm_pct)),
    ProfilingMetric("DCGM_FI_PROF_SM_OCCUPANCY",
                    "Ratio of resident warps to the SMs' maximum (0 to 1, GPM).",
                    lambda p: _ratio(p.sm_occupancy_pct)),
    ProfilingMetric("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
                    "Ratio of cycles any tensor pipe was active (0 to 1, GPM).",
                    lambda p: _ratio(p.tensor_pct)),
    ProfilingMetric("DCGM_FI_PROF_DRAM_ACTIVE",
                    "Ratio of device memory bandwidth used to its peak (0 to 1, GPM).",
                    lambda p: _ratio(p.dram_pct)),
    ProfilingMetric("DCGM_FI_PROF_PCIE_TX_BYTES",
                    "PCIe bytes per second sent by the GPU, headers included (GPM).",
                    lambda p: _bytes_per_s(p.pcie_tx_mib_s)),
    ProfilingMetric("DCGM_FI_PROF_PCIE_RX_BYTES",
                    "PCIe bytes per second received by the GPU, headers included (GPM).",
                    lambda p: _bytes_per_s(p.pcie_rx_mib_s)),
    ProfilingMetric("DCGM_FI_PROF_NVLINK_TX_BYTES",
                    "NVLink bytes per second sent by the GPU over all its links (GPM).",
                    lambda p: _bytes_per_s(p.nvlink_tx_mib_s)),
    ProfilingMetric("DCGM_FI_PROF_NVLINK_RX_BYTES",
                    "NVLink bytes per second received by the GPU over all its links (GPM).",
                    lambda p: _bytes_per_s(p.nvlink_rx_mib_s)),
)  # fmt: skip

FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
XID_ERRORS = "DCGM_FI_DEV_XID_ERRORS"
GPU_HEALTHY = "nvidia_docker_gpu_healthy"
PROCESS_INFO = "nvidia_docker_gpu_process_info"
PROCESS_MEMORY = "nvidia_docker_gpu_process_memory_used_bytes"


def gpu_labels(device: DeviceInfo, driver_version: str, hostname: str) -> dict[str, str]:
    """dcgm-exporter's labels of one GPU; one it cannot know is left out."""
    labels = {"gpu": str(device.index)}
    if device.uuid:
        labels["UUID"] = device.uuid
    if device.path:
        labels["device"] = os.path.basename(device.path)  # "nvidia0"
    if device.model:
        labels["modelName"] = device.model
    labels["Hostname"] = hostname
    if device.pci.bus_id:
        labels["pci_bus_id"] = device.pci.bus_id
    labels["DCGM_FI_DRIVER_VERSION"] = driver_version
    return labels


def owner_labels(owner: ProcessOwner) -> dict[str, str]:
    """The container labels of a process (none for the host's)."""
    labels = {}
    if owner.container_name:
        labels["container"] = owner.container_name
    if owner.container_id:
        labels["container_id"] = owner.container_id
    if owner.image:
        labels["image"] = owner.image
    if owner.mesos_container:
        labels["mesos_container"] = owner.mesos_container
    return labels


def sole_owner(status: DeviceStatus, owners: Mapping[int, ProcessOwner]) -> ProcessOwner | None:
    """The container every process of the GPU runs in, if there is exactly one."""
    found: dict[object, ProcessOwner] = {}
    for process in status.processes:
        owner = owners.get(process.pid)
        if owner is None:
            return None
        found[owner.key] = owner
    if len(found) != 1:
        return None
    (owner,) = found.values()
    return owner if owner.in_container else None


def mig_labels(base: Mapping[str, str], mig: MigDevice) -> dict[str, str]:
    """A MIG device's labels: its GPU's, and dcgm-exporter's ``GPU_I_PROFILE`` (its GPU
    instance's profile: ``3g.71gb`` for ``3g.71gb`` and for a compute instance's
    ``1c.3g.71gb`` alike) and ``GPU_I_ID``."""
    labels = dict(base)
    profile = _instance_profile(mig.profile)
    if profile:
        labels["GPU_I_PROFILE"] = profile
    if mig.gpu_instance_id is not None:
        labels["GPU_I_ID"] = str(mig.gpu_instance_id)
    return labels


def _instance_profile(profile: str | None) -> str | None:
    """The GPU instance's profile of a MIG device's profile: a compute instance smaller than
    its GPU instance is named ``<n>c.`` and the GPU instance's (``1c.3g.71gb``)."""
    if profile is None:
        return None
    head, _, rest = profile.partition(".")
    return rest if rest and head.endswith("c") and head[:-1].isdigit() else profile


def xid_labels(labels: Mapping[str, str], xid: int) -> dict[str, str]:
    """dcgm-exporter's labels of the XID sample: ``err_code``, ``err_msg`` (its catalog's)."""
    return {**labels, "err_code": str(xid), "err_msg": xid_message(xid)}


def gpu_families(
    devices: Sequence[DeviceInfo],
    statuses: Sequence[DeviceStatus],
    throughputs: Sequence[PcieThroughput],
    owners: Mapping[int, ProcessOwner],
    *,
    driver_version: str,
    hostname: str,
    health: Sequence[DeviceHealth] | None = None,
    last_xids: Sequence[int] | None = None,
) -> list[Metric]:
    """Every GPU family of one sweep: dcgm-exporter's, then health, then the processes'."""
    families = {m.name: Metric(m.name, m.help, m.kind) for m in GPU_METRICS}
    profiling = {m.name: Metric(m.name, m.help, GAUGE) for m in PROFILING_METRICS}
    xid = Metric(XID_ERRORS, "Value of the last XID error encountered (0: none).", GAUGE)
    healthy = Metric(GPU_HEALTHY, "Whether the agent judges the GPU healthy (1) or not (0).",
                     GAUGE)  # fmt: skip
    info = Metric(PROCESS_INFO, "A process using the GPU, and what it runs in (always 1).",
                  GAUGE)  # fmt: skip
    memory = Metric(PROCESS_MEMORY, "GPU memory used by a process (in bytes).", GAUGE)
    for device, status, tput in zip(devices, statuses, throughputs, strict=True):
        base = gpu_labels(device, driver_version, hostname)
        sole = sole_owner(status, owners)
        labels = {**base, **owner_labels(sole)} if sole is not None else base
        for spec in GPU_METRICS:
            value = spec.read(status, tput)
            if value is not None:
                families[spec.name].add_sample(spec.name, labels, value)
        _add_profiling(profiling, status.telemetry.profiling, labels)
        state = health[device.index] if health is not None and device.index < len(health) else None
        if last_xids is not None and device.index < len(last_xids):
            code = last_xids[device.index]
            xid.add_sample(XID_ERRORS, xid_labels(labels, code), code)
        if state is not None:
            healthy.add_sample(GPU_HEALTHY, labels, int(state.healthy))
        _add_mig_samples(device, status, base, state, families, profiling, healthy)
        for sample_labels, used_mib in _process_samples(status, owners, base):
            info.add_sample(PROCESS_INFO, sample_labels, 1)
            if used_mib is not None:
                memory.add_sample(PROCESS_MEMORY, sample_labels, used_mib * MIB)
    out = [*families.values(), *profiling.values(), xid, healthy, info, memory]
    return [family for family in out if family.samples]


def _add_profiling(
    families: Mapping[str, Metric], values: Profiling, labels: dict[str, str]
) -> None:
    for spec in PROFILING_METRICS:
        value = spec.read(values)
        if value is not None:
            families[spec.name].add_sample(spec.name, labels, value)


def _add_mig_samples(
    device: DeviceInfo,
    status: DeviceStatus,
    base: Mapping[str, str],
    state: DeviceHealth | None,
    families: Mapping[str, Metric],
    profiling: Mapping[str, Metric],
    healthy: Metric,
) -> None:
    """The series of each GPU instance of the GPU's MIG devices: framebuffer, profiling,
    health. The MIG devices of one GPU instance (its compute instances) share its memory
    and its profiling values, and its labels: they make one series each, of the first
    such MIG device's values, healthy (1) only while all of them are."""
    live = {m.index: m for m in status.telemetry.mig_devices}
    instances: dict[object, tuple[dict[str, str], list[MigDevice]]] = {}
    for mig in device.mig_devices:
        key = mig.index if mig.gpu_instance_id is None else ("gi", mig.gpu_instance_id)
        instances.setdefault(key, (mig_labels(base, mig), []))[1].append(mig)
    for labels, migs in instances.values():
        values = next((live[m.index] for m in migs if m.index in live), None)
        if values is not None:
            fb = values.framebuffer
            for name, value in ((FB_USED, fb.used_mib), (FB_FREE, fb.free_mib),
                                (FB_RESERVED, fb.reserved_mib)):  # fmt: skip
                if value is not None:
                    families[name].add_sample(name, labels, value)
            _add_profiling(profiling, values.profiling, labels)
        if state is not None:
            ok = all(state.of_mig(m.index).healthy for m in migs)
            healthy.add_sample(GPU_HEALTHY, labels, int(ok))


def _process_samples(
    status: DeviceStatus, owners: Mapping[int, ProcessOwner], base: Mapping[str, str]
) -> Iterable[tuple[dict[str, str], int | None]]:
    gpu = {k: base[k] for k in ("gpu", "UUID", "device", "Hostname") if k in base}
    for process in status.processes:
        owner = owners.get(process.pid)
        labels = {**gpu, "pid": str(process.pid)}
        if process.name:
            labels["process_name"] = process.name
        if owner is not None:
            labels["owner"] = owner.kind.value
            labels.update(owner_labels(owner))
        yield labels, process.memory_used_mib
