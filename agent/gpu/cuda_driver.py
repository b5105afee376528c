"""The few facts only the CUDA driver API knows, read from ``libcuda.so.1`` through ctypes.

NVML has no call for the L2 cache size, the shared memory per multiprocessor, the constant
memory or the multiprocessor count, and no "can this GPU access that one's memory" as CUDA
sees it; and the GPU worker keeps libcuda away from NVML (``agent.gpu.hidden_libcuda``), so
the CUDA version NVML would ask libcuda for is read here too (``cuDriverGetVersion``, which
needs no ``cuInit``). This module reads them once at start. Devices are matched by PCI bus
id, never by index: CUDA orders devices fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
NVML orders them by PCI bus id.

No CUDA context is created (``cuDeviceGetAttribute`` and ``cuDeviceCanAccessPeer`` need
none), so reading these facts costs no GPU memory. Any failure (no libcuda, ``cuInit``
error, a device CUDA cannot see) gives ``None`` for the values concerned and one log line;
nothing here raises.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

LIBRARY = "libcuda.so.1"

CUDA_SUCCESS = 0

# CUdevice_attribute values (cuda.h; stable since CUDA 4-6).
ATTRIBUTE_TOTAL_CONSTANT_MEMORY = 9  # bytes
ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
ATTRIBUTE_L2_CACHE_SIZE = 38  # bytes
ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81  # bytes


@dataclass(frozen=True, slots=True)
class CudaDeviceFacts:
    """What CUDA says about one device; ``None`` where CUDA did not answer."""

    l2_cache_bytes: int | None
    shared_memory_per_mp_bytes: int | None
    constant_memory_bytes: int | None
    multiprocessor_count: int | None


UNKNOWN_FACTS = CudaDeviceFacts(None, None, None, None)


class CudaFacts(Protocol):
    """What the NVML backend asks of CUDA (``cuda_probe.ProbedCuda``, or a fake in tests):
    ``driver_version`` is ``cuDriverGetVersion``'s answer (``None``: unknown)."""

    @property
    def driver_version(self) -> int | None: ...

    def device_facts(self, bus_id: str) -> CudaDeviceFacts: ...

    def can_access_peer(self, bus_id: str, peer_bus_id: str) -> bool | None: ...


def cuda_bus_id(nvml_bus_id: str) -> str:
    """NVML's ``00000000:00:06.0`` as CUDA writes it, ``0000:00:06.0`` (4-digit domain)."""
    domain, sep, rest = nvml_bus_id.partition(":")
    if not sep:
        return nvml_bus_id
    try:
        return f"{int(domain, 16):04x}:{rest}".lower()
    except ValueError:
        return nvml_bus_id.lower()


class LibCuda:
    """The CUDA driver library: ``load()`` opens it, ``init()`` runs ``cuInit`` (the device
    facts need it, the driver version does not); ``open()`` does both."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._devices: dict[str, int | None] = {}
        self._failed: set[int] = set()

    @classmethod
    def load(cls, loader: Callable[[str], Any] = ctypes.CDLL) -> LibCuda | None:
        """Load ``libcuda.so.1``; ``None`` (one log line) when it cannot be loaded."""
        try:
            return cls(loader(LIBRARY))
        except OSError as err:
            log.warning(
                "CUDA driver library not usable (%s): L2 cache, shared and constant memory "
                "are reported as null",
                err,
            )
            return None

    def init(self) -> bool:
        """Run ``cuInit(0)``; ``False`` (one log line) when it fails."""
        rc = self._rc("cuInit", 0)
        if rc != CUDA_SUCCESS:
            log.warning(
                "cuInit failed (%s): L2 cache, shared and constant memory are reported as null",
                self._error_text(rc),
            )
            return False
        return True

    @classmethod
    def open(cls, loader: Callable[[str], Any] = ctypes.CDLL) -> LibCuda | None:
        """Load ``libcuda.so.1`` and run ``cuInit(0)``; ``None`` (one log line) on failure."""
        cuda = cls.load(loader)
        return cuda if cuda is not None and cuda.init() else None

    def read_driver_version(self) -> int | None:
        """``cuDriverGetVersion``: the newest CUDA the driver supports (``13000`` for 13.0);
        ``None`` when it does not answer. Needs no ``cuInit``."""
        version = ctypes.c_int()
        if self._rc("cuDriverGetVersion", ctypes.byref(version)) != CUDA_SUCCESS:
            return None
        return version.value if version.value > 0 else None

    def _rc(self, name: str, *args: Any) -> int:
        fn = getattr(self._lib, name, None)
        if fn is None:
            return -1
        try:
            return int(fn(*args))
        except (ctypes.ArgumentError, OSError, TypeError, ValueError):
            return -1

    def _error_text(self, rc: int) -> str:
        if rc == -1:
            return "function missing or not callable"
        text = ctypes.c_char_p()
        if self._rc("cuGetErrorString", rc, ctypes.byref(text)) == CUDA_SUCCESS and text.value:
            return f"{text.value.decode(errors='replace')} ({rc})"
        return f"CUDA error {rc}"

    def _device(self, bus_id: str) -> int | None:
        key = cuda_bus_id(bus_id)
        if key not in self._devices:
            device = ctypes.c_int()
            rc = self._rc("cuDeviceGetByPCIBusId", ctypes.byref(device), key.encode())
            if rc == CUDA_SUCCESS:
                self._devices[key] = device.value
            else:
                self._devices[key] = None
                log.warning(
                    "CUDA does not see the GPU at %s (%s): its CUDA facts are reported as null",
                    key,
                    self._error_text(rc),
                )
        return self._devices[key]

    def _attribute(self, device: int, attribute: int) -> int | None:
        value = ctypes.c_int()
        rc = self._rc("cuDeviceGetAttribute", ctypes.byref(value), attribute, device)
        if rc != CUDA_SUCCESS:
            if attribute not in self._failed:
                self._failed.add(attribute)
                log.warning(
                    "cuDeviceGetAttribute(%d) failed (%s): reported as null",
                    attribute,
                    self._error_text(rc),
                )
            return None
        return value.value

    def device_facts(self, bus_id: str) -> CudaDeviceFacts:
        device = self._device(bus_id)
        if device is None:
            return UNKNOWN_FACTS
        return CudaDeviceFacts(
            l2_cache_bytes=self._attribute(device, ATTRIBUTE_L2_CACHE_SIZE),
            shared_memory_per_mp_bytes=self._attribute(
                device, ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
            ),
            constant_memory_bytes=self._attribute(device, ATTRIBUTE_TOTAL_CONSTANT_MEMORY),
            multiprocessor_count=self._attribute(device, ATTRIBUTE_MULTIPROCESSOR_COUNT),
        )

    def can_access_peer(self, bus_id: str, peer_bus_id: str) -> bool | None:
        """Whether CUDA can map the peer's memory from this device; ``None`` if unknown."""
        device, peer = self._device(bus_id), self._device(peer_bus_id)
        if device is None or peer is None:
            return None
        can = ctypes.c_int()
        rc = self._rc("cuDeviceCanAccessPeer", ctypes.byref(can), device, peer)
        if rc != CUDA_SUCCESS:
            log.debug("cuDeviceCanAccessPeer(%d, %d) failed: %s", device, peer, rc)
            return None
        return bool(can.value)
