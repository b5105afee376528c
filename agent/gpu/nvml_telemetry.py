"""The status values only ``/metrics`` exports, read from NVML as dcgm-exporter's DCGM does.

Memory temperature exists only as an NVML *field value*, and so do the energy counter, the
PCIe replay counter and the remapped rows; one ``nvmlDeviceGetFieldValues`` call reads
several, and each field carries its own return code, so a field the GPU does not have is
``None`` without costing the others. Device memory comes from the version-2 memory call,
which tells the driver's reserve apart from what processes use (what nvidia-smi shows as
"Used").

Two fields are slow: measured on an H200 (driver 580.159.04), the energy counter takes
3.2 ms and the PCIe replay counter 0.14 ms, against 6-11 us for each of the others, so
reading them at every status request made a status read 50 times slower (81 us -> 4.1
ms). They are ``SLOW_FIELD_IDS``: the background sampler reads them with the PCIe
counters (``NvmlBackend.pcie_throughput``, about once a second) and status serves that
sample; both are counters that Prometheus rates over minutes.

On a GPU in MIG mode each MIG device's memory is read too (``nvmlDeviceGetMemoryInfo`` of
its handle, kept from the start: ``mig_handles``), and the profiling values of the GPU and
of its GPU instances are the GPM sampler's (``agent.gpu.nvml_gpm``), passed in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.gpu import nvml_query as nvml
from agent.gpu.model import (
    UNKNOWN_PROFILING,
    DeviceInfo,
    DeviceTelemetry,
    FrameBuffer,
    MigTelemetry,
    Profiling,
    RemappedRows,
)

MIB = 1024 * 1024

# nvmlFieldValue ids (nvml.h NVML_FI_DEV_*; stable across versions).
FI_MEMORY_TEMP = 82
FI_TOTAL_ENERGY_CONSUMPTION = 83  # mJ since the driver was last loaded
FI_PCIE_REPLAY_COUNTER = 94
FI_REMAPPED_COR = 142
FI_REMAPPED_UNC = 143
FI_REMAPPED_PENDING = 144
FI_REMAPPED_FAILURE = 145
FAST_FIELD_IDS = (  # read at every status read
    FI_MEMORY_TEMP,
    FI_REMAPPED_COR,
    FI_REMAPPED_UNC,
    FI_REMAPPED_PENDING,
    FI_REMAPPED_FAILURE,
)
SLOW_FIELD_IDS = (FI_TOTAL_ENERGY_CONSUMPTION, FI_PCIE_REPLAY_COUNTER)  # by the sampler
FIELD_IDS = FAST_FIELD_IDS + SLOW_FIELD_IDS

MEMORY_INFO_V2 = 0x02000028  # nvmlMemory_v2: sizeof(nvmlMemory_v2_t) | 2 << 24

# nvmlValueType_t -> the member of the nvmlValue_t union that holds the value.
_VALUE_MEMBERS = {
    0: "dVal",
    1: "uiVal",
    2: "ulVal",
    3: "ullVal",
    4: "sllVal",
    5: "siVal",
    6: "usVal",
}


# One GPU's MIG devices: (MIG device index, its GPU instance id, its NVML handle).
MigHandles = tuple[tuple[int, int | None, Any], ...]


def read_telemetry(
    handle: Any,
    power_mw: int | None,
    memory_v1: Any,
    slow_fields: dict[int, int] | None = None,
    *,
    profiling: Profiling = UNKNOWN_PROFILING,
    migs: MigHandles = (),
    mig_profiling: Mapping[int, Profiling] | None = None,
) -> DeviceTelemetry:
    """The telemetry of one GPU; ``power_mw`` and ``memory_v1`` are what the status read
    already has (the draw, and the version-1 memory answer used when v2 is missing);
    ``slow_fields`` the sampler's last reading of ``SLOW_FIELD_IDS`` (None: read them now);
    ``profiling`` and ``mig_profiling`` (by GPU instance id) the GPM sampler's last values;
    ``migs`` the GPU's MIG devices, whose memory is read now."""
    if slow_fields is None:
        fields = field_values(handle, FIELD_IDS)
    else:
        fields = {**field_values(handle, FAST_FIELD_IDS), **slow_fields}
    return DeviceTelemetry(
        power_mw=power_mw,
        memory_temperature_c=fields.get(FI_MEMORY_TEMP),
        total_energy_mj=fields.get(FI_TOTAL_ENERGY_CONSUMPTION),
        pcie_replay_count=fields.get(FI_PCIE_REPLAY_COUNTER),
        framebuffer=framebuffer(handle, memory_v1),
        remapped_rows=RemappedRows(
            correctable=fields.get(FI_REMAPPED_COR),
            uncorrectable=fields.get(FI_REMAPPED_UNC),
            pending=_flag(fields.get(FI_REMAPPED_PENDING)),
            failed=_flag(fields.get(FI_REMAPPED_FAILURE)),
        ),
        profiling=profiling,
        mig_devices=tuple(
            MigTelemetry(
                index=mig,
                framebuffer=mig_framebuffer(mig_handle),
                profiling=(mig_profiling or {}).get(gi, UNKNOWN_PROFILING)
                if gi is not None
                else UNKNOWN_PROFILING,
            )
            for mig, gi, mig_handle in migs
        ),
    )


def mig_handles(handles: Sequence[Any | None], devices: Sequence[DeviceInfo]) -> list[MigHandles]:
    """Per GPU, the handles of its MIG devices (read once: the MIG layout is the node's
    static facts); a MIG device NVML cannot open now is left out."""
    found: list[MigHandles] = []
    for device in devices:
        handle = handles[device.index] if device.index < len(handles) else None
        entries = []
        for mig in device.mig_devices if handle is not None else ():
            mig_handle = nvml.query("nvmlDeviceGetMigDeviceHandleByIndex", handle, mig.index)
            if mig_handle is not None:
                entries.append((mig.index, mig.gpu_instance_id, mig_handle))
        found.append(tuple(entries))
    return found


def mig_framebuffer(handle: Any) -> FrameBuffer:
    """A MIG device's own memory: used, free (and reserved, where the v2 call answers)."""
    memory = nvml.query("nvmlDeviceGetMemoryInfo", handle, MEMORY_INFO_V2)
    if memory is None:
        memory = nvml.query("nvmlDeviceGetMemoryInfo", handle)
    if memory is None:
        return FrameBuffer()
    return FrameBuffer(
        used_mib=_mib(getattr(memory, "used", None)),
        free_mib=_mib(getattr(memory, "free", None)),
        reserved_mib=_mib(getattr(memory, "reserved", None)),
    )


def field_values(handle: Any, ids: tuple[int, ...]) -> dict[int, int]:
    """``{field id: value}`` for the fields NVML answered; a failed field is left out."""
    answer = nvml.query("nvmlDeviceGetFieldValues", handle, list(ids))
    if answer is None:
        return {}
    found: dict[int, int] = {}
    try:
        entries = list(answer)
    except TypeError:
        return {}
    for entry in entries:
        field_id = getattr(entry, "fieldId", None)
        if not isinstance(field_id, int) or getattr(entry, "nvmlReturn", None) != nvml.SUCCESS:
            continue
        value = _value(entry)
        if value is not None:
            found[field_id] = value
    return found


def _value(entry: Any) -> int | None:
    member = _VALUE_MEMBERS.get(getattr(entry, "valueType", None))  # type: ignore[arg-type]
    raw = getattr(getattr(entry, "value", None), member, None) if member else None
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return None
    return int(raw)


def _flag(value: int | None) -> bool | None:
    return None if value is None else value != 0


def framebuffer(handle: Any, memory_v1: Any) -> FrameBuffer:
    """Used, free and reserved device memory; without the v2 call (drivers before R510),
    v1's used, which includes the reserve, and no reserve figure."""
    memory = nvml.query("nvmlDeviceGetMemoryInfo", handle, MEMORY_INFO_V2)
    if memory is not None:
        return FrameBuffer(
            used_mib=_mib(getattr(memory, "used", None)),
            free_mib=_mib(getattr(memory, "free", None)),
            reserved_mib=_mib(getattr(memory, "reserved", None)),
        )
    return FrameBuffer(
        used_mib=_mib(getattr(memory_v1, "used", None)),
        free_mib=_mib(getattr(memory_v1, "free", None)),
    )


def _mib(value_bytes: Any) -> int | None:
    if isinstance(value_bytes, bool) or not isinstance(value_bytes, int):
        return None
    return value_bytes // MIB
