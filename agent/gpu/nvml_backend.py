"""The real GPU backend: NVML (through ``nvml_query``) plus a few facts from the CUDA driver.

``NvmlBackend.start()`` initialises NVML, reads every static fact once (``/gpu/info``; the
CUDA facts from a child process in the environment nvidia-docker 1.0 set for them:
``cuda_probe``) and keeps one NVML handle per GPU. Live calls
(``device_status``, ``pcie_throughput``) touch only that GPU's handle and may run in
threads concurrently for different GPUs (NVML is thread-safe). A value NVML cannot give is
``None``; a GPU that stops answering ("GPU is lost") reports ``LOST_DEVICE_STATUS`` and
never takes the node down. Which NVML call gives which field: ``docs/gpu-backends.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agent.gpu import architecture, cuda_probe, nvml_health, nvml_mig
from agent.gpu import nvml_query as nvml
from agent.gpu.backend import GpuBackendError
from agent.gpu.cuda_driver import (
    UNKNOWN_FACTS,
    CudaDeviceFacts,
    CudaFacts,
    cuda_bus_id,
)
from agent.gpu.health import DeviceCheck
from agent.gpu.model import (
    LOST_DEVICE_STATUS,
    UNKNOWN_THROUGHPUT,
    Clocks,
    DeviceInfo,
    DeviceMemory,
    DeviceStatus,
    EccErrors,
    GpuProcess,
    NodeInfo,
    PcieThroughput,
    PciInfo,
    PeerLink,
    Utilization,
)
from agent.gpu.nvml_gpm import GpmSampler
from agent.gpu.nvml_telemetry import SLOW_FIELD_IDS, field_values, mig_handles, read_telemetry
from agent.gpu.nvml_topology import node_topology, normalize_bus_id

log = logging.getLogger(__name__)

MIB = 1024 * 1024

# NVML enum values used below (nvml.h; stable across versions).
CLOCK_SM = 1  # nvmlClockType_t NVML_CLOCK_SM
CLOCK_MEM = 2  # NVML_CLOCK_MEM
TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t NVML_TEMPERATURE_GPU
FEATURE_ENABLED = 1  # nvmlEnableState_t
MEMORY_ERROR_UNCORRECTED = 1  # nvmlMemoryErrorType_t
VOLATILE_ECC = 0  # nvmlEccCounterType_t
MEMORY_LOCATION_L1_CACHE = 0  # nvmlMemoryLocation_t
MEMORY_LOCATION_L2_CACHE = 1
MEMORY_LOCATION_DEVICE_MEMORY = 2
PCIE_UTIL_TX_BYTES = 0  # nvmlPcieUtilCounter_t
PCIE_UTIL_RX_BYTES = 1
AFFINITY_SCOPE_NODE = 0  # nvmlAffinityScope_t

_SIMULATE_HINT = (
    "or try the agent on a simulated node: --simulate h200 (built in: h200, h200x2, "
    "hgx-h200-8, h200x2-mig) or --simulate FILE"
)


_COMPUTE_PROCESSES = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)
_CUDA_VERSION = ("nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetCudaDriverVersion")


def _cuda_version(driver: str, cuda: CudaFacts | None) -> int:
    """The newest CUDA version the driver supports: NVML's answer where it has libcuda (the
    wrapper, ``--dump-node``), else the CUDA child's (the GPU worker, whose NVML runs
    without libcuda: ``agent.gpu.hidden_libcuda``); both ask the same ``libcuda.so.1``."""
    version = nvml.attempt_first(_CUDA_VERSION).value
    if isinstance(version, int) and version > 0:
        return version
    if cuda is not None and cuda.driver_version is not None:
        return cuda.driver_version
    raise GpuBackendError(
        f"NVIDIA driver {driver} does not say which CUDA version it supports (neither NVML "
        "nor libcuda.so.1 answered: is libcuda.so.1 installed and in the linker cache?): "
        "update the driver, " + _SIMULATE_HINT
    )


def format_cuda_version(version: int) -> str:
    """NVML's integer CUDA version as ``major.minor``: 13000 -> ``13.0``, 12080 -> ``12.8``."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _mib(value_bytes: Any) -> int | None:
    return value_bytes // MIB if isinstance(value_bytes, int) else None


def _watts(value_mw: Any) -> int | None:
    return value_mw // 1000 if isinstance(value_mw, int) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _field(obj: Any, name: str) -> Any:
    return None if obj is None else getattr(obj, name, None)


def _text(value: Any) -> str | None:
    value = nvml.decode(value)
    return value if isinstance(value, str) and value else None


class NvmlBackend:
    """GPU facts from NVML. Build it with ``start()``; release it with ``close()``."""

    def __init__(
        self,
        info: NodeInfo,
        handles: tuple[Any | None, ...],
        nvml_version: str,
        proc: str | os.PathLike[str] = "/proc",
    ) -> None:
        self._info = info
        self._proc = proc
        self._handles = handles
        self._nvml_version = nvml_version
        self._lost_logged: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        # BAR1 usage costs 160-360 us per read, most of a status read; it changes only when
        # mappings change, so the background sampler reads it with the PCIe counters
        # (pcie_throughput) and status serves that sample once there is one.
        self._bar1_sampled = [False] * len(handles)
        self._bar1_used_mib: list[int | None] = [None] * len(handles)
        # The same for the slow field values (the energy and PCIe replay counters, 3.3 ms a
        # GPU on an H200: nvml_telemetry.SLOW_FIELD_IDS); None until the first sample.
        self._slow_fields: list[dict[int, int] | None] = [None] * len(handles)
        # Profiling (GPM) samples, taken with the PCIe counters; MIG devices' own handles.
        self._gpm = GpmSampler(handles, info.devices)
        self._mig_handles = mig_handles(handles, info.devices)

    @classmethod
    def start(
        cls,
        *,
        cuda: Callable[[Sequence[str]], CudaFacts | None] | None = None,
        sysfs: str | os.PathLike[str] = "/sys",
        proc: str | os.PathLike[str] = "/proc",
    ) -> NvmlBackend:
        """Initialise NVML and read the node's static facts; ``GpuBackendError`` if impossible.

        ``cuda`` reads the CUDA driver's facts for the given bus ids (default
        ``cuda_probe.probe``, in a child process; when it gives ``None``, the CUDA facts are
        null); ``sysfs`` and ``proc`` are where the kernel's files are (tests
        point them elsewhere).
        """
        _init_nvml()
        try:
            return cls._read_node(cuda or cuda_probe.probe, sysfs, proc)
        except BaseException:
            with contextlib.suppress(nvml.NvmlCallError):
                nvml.call("nvmlShutdown")
            raise

    @classmethod
    def _read_node(
        cls,
        open_cuda: Callable[[Sequence[str]], CudaFacts | None],
        sysfs: str | os.PathLike[str],
        proc: str | os.PathLike[str],
    ) -> NvmlBackend:
        try:
            driver = str(nvml.call("nvmlSystemGetDriverVersion"))
            count = int(nvml.call("nvmlDeviceGetCount"))
        except nvml.NvmlCallError as err:
            raise GpuBackendError(
                f"NVML started but cannot list the GPUs ({err}): "
                "check the driver with nvidia-smi, " + _SIMULATE_HINT
            ) from None
        nvml_version = _text(nvml.query("nvmlSystemGetNVMLVersion")) or "unknown"
        handles: list[Any | None] = []
        for index in range(count):
            outcome = nvml.attempt("nvmlDeviceGetHandleByIndex", index)
            if outcome.value is None:
                log.warning(
                    "GPU %d: NVML cannot open it (%s): it is listed with null facts",
                    index,
                    nvml.error_name(outcome.error or nvml.ERROR_UNKNOWN),
                )
            handles.append(outcome.value)
        bus_ids = [_bus_id(handle) for handle in handles]
        cuda = open_cuda([bus for bus in bus_ids if bus])
        cuda_version = _cuda_version(driver, cuda)
        topology = node_topology(handles, bus_ids, cuda)
        mig_minors = nvml_mig.read_mig_minors(proc)
        devices = tuple(
            _device_info(
                index, handles[index], bus_ids[index], topology[index], cuda, sysfs, mig_minors
            )
            for index in range(count)
        )
        info = NodeInfo(
            driver_version=driver,
            cuda_version=format_cuda_version(cuda_version),
            devices=devices,
        )
        return cls(info, tuple(handles), nvml_version, proc)

    @property
    def name(self) -> str:
        return f"NVML {self._nvml_version}"

    def node_info(self) -> NodeInfo:
        return self._info

    def _handle(self, index: int) -> Any | None:
        handle = self._handles[index]
        if handle is None:
            self._log_lost(index, "NVML cannot open it")
        return handle

    def _log_lost(self, index: int, why: str) -> None:
        with self._lock:
            if index in self._lost_logged:
                return
            self._lost_logged.add(index)
        log.warning("GPU %d: %s: its status is reported as null", index, why)

    def device_status(self, index: int) -> DeviceStatus:
        handle = self._handle(index)
        if handle is None:
            return LOST_DEVICE_STATUS
        power = nvml.attempt("nvmlDeviceGetPowerUsage", handle)
        if power.lost:
            self._log_lost(index, "GPU is lost (fell off the bus? see dmesg for Xid errors)")
            return LOST_DEVICE_STATUS
        util = nvml.query("nvmlDeviceGetUtilizationRates", handle)
        encoder = nvml.query("nvmlDeviceGetEncoderUtilization", handle)
        decoder = nvml.query("nvmlDeviceGetDecoderUtilization", handle)
        memory = nvml.query("nvmlDeviceGetMemoryInfo", handle)
        if self._bar1_sampled[index]:
            bar1_used_mib = self._bar1_used_mib[index]
        else:
            bar1_used_mib = self._read_bar1_used(handle)
        return DeviceStatus(
            power_w=_watts(power.value),
            temperature_c=_int(nvml.query("nvmlDeviceGetTemperature", handle, TEMPERATURE_GPU)),
            utilization=Utilization(
                gpu_pct=_int(_field(util, "gpu")),
                memory_pct=_int(_field(util, "memory")),
                encoder_pct=_int(encoder[0]) if isinstance(encoder, list | tuple) else None,
                decoder_pct=_int(decoder[0]) if isinstance(decoder, list | tuple) else None,
            ),
            memory_used_mib=_mib(_field(memory, "used")),
            ecc_errors=EccErrors(
                l1_cache=_ecc(handle, MEMORY_LOCATION_L1_CACHE),
                l2_cache=_ecc(handle, MEMORY_LOCATION_L2_CACHE),
                global_=_ecc(handle, MEMORY_LOCATION_DEVICE_MEMORY),
            ),
            clocks=Clocks(
                cores_mhz=_int(nvml.query("nvmlDeviceGetClockInfo", handle, CLOCK_SM)),
                memory_mhz=_int(nvml.query("nvmlDeviceGetClockInfo", handle, CLOCK_MEM)),
            ),
            bar1_used_mib=bar1_used_mib,
            processes=self._processes(handle),
            telemetry=read_telemetry(
                handle,
                _int(power.value),
                memory,
                self._slow_fields[index],
                profiling=self._gpm.profiling(index),
                migs=self._mig_handles[index],
                mig_profiling=self._gpm.mig_profiling(index),
            ),
        )

    def _processes(self, handle: Any) -> tuple[GpuProcess, ...]:
        found = nvml.attempt_first(_COMPUTE_PROCESSES, handle).value
        if not isinstance(found, list | tuple):
            return ()
        processes = []
        for proc in found:
            pid = _int(_field(proc, "pid"))
            if pid is None:
                continue
            processes.append(
                GpuProcess(
                    pid=pid,
                    name=self._process_name(pid),
                    memory_used_mib=_mib(_field(proc, "usedGpuMemory")),
                )
            )
        return tuple(processes)

    def _process_name(self, pid: int) -> str | None:
        try:
            path = os.path.join(self._proc, str(pid), "comm")
            with open(path, encoding="utf-8", errors="replace") as file:
                name = file.read()
        except OSError:  # another pid namespace, or the process just ended
            return _text(nvml.query("nvmlSystemGetProcessName", pid))
        return name.strip() or None

    def pcie_throughput(self, index: int) -> PcieThroughput:
        handle = self._handle(index)
        if handle is None:
            return UNKNOWN_THROUGHPUT
        rx = nvml.attempt("nvmlDeviceGetPcieThroughput", handle, PCIE_UTIL_RX_BYTES)
        if rx.lost:
            self._log_lost(index, "GPU is lost (fell off the bus? see dmesg for Xid errors)")
            return UNKNOWN_THROUGHPUT
        tx = nvml.query("nvmlDeviceGetPcieThroughput", handle, PCIE_UTIL_TX_BYTES)
        self._bar1_used_mib[index] = self._read_bar1_used(handle)
        self._bar1_sampled[index] = True
        self._slow_fields[index] = field_values(handle, SLOW_FIELD_IDS)
        self._gpm.sample(index)
        return PcieThroughput(rx_mbps=_kbps_to_mbps(rx.value), tx_mbps=_kbps_to_mbps(tx))

    @staticmethod
    def _read_bar1_used(handle: Any) -> int | None:
        return _mib(_field(nvml.query("nvmlDeviceGetBAR1MemoryInfo", handle), "bar1Used"))

    @staticmethod
    def take_driver_error() -> int | None:
        """The last driver-wide NVML error code since the previous call (``nvml_query``)."""
        return nvml.take_driver_error()

    def health_check(self, index: int) -> DeviceCheck:
        """One health sweep of GPU ``index`` (``agent.gpu.nvml_health``)."""
        return nvml_health.check_device(self._handles[index])

    def event_watch(self) -> nvml_health.NvmlEventWatch | None:
        """NVML's critical XID and double-bit ECC events of every GPU that delivers them."""
        return nvml_health.NvmlEventWatch.register(self._handles)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._gpm.close()
        try:
            nvml.call("nvmlShutdown")
        except nvml.NvmlCallError as err:
            log.warning("NVML shutdown failed: %s", err)


def _init_nvml() -> None:
    try:
        nvml.call("nvmlInit")
    except nvml.NvmlCallError as err:
        raise GpuBackendError(_init_error(err), nvml_code=err.code) from None


def _init_error(err: nvml.NvmlCallError) -> str:
    if err.code == nvml.ERROR_LIBRARY_NOT_FOUND:
        try:
            ctypes.CDLL("libnvidia-ml.so.1")
            why = "libnvidia-ml.so.1 cannot be loaded"
        except OSError as load_error:
            why = str(load_error)
        return f"NVIDIA driver not found ({why}): install the driver, {_SIMULATE_HINT}"
    if err.code == nvml.ERROR_DRIVER_NOT_LOADED:
        return (
            "NVIDIA driver not loaded (nvmlInit: driver not loaded): load the kernel module "
            f"(modprobe nvidia, or reboot after installing the driver), {_SIMULATE_HINT}"
        )
    if err.code == nvml.ERROR_LIB_RM_VERSION_MISMATCH:
        return (
            "NVIDIA driver library and kernel module versions differ (driver updated without "
            f"a reboot?): reboot or reload the nvidia module, {_SIMULATE_HINT}"
        )
    if err.code == nvml.ERROR_NO_PERMISSION:
        return (
            f"NVML refused access (nvmlInit: insufficient permissions): run as a user "
            f"allowed to open /dev/nvidia*, {_SIMULATE_HINT}"
        )
    return f"NVML failed to start ({err}): check the driver with nvidia-smi, {_SIMULATE_HINT}"


def _kbps_to_mbps(value: Any) -> int | None:
    return value // 1000 if isinstance(value, int) else None


def _ecc(handle: Any, location: int) -> int | None:
    return _int(
        nvml.query(
            "nvmlDeviceGetMemoryErrorCounter",
            handle,
            MEMORY_ERROR_UNCORRECTED,
            VOLATILE_ECC,
            location,
        )
    )


def _bus_id(handle: Any | None) -> str:
    """NVML's bus id of a GPU; ``""`` for a GPU NVML cannot open or read (lost)."""
    if handle is None:
        return ""
    bus_id = _text(_field(nvml.query("nvmlDeviceGetPciInfo", handle), "busId"))
    return normalize_bus_id(bus_id) if bus_id else ""


def _numa_node(handle: Any, bus_id: str, sysfs: str | os.PathLike[str]) -> int | None:
    """NUMA node of the CPUs closest to the GPU (the old tool's ``CPUAffinity``); -1 -> 0.

    The kernel's ``numa_node`` of the PCI device first (what ``nvidia-smi topo -m`` shows
    as "NUMA Affinity"); else the lowest node of NVML's node-scope CPU affinity mask (None
    when the mask is empty or NVML cannot give it). Not
    ``nvmlDeviceGetNumaNodeId``: that is the NUMA node of the GPU's *own memory* on
    coherent systems (Grace Hopper), "GPU NUMA ID" in ``topo -m``, not the CPU side.
    """
    if bus_id:
        try:
            path = os.path.join(sysfs, "bus", "pci", "devices", cuda_bus_id(bus_id), "numa_node")
            with open(path) as file:
                text = file.read()
            return max(int(text.strip()), 0)
        except (OSError, ValueError):
            pass
    mask = nvml.query("nvmlDeviceGetCpuAffinityWithinScope", handle, 4, AFFINITY_SCOPE_NODE)
    if mask is None:
        return None
    bits = 64 if ctypes.sizeof(ctypes.c_ulong) == 8 else 32
    for word_index, word in enumerate(mask):
        value = int(word)
        if value:
            return word_index * bits + (value & -value).bit_length() - 1
    return None  # no node in the mask: NVML does not know, which is not node 0


def _device_info(
    index: int,
    handle: Any | None,
    bus_id: str,
    topology: tuple[PeerLink, ...],
    cuda: CudaFacts | None,
    sysfs: str | os.PathLike[str],
    mig_minors: Mapping[str, int] | None = None,
) -> DeviceInfo:
    if handle is None:
        return DeviceInfo(
            index=index,
            uuid=None,
            path=None,
            model=None,
            power_w=None,
            cpu_affinity=None,
            pci=PciInfo(bus_id=bus_id, bar1_mib=None, bandwidth_mbps=None),
            clocks=Clocks(None, None),
            topology=(),
            family=None,
            arch=None,
            cores=None,
            memory=DeviceMemory(None, None, None, None, None, None),
        )
    facts: CudaDeviceFacts = cuda.device_facts(bus_id) if cuda and bus_id else UNKNOWN_FACTS
    minor = _int(nvml.query("nvmlDeviceGetMinorNumber", handle))
    capability = nvml.query("nvmlDeviceGetCudaComputeCapability", handle)
    arch = None
    if isinstance(capability, list | tuple) and len(capability) == 2:
        major, minor_cc = int(capability[0]), int(capability[1])
        arch = architecture.architecture(major, minor_cc)
        arch_name: str | None = f"{major}.{minor_cc}"
    else:
        arch_name = None
    cores = _int(nvml.query("nvmlDeviceGetNumGpuCores", handle))
    if cores is None and arch is not None and facts.multiprocessor_count is not None:
        cores = facts.multiprocessor_count * arch.cores_per_sm
    max_memory_mhz = _int(nvml.query("nvmlDeviceGetMaxClockInfo", handle, CLOCK_MEM))
    ecc = nvml.query("nvmlDeviceGetEccMode", handle)
    memory = nvml.query("nvmlDeviceGetMemoryInfo", handle)
    bar1 = nvml.query("nvmlDeviceGetBAR1MemoryInfo", handle)
    mig_enabled, mig_devices = nvml_mig.mig_state(handle, index, minor, mig_minors or {})
    return DeviceInfo(
        index=index,
        uuid=_text(nvml.query("nvmlDeviceGetUUID", handle)),
        path=None if minor is None else f"/dev/nvidia{minor}",
        model=_text(nvml.query("nvmlDeviceGetName", handle)),
        power_w=_watts(nvml.query("nvmlDeviceGetPowerManagementLimit", handle)),
        cpu_affinity=_numa_node(handle, bus_id, sysfs),
        pci=PciInfo(
            bus_id=bus_id,
            bar1_mib=_mib(_field(bar1, "bar1Total")),
            bandwidth_mbps=architecture.pcie_bandwidth_mbps(
                _int(nvml.query("nvmlDeviceGetMaxPcieLinkGeneration", handle)),
                _int(nvml.query("nvmlDeviceGetMaxPcieLinkWidth", handle)),
            ),
        ),
        clocks=Clocks(
            cores_mhz=_int(nvml.query("nvmlDeviceGetMaxClockInfo", handle, CLOCK_SM)),
            memory_mhz=max_memory_mhz,
        ),
        topology=topology,
        family=arch.family if arch else None,
        arch=arch_name,
        cores=cores,
        memory=DeviceMemory(
            ecc=(ecc[0] == FEATURE_ENABLED) if isinstance(ecc, list | tuple) else None,
            global_mib=_mib(_field(memory, "total")),
            shared_kib=_kib(facts.shared_memory_per_mp_bytes),
            constant_kib=_kib(facts.constant_memory_bytes),
            l2_cache_kib=_kib(facts.l2_cache_bytes),
            bandwidth_mbps=architecture.memory_bandwidth_mbps(
                max_memory_mhz, _int(nvml.query("nvmlDeviceGetMemoryBusWidth", handle))
            ),
        ),
        mig_enabled=mig_enabled,
        mig_devices=mig_devices,
    )


def _kib(value_bytes: int | None) -> int | None:
    return None if value_bytes is None else value_bytes // 1024
