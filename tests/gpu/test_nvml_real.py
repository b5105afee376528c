"""The NVML backend on a real NVIDIA GPU, checked against nvidia-smi.

Run on a GPU machine: ``pytest -m gpu tests/gpu``. Every test skips (with the reason)
where no NVIDIA driver or no nvidia-smi is present.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from xml.etree import ElementTree

import pytest

from agent.gpu import nodefile
from agent.gpu.backend import GpuBackendError
from agent.gpu.dump import dump_node
from agent.gpu.model import NodeInfo, PciLink
from agent.gpu.nvml_backend import NvmlBackend

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
NOT_A_VALUE = ("[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", "")


def nvidia_smi(*args: str) -> str:
    """nvidia-smi's output; skips the test when it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on PATH")
    try:
        done = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"nvidia-smi {' '.join(args)} did not run: {err}")
    if done.returncode != 0:
        pytest.skip(f"nvidia-smi {' '.join(args)} failed: {done.stdout}{done.stderr}".strip())
    return ANSI.sub("", done.stdout)


def query_gpus(fields: str) -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu`` as one dict per GPU, in NVML index order."""
    out = nvidia_smi(f"--query-gpu={fields}", "--format=csv,noheader,nounits")
    names = fields.split(",")
    rows = [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line]
    return [dict(zip(names, row, strict=True)) for row in rows]


@pytest.fixture(scope="module")
def backend() -> Iterator[NvmlBackend]:
    with pytest.MonkeyPatch.context() as env:  # start() edits the environment: restore it
        for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DISABLE_UNIFIED_MEMORY", "CUDA_CACHE_DISABLE"):
            env.setenv(name, os.environ.get(name, ""))
        try:
            started = NvmlBackend.start()
        except GpuBackendError as err:
            pytest.skip(f"no usable NVIDIA driver here: {err}")
        try:
            yield started
        finally:
            started.close()


@pytest.fixture(scope="module")
def info(backend: NvmlBackend) -> NodeInfo:
    return backend.node_info()


def test_identity_matches_nvidia_smi(info: NodeInfo) -> None:
    smi = query_gpus("uuid,pci.bus_id,memory.total,driver_version")
    assert len(info.devices) == len(smi)
    for dev, row in zip(info.devices, smi, strict=True):
        assert dev.uuid == row["uuid"]
        assert dev.pci.bus_id == row["pci.bus_id"].upper()
        assert dev.memory.global_mib == int(row["memory.total"])
        assert info.driver_version == row["driver_version"]


def test_cuda_version_matches_nvidia_smi(info: NodeInfo) -> None:
    match = re.search(r"CUDA Version\s*:\s*([0-9]+\.[0-9]+)", nvidia_smi())
    if match is None:
        match = re.search(r"CUDA Version\s*:\s*([0-9]+\.[0-9]+)", nvidia_smi("-q"))
    assert match is not None, "nvidia-smi shows no CUDA version"
    assert info.cuda_version == match.group(1)


def test_cuda_version_matches_nvidia_smi_xml(info: NodeInfo) -> None:
    root = ElementTree.fromstring(nvidia_smi("-q", "-x"))
    assert info.cuda_version == root.findtext("cuda_version")
    assert info.driver_version == root.findtext("driver_version")


def test_device_paths_match_nvidia_smi_minor_numbers(info: NodeInfo) -> None:
    root = ElementTree.fromstring(nvidia_smi("-q", "-x"))
    minors = {
        (gpu.get("id") or "").upper(): gpu.findtext("minor_number") for gpu in root.iter("gpu")
    }
    for dev in info.devices:
        assert dev.path == f"/dev/nvidia{minors[dev.pci.bus_id]}"
        assert dev.path is not None
        assert Path(dev.path).exists()


def test_static_facts_match_nvidia_smi(info: NodeInfo) -> None:
    fields = "name,power.limit,clocks.max.sm,clocks.max.memory"
    for dev, row in zip(info.devices, query_gpus(fields), strict=True):
        assert dev.model == row["name"]
        if row["power.limit"] not in NOT_A_VALUE:
            assert dev.power_w == int(float(row["power.limit"]))
        assert dev.clocks.cores_mhz == int(row["clocks.max.sm"])
        assert dev.clocks.memory_mhz == int(row["clocks.max.memory"])


def test_derived_facts_are_known_and_consistent(info: NodeInfo) -> None:
    for dev in info.devices:
        assert dev.family is not None, f"compute capability {dev.arch} missing from the table"
        assert dev.arch is not None
        assert dev.cores is not None
        assert dev.cores > 0
        assert dev.pci.bandwidth_mbps is not None
        assert dev.pci.bandwidth_mbps > 0
        assert dev.memory.bandwidth_mbps is not None
        assert dev.memory.bandwidth_mbps > 0
        assert dev.cpu_affinity is not None
        assert dev.cpu_affinity >= 0
        # From libcuda: these are null only if the CUDA driver is unusable.
        assert dev.memory.l2_cache_kib is not None
        assert dev.memory.l2_cache_kib > 0
        assert dev.memory.shared_kib is not None
        assert dev.memory.shared_kib > 0
        assert dev.memory.constant_kib == 64


def test_status_in_sane_ranges(backend: NvmlBackend, info: NodeInfo) -> None:
    for dev in info.devices:
        status = backend.device_status(dev.index)
        assert status.power_w is not None
        assert 0 < status.power_w <= 2000
        assert status.temperature_c is not None
        assert 0 < status.temperature_c < 120
        util = status.utilization
        for pct in (util.gpu_pct, util.memory_pct, util.encoder_pct, util.decoder_pct):
            assert pct is None or 0 <= pct <= 100
        assert util.gpu_pct is not None
        assert status.memory_used_mib is not None
        assert dev.memory.global_mib is not None
        assert 0 <= status.memory_used_mib <= dev.memory.global_mib
        for count in (status.ecc_errors.l1_cache, status.ecc_errors.l2_cache):
            assert count is None or count >= 0
        assert status.clocks.cores_mhz is not None
        assert dev.clocks.cores_mhz is not None
        assert 0 < status.clocks.cores_mhz <= dev.clocks.cores_mhz
        assert status.bar1_used_mib is not None
        assert dev.pci.bar1_mib is not None
        assert 0 <= status.bar1_used_mib <= dev.pci.bar1_mib
        for proc in status.processes:
            assert proc.pid > 0


def test_pcie_throughput(backend: NvmlBackend, info: NodeInfo) -> None:
    for dev in info.devices:
        tput = backend.pcie_throughput(dev.index)
        assert dev.pci.bandwidth_mbps is not None
        for value in (tput.rx_mbps, tput.tx_mbps):
            assert value is not None
            assert 0 <= value <= dev.pci.bandwidth_mbps


def test_status_of_all_gpus_in_threads(backend: NvmlBackend, info: NodeInfo) -> None:
    indices = [dev.index for dev in info.devices] * 20
    with ThreadPoolExecutor(max_workers=max(2, len(info.devices))) as pool:
        statuses = list(pool.map(backend.device_status, indices))
    assert all(status.power_w is not None for status in statuses)


def parse_topo(text: str, count: int) -> list[list[str]]:
    """The GPU x GPU cells of an ``nvidia-smi topo`` matrix, in NVML index order."""
    rows: dict[int, list[str]] = {}
    for line in ANSI.sub("", text).splitlines():
        match = re.match(r"\s*GPU(\d+)\s+(?!GPU)(.*)", line)  # the header row names GPUs
        if match:
            rows[int(match.group(1))] = match.group(2).split()[:count]
    assert sorted(rows) == list(range(count)), f"cannot parse nvidia-smi topo output:\n{text}"
    return [rows[i] for i in range(count)]


def topo_matrix(count: int, *args: str) -> list[list[str]]:
    return parse_topo(nvidia_smi("topo", *args), count)


def test_topology_matches_nvidia_smi(info: NodeInfo) -> None:
    count = len(info.devices)
    if count < 2:
        pytest.skip("one GPU: no topology to compare")
    links = topo_matrix(count, "-m")
    p2p_read = topo_matrix(count, "-p2p", "r")
    for i, dev in enumerate(info.devices):
        peers = {peer.bus_id: peer for peer in dev.topology}
        for j, other in enumerate(info.devices):
            if i == j:
                assert other.pci.bus_id not in peers
                continue
            peer = peers.get(other.pci.bus_id)
            if p2p_read[i][j] == "OK" or links[i][j].startswith("NV"):
                assert peer is not None, f"GPU{i} does not list GPU{j} as a peer"
            if peer is None:
                continue
            assert PciLink.CROSS_CPU <= peer.link <= PciLink.SAME_BOARD
            nv = re.fullmatch(r"NV(\d+)", links[i][j])
            assert peer.nvlinks == (int(nv.group(1)) if nv else 0), (
                f"GPU{i}->GPU{j}: {peer.nvlinks} NVLinks, nvidia-smi topo -m says {links[i][j]}"
            )


def test_every_gpu_peers_with_every_other_when_p2p_works(info: NodeInfo) -> None:
    count = len(info.devices)
    if count < 2:
        pytest.skip("one GPU: no peers")
    p2p_read = topo_matrix(count, "-p2p", "r")
    if any(p2p_read[i][j] != "OK" for i in range(count) for j in range(count) if i != j):
        pytest.skip("nvidia-smi topo -p2p r: not every pair supports P2P here")
    for dev in info.devices:
        assert len(dev.topology) == count - 1
        assert all(1 <= peer.link <= 6 for peer in dev.topology)


def test_dump_round_trip(backend: NvmlBackend, info: NodeInfo) -> None:
    data = json.loads(json.dumps(dump_node(backend)))
    parsed = nodefile.parse(data)
    assert parsed.info == info
    assert len(parsed.devices) == len(info.devices)
    assert 0 < parsed.status_call_s < 0.1
    assert 0 < parsed.pcie_sample_s < 1.0


def test_dump_command(tmp_path: Path) -> None:
    """``python -m agent.gpu.dump FILE`` in its own process, served back by the simulator."""
    target = tmp_path / "node.json"
    done = subprocess.run(
        [sys.executable, "-m", "agent.gpu.dump", str(target)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0 and "--simulate" in done.stderr:
        pytest.skip(f"no usable NVIDIA driver: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    node = nodefile.load(str(target))
    smi = query_gpus("uuid")
    assert [dev.uuid for dev in node.info.devices] == [row["uuid"] for row in smi]
