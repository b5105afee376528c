"""libcuda through ctypes, faked at the ctypes boundary (values written through pointers)."""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import pytest

from agent.gpu.cuda_driver import (
    ATTRIBUTE_L2_CACHE_SIZE,
    ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
    ATTRIBUTE_MULTIPROCESSOR_COUNT,
    ATTRIBUTE_TOTAL_CONSTANT_MEMORY,
    UNKNOWN_FACTS,
    CudaDeviceFacts,
    LibCuda,
    cuda_bus_id,
)
from tests.support.prerequisites import unavailable
from tests.unit.gpu.fake_nvml import load_capture

CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101


def _store(pointer: Any, value: Any) -> None:
    """Write through a ``ctypes.byref`` argument, as the C function would."""
    pointer._obj.value = value


class FakeLibCuda:
    """libcuda.so.1 with the capture's devices, in the reverse of NVML's order."""

    def __init__(self, init_rc: int = 0) -> None:
        self.devices = list(reversed(load_capture("h200x2")["cuda_devices"]))
        self.init_rc = init_rc
        self.bus_ids_asked: list[bytes] = []
        self.contexts_created = 0
        self.initialised = False

    def cuInit(self, flags: int) -> int:
        self.initialised = True
        return self.init_rc

    def cuDriverGetVersion(self, version: Any) -> int:
        _store(version, 13000)
        return 0

    def cuGetErrorString(self, rc: int, text: Any) -> int:
        _store(text, f"error {rc}".encode())
        return 0

    def cuDeviceGetByPCIBusId(self, device: Any, bus_id: bytes) -> int:
        self.bus_ids_asked.append(bus_id)
        for index, dev in enumerate(self.devices):
            if dev["busid"].lower() == bus_id.decode():
                _store(device, index)
                return 0
        return CUDA_ERROR_INVALID_DEVICE

    def cuDeviceGetAttribute(self, value: Any, attribute: int, device: int) -> int:
        dev = self.devices[device]
        key = {
            ATTRIBUTE_L2_CACHE_SIZE: "l2",
            ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: "max_shared_per_mp",
            ATTRIBUTE_TOTAL_CONSTANT_MEMORY: "total_const",
            ATTRIBUTE_MULTIPROCESSOR_COUNT: "mp_count",
        }[attribute]
        _store(value, dev[key])
        return 0

    def cuDeviceCanAccessPeer(self, can: Any, device: int, peer: int) -> int:
        _store(can, 1 if device != peer else 0)
        return 0


def test_bus_id_in_cuda_form() -> None:
    assert cuda_bus_id("00000000:00:06.0") == "0000:00:06.0"
    assert cuda_bus_id("00000001:1A:00.0") == "0001:1a:00.0"


def test_facts_matched_by_bus_id_not_index() -> None:
    lib = FakeLibCuda()
    cuda = LibCuda.open(loader=lambda _name: lib)
    assert cuda is not None
    facts = cuda.device_facts("00000000:00:06.0")
    assert facts == CudaDeviceFacts(
        l2_cache_bytes=62914560,
        shared_memory_per_mp_bytes=233472,
        constant_memory_bytes=65536,
        multiprocessor_count=132,
    )
    assert lib.bus_ids_asked == [b"0000:00:06.0"]
    assert lib.devices[1]["busid"] == "0000:00:06.0"  # CUDA index 1 is NVML's GPU 0


def test_peer_access() -> None:
    cuda = LibCuda.open(loader=lambda _name: FakeLibCuda())
    assert cuda is not None
    assert cuda.can_access_peer("00000000:00:06.0", "00000000:00:07.0") is True
    assert cuda.can_access_peer("00000000:00:06.0", "00000000:00:99.0") is None


def test_unknown_device_is_unknown_facts_and_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    cuda = LibCuda.open(loader=lambda _name: FakeLibCuda())
    assert cuda is not None
    for _ in range(3):
        assert cuda.device_facts("00000000:00:99.0") == UNKNOWN_FACTS
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "0000:00:99.0" in warnings[0].getMessage()


def test_missing_library_is_none(caplog: pytest.LogCaptureFixture) -> None:
    def loader(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    assert LibCuda.open(loader=loader) is None
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "libcuda.so.1" in record.getMessage()


def test_cuinit_failure_is_none(caplog: pytest.LogCaptureFixture) -> None:
    assert LibCuda.open(loader=lambda _name: FakeLibCuda(CUDA_ERROR_NO_DEVICE)) is None
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "cuInit failed" in record.getMessage()
    assert "error 100" in record.getMessage()


def test_the_driver_version_needs_no_cuinit() -> None:
    """What the GPU worker's NVML cannot say without libcuda: read even where cuInit fails."""
    lib = FakeLibCuda(CUDA_ERROR_NO_DEVICE)
    cuda = LibCuda.load(loader=lambda _name: lib)
    assert cuda is not None
    assert cuda.read_driver_version() == 13000
    assert not lib.initialised
    assert cuda.init() is False


def test_a_driver_without_the_version_call_says_none() -> None:
    lib = FakeLibCuda()
    lib.cuDriverGetVersion = lambda version: CUDA_ERROR_NOT_INITIALIZED  # type: ignore[method-assign]
    cuda = LibCuda.load(loader=lambda _name: lib)
    assert cuda is not None
    assert cuda.read_driver_version() is None


def test_attribute_failure_is_none() -> None:
    lib = FakeLibCuda()

    def failing(value: Any, attribute: int, device: int) -> int:
        return CUDA_ERROR_NOT_INITIALIZED

    lib.cuDeviceGetAttribute = failing  # type: ignore[method-assign]
    cuda = LibCuda.open(loader=lambda _name: lib)
    assert cuda is not None
    assert cuda.device_facts("00000000:00:07.0") == UNKNOWN_FACTS


def test_real_library_absent_here_gives_none() -> None:
    """On a machine without a driver the real loader fails cleanly. Checked in a new process:
    other tests load a fake libcuda.so.1 into this one (tests/unit/plugin/test_volumes.py)."""
    probe = "import ctypes; ctypes.CDLL('libcuda.so.1')"
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, timeout=60, check=False
    )
    if found.returncode == 0:
        unavailable("libcuda.so.1 is installed here: this test needs a machine without a driver")
    opened = "from agent.gpu.cuda_driver import LibCuda; print(LibCuda.open() is None)"
    done = subprocess.run(
        [sys.executable, "-c", opened], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout == "True\n", done.stderr
