"""A fake pynvml module built from a real NVML capture (``tests/fixtures/*/nvml-capture.json``).

The fake answers the pynvml functions the backend calls with the values the real H200
gave, raises pynvml's own ``NVMLError`` subclasses, and lets a test break things the way
real machines break: a function that fails for one GPU (``fail``), a function the driver
does not have (``remove_from_driver``: FunctionNotFound) or that pynvml does not have
(``remove_from_pynvml``: attribute absent), a driver that is not installed.
"""

from __future__ import annotations

import json
import queue
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from agent.gpu.cuda_driver import UNKNOWN_FACTS, CudaDeviceFacts
from tests.support.fixture_files import FIXTURES

INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
NOT_FOUND = 6
MAX_MIG_DEVICES = 7  # an H200 splits into at most seven MIG devices
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
LIBRARY_NOT_FOUND = 12
LIB_RM_VERSION_MISMATCH = 18
UNINITIALIZED = 1

EVENT_DOUBLE_BIT_ECC = 0x0000000000000002  # nvmlEventTypeDoubleBitEccError
EVENT_XID_CRITICAL = 0x0000000000000008  # nvmlEventTypeXidCriticalError
EVENT_SINGLE_BIT_ECC = 0x0000000000000001
NO_INSTANCE = 0xFFFFFFFF  # an event's gpuInstanceId/computeInstanceId when none applies


def load_capture(name: str) -> dict[str, Any]:
    """The NVML capture of a fixture machine (``h200`` or ``h200x2``)."""
    data: dict[str, Any] = json.loads((FIXTURES / name / "nvml-capture.json").read_text())
    return data


@dataclass(frozen=True)
class Handle:
    index: int


@dataclass(frozen=True)
class MigHandle:
    """The handle of MIG device ``slot`` of GPU ``parent``."""

    parent: int
    slot: int


@dataclass(frozen=True)
class FakeMig:
    """A MIG device as the fake NVML reports it."""

    slot: int
    uuid: str
    profile: str  # "1g.18gb": the name is "<GPU name> MIG <profile>"
    memory_mib: int
    gpu_instance: int
    compute_instance: int


class Struct(types.SimpleNamespace):
    """A ctypes structure as pynvml returns it: attribute access."""


# Functions the fake answers that the floor's pynvml (nvidia-ml-py 11.510.69) does not have:
# GPM came later. Every one exists in the newest pynvml (test_nvml_backend checks).
NEWER_THAN_THE_FLOOR = frozenset({
    "nvmlGpmMetricsGet", "nvmlGpmMigSampleGet", "nvmlGpmQueryDeviceSupport",
    "nvmlGpmQueryIfStreamingEnabled", "nvmlGpmSampleAlloc", "nvmlGpmSampleFree",
    "nvmlGpmSampleGet",
})  # fmt: skip
GPM_METRIC_SLOTS = 477  # NVML_GPM_METRIC_MAX: the metrics array of nvmlGpmMetricsGet_t
GPM_METRIC_IDS = {  # nvml.h's NVML_GPM_METRIC_*, the ones the agent asks for
    "GRAPHICS_UTIL": 1, "SM_UTIL": 2, "SM_OCCUPANCY": 3, "ANY_TENSOR_UTIL": 5,
    "DRAM_BW_UTIL": 10, "PCIE_TX_PER_SEC": 20, "PCIE_RX_PER_SEC": 21,
    "NVLINK_TOTAL_RX_PER_SEC": 60, "NVLINK_TOTAL_TX_PER_SEC": 61,
}  # fmt: skip


class GpmSample:
    """An opaque GPM sample: what it was last taken of, and when (the fake's clock)."""

    def __init__(self) -> None:
        self.of: tuple[int, int | None] | None = None  # (GPU, GPU instance or None)
        self.tick = 0
        self.freed = False


class GpmMetricsGet:
    """pynvml's ``c_nvmlGpmMetricsGet_t``: the request and, after the call, the answer."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: GpmSample | None = None
        self.sample2: GpmSample | None = None
        self.metrics = [
            Struct(metricId=0, nvmlReturn=0, value=0.0, metricInfo=Struct(unit=None))
            for _ in range(GPM_METRIC_SLOTS)
        ]


class EventSet:
    """An NVML event set: what was registered, and the events waiting to be delivered."""

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}  # GPU index -> registered event types
        self.ready: queue.Queue[Struct] = queue.Queue()
        self.freed = False


class FakeNvml:
    """State of the fake NVML library; ``module`` is what replaces ``pynvml``."""

    def __init__(self, capture: dict[str, Any]) -> None:
        self.capture = capture
        self.devices: list[dict[str, Any]] = capture["devices"]
        self.failures: dict[tuple[str, int | None], int] = {}
        self.missing_in_driver: set[str] = set()
        self.missing_in_pynvml: set[str] = set()
        self.init_error: int | None = None
        self.calls: list[str] = []
        self.initialised = 0
        self.shutdowns = 0
        self.remote_device_type: int | None = 0  # NVML_NVLINK_DEVICE_TYPE_GPU
        self.processes: dict[int, list[Struct]] = {}
        # NVML field values per GPU, {field id: value}; a field not here is "not supported".
        # The default is what nvidia-smi -q showed on the captured H200 (memory 38 C, one
        # PCIe replay, no remapped rows; it does not print the energy counter, so that one
        # is "not supported" unless a test sets it).
        self.field_values: dict[int, dict[int, int]] = {
            index: {82: 38, 94: 1, 142: 0, 143: 0, 144: 0, 145: 0}
            for index in range(len(self.devices))
        }
        self.field_value_types: dict[int, int] = {83: 3}  # energy: unsigned long long
        self.field_requests: list[tuple[int, ...]] = []  # the ids of each GetFieldValues call
        # Health: what each GPU can deliver, its row remapper, retired pages, volatile DBEs.
        self.supported_events: dict[int, int] = {}  # default: XID | DBE | SBE
        self.remapped_rows: dict[int, tuple[int, int, int, int]] = {}
        self.retired_pending: dict[int, int] = {}  # absent: not supported (Hopper)
        self.volatile_dbe: dict[int, int] = {}
        self.event_sets: list[EventSet] = []
        self.mig: dict[int, list[FakeMig]] = {}  # GPU index -> MIG devices, when MIG is on
        # GPM (Hopper and later): which GPUs have it (default: every one, the capture is an
        # H200), and what nvmlGpmMetricsGet answers per metric id for a pair of samples of
        # a GPU (key: index) or a GPU instance (key: (index, GPU instance id)). A metric id
        # not in the dict answers "not supported" on its own.
        self.gpm_supported: dict[int, bool] = {}
        self.gpm_values: dict[int | tuple[int, int], dict[int, float]] = {}
        self.gpm_samples: list[GpmSample] = []
        self.gpm_tick = 0
        self.gpm_streaming: dict[int, int] = {}
        self.module = self._build_module()

    # -- what a test changes -------------------------------------------------------------

    def fail(self, func: str, code: int, index: int | None = None) -> None:
        """``func`` raises NVML error ``code`` (for GPU ``index``, or always)."""
        self.failures[func, index] = code

    def lose(self, index: int) -> None:
        """GPU ``index`` fell off the bus: every per-device call raises GPU_IS_LOST."""
        self.failures["*", index] = GPU_IS_LOST

    def emit(
        self,
        index: int,
        event_type: int,
        data: int = 0,
        gpu_instance: int = NO_INSTANCE,
        compute_instance: int = NO_INSTANCE,
    ) -> None:
        """The driver raises an event on GPU ``index``: every set registered for it gets it
        (with the MIG instances it is attributed to; ``NO_INSTANCE``: none, as NVML says)."""
        for event_set in self.event_sets:
            if event_set.masks.get(index, 0) & event_type:
                event_set.ready.put(
                    Struct(device=Handle(index), eventType=event_type, eventData=data,
                           gpuInstanceId=gpu_instance, computeInstanceId=compute_instance)
                )  # fmt: skip

    def emit_xid(
        self,
        index: int,
        xid: int,
        gpu_instance: int = NO_INSTANCE,
        compute_instance: int = NO_INSTANCE,
    ) -> None:
        self.emit(index, EVENT_XID_CRITICAL, xid, gpu_instance, compute_instance)

    def emit_double_bit_ecc(self, index: int) -> None:
        self.emit(index, EVENT_DOUBLE_BIT_ECC)

    def recover(self, index: int) -> None:
        """GPU ``index`` answers again (after a reset)."""
        self.failures.pop(("*", index), None)

    def enable_mig(self, index: int, devices: list[FakeMig]) -> None:
        """GPU ``index`` is in MIG mode with these MIG devices (the capture's GPUs are not)."""
        self.mig[index] = list(devices)

    def remove_from_driver(self, func: str) -> None:
        self.missing_in_driver.add(func)

    def remove_from_pynvml(self, func: str) -> None:
        self.missing_in_pynvml.add(func)
        if hasattr(self.module, func):
            delattr(self.module, func)

    # -- the module ----------------------------------------------------------------------

    def _build_module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml")
        module.NVMLError = pynvml.NVMLError  # type: ignore[attr-defined]
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(module, name, self._wrap(name, getattr(self, name)))
        module.c_nvmlGpmMetricsGet_t = GpmMetricsGet  # type: ignore[attr-defined]
        module.NVML_GPM_METRICS_GET_VERSION = 1  # type: ignore[attr-defined]
        metric_ids = {  # pynvml's where it has them (the floor, 11.510.69, has no GPM)
            name: value
            for name, value in vars(pynvml).items()
            if name.startswith("NVML_GPM_METRIC_")
        } or {f"NVML_GPM_METRIC_{name}": value for name, value in GPM_METRIC_IDS.items()}
        for name, value in metric_ids.items():
            setattr(module, name, value)
        return module

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls.append(name)
            if name in self.missing_in_driver:
                raise pynvml.NVMLError(FUNCTION_NOT_FOUND)
            for arg in args:
                if isinstance(arg, Handle | MigHandle):
                    index = arg.index if isinstance(arg, Handle) else arg.parent
                    for key in ((name, index), ("*", index)):
                        if key in self.failures:
                            raise pynvml.NVMLError(self.failures[key])
            if (name, None) in self.failures:
                raise pynvml.NVMLError(self.failures[name, None])
            return fn(*args)

        return call

    def _dev(self, handle: Handle) -> dict[str, Any]:
        return self.devices[handle.index]

    @staticmethod
    def _value(value: Any) -> Any:
        """A capture value, or the NVML error the capture recorded (``ERR:Not Supported``)."""
        if isinstance(value, str) and value.startswith("ERR:"):
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return value

    # -- system --------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return str(self.capture["driver"]).encode()  # old pynvml returned bytes

    def nvmlSystemGetNVMLVersion(self) -> str:
        return str(self.capture["nvml_version"])

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return int(self.capture["cuda_driver_v2"])

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return int(self.capture["cuda_driver"])

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        return f"/usr/bin/process-{pid}"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        if ("nvmlDeviceGetHandleByIndex", index) in self.failures:
            raise pynvml.NVMLError(self.failures["nvmlDeviceGetHandleByIndex", index])
        return Handle(index)

    # -- static facts --------------------------------------------------------------------

    def nvmlDeviceGetName(self, h: Handle | MigHandle) -> str:
        if isinstance(h, MigHandle):
            return f"{self.devices[h.parent]['name']} MIG {self._mig(h).profile}"
        return str(self._dev(h)["name"])

    def nvmlDeviceGetUUID(self, h: Handle | MigHandle) -> bytes:
        if isinstance(h, MigHandle):
            return self._mig(h).uuid.encode()
        return str(self._dev(h)["uuid"]).encode()

    def nvmlDeviceGetMinorNumber(self, h: Handle) -> int:
        return int(self._dev(h)["minor"])

    def nvmlDeviceGetPowerManagementLimit(self, h: Handle) -> int:
        return int(self._dev(h)["power_limit_mW"])

    def nvmlDeviceGetPciInfo(self, h: Handle) -> Struct:
        pci = self._dev(h)["pci"]
        return Struct(busId=pci["busId"].encode(), busIdLegacy=pci["busIdLegacy"].encode())

    def nvmlDeviceGetBAR1MemoryInfo(self, h: Handle) -> Struct:
        return Struct(**self._dev(h)["bar1"])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: Handle) -> int:
        return int(self._dev(h)["max_pcie_gen"])

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: Handle) -> int:
        return int(self._dev(h)["max_pcie_width"])

    def nvmlDeviceGetMaxClockInfo(self, h: Handle, clock: int) -> int:
        return int(self._dev(h)["max_clock_sm" if clock == 1 else "max_clock_mem"])

    def nvmlDeviceGetCudaComputeCapability(self, h: Handle) -> tuple[int, int]:
        major, minor = self._dev(h)["cuda_cc"]
        return (major, minor)

    def nvmlDeviceGetNumGpuCores(self, h: Handle) -> int:
        return int(self._dev(h)["num_cores"])

    def nvmlDeviceGetMemoryBusWidth(self, h: Handle) -> int:
        return int(self._dev(h)["mem_bus_width"])

    def nvmlDeviceGetEccMode(self, h: Handle) -> list[int]:
        return list(self._dev(h)["ecc_mode"])

    def nvmlDeviceGetMemoryInfo(self, h: Handle | MigHandle, version: int | None = None) -> Struct:
        if isinstance(h, MigHandle):
            total = self._mig(h).memory_mib * 1024 * 1024
            return Struct(total=total, free=total, used=0)
        memory = self._dev(h)["memory"]
        if not version:
            return Struct(**memory)
        if "nvmlDeviceGetMemoryInfo_v2" in self.missing_in_driver:
            raise pynvml.NVMLError(FUNCTION_NOT_FOUND)
        # v2 splits v1's used into the driver's reserve and what processes use: on the idle
        # captured H200 nvidia-smi showed all of it as reserved (616 MiB) and 0 MiB used.
        return Struct(
            version=version, total=memory["total"], reserved=memory["used"],
            free=memory["free"], used=0,
        )  # fmt: skip

    def nvmlDeviceGetFieldValues(self, h: Handle, field_ids: list[int]) -> list[Struct]:
        self.field_requests.append(tuple(field_ids))
        known = self.field_values.get(h.index, {})
        entries = []
        for field_id in field_ids:
            value_type = self.field_value_types.get(field_id, 1)  # unsigned int
            member = {1: "uiVal", 3: "ullVal", 0: "dVal"}[value_type]
            if field_id in known:
                entries.append(
                    Struct(fieldId=field_id, nvmlReturn=0, valueType=value_type,
                           value=Struct(**{member: known[field_id]}))
                )  # fmt: skip
            else:
                entries.append(
                    Struct(fieldId=field_id, nvmlReturn=NOT_SUPPORTED, valueType=value_type,
                           value=Struct(**{member: 0}))
                )  # fmt: skip
        return entries

    # -- MIG -----------------------------------------------------------------------------

    def _mig(self, h: MigHandle) -> FakeMig:
        for device in self.mig.get(h.parent, []):
            if device.slot == h.slot:
                return device
        raise pynvml.NVMLError(NOT_FOUND)

    def nvmlDeviceGetMigMode(self, h: Handle | MigHandle) -> list[int]:
        if isinstance(h, MigHandle) or "mig_mode" not in self._dev(h):
            raise pynvml.NVMLError(NOT_SUPPORTED)
        if h.index in self.mig:
            return [1, 1]
        return [int(mode) for mode in self._dev(h)["mig_mode"]]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Handle) -> int:
        if "mig_mode" not in self._dev(h):
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return MAX_MIG_DEVICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Handle, slot: int) -> MigHandle:
        if h.index not in self.mig:
            raise pynvml.NVMLError(INVALID_ARGUMENT)  # MIG mode is off
        handle = MigHandle(h.index, slot)
        self._mig(handle)  # not found: an empty slot
        return handle

    def nvmlDeviceGetGpuInstanceId(self, h: MigHandle) -> int:
        return self._mig(h).gpu_instance

    def nvmlDeviceGetComputeInstanceId(self, h: MigHandle) -> int:
        return self._mig(h).compute_instance

    def nvmlDeviceGetCpuAffinityWithinScope(self, h: Handle, size: int, scope: int) -> list[int]:
        return [1] + [0] * (size - 1)  # NUMA node 0

    # -- GPM -----------------------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, h: Handle) -> Struct:
        return Struct(version=1, isSupportedDevice=int(self.gpm_supported.get(h.index, True)))

    def nvmlGpmQueryIfStreamingEnabled(self, h: Handle) -> int:
        return self.gpm_streaming.get(h.index, 0)

    def nvmlGpmSampleAlloc(self) -> GpmSample:
        sample = GpmSample()
        self.gpm_samples.append(sample)
        return sample

    def nvmlGpmSampleFree(self, sample: GpmSample) -> None:
        sample.freed = True

    def _take(self, sample: GpmSample, of: tuple[int, int | None]) -> GpmSample:
        if sample.freed:
            raise pynvml.NVMLError(INVALID_ARGUMENT)
        self.gpm_tick += 1
        sample.of, sample.tick = of, self.gpm_tick
        return sample

    def nvmlGpmSampleGet(self, h: Handle, sample: GpmSample) -> GpmSample:
        if not self.gpm_supported.get(h.index, True):
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return self._take(sample, (h.index, None))

    def nvmlGpmMigSampleGet(self, h: Handle, gpu_instance: int, sample: GpmSample) -> GpmSample:
        if not any(m.gpu_instance == gpu_instance for m in self.mig.get(h.index, [])):
            raise pynvml.NVMLError(NOT_FOUND)
        return self._take(sample, (h.index, gpu_instance))

    def nvmlGpmMetricsGet(self, request: GpmMetricsGet) -> GpmMetricsGet:
        first, second = request.sample1, request.sample2
        if first is None or second is None or first.of is None or first.of != second.of:
            raise pynvml.NVMLError(INVALID_ARGUMENT)  # not two samples of one target
        if first.tick >= second.tick:
            raise pynvml.NVMLError(INVALID_ARGUMENT)
        gpu, instance = first.of
        values = self.gpm_values.get(gpu if instance is None else (gpu, instance), {})
        for metric in request.metrics[: request.numMetrics]:
            if metric.metricId in values:
                metric.nvmlReturn, metric.value = 0, values[metric.metricId]
            else:
                metric.nvmlReturn, metric.value = NOT_SUPPORTED, 0.0
        return request

    # -- topology ------------------------------------------------------------------------

    def _pair(self, a: Handle, b: Handle) -> dict[str, Any]:
        for pair in self.capture.get("topology", []):
            if {pair["i"], pair["j"]} == {a.index, b.index}:
                return dict(pair)
        raise pynvml.NVMLError(NOT_SUPPORTED)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: Handle, b: Handle) -> int:
        return int(self._pair(a, b)["common_ancestor"])

    def nvmlDeviceGetP2PStatus(self, a: Handle, b: Handle, index: int) -> int:
        key = {0: "p2p_read", 1: "p2p_write", 2: "p2p_nvlink", 3: "p2p_atomics"}[index]
        return int(self._pair(a, b)[key])

    def _links(self, h: Handle) -> list[dict[str, Any]]:
        nvlink = self.capture.get("nvlink")
        return list(nvlink[h.index]) if nvlink else []

    def _link(self, h: Handle, link: int) -> dict[str, Any]:
        links = self._links(h)
        if not links:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        if link >= len(links):
            raise pynvml.NVMLError(2)  # invalid argument: past the last link
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h: Handle, link: int) -> int:
        return int(self._link(h, link)["state"])

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Handle, link: int) -> Struct:
        return Struct(busId=self._link(h, link)["remote_bus"].encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: Handle, link: int) -> int:
        self._link(h, link)
        if self.remote_device_type is None:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return self.remote_device_type

    # -- status --------------------------------------------------------------------------

    def nvmlDeviceGetPowerUsage(self, h: Handle) -> int:
        return int(self._dev(h)["power_usage_mW"])

    def nvmlDeviceGetTemperature(self, h: Handle, sensor: int) -> int:
        return int(self._dev(h)["temperature_C"])

    def nvmlDeviceGetUtilizationRates(self, h: Handle) -> Struct:
        return Struct(**self._dev(h)["utilization"])

    def nvmlDeviceGetEncoderUtilization(self, h: Handle) -> list[int]:
        return list(self._dev(h)["encoder_util"])

    def nvmlDeviceGetDecoderUtilization(self, h: Handle) -> list[int]:
        return list(self._dev(h)["decoder_util"])

    def nvmlDeviceGetMemoryErrorCounter(
        self, h: Handle, error_type: int, counter: int, location: int
    ) -> int:
        key = {0: "ecc_l1", 1: "ecc_l2", 2: "ecc_devmem"}[location]
        return int(self._value(self._dev(h)[key]))

    def nvmlDeviceGetClockInfo(self, h: Handle, clock: int) -> int:
        return int(self._dev(h)["clock_sm" if clock == 1 else "clock_mem"])

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: Handle) -> list[Struct]:
        return self.processes.get(h.index, [])

    def nvmlDeviceGetPcieThroughput(self, h: Handle, counter: int) -> int:
        return int(self._dev(h)["pcie_rx_KBps" if counter == 1 else "pcie_tx_KBps"])

    # -- health --------------------------------------------------------------------------

    def nvmlDeviceGetIndex(self, h: Handle) -> int:
        return h.index

    def nvmlDeviceGetRemappedRows(self, h: Handle) -> tuple[int, int, int, int]:
        return self.remapped_rows.get(h.index, (0, 0, 0, 0))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: Handle) -> int:
        if h.index not in self.retired_pending:
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return self.retired_pending[h.index]

    def nvmlDeviceGetTotalEccErrors(self, h: Handle, error_type: int, counter: int) -> int:
        return self.volatile_dbe.get(h.index, 0)

    def nvmlDeviceGetSupportedEventTypes(self, h: Handle) -> int:
        default = EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC | EVENT_SINGLE_BIT_ECC
        return self.supported_events.get(h.index, default)

    def nvmlEventSetCreate(self) -> EventSet:
        event_set = EventSet()
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, h: Handle, event_types: int, event_set: EventSet) -> None:
        if event_types & ~self.nvmlDeviceGetSupportedEventTypes(h):
            raise pynvml.NVMLError(NOT_SUPPORTED)
        event_set.masks[h.index] = event_set.masks.get(h.index, 0) | event_types

    def nvmlEventSetWait(self, event_set: EventSet, timeout_ms: int) -> Struct:
        try:
            return event_set.ready.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: EventSet) -> None:
        event_set.freed = True


@dataclass
class FakeCuda:
    """The CUDA facts of a capture (``cuda_devices``, ``cuda_peers``), by PCI bus id."""

    capture: dict[str, Any]
    driver_version: int | None = None  # cuDriverGetVersion's answer (None: unknown)

    def _device(self, bus_id: str) -> tuple[int, dict[str, Any]] | None:
        short = bus_id.lower()[4:]  # "00000000:00:06.0" -> "0000:00:06.0"
        for index, dev in enumerate(self.capture["cuda_devices"]):
            if dev["busid"].lower() == short:
                return index, dev
        return None

    def device_facts(self, bus_id: str) -> CudaDeviceFacts:
        found = self._device(bus_id)
        if found is None:
            return UNKNOWN_FACTS
        dev = found[1]
        return CudaDeviceFacts(
            l2_cache_bytes=dev["l2"],
            shared_memory_per_mp_bytes=dev["max_shared_per_mp"],
            constant_memory_bytes=dev["total_const"],
            multiprocessor_count=dev["mp_count"],
        )

    def can_access_peer(self, bus_id: str, peer_bus_id: str) -> bool | None:
        a, b = self._device(bus_id), self._device(peer_bus_id)
        if a is None or b is None:
            return None
        for peer in self.capture.get("cuda_peers", []):
            if (peer["i"], peer["j"]) == (a[0], b[0]):
                return bool(peer["can_access_peer"])
        return None
