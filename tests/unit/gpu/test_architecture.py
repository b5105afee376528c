"""The hardware tables: every PCIe generation and every architecture family."""

from __future__ import annotations

import json

import pytest

from agent.gpu import architecture, nodefile
from agent.gpu.architecture import memory_bandwidth_mbps, pcie_bandwidth_mbps


@pytest.mark.parametrize(
    ("generation", "lane_mbps"),
    [(1, 250), (2, 500), (3, 985), (4, 1969), (5, 3938), (6, 7563)],
)
def test_pcie_generations(generation: int, lane_mbps: int) -> None:
    assert pcie_bandwidth_mbps(generation, 1) == lane_mbps
    assert pcie_bandwidth_mbps(generation, 16) == 16 * lane_mbps


def test_pcie_gen6_is_64_gts_with_flit_efficiency() -> None:
    # 7562.5 MB/s rounded half up (Python's round() would give the even 7562)
    assert pcie_bandwidth_mbps(6, 1) == int(64e9 / 8 * 242 / 256 / 1e6 + 0.5)


@pytest.mark.parametrize(("generation", "width"), [(None, 16), (5, None), (7, 16), (5, 0)])
def test_pcie_unknown_is_none(generation: int | None, width: int | None) -> None:
    assert pcie_bandwidth_mbps(generation, width) is None


@pytest.mark.parametrize(
    ("capability", "family", "cores_per_sm"),
    [
        ((3, 5), "Kepler", 192),
        ((5, 2), "Maxwell", 128),
        ((6, 0), "Pascal", 64),
        ((6, 1), "Pascal", 128),
        ((7, 0), "Volta", 64),
        ((7, 2), "Volta", 64),
        ((7, 5), "Turing", 64),
        ((8, 0), "Ampere", 64),
        ((8, 6), "Ampere", 128),
        ((8, 7), "Ampere", 128),
        ((8, 9), "Ada Lovelace", 128),
        ((9, 0), "Hopper", 128),
        ((10, 0), "Blackwell", 128),
        ((10, 1), "Blackwell", 128),
        ((10, 3), "Blackwell", 128),
        ((11, 0), "Blackwell", 128),
        ((12, 0), "Blackwell", 128),
        ((12, 1), "Blackwell", 128),
    ],
)
def test_families(capability: tuple[int, int], family: str, cores_per_sm: int) -> None:
    arch = architecture.architecture(*capability)
    assert arch is not None
    assert (arch.family, arch.cores_per_sm) == (family, cores_per_sm)


def test_unknown_capability_is_none() -> None:
    assert architecture.architecture(99, 9) is None
    assert architecture.architecture(2, 0) is None  # Fermi: too old to list


def test_memory_bandwidth() -> None:
    assert memory_bandwidth_mbps(3201, 6016) == 4814304  # H200: 4.8 TB/s
    assert memory_bandwidth_mbps(None, 6016) is None
    assert memory_bandwidth_mbps(3201, None) is None


@pytest.mark.parametrize("node", nodefile.BUILTIN_NODES)
def test_builtin_nodes_agree_with_the_tables(node: str) -> None:
    """The simulated nodes' derived numbers are the tables' (H200: gen 5 x16, 132 SMs)."""
    raw = json.loads(nodefile.resolve(node).read_text())
    for dev in raw["devices"]:
        major, minor = (int(x) for x in dev["arch"].split("."))
        arch = architecture.architecture(major, minor)
        assert arch is not None
        assert dev["family"] == arch.family
        assert dev["cores"] == 132 * arch.cores_per_sm
        assert dev["pci"]["bandwidth_mbps"] == pcie_bandwidth_mbps(5, 16)
        assert dev["memory"]["bandwidth_mbps"] == memory_bandwidth_mbps(
            dev["clocks"]["memory_mhz"], 6016
        )
