"""Profiling through GPM on the fake pynvml: supported, unsupported, failing, stale, MIG."""

from __future__ import annotations

import logging

import pytest

from agent.gpu import nvml_gpm
from agent.gpu.model import UNKNOWN_PROFILING, DeviceInfo, Profiling
from agent.gpu.nvml_gpm import GpmSampler
from tests.unit.gpu.conftest import MakeFake, StartBackend
from tests.unit.gpu.fake_nvml import GPU_IS_LOST, FakeMig, FakeNvml, Handle

BUSY = {
    nvml_gpm.GRAPHICS_UTIL: 97.5,
    nvml_gpm.SM_UTIL: 91.0,
    nvml_gpm.SM_OCCUPANCY: 40.25,
    nvml_gpm.ANY_TENSOR_UTIL: 63.0,
    nvml_gpm.DRAM_BW_UTIL: 52.5,
    nvml_gpm.PCIE_TX_PER_SEC: 1788.0,
    nvml_gpm.PCIE_RX_PER_SEC: 2203.0,
    nvml_gpm.NVLINK_TOTAL_TX_PER_SEC: 118000.0,
    nvml_gpm.NVLINK_TOTAL_RX_PER_SEC: 117000.0,
}
UNKNOWN_ERROR = 999


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sampler(fake: FakeNvml, devices: tuple[DeviceInfo, ...], clock: Clock) -> GpmSampler:
    return GpmSampler([Handle(i) for i in range(len(devices))], devices, clock=clock)


def test_two_samples_apart_give_the_values_of_the_interval(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")  # two H200s joined by NVLinks
    devices = start_backend(fake).node_info().devices
    fake.gpm_values[0] = dict(BUSY)
    clock = Clock()
    gpm = sampler(fake, devices, clock)
    assert gpm.gpus == (0, 1)
    gpm.sample(0)
    assert gpm.profiling(0) is UNKNOWN_PROFILING  # one sample measures nothing
    clock.now += 1.0
    gpm.sample(0)
    assert gpm.profiling(0) == Profiling(
        graphics_pct=97.5, sm_pct=91.0, sm_occupancy_pct=40.25, tensor_pct=63.0,
        dram_pct=52.5, pcie_tx_mib_s=1788.0, pcie_rx_mib_s=2203.0,
        nvlink_tx_mib_s=118000.0, nvlink_rx_mib_s=117000.0, interval_s=1.0,
    )  # fmt: skip
    assert gpm.profiling(1) is UNKNOWN_PROFILING  # never sampled
    gpm.close()
    assert fake.gpm_samples
    assert all(sample.freed for sample in fake.gpm_samples)


def test_nvlink_is_asked_only_of_a_gpu_with_links(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")  # one GPU, no NVLink peer
    devices = start_backend(fake).node_info().devices
    fake.gpm_values[0] = dict(BUSY)
    clock = Clock()
    gpm = sampler(fake, devices, clock)
    gpm.sample(0)
    clock.now += 1.0
    gpm.sample(0)
    values = gpm.profiling(0)
    assert values.graphics_pct == 97.5
    assert values.nvlink_tx_mib_s is None
    assert values.nvlink_rx_mib_s is None


def test_a_metric_the_gpu_does_not_give_is_absent_alone(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake = make_fake("h200")
    devices = start_backend(fake).node_info().devices
    fake.gpm_values[0] = {nvml_gpm.GRAPHICS_UTIL: 0.0, nvml_gpm.SM_UTIL: 0.0}
    clock = Clock()
    gpm = sampler(fake, devices, clock)
    for _ in range(3):
        gpm.sample(0)
        clock.now += 1.0
    values = gpm.profiling(0)
    assert (values.graphics_pct, values.sm_pct) == (0.0, 0.0)  # idle: 0, not absent
    assert values.tensor_pct is None
    assert values.pcie_tx_mib_s is None
    assert caplog.text.count("GPM gives no metric") == 1  # once, not at every sample


def test_a_gpu_without_gpm_has_no_values_and_says_so_once(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake = make_fake("h200x2")
    devices = start_backend(fake).node_info().devices
    fake.gpm_supported[1] = False
    fake.gpm_values[1] = dict(BUSY)
    clock = Clock()
    gpm = sampler(fake, devices, clock)
    assert gpm.gpus == (0,)
    for _ in range(2):
        gpm.sample(1)
        clock.now += 1.0
    assert gpm.profiling(1) is UNKNOWN_PROFILING
    assert "GPU(s) 1 (no): no GPM support" in caplog.text


def test_a_pynvml_without_gpm_gives_nothing(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake = make_fake("h200")
    devices = start_backend(fake).node_info().devices
    del fake.module.c_nvmlGpmMetricsGet_t  # nvidia-ml-py 11.510.69, the floor, has no GPM
    fake.gpm_values[0] = dict(BUSY)
    gpm = sampler(fake, devices, Clock())
    assert gpm.gpus == ()
    gpm.sample(0)
    assert gpm.profiling(0) is UNKNOWN_PROFILING
    assert "The installed nvidia-ml-py has no GPM" in caplog.text


def test_a_driver_without_gpm_functions_gives_nothing(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    devices = start_backend(fake).node_info().devices
    fake.remove_from_driver("nvmlGpmQueryDeviceSupport")
    assert sampler(fake, devices, Clock()).gpus == ()


def test_a_failed_sample_breaks_the_pair_and_values_come_back(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fake = make_fake("h200")
    devices = start_backend(fake).node_info().devices
    fake.gpm_values[0] = dict(BUSY)
    clock = Clock()
    gpm = sampler(fake, devices, clock)
    gpm.sample(0)
    clock.now += 1.0
    gpm.sample(0)
    assert gpm.profiling(0).graphics_pct == 97.5
    fake.fail("nvmlGpmSampleGet", UNKNOWN_ERROR, 0)
    clock.now += 1.0
    gpm.sample(0)
    assert gpm.profiling(0) is UNKNOWN_PROFILING  # never the last good values, never 0
    del fake.failures["nvmlGpmSampleGet", 0]
    clock.now += 1.0
    gpm.sample(0)
    assert gpm.profiling(0) is UNKNOWN_PROFILING  # a first sample again
    clock.now += 1.0
    gpm.sample(0)
    assert gpm.profiling(0).graphics_pct == 97.5
    assert caplog.text.count("no GPM sample (unknown error)") == 1


def test_a_failed_metrics_call_gives_nothing(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    devices = start_backend(fake).node_info().devices
    fake.gpm_values[0] = dict(BUSY)
    fake.fail("nvmlGpmMetricsGet", UNKNOWN_ERROR)
    clock = Clock()
    gpm = sampler(fake, devices, clock)
    gpm.sample(0)
    clock.now += 1.0
    gpm.sample(0)
    assert gpm.profiling(0) == UNKNOWN_PROFILING


def test_a_lost_gpu_gives_nothing_and_raises_nothing(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    devices = start_backend(fake).node_info().devices
    fake.gpm_values[0] = dict(BUSY)
    clock = Clock()
    gpm = sampler(fake, devices, clock)
    gpm.sample(0)
    fake.lose(0)
    clock.now += 1.0
    gpm.sample(0)
    assert gpm.profiling(0) is UNKNOWN_PROFILING
    assert fake.failures["*", 0] == GPU_IS_LOST


def test_samples_too_close_or_too_far_apart_give_no_values(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    devices = start_backend(fake).node_info().devices
    fake.gpm_values[0] = dict(BUSY)
    clock = Clock()
    gpm = sampler(fake, devices, clock)
    gpm.sample(0)
    clock.now += nvml_gpm.MIN_PAIR_S / 2
    gpm.sample(0)  # too soon: kept the first one, measured nothing
    assert gpm.profiling(0) is UNKNOWN_PROFILING
    clock.now += 1.0
    gpm.sample(0)
    assert gpm.profiling(0).interval_s == pytest.approx(1.0 + nvml_gpm.MIN_PAIR_S / 2)
    clock.now += nvml_gpm.MAX_AGE_S + 1  # nobody read status: the sampler rested
    assert gpm.profiling(0) is UNKNOWN_PROFILING  # too old to be served
    gpm.sample(0)  # the pair spans the rest: it says nothing of now
    assert gpm.profiling(0) is UNKNOWN_PROFILING
    clock.now += 1.0
    gpm.sample(0)
    assert gpm.profiling(0).interval_s == 1.0


def test_each_gpu_instance_of_a_mig_gpu_is_sampled_on_its_own(
    make_fake: MakeFake, start_backend: StartBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake("h200")
    fake.capture["devices"][0]["mig_mode"] = [1, 1]
    fake.enable_mig(
        0,
        [
            FakeMig(0, "MIG-aaaa", "3g.71gb", 71424, gpu_instance=1, compute_instance=0),
            FakeMig(1, "MIG-bbbb", "1g.18gb", 16384, gpu_instance=13, compute_instance=0),
        ],
    )
    fake.gpm_values[0, 1] = {nvml_gpm.GRAPHICS_UTIL: 61.5, nvml_gpm.SM_UTIL: 58.0}
    fake.gpm_values[0, 13] = {nvml_gpm.GRAPHICS_UTIL: 0.0}
    monkeypatch.setattr(nvml_gpm, "MIN_PAIR_S", 0.0)  # the backend's clock is the real one
    backend = start_backend(fake)
    backend.pcie_throughput(0)
    backend.pcie_throughput(0)
    telemetry = backend.device_status(0).telemetry
    assert telemetry.profiling is UNKNOWN_PROFILING  # the whole GPU: no values were set
    first, second = telemetry.mig_devices
    assert (first.index, first.profiling.graphics_pct, first.profiling.sm_pct) == (0, 61.5, 58.0)
    assert first.framebuffer.free_mib == 71424
    assert (second.index, second.profiling.graphics_pct) == (1, 0.0)
    assert second.profiling.sm_pct is None


def test_status_reads_serve_the_sampler_values_and_take_no_sample(
    make_fake: MakeFake, start_backend: StartBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = make_fake("h200")
    fake.gpm_values[0] = dict(BUSY)
    monkeypatch.setattr(nvml_gpm, "MIN_PAIR_S", 0.0)
    backend = start_backend(fake)
    backend.pcie_throughput(0)
    backend.pcie_throughput(0)
    fake.calls.clear()
    for _ in range(3):
        assert backend.device_status(0).telemetry.profiling.graphics_pct == 97.5
    assert not [call for call in fake.calls if call.startswith("nvmlGpm")]
    backend.close()
    assert all(sample.freed for sample in fake.gpm_samples)


def test_a_series_gpm_cannot_sample_is_not_asked_again(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    devices = start_backend(fake).node_info().devices
    gpm = sampler(fake, devices, Clock())
    fake.gpm_supported[0] = False  # said yes at start, then the sample says "not supported"
    gpm.sample(0)
    fake.calls.clear()
    gpm.sample(0)
    assert "nvmlGpmSampleGet" not in fake.calls
    assert gpm.profiling(0) is UNKNOWN_PROFILING
