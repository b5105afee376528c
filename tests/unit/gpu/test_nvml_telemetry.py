"""The telemetry /metrics exports (dcgm-exporter's fields), read by NvmlBackend from NVML."""

from __future__ import annotations

import logging

import pytest

from agent.gpu.model import LOST_DEVICE_STATUS, UNKNOWN_TELEMETRY, FrameBuffer, RemappedRows
from agent.gpu.nvml_telemetry import (
    FI_MEMORY_TEMP,
    FI_PCIE_REPLAY_COUNTER,
    FI_REMAPPED_FAILURE,
    FI_REMAPPED_PENDING,
    FI_REMAPPED_UNC,
    FI_TOTAL_ENERGY_CONSUMPTION,
    SLOW_FIELD_IDS,
)
from tests.unit.gpu.conftest import MakeFake, StartBackend
from tests.unit.gpu.fake_nvml import GPU_IS_LOST, NOT_SUPPORTED


def test_h200_telemetry_as_nvidia_smi_showed_it(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    telemetry = start_backend(make_fake("h200")).device_status(0).telemetry
    assert telemetry.power_mw == 77630  # the draw power_w (77) rounds down
    assert telemetry.memory_temperature_c == 38  # "Memory Current Temp : 38 C"
    assert telemetry.pcie_replay_count == 1  # "Replays Since Reset : 1"
    assert telemetry.total_energy_mj is None  # not in that capture
    # nvidia-smi: Reserved 616 MiB, Used 0 MiB, Free 143156 MiB (it rounds, we floor)
    assert telemetry.framebuffer == FrameBuffer(used_mib=0, free_mib=143155, reserved_mib=615)
    assert telemetry.remapped_rows == RemappedRows(0, 0, pending=False, failed=False)


def test_energy_counter_is_a_64_bit_field_value(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    fake.field_values[0][FI_TOTAL_ENERGY_CONSUMPTION] = 2**40 + 7  # past 32 bits: mJ
    assert start_backend(fake).device_status(0).telemetry.total_energy_mj == 2**40 + 7


def test_one_missing_field_costs_only_itself(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_fake("h200")
    del fake.field_values[0][FI_MEMORY_TEMP]  # a GDDR board: no memory sensor
    telemetry = start_backend(fake).device_status(0).telemetry
    assert telemetry.memory_temperature_c is None
    assert telemetry.pcie_replay_count == 1
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_remapping_pending_and_failed_are_flags(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    fake.field_values[0].update(
        {FI_REMAPPED_UNC: 3, FI_REMAPPED_PENDING: 1, FI_REMAPPED_FAILURE: 1}
    )
    rows = start_backend(fake).device_status(0).telemetry.remapped_rows
    assert rows == RemappedRows(correctable=0, uncorrectable=3, pending=True, failed=True)


def test_double_typed_field_is_read_from_its_member(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    fake.field_value_types[FI_MEMORY_TEMP] = 0  # NVML_VALUE_TYPE_DOUBLE
    fake.field_values[0][FI_MEMORY_TEMP] = 41.0  # type: ignore[assignment]
    assert start_backend(fake).device_status(0).telemetry.memory_temperature_c == 41


def test_driver_without_field_values_keeps_the_rest(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    fake.fail("nvmlDeviceGetFieldValues", NOT_SUPPORTED)
    status = start_backend(fake).device_status(0)
    assert status.telemetry.memory_temperature_c is None
    assert status.telemetry.pcie_replay_count is None
    assert status.telemetry.remapped_rows == RemappedRows()
    assert status.telemetry.power_mw == 77630
    assert status.telemetry.framebuffer.reserved_mib == 615
    assert status.temperature_c == 36


def test_driver_without_memory_v2_reports_v1_used_and_no_reserve(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    fake.remove_from_driver("nvmlDeviceGetMemoryInfo_v2")
    framebuffer = start_backend(fake).device_status(0).telemetry.framebuffer
    assert framebuffer == FrameBuffer(used_mib=615, free_mib=143155, reserved_mib=None)


def test_lost_gpu_has_no_telemetry(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200")
    backend = start_backend(fake)
    fake.lose(0)
    status = backend.device_status(0)
    assert status == LOST_DEVICE_STATUS
    assert status.telemetry == UNKNOWN_TELEMETRY


def test_replay_counter_from_the_field_not_a_separate_call(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    """All seven fields come from one call, whatever the GPU answers for each."""
    fake = make_fake("h200")
    backend = start_backend(fake)
    fake.calls.clear()
    fake.field_values[0][FI_PCIE_REPLAY_COUNTER] = 12
    assert backend.device_status(0).telemetry.pcie_replay_count == 12
    assert fake.calls.count("nvmlDeviceGetFieldValues") == 1
    assert "nvmlDeviceGetPcieReplayCounter" not in fake.calls


def test_gpu_lost_during_the_field_read_is_null(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    fake.fail("nvmlDeviceGetFieldValues", GPU_IS_LOST)
    telemetry = start_backend(fake).device_status(0).telemetry
    assert telemetry.memory_temperature_c is None
    assert telemetry.total_energy_mj is None


def test_the_slow_counters_come_from_the_sampler_not_the_status_read(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    """The energy and PCIe replay counters cost 3.3 ms a GPU on an H200 (81 us for the rest
    of a status read): status serves what the background sampler read last."""
    fake = make_fake("h200")
    fake.field_values[0][FI_TOTAL_ENERGY_CONSUMPTION] = 1000
    backend = start_backend(fake)
    backend.pcie_throughput(0)  # the sampler's call
    fake.field_values[0][FI_TOTAL_ENERGY_CONSUMPTION] = 2000
    fake.field_requests.clear()
    telemetry = backend.device_status(0).telemetry
    assert not any(set(ids) & set(SLOW_FIELD_IDS) for ids in fake.field_requests)
    assert (telemetry.total_energy_mj, telemetry.pcie_replay_count) == (1000, 1)  # sampled
    assert telemetry.memory_temperature_c == 38  # the fast fields: read now
    backend.pcie_throughput(0)
    assert backend.device_status(0).telemetry.total_energy_mj == 2000
