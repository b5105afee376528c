"""NvmlBackend against a fake pynvml that answers with a real H200's NVML values."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pynvml
import pytest

from agent.gpu.backend import GpuBackendError
from agent.gpu.model import (
    LOST_DEVICE_STATUS,
    UNKNOWN_THROUGHPUT,
    GpuProcess,
    PciLink,
    PeerLink,
)
from agent.gpu.nvml_backend import NvmlBackend, format_cuda_version
from agent.gpu.simulated import SimulatedBackend
from tests.unit.gpu.conftest import MakeFake, StartBackend
from tests.unit.gpu.fake_nvml import (
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    LIBRARY_NOT_FOUND,
    NEWER_THAN_THE_FLOOR,
    NOT_FOUND,
    NOT_SUPPORTED,
    FakeCuda,
    FakeNvml,
    Struct,
)

MIB = 1024 * 1024


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_h200_info_every_field(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200")
    raw = fake.devices[0]
    info = start_backend(fake).node_info()

    assert info.driver_version == fake.capture["driver"]
    assert info.cuda_version == "13.0"
    (dev,) = info.devices
    assert dev.index == 0
    assert dev.uuid == raw["uuid"]
    assert dev.path == "/dev/nvidia0"
    assert dev.model == "NVIDIA H200"
    assert dev.power_w == 700
    assert dev.cpu_affinity == 0
    assert dev.pci.bus_id == "00000000:00:06.0"
    assert dev.pci.bar1_mib == 262144
    assert dev.pci.bandwidth_mbps == 63008  # PCIe gen 5 x16
    assert (dev.clocks.cores_mhz, dev.clocks.memory_mhz) == (1980, 3201)
    assert dev.topology == ()
    assert (dev.family, dev.arch, dev.cores) == ("Hopper", "9.0", 16896)
    assert dev.memory.ecc is True
    assert dev.memory.global_mib == 143771  # NVML total, as nvidia-smi's FB total
    assert dev.memory.shared_kib == 228
    assert dev.memory.constant_kib == 64
    assert dev.memory.l2_cache_kib == 61440
    assert dev.memory.bandwidth_mbps == 4814304


def test_h200_info_equals_the_builtin_node_file(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    """The simulated h200 node was written from the same capture: both backends agree."""
    backend = start_backend(make_fake("h200"))
    simulated = SimulatedBackend.from_file("h200")
    assert backend.node_info() == simulated.node_info()
    assert backend.device_status(0) == simulated.device_status(0)


def test_global_memory_is_nvml_total_not_cuda_total(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    dev = start_backend(fake).node_info().devices[0]
    cuda_total_mib = fake.capture["cuda_devices"][0]["total_mem"] // MIB
    assert dev.memory.global_mib == fake.devices[0]["memory"]["total"] // MIB
    assert dev.memory.global_mib == cuda_total_mib + 616


def test_h200_status(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200")
    status = start_backend(fake).device_status(0)
    assert status.power_w == 77  # 77630 mW
    assert status.temperature_c == 36
    assert status.utilization.gpu_pct == 0
    assert status.utilization.encoder_pct == 0
    assert status.memory_used_mib == 615
    assert status.ecc_errors.l1_cache is None  # "Not Supported" on Hopper
    assert status.ecc_errors.l2_cache is None
    assert status.ecc_errors.global_ == 0
    assert (status.clocks.cores_mhz, status.clocks.memory_mhz) == (345, 3201)
    assert status.bar1_used_mib == 1
    assert status.processes == ()


def test_bar1_usage_comes_from_the_background_sample_once_there_is_one(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")
    backend = start_backend(fake)
    fake.calls.clear()
    assert backend.device_status(0).bar1_used_mib == 1  # no sample yet: read live
    assert "nvmlDeviceGetBAR1MemoryInfo" in fake.calls
    fake.devices[0]["bar1"]["bar1Used"] = 64 * 2**20
    backend.pcie_throughput(0)  # the sampler's read
    fake.calls.clear()
    assert backend.device_status(0).bar1_used_mib == 64
    assert "nvmlDeviceGetBAR1MemoryInfo" not in fake.calls


def test_pcie_throughput_in_mb_per_s(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200")
    fake.devices[0]["pcie_rx_KBps"] = 12_345_678
    fake.devices[0]["pcie_tx_KBps"] = 2_000
    tput = start_backend(fake).pcie_throughput(0)
    assert (tput.rx_mbps, tput.tx_mbps) == (12_345, 2)


def test_not_supported_is_none_without_a_warning(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_fake("h200")
    fake.fail("nvmlDeviceGetTemperature", NOT_SUPPORTED)
    fake.fail("nvmlDeviceGetEccMode", NOT_SUPPORTED)
    backend = start_backend(fake)
    status = backend.device_status(0)
    assert status.temperature_c is None
    assert status.power_w == 77
    assert backend.node_info().devices[0].memory.ecc is None
    assert warnings_of(caplog) == []


def test_lost_gpu_reports_null_status_and_the_other_is_fine(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_fake("h200x2")
    backend = start_backend(fake)
    fake.lose(1)
    for _ in range(3):
        assert backend.device_status(1) == LOST_DEVICE_STATUS
        assert backend.pcie_throughput(1) == UNKNOWN_THROUGHPUT
    healthy = backend.device_status(0)
    assert healthy.power_w == fake.devices[0]["power_usage_mW"] // 1000
    assert healthy.temperature_c == fake.devices[0]["temperature_C"]
    assert healthy.memory_used_mib == 615
    lost_lines = [m for m in warnings_of(caplog) if "GPU 1" in m]
    assert len(lost_lines) == 1
    assert "lost" in lost_lines[0]


def test_gpu_lost_before_start_still_listed(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    fake.lose(1)
    backend = start_backend(fake)
    info = backend.node_info()
    assert len(info.devices) == 2
    lost = info.devices[1]
    assert lost.uuid is None
    assert lost.memory.global_mib is None
    assert lost.cores is None
    assert info.devices[0].uuid == fake.devices[0]["uuid"]
    assert info.devices[0].topology == ()  # a lost peer is not reachable
    assert backend.device_status(1) == LOST_DEVICE_STATUS


def test_handle_that_cannot_be_opened(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200x2")
    fake.fail("nvmlDeviceGetHandleByIndex", GPU_IS_LOST, index=1)
    backend = start_backend(fake)
    dev = backend.node_info().devices[1]
    assert (dev.uuid, dev.model, dev.pci.bus_id) == (None, None, "")
    assert backend.device_status(1) == LOST_DEVICE_STATUS
    assert backend.device_status(0).power_w == fake.devices[0]["power_usage_mW"] // 1000
    assert backend.node_info().devices[0].topology == ()


def test_function_missing_from_old_driver_warns_once(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_fake("h200x2")
    fake.remove_from_driver("nvmlDeviceGetMemoryBusWidth")
    fake.remove_from_driver("nvmlDeviceGetEncoderUtilization")
    backend = start_backend(fake)
    for dev in backend.node_info().devices:
        assert dev.memory.bandwidth_mbps is None
        assert dev.memory.global_mib == 143771
    for _ in range(3):
        assert backend.device_status(0).utilization.encoder_pct is None
        assert backend.device_status(1).utilization.decoder_pct == 0
    lines = warnings_of(caplog)
    assert len([m for m in lines if "nvmlDeviceGetMemoryBusWidth" in m]) == 1
    encoder = [m for m in lines if "nvmlDeviceGetEncoderUtilization" in m]
    assert len(encoder) == 1
    assert "update the NVIDIA driver" in encoder[0]


def test_function_missing_from_pynvml_falls_back_to_cuda(
    make_fake: MakeFake, start_backend: StartBackend, caplog: pytest.LogCaptureFixture
) -> None:
    fake = make_fake("h200")
    fake.remove_from_pynvml("nvmlDeviceGetNumGpuCores")
    dev = start_backend(fake).node_info().devices[0]
    assert dev.cores == 132 * 128  # CUDA multiprocessor count x cores per SM (Hopper)
    assert any("nvidia-ml-py" in m for m in warnings_of(caplog))


def test_without_cuda_the_cuda_facts_are_null(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    dev = start_backend(make_fake("h200"), cuda=False).node_info().devices[0]
    assert dev.memory.l2_cache_kib is None
    assert dev.memory.shared_kib is None
    assert dev.memory.constant_kib is None
    assert dev.cores == 16896  # from NVML
    assert dev.memory.bandwidth_mbps == 4814304


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (LIBRARY_NOT_FOUND, "NVIDIA driver not found"),
        (9, "driver not loaded"),
        (18, "versions differ"),
        (999, "NVML failed to start"),
    ],
)
def test_driver_absent_is_one_line_naming_simulate(
    make_fake: MakeFake, code: int, words: str
) -> None:
    fake = make_fake("h200")
    fake.init_error = code
    with pytest.raises(GpuBackendError) as caught:
        NvmlBackend.start()
    message = str(caught.value)
    assert words in message
    assert "--simulate" in message
    assert "\n" not in message


def test_real_missing_library_names_the_library(make_fake: MakeFake) -> None:
    """No driver on this machine: the message carries the loader's own reason."""
    fake = make_fake("h200")
    fake.init_error = LIBRARY_NOT_FOUND
    with pytest.raises(GpuBackendError, match=r"libnvidia-ml\.so\.1"):
        NvmlBackend.start()


def test_failure_after_init_shuts_nvml_down(make_fake: MakeFake) -> None:
    fake = make_fake("h200")
    fake.fail("nvmlDeviceGetCount", 999)
    with pytest.raises(GpuBackendError, match="cannot list the GPUs"):
        NvmlBackend.start(cuda=lambda _bus_ids: None)
    assert (fake.initialised, fake.shutdowns) == (1, 1)


def test_start_leaves_the_process_environment_alone(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    """The wrapper reads NVML in-process, then execs docker: the user's CUDA_VISIBLE_DEVICES
    must reach docker unchanged (only the CUDA child process gets the discovery env)."""
    before = dict(os.environ)
    start_backend(make_fake("h200")).close()
    assert dict(os.environ) == before


def test_two_h200_topology_host_bridge_and_18_nvlinks(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    """The VM hides the NVLinks' far end (FFFFFFFF:FF:FF.0): still NV18 both ways."""
    fake = make_fake("h200x2")
    assert {link["remote_bus"] for links in fake.capture["nvlink"] for link in links} == {
        "FFFFFFFF:FF:FF.0"
    }
    first, second = start_backend(fake).node_info().devices
    assert first.topology == (PeerLink(second.pci.bus_id, PciLink.HOST_BRIDGE, 18),)
    assert second.topology == (PeerLink(first.pci.bus_id, PciLink.HOST_BRIDGE, 18),)


def test_nvlinks_when_nvml_hides_remote_type_and_nvlink_p2p(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    fake.remote_device_type = None  # NotSupported
    del fake.capture["topology"][0]["p2p_nvlink"]  # P2P status NVLINK: NotSupported
    first, second = start_backend(fake).node_info().devices
    assert first.topology[0].nvlinks == 18
    assert second.topology[0].nvlinks == 18


def test_nvlinks_counted_by_remote_bus_id_when_visible(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    buses = [dev["pci"]["busId"] for dev in fake.devices]
    for gpu, links in enumerate(fake.capture["nvlink"]):
        for link in links:
            link["remote_bus"] = buses[1 - gpu]
        links[17]["state"] = 0  # one link down
    first, second = start_backend(fake).node_info().devices
    assert first.topology[0].nvlinks == 17
    assert second.topology[0].nvlinks == 17


def test_nvlinks_through_nvswitch(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200x2")
    fake.remote_device_type = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
    first, _ = start_backend(fake).node_info().devices
    assert first.topology[0].nvlinks == 18


def test_no_nvlink_and_no_p2p_means_no_peer(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200x2")
    fake.capture["nvlink"] = None
    pair = fake.capture["topology"][0]
    pair.update(p2p_read=2, p2p_write=2, p2p_nvlink=2)  # chipset not supported
    fake.capture["cuda_peers"] = []
    first, second = start_backend(fake).node_info().devices
    assert first.topology == ()
    assert second.topology == ()


def test_pcie_only_peer_has_zero_nvlinks(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200x2")
    fake.capture["nvlink"] = None
    fake.capture["topology"][0]["common_ancestor"] = 10  # one PCIe switch
    first, _ = start_backend(fake).node_info().devices
    assert first.topology[0].link == PciLink.SINGLE_SWITCH
    assert first.topology[0].nvlinks == 0


def test_compute_processes(
    make_fake: MakeFake, start_backend: StartBackend, tmp_path: Path
) -> None:
    fake = make_fake("h200")
    proc = tmp_path / "fakeproc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "comm").write_text("python3\n")
    fake.processes[0] = [
        Struct(pid=4242, usedGpuMemory=2048 * MIB),
        Struct(pid=777, usedGpuMemory=None),  # another pid namespace: no /proc entry
    ]
    status = start_backend(fake, proc=proc).device_status(0)
    assert status.processes == (
        GpuProcess(pid=4242, name="python3", memory_used_mib=2048),
        GpuProcess(pid=777, name="/usr/bin/process-777", memory_used_mib=None),
    )


def test_compute_processes_on_old_driver(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200")
    fake.remove_from_driver("nvmlDeviceGetComputeRunningProcesses_v3")
    fake.module.nvmlDeviceGetComputeRunningProcesses_v2 = lambda handle: [  # type: ignore[attr-defined]
        Struct(pid=99, usedGpuMemory=MIB)
    ]
    (process,) = start_backend(fake).device_status(0).processes
    assert (process.pid, process.memory_used_mib) == (99, 1)


def test_numa_node_from_sysfs(
    make_fake: MakeFake, start_backend: StartBackend, tmp_path: Path
) -> None:
    fake = make_fake("h200x2")
    for bus, node in (("0000:00:06.0", "1"), ("0000:00:07.0", "-1")):
        device = tmp_path / "sys" / "bus" / "pci" / "devices" / bus
        device.mkdir(parents=True)
        (device / "numa_node").write_text(node + "\n")
    first, second = start_backend(fake).node_info().devices
    assert first.cpu_affinity == 1
    assert second.cpu_affinity == 0  # -1 (no NUMA) is reported as 0


def test_an_empty_numa_mask_is_unknown_not_node_0(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    fake = make_fake("h200")  # no sysfs numa_node here: NVML's mask decides
    fake.module.nvmlDeviceGetCpuAffinityWithinScope = lambda h, size, scope: [0] * size  # type: ignore[attr-defined]
    (dev,) = start_backend(fake).node_info().devices
    assert dev.cpu_affinity is None


def test_concurrent_status_of_different_gpus(
    make_fake: MakeFake, start_backend: StartBackend
) -> None:
    backend = start_backend(make_fake("h200x2"))
    serial = [backend.device_status(i) for i in (0, 1)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(backend.device_status, [0, 1] * 50))
    assert results == serial * 50


def test_close_shuts_nvml_down_once(make_fake: MakeFake) -> None:
    fake = make_fake("h200")
    backend = NvmlBackend.start(cuda=lambda _bus_ids: None)
    backend.close()
    backend.close()
    assert fake.shutdowns == 1
    assert backend.name == "NVML 13.580.159.04"


@pytest.mark.parametrize(
    ("version", "text"), [(13000, "13.0"), (12080, "12.8"), (11040, "11.4"), (9020, "9.2")]
)
def test_cuda_version_format(version: int, text: str) -> None:
    assert format_cuda_version(version) == text


def test_cuda_version_from_old_function(make_fake: MakeFake, start_backend: StartBackend) -> None:
    fake = make_fake("h200")
    fake.remove_from_driver("nvmlSystemGetCudaDriverVersion_v2")
    fake.capture["cuda_driver"] = 12040
    assert start_backend(fake).node_info().cuda_version == "12.4"


def test_cuda_version_from_the_cuda_child_when_nvml_has_no_libcuda(
    make_fake: MakeFake, caplog: pytest.LogCaptureFixture
) -> None:
    """The GPU worker's NVML runs without libcuda (agent.gpu.hidden_libcuda): its CUDA version
    call answers "not found", and the CUDA child's cuDriverGetVersion gives the version."""
    fake = make_fake("h200")
    fake.fail("nvmlSystemGetCudaDriverVersion_v2", NOT_FOUND)
    cuda = FakeCuda(fake.capture, driver_version=12080)
    with caplog.at_level(logging.WARNING):
        backend = NvmlBackend.start(cuda=lambda _bus_ids: cuda)
    assert backend.node_info().cuda_version == "12.8"
    assert warnings_of(caplog) == []
    backend.close()


def test_nvml_says_the_cuda_version_where_it_can(make_fake: MakeFake) -> None:
    fake = make_fake("h200")
    cuda = FakeCuda(fake.capture, driver_version=12080)
    backend = NvmlBackend.start(cuda=lambda _bus_ids: cuda)
    assert backend.node_info().cuda_version == "13.0"  # NVML's, as before
    backend.close()


def test_no_cuda_version_from_either_is_one_clear_line(make_fake: MakeFake) -> None:
    fake = make_fake("h200")
    fake.fail("nvmlSystemGetCudaDriverVersion_v2", NOT_FOUND)
    with pytest.raises(GpuBackendError) as caught:
        NvmlBackend.start(cuda=lambda _bus_ids: None)
    message = str(caught.value)
    assert "does not say which CUDA version it supports" in message
    assert "libcuda.so.1" in message
    assert "\n" not in message
    assert (fake.initialised, fake.shutdowns) == (1, 1)


def test_function_not_found_constant_matches_pynvml() -> None:
    assert pynvml.NVML_ERROR_FUNCTION_NOT_FOUND == FUNCTION_NOT_FOUND
    assert pynvml.NVML_ERROR_GPU_IS_LOST == GPU_IS_LOST


def test_fake_only_offers_functions_real_pynvml_has() -> None:
    """The fake must not invent API: every function it answers exists in pynvml (GPM's in
    newer ones than the floor's: then in this one, when it has GPM at all)."""
    missing = [n for n in dir(FakeNvml) if n.startswith("nvml") and not hasattr(pynvml, n)]
    if hasattr(pynvml, "nvmlGpmSampleGet"):
        assert missing == []
    else:
        assert set(missing) <= NEWER_THAN_THE_FLOOR
